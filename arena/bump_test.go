package arena_test

import (
	"context"
	"errors"
	"math"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/backing/host"
)

type hostArena = arena.Arena[*host.PrivateReservation, *host.Private]

var (
	_ arena.Allocator      = (*hostArena)(nil)
	_ arena.VirtualBacking = (*hostArena)(nil)
	_ arena.Sharing        = (*hostArena)(nil)
)

// newHostArena returns an arena of capacity bytes on private host memory with a
// page-sized granule, charged to a fresh governor's authority (limit: no limit unless
// set by the caller through the returned governor).
func newHostArena(t testing.TB, capacity int, opts arena.ArenaOptions) (*hostArena, *accounting.Governor) {
	t.Helper()
	p, err := host.NewPrivate(host.PrivateOptions{Granularity: os.Getpagesize()})
	require.NoError(t, err)
	g := accounting.NewGovernor()
	buf, err := arena.NewBuffer(p, capacity, g.Authority("arena", accounting.HostKey))
	require.NoError(t, err)
	a, err := arena.NewArena(buf, opts)
	require.NoError(t, err)
	t.Cleanup(func() {
		defer func() { _ = recover() }() // already closed by the test
		a.Close()
	})
	return a, g
}

func TestArenaAlloc(t *testing.T) {
	page := os.Getpagesize()
	a, g := newHostArena(t, 64*page, arena.ArenaOptions{})
	base := a.Buffer().Base()
	assert.Zero(t, a.Used())
	assert.Zero(t, a.Committed())
	assert.True(t, a.HostAccessible())
	assert.Equal(t, accounting.HostKey, a.Device())

	prevEnd := 0
	for _, tt := range []struct{ size, align int }{
		{1, 1}, {3, 2}, {10, 64}, {0, 8}, {page, 4096}, {5, 2 * page}, {100, 1}, {3 * page, 16},
	} {
		off, err := a.Alloc(tt.size, tt.align)
		require.NoError(t, err, "Alloc(%d, %d)", tt.size, tt.align)
		assert.Zero(t, (base+uintptr(off))%uintptr(tt.align), "Alloc(%d, %d) at %d is aligned", tt.size, tt.align, off)
		assert.GreaterOrEqual(t, off, prevEnd, "no overlap with the previous allocation")
		assert.Less(t, off-prevEnd, tt.align, "no more padding than the alignment needs")
		prevEnd = off + tt.size
		assert.Equal(t, prevEnd, a.Used())
		assert.Equal(t, prevEnd, a.HighWater())
		// The buffer grows to the next granule boundary, no further.
		assert.Equal(t, (prevEnd+page-1)/page*page, a.Buffer().Len())
		assert.Equal(t, a.Buffer().Len(), a.Committed())
		assert.Equal(t, int64(a.Committed()), g.Stats(accounting.HostKey).Used)
	}
	// The memory is the caller's: write all of it.
	b := a.Buffer().Bytes()
	for i := range b {
		b[i] = 0xa5
	}
}

func TestArenaBadInputs(t *testing.T) {
	page := os.Getpagesize()
	a, _ := newHostArena(t, 4*page, arena.ArenaOptions{})
	_, err := a.Alloc(10, 8)
	require.NoError(t, err)
	tests := []struct {
		name string
		do   func() error
		want []error
	}{
		{"negative size", func() error { _, err := a.Alloc(-1, 8); return err }, []error{arena.ErrInvalidSize}},
		{"zero alignment", func() error { _, err := a.Alloc(8, 0); return err }, []error{arena.ErrInvalidAlignment}},
		{"alignment not a power of two", func() error { _, err := a.Alloc(8, 24); return err }, []error{arena.ErrInvalidAlignment}},
		{"negative alignment", func() error { _, err := a.Alloc(8, -8); return err }, []error{arena.ErrInvalidAlignment}},
		{"past the capacity", func() error { _, err := a.Alloc(4*page, 1); return err }, []error{arena.ErrArenaFull, arena.ErrCapacity}},
		{"huge", func() error { _, err := a.Alloc(math.MaxInt, 1); return err }, []error{arena.ErrArenaFull, arena.ErrCapacity}},
		{"padding past the capacity", func() error { _, err := a.Alloc(0, 1<<40); return err }, []error{arena.ErrArenaFull}},
		{"Allocate past the capacity", func() error { _, err := a.Allocate(4*page, 1); return err }, []error{arena.ErrArenaFull}},
		{"Make negative", func() error { _, err := arena.Make[float32](a, -1); return err }, []error{arena.ErrInvalidSize}},
		{"Make overflows", func() error { _, err := arena.Make[float64](a, math.MaxInt/4); return err }, []error{arena.ErrInvalidSize}},
		{"Make past the capacity", func() error { _, err := arena.Make[arena.F16](a, 2*page); return err }, []error{arena.ErrArenaFull}},
		{"MakeTensor negative dim", func() error { _, err := arena.MakeTensor[float32](a, 2, -3); return err }, []error{arena.ErrInvalidShape}},
		{"MakeTensor overflow", func() error { _, err := arena.MakeTensor[float32](a, 1<<40, 1<<40); return err }, []error{arena.ErrInvalidShape}},
		{"MakeTensor past the capacity", func() error { _, err := arena.MakeTensor[float32](a, page, 2); return err }, []error{arena.ErrArenaFull}},
		{"Trim negative", func() error { return a.Trim(-1) }, []error{arena.ErrInvalidSize}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			used, committed := a.Used(), a.Committed()
			err := tt.do()
			for _, want := range tt.want {
				assert.ErrorIs(t, err, want)
			}
			assert.Equal(t, used, a.Used(), "a failed call changes nothing")
			assert.Equal(t, committed, a.Committed())
		})
	}

	p, err := host.NewPrivate(host.PrivateOptions{})
	require.NoError(t, err)
	buf, err := arena.NewBuffer(p, 1<<20, accounting.NewGovernor().Authority("x", accounting.HostKey))
	require.NoError(t, err)
	defer buf.Close()
	_, err = arena.NewArena(buf, arena.ArenaOptions{Align: 48})
	assert.ErrorIs(t, err, arena.ErrInvalidAlignment)
	_, err = arena.NewArena(buf, arena.ArenaOptions{Align: -64})
	assert.ErrorIs(t, err, arena.ErrInvalidAlignment)
}

// TestArenaBudget: growth that the governor refuses is an error that changes nothing.
func TestArenaBudget(t *testing.T) {
	page := os.Getpagesize()
	a, g := newHostArena(t, 16*page, arena.ArenaOptions{})
	require.NoError(t, g.SetLimit(accounting.HostKey, int64(2*page)))
	_, err := a.Alloc(page+1, 1)
	require.NoError(t, err)
	_, err = a.Alloc(page, 1)
	assert.ErrorIs(t, err, accounting.ErrBudgetExceeded)
	assert.Equal(t, page+1, a.Used())
	assert.Equal(t, 2*page, a.Committed())
	// What fits in the committed granules needs no budget.
	_, err = a.Alloc(page-1, 1)
	assert.NoError(t, err)
}

// TestArenaAllocCtx: growth the budget refuses waits in the governor's queue until
// another ledger gives bytes back; a cancelled wait or a request that can never fit
// changes nothing.
func TestArenaAllocCtx(t *testing.T) {
	page := os.Getpagesize()
	a, g := newHostArena(t, 16*page, arena.ArenaOptions{})
	require.NoError(t, g.SetLimit(accounting.HostKey, int64(4*page)))
	other := g.Authority("other", accounting.HostKey)
	require.NoError(t, other.TryAcquire(int64(3*page)))
	_, err := a.AllocCtx(context.Background(), page, 1)
	require.NoError(t, err)

	// Past the limit altogether: at once, without waiting.
	_, err = a.AllocCtx(context.Background(), 8*page, 1)
	assert.ErrorIs(t, err, accounting.ErrExceedsLimit)

	// A wait that is cancelled changes nothing.
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := a.AllocCtx(ctx, 2*page, 1)
		done <- err
	}()
	require.Eventually(t, func() bool { return g.Stats(accounting.HostKey).Waiters == 1 }, 10*time.Second, time.Millisecond)
	cancel()
	assert.ErrorIs(t, <-done, context.Canceled)
	assert.Equal(t, page, a.Used())
	assert.Equal(t, page, a.Committed())

	// A wait that the other ledger's release serves.
	go func() {
		_, err := a.AllocCtx(context.Background(), 2*page, 1)
		done <- err
	}()
	require.Eventually(t, func() bool { return g.Stats(accounting.HostKey).Waiters == 1 }, 10*time.Second, time.Millisecond)
	other.Release(int64(3 * page))
	require.NoError(t, <-done)
	assert.Equal(t, 3*page, a.Used())
	assert.Equal(t, 3*page, a.Committed())
	assert.Equal(t, int64(3*page), g.Stats(accounting.HostKey).Used)

	assert.PanicsWithValue(t, "arena: AllocCtx with a nil context", func() {
		//lint:ignore SA1012 the nil context is the misuse under test
		_, _ = a.AllocCtx(nil, 1, 1)
	})
}

func TestArenaMarkRewind(t *testing.T) {
	a, _ := newHostArena(t, 1<<20, arena.ArenaOptions{})
	_, err := a.Alloc(100, 1)
	require.NoError(t, err)
	m1 := a.Mark()
	x, err := a.Alloc(200, 1)
	require.NoError(t, err)
	assert.Equal(t, 100, x)
	m2 := a.Mark()
	_, err = a.Alloc(300, 1)
	require.NoError(t, err)

	a.Rewind(m2)
	assert.Equal(t, 300, a.Used())
	a.Rewind(m2) // a mark may be rewound to again
	assert.Equal(t, 300, a.Used())
	a.Rewind(m1)
	assert.Equal(t, 100, a.Used())
	assert.Equal(t, 600, a.HighWater(), "rewinding keeps the high-water mark")
	y, err := a.Alloc(50, 1)
	require.NoError(t, err)
	assert.Equal(t, x, y, "rewound bytes are reused")

	// m2 was taken after m1: rewinding to m1 invalidated it, even once a new mark
	// sits at the same depth.
	assert.PanicsWithValue(t, arena.PanicBadMark, func() { a.Rewind(m2) })
	m3 := a.Mark()
	assert.PanicsWithValue(t, arena.PanicBadMark, func() { a.Rewind(m2) })
	a.Rewind(m3)
	a.Rewind(m1)

	require.NoError(t, a.Reset())
	assert.PanicsWithValue(t, arena.PanicBadMark, func() { a.Rewind(m1) }, "Reset invalidates every mark")
	m4 := a.Mark()
	assert.PanicsWithValue(t, arena.PanicBadMark, func() { a.Rewind(m1) }, "a new mark at the same depth is another mark")
	a.Rewind(m4)

	other, _ := newHostArena(t, 1<<20, arena.ArenaOptions{})
	om := other.Mark()
	assert.PanicsWithValue(t, arena.PanicBadMark, func() { a.Rewind(om) })
	assert.PanicsWithValue(t, arena.PanicBadMark, func() { a.Rewind(arena.Mark{}) })
}

func TestArenaRelease(t *testing.T) {
	a, _ := newHostArena(t, 1<<20, arena.ArenaOptions{})
	x, err := a.Allocate(100, 16)
	require.NoError(t, err)
	y, err := a.Allocate(200, 16)
	require.NoError(t, err)
	assert.Equal(t, a.Buffer().Base()+112, y.Ptr)
	assert.Equal(t, 200, y.Size)

	// Not the latest: stays in place.
	out := a.Release(x)
	assert.Equal(t, accounting.Released(0), out)
	assert.Equal(t, 312, a.Used())
	// The latest: the bump pointer returns to its start.
	out = a.Release(y)
	assert.Equal(t, accounting.Released(0), out)
	assert.Equal(t, 112, a.Used())
	// Twice: nothing more.
	assert.Equal(t, accounting.Released(0), a.Release(y))
	assert.Equal(t, 112, a.Used())
	// A new allocation in y's place is not y.
	z, err := a.Allocate(200, 16)
	require.NoError(t, err)
	require.Equal(t, y.Ptr, z.Ptr)
	a.Release(y)
	assert.Equal(t, 312, a.Used(), "a stale release must not free a newer allocation")

	// Under a mark the latest allocation stays.
	a.Mark()
	a.Release(z)
	assert.Equal(t, 312, a.Used())

	other, _ := newHostArena(t, 1<<20, arena.ArenaOptions{})
	o, err := other.Allocate(8, 8)
	require.NoError(t, err)
	assert.PanicsWithValue(t, arena.PanicForeignAllocation, func() { a.Release(o) })
	assert.PanicsWithValue(t, arena.PanicForeignAllocation, func() { a.Release(arena.Allocation{}) })
}

func TestArenaResetReuses(t *testing.T) {
	page := os.Getpagesize()
	a, g := newHostArena(t, 64*page, arena.ArenaOptions{})
	step := func() []int {
		var offs []int
		for _, n := range []int{3 * page, 100, 5 * page, 7} {
			off, err := a.Alloc(n, 64)
			require.NoError(t, err)
			offs = append(offs, off)
		}
		return offs
	}
	first := step()
	committed := a.Committed()
	used := g.Stats(accounting.HostKey).Used
	require.NoError(t, a.Reset())
	assert.Zero(t, a.Used())
	assert.Zero(t, a.HighWater())
	assert.Equal(t, committed, a.Committed(), "Reset keeps the granules warm")
	assert.Equal(t, first, step(), "the next step gets the same memory")
	assert.Equal(t, committed, a.Committed(), "and commits nothing new")
	assert.Equal(t, used, g.Stats(accounting.HostKey).Used)
}

func TestArenaDecommitOnReset(t *testing.T) {
	page := os.Getpagesize()
	a, g := newHostArena(t, 64*page, arena.ArenaOptions{DecommitOnReset: true})
	_, err := a.Alloc(20*page+1, 1) // a large step
	require.NoError(t, err)
	require.NoError(t, a.Reset())
	assert.Equal(t, 21*page, a.Committed(), "the large step's high-water mark stays")

	_, err = a.Alloc(3*page, 1) // a small step
	require.NoError(t, err)
	require.NoError(t, a.Reset())
	assert.Equal(t, 3*page, a.Committed(), "granules past the small step's high-water mark go back")
	assert.Equal(t, int64(3*page), g.Stats(accounting.HostKey).Used)

	require.NoError(t, a.Reset())
	assert.Zero(t, a.Committed(), "an empty step keeps nothing")

	// Trim: explicit, never below what is in use.
	b, _ := newHostArena(t, 64*page, arena.ArenaOptions{})
	_, err = b.Alloc(10*page, 1)
	require.NoError(t, err)
	require.NoError(t, b.Reset())
	_, err = b.Alloc(2*page+5, 1)
	require.NoError(t, err)
	require.NoError(t, b.Trim(0))
	assert.Equal(t, 3*page, b.Committed())
	require.NoError(t, b.Trim(8*page))
	assert.Equal(t, 3*page, b.Committed(), "Trim never commits")
}

func TestArenaMake(t *testing.T) {
	a, _ := newHostArena(t, 1<<20, arena.ArenaOptions{})
	s, err := arena.Make[float32](a, 10)
	require.NoError(t, err)
	require.Len(t, s, 10)
	for i := range s {
		s[i] = float32(i)
	}
	h, err := arena.Make[arena.F16](a, 3)
	require.NoError(t, err)
	h[2] = arena.F16FromFloat32(1.5)
	assert.Equal(t, 64, a.Used()-6, "aligned to DefaultAlign after 40 bytes")
	empty, err := arena.Make[int8](a, 0)
	require.NoError(t, err)
	assert.Empty(t, empty)

	v, err := arena.MakeTensor[float32](a, 2, 3, 4)
	require.NoError(t, err)
	assert.Equal(t, 128, v.Offset())
	assert.Zero(t, v.DevicePtr()%arena.DefaultAlign)
	assert.Equal(t, []int{2, 3, 4}, v.Shape())
	vs, err := v.Slice()
	require.NoError(t, err)
	require.Len(t, vs, 24)
	vs[23] = 7
	assert.Equal(t, float32(7), v.At(1, 2, 3))
	assert.Equal(t, float32(9), s[9], "allocations do not overlap")
	assert.Equal(t, float32(1.5), h[2].Float32())

	// Option: a larger alignment; elements larger than it still align to their size.
	b, _ := newHostArena(t, 1<<20, arena.ArenaOptions{Align: 4})
	_, err = arena.Make[uint8](b, 1)
	require.NoError(t, err)
	d, err := arena.Make[float64](b, 1)
	require.NoError(t, err)
	assert.Zero(t, b.Buffer().Base()%8)
	assert.Equal(t, 8, b.Used()-8)
	_ = d
}

// TestArenaDevice: on memory the CPU must not touch (the fake backing's synthetic
// addresses), tensors give addresses and Make refuses.
func TestArenaDevice(t *testing.T) {
	g := accounting.NewGovernor()
	fake := backingtest.NewFake(backingtest.FakeOptions{Device: accounting.GPU(0)})
	buf, err := arena.NewBuffer(fake, 1<<20, g.Authority("gpu", accounting.GPU(0)))
	require.NoError(t, err)
	a, err := arena.NewArena(buf, arena.ArenaOptions{Align: 256})
	require.NoError(t, err)
	defer a.Close()
	assert.False(t, a.HostAccessible())
	assert.Equal(t, accounting.GPU(0), a.Device())

	_, err = arena.Make[float32](a, 4)
	assert.ErrorIs(t, err, arena.ErrNotHostAccessible)
	x, err := arena.MakeTensor[arena.BF16](a, 8, 4096)
	require.NoError(t, err)
	y, err := arena.MakeTensor[arena.BF16](a, 3)
	require.NoError(t, err)
	assert.Equal(t, buf.Base(), x.DevicePtr())
	assert.Equal(t, buf.Base()+8*4096*2, y.DevicePtr())
	assert.Zero(t, y.DevicePtr()%256)
	_, err = x.Slice()
	assert.ErrorIs(t, err, arena.ErrNotHostAccessible)
	assert.PanicsWithValue(t, arena.PanicDeviceAccess, func() { x.At(0, 0) })
}

func TestArenaAllocatorContract(t *testing.T) {
	a, _ := newHostArena(t, 1<<20, arena.ArenaOptions{})
	var al arena.Allocator = a
	assert.True(t, arena.IsVirtual(al))
	assert.False(t, arena.CanShare(al), "private host memory can not be shared")
	assert.Equal(t, accounting.HostKey, al.Device())
	x, err := al.Allocate(1000, 128)
	require.NoError(t, err)
	assert.Zero(t, x.Ptr%128)
	assert.True(t, al.Release(x).OK())

	// A backing that shares (ByBacking fake) says so.
	g := accounting.NewGovernor()
	fake := backingtest.NewFake(backingtest.FakeOptions{Authority: g.Authority("pool", accounting.HostKey)})
	buf, err := arena.NewBuffer(fake, 1<<20, nil)
	require.NoError(t, err)
	sa, err := arena.NewArena(buf, arena.ArenaOptions{})
	require.NoError(t, err)
	defer sa.Close()
	assert.True(t, arena.CanShare(sa))

	// Something that answers nothing.
	assert.False(t, arena.IsVirtual(plainAllocator{}))
	assert.False(t, arena.CanShare(plainAllocator{}))
}

type plainAllocator struct{}

func (plainAllocator) Allocate(int, int) (arena.Allocation, error) {
	return arena.Allocation{}, errors.ErrUnsupported
}
func (plainAllocator) Release(arena.Allocation) accounting.ReleaseOutcome {
	return accounting.Released(0)
}
func (plainAllocator) Device() accounting.DeviceKey { return accounting.HostKey }

func TestArenaClose(t *testing.T) {
	a, g := newHostArena(t, 1<<20, arena.ArenaOptions{})
	_, err := arena.Make[float32](a, 50000)
	require.NoError(t, err)
	require.NotZero(t, g.Stats(accounting.HostKey).Used)
	out := a.Close()
	assert.True(t, out.OK(), "%v", out)
	assert.Zero(t, g.Stats(accounting.HostKey).Used)
	for name, use := range map[string]func(){
		"Alloc":      func() { _, _ = a.Alloc(1, 1) },
		"Make":       func() { _, _ = arena.Make[float32](a, 1) },
		"MakeTensor": func() { _, _ = arena.MakeTensor[float32](a, 1) },
		"Mark":       func() { a.Mark() },
		"Reset":      func() { _ = a.Reset() },
		"Trim":       func() { _ = a.Trim(0) },
		"Release":    func() { a.Release(arena.Allocation{}) },
	} {
		assert.PanicsWithValue(t, arena.PanicArenaClosed, use, name)
	}
	again := a.Close()
	assert.Equal(t, accounting.Failed, again.Status, "a second Close changes nothing")
	assert.ErrorIs(t, again.Err, arena.ErrClosed)
}

// TestArenaStepAllocsNothing: a step of tensors from the arena and a Reset make no
// heap allocation (the benchmark's target, as a property).
func TestArenaStepAllocsNothing(t *testing.T) {
	a, _ := newHostArena(t, 64<<20, arena.ArenaOptions{})
	step := newLayerStep(decodeStep)
	require.NoError(t, step.arena(a)) // the first step commits
	allocs := testing.AllocsPerRun(100, func() {
		if err := step.arena(a); err != nil {
			panic(err)
		}
	})
	assert.Zero(t, allocs)
}

// compile-time check that the fake backing's arena is an Allocator too.
var _ arena.Allocator = (*arena.Arena[*backingtest.FakeReservation, *backingtest.Fake])(nil)
