package host_test

import (
	"fmt"
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/backing/host"
)

func newPrivate(t testing.TB, opts host.PrivateOptions) *host.Private {
	t.Helper()
	p, err := host.NewPrivate(opts)
	require.NoError(t, err)
	return p
}

func TestPrivateConformance(t *testing.T) {
	page := os.Getpagesize()
	for _, tt := range []struct {
		name string
		opts host.PrivateOptions
	}{
		{"default", host.PrivateOptions{}},
		{"granule=page", host.PrivateOptions{Granularity: page}},
		{"granule=2MiB", host.PrivateOptions{Granularity: 2 << 20}},
		{"populate", host.PrivateOptions{Populate: true, Name: "vmarena-test"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			backingtest.Run(t, func(t *testing.T) backing.Backing[*host.PrivateReservation] {
				return newPrivate(t, tt.opts)
			})
		})
	}
}

func TestNewPrivateBadOptions(t *testing.T) {
	page := os.Getpagesize()
	for _, tt := range []struct {
		name string
		opts host.PrivateOptions
	}{
		{"negative granule", host.PrivateOptions{Granularity: -page}},
		{"granule not a power of two", host.PrivateOptions{Granularity: 3 * page}},
		{"granule below the page", host.PrivateOptions{Granularity: page / 2}},
		{"granule of one byte", host.PrivateOptions{Granularity: 1}},
		{"name too long", host.PrivateOptions{Name: string(make([]byte, 80))}},
		{"name with a bracket", host.PrivateOptions{Name: "kv[0]"}},
		{"name with a newline", host.PrivateOptions{Name: "kv\n"}},
		{"name not ASCII", host.PrivateOptions{Name: "kv-é"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			p, err := host.NewPrivate(tt.opts)
			assert.ErrorIs(t, err, host.ErrPrivateOptions)
			assert.Nil(t, p)
		})
	}
}

func TestPrivateIdentity(t *testing.T) {
	p := newPrivate(t, host.PrivateOptions{})
	assert.Equal(t, 64<<10, p.Granularity(), "default granule")
	assert.Equal(t, accounting.HostKey, p.Device())
	assert.False(t, p.Accounting().OwnedByBacking(), "ByBuffer")
	assert.True(t, backing.IsHostAccessible(p))
	assert.True(t, p.CommitZeroes())
	name := string(make([]byte, 79))
	for i := range []byte(name) {
		name = name[:i] + "a" + name[i+1:]
	}
	_, err := host.NewPrivate(host.PrivateOptions{Name: name})
	assert.NoError(t, err, "a 79-byte name is the longest allowed")
}

func TestPrivateBaseAligned(t *testing.T) {
	for _, g := range []int{64 << 10, 2 << 20} {
		t.Run(fmt.Sprintf("granule=%dKiB", g>>10), func(t *testing.T) {
			p := newPrivate(t, host.PrivateOptions{Granularity: g})
			var rs []*host.PrivateReservation
			for range 4 {
				r, err := p.Reserve(3 * g)
				require.NoError(t, err)
				rs = append(rs, r)
				assert.Zero(t, p.Base(r)%uintptr(g), "base %#x is not aligned to the granule", p.Base(r))
			}
			for _, r := range rs {
				assert.True(t, p.Unreserve(r).OK())
			}
		})
	}
}

func TestPrivateNilAndForeign(t *testing.T) {
	p := newPrivate(t, host.PrivateOptions{})
	assert.ErrorIs(t, p.Commit(nil, 0, p.Granularity()), backing.ErrForeignReservation)
	assert.ErrorIs(t, p.Decommit(nil, 0, p.Granularity()), backing.ErrForeignReservation)
	assert.ErrorIs(t, p.Populate(nil, 0, p.Granularity()), backing.ErrForeignReservation)
	assert.ErrorIs(t, p.CopyIn(nil, 0, []byte{1}), backing.ErrForeignReservation)
	assert.ErrorIs(t, p.CopyOut([]byte{1}, nil, 0), backing.ErrForeignReservation)
	o := p.Unreserve(nil)
	assert.Equal(t, accounting.Failed, o.Status)
	assert.ErrorIs(t, o.Err, backing.ErrForeignReservation)
}

func ExamplePrivate() {
	p, err := host.NewPrivate(host.PrivateOptions{Granularity: 64 << 10, Name: "example"})
	if err != nil {
		panic(err)
	}
	// Reserve 1 GiB of address space once; it costs no memory.
	r, err := p.Reserve(1 << 30)
	if err != nil {
		panic(err)
	}
	base := p.Base(r)

	// Grow to two granules, write, and read back.
	if err := p.Commit(r, 0, 2*p.Granularity()); err != nil {
		panic(err)
	}
	_ = p.CopyIn(r, 100_000, []byte("hello"))
	buf := make([]byte, 5)
	_ = p.CopyOut(buf, r, 100_000)
	fmt.Printf("%s\n", buf)

	// Shrink back to one granule: the second one's contents are forfeit.
	_ = p.Decommit(r, p.Granularity(), p.Granularity())
	fmt.Println(p.CopyOut(buf, r, 100_000))
	fmt.Println("base moved:", p.Base(r) != base)
	fmt.Println(p.Unreserve(r))
	// Output:
	// hello
	// backing: copy out [0x186a0, +0x5): range not committed: granule at 0x10000
	// base moved: false
	// complete (unmapped 65536, residual 0)
}
