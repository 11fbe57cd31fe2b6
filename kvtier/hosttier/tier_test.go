package hosttier_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/hosttier"
)

const gran = 64 << 10

var bg = context.Background()

func key(i int) tierval.Key { return tierval.Key{Namespace: 0xfeed, Hash: uint64(i)} }

// content returns the bytes of value i of size n: different for every key and size.
func content(i, n int) []byte {
	p := make([]byte, n)
	for j := range p {
		p[j] = byte(j*31 + i*7 + n)
	}
	return p
}

// ledger is a HostTier authority on a governor of its own, limited to limit bytes.
func ledger(t *testing.T, limit int64) *accounting.Authority {
	t.Helper()
	g := accounting.NewGovernor()
	dev := accounting.DeviceKey{Tier: accounting.HostTier}
	require.NoError(t, g.SetLimit(dev, limit))
	return g.Authority("test", dev)
}

// newTier returns a tier closed at cleanup, whose ledger must then be empty.
func newTier(t *testing.T, o hosttier.Options) (*hosttier.Tier, *accounting.Authority) {
	t.Helper()
	if o.Authority == nil {
		o.Authority = ledger(t, o.Budget)
	}
	tr, err := hosttier.New(o)
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, tr.Close())
		assert.Zero(t, o.Authority.Stats().Owned, "bytes left charged after Close")
	})
	return tr, o.Authority
}

func store(t *testing.T, tr *hosttier.Tier, i, n int) {
	t.Helper()
	require.NoError(t, tr.Store(bg, key(i), n, func(dst []byte) error {
		require.Len(t, dst, n)
		copy(dst, content(i, n))
		return nil
	}))
}

// load returns a copy of the value under key i, or the error.
func load(tr *hosttier.Tier, i int) ([]byte, error) {
	var got []byte
	err := tr.Load(bg, key(i), func(src []byte) error {
		got = bytes.Clone(src)
		return nil
	})
	return got, err
}

// checkBooks asserts that the tier's figures and its ledger agree.
func checkBooks(t *testing.T, tr *hosttier.Tier, a *accounting.Authority) {
	t.Helper()
	s := tr.Stats()
	assert.Equal(t, s.Held, a.Stats().Owned, "held bytes vs ledger")
	assert.LessOrEqual(t, s.Held, s.Budget)
	assert.LessOrEqual(t, s.ValueBytes, s.Held)
	assert.GreaterOrEqual(t, s.Values, 0)
}

func TestRoundTrip(t *testing.T) {
	tr, a := newTier(t, hosttier.Options{Budget: 16 << 20})
	sizes := []int{0, 1, gran - 1, gran, gran + 1, 2<<20 + 3}
	for i, n := range sizes {
		store(t, tr, i, n)
	}
	for i, n := range sizes {
		got, err := load(tr, i)
		require.NoError(t, err, "size %d", n)
		assert.Equal(t, content(i, n), got, "size %d", n)
	}
	s := tr.Stats()
	var total int64
	for _, n := range sizes {
		total += int64(n)
	}
	assert.Equal(t, len(sizes), s.Values)
	assert.Equal(t, total, s.ValueBytes)
	assert.Equal(t, total, s.StoredBytes)
	assert.Equal(t, total, s.LoadedBytes)
	assert.Equal(t, int64(len(sizes)), s.Hits)
	assert.Equal(t, int64(len(sizes)), s.Stores)
	assert.Equal(t, int64(16<<20), s.Budget)
	// 0 + 1 + 1 + 1 + 2 + 33 granules committed.
	assert.Equal(t, int64(38*gran), s.Held)
	assert.Equal(t, "host", tr.Name())
	checkBooks(t, tr, a)
}

func TestMissContainsDelete(t *testing.T) {
	tr, a := newTier(t, hosttier.Options{Budget: 1 << 20})
	_, err := load(tr, 9)
	assert.ErrorIs(t, err, kv.ErrTierMiss)
	assert.Equal(t, int64(1), tr.Stats().Misses)

	for i := range 3 {
		store(t, tr, i, 100)
	}
	n, err := tr.Contains(bg, []tierval.Key{key(0), key(1), key(2), key(3), key(0)})
	require.NoError(t, err)
	assert.Equal(t, 3, n, "the run stops at the first key not held")
	n, err = tr.Contains(bg, nil)
	require.NoError(t, err)
	assert.Zero(t, n)

	require.NoError(t, tr.Delete(bg, key(1)))
	require.NoError(t, tr.Delete(bg, key(1)), "deleting what is not held is no error")
	n, err = tr.Contains(bg, []tierval.Key{key(0), key(1), key(2)})
	require.NoError(t, err)
	assert.Equal(t, 1, n)
	_, err = load(tr, 1)
	assert.ErrorIs(t, err, kv.ErrTierMiss)
	assert.Equal(t, 2, tr.Stats().Values)
	checkBooks(t, tr, a)
}

func TestReplace(t *testing.T) {
	tr, a := newTier(t, hosttier.Options{Budget: 1 << 20})
	store(t, tr, 1, 5000)
	require.NoError(t, tr.Store(bg, key(1), 70000, func(dst []byte) error {
		copy(dst, content(2, 70000))
		return nil
	}))
	got, err := load(tr, 1)
	require.NoError(t, err)
	assert.Equal(t, content(2, 70000), got)
	s := tr.Stats()
	assert.Equal(t, 1, s.Values)
	assert.Equal(t, int64(70000), s.ValueBytes)
	checkBooks(t, tr, a)
}

// A fill that fails keeps nothing and leaves the value held before under the key.
func TestFillError(t *testing.T) {
	tr, a := newTier(t, hosttier.Options{Budget: 1 << 20})
	store(t, tr, 1, 300)
	boom := errors.New("boom")
	err := tr.Store(bg, key(1), 400, func([]byte) error { return boom })
	assert.ErrorIs(t, err, boom)
	got, err := load(tr, 1)
	require.NoError(t, err)
	assert.Equal(t, content(1, 300), got, "the old value stays")
	err = tr.Store(bg, key(2), 400, func([]byte) error { return boom })
	assert.ErrorIs(t, err, boom)
	_, err = load(tr, 2)
	assert.ErrorIs(t, err, kv.ErrTierMiss)
	s := tr.Stats()
	assert.Equal(t, 1, s.Values)
	assert.Equal(t, int64(1), s.Stores)
	// A fill that panics gives its room back too: 15 of the 16 granules, then 15 again
	// with no eviction.
	assert.Panics(t, func() { _ = tr.Store(bg, key(3), 15*gran, func([]byte) error { panic("fill") }) })
	store(t, tr, 4, 15*gran)
	assert.Zero(t, tr.Stats().Evictions)
	_, err = load(tr, 1)
	assert.NoError(t, err)
	checkBooks(t, tr, a)

	useErr := errors.New("use")
	assert.ErrorIs(t, tr.Load(bg, key(4), func([]byte) error { return useErr }), useErr)
}

func TestEvictLRU(t *testing.T) {
	tr, a := newTier(t, hosttier.Options{Budget: 4 * gran})
	for i := range 4 {
		store(t, tr, i, gran)
	}
	_, err := load(tr, 0) // 0 is now the most recently used; 1 the least
	require.NoError(t, err)
	store(t, tr, 4, gran)
	_, err = load(tr, 1)
	assert.ErrorIs(t, err, kv.ErrTierMiss, "the least recently used value went")
	for _, i := range []int{0, 2, 3, 4} {
		got, err := load(tr, i)
		require.NoError(t, err, "key %d", i)
		assert.Equal(t, content(i, gran), got)
	}
	// Granules now hold 0, 4, 2, 3 in that order, 0 the least recently used and 4 the
	// most. A value of two granules needs two adjacent ones: evicting 0 and then 2
	// frees granules that are not adjacent, so 3 goes too. Mixed sizes can evict more
	// than they need; a cache's blocks are one size.
	store(t, tr, 5, 2*gran)
	n, err := tr.Contains(bg, []tierval.Key{key(4), key(5)})
	require.NoError(t, err)
	assert.Equal(t, 2, n)
	s := tr.Stats()
	assert.Equal(t, int64(4), s.Evictions)
	assert.Equal(t, 2, s.Values)
	assert.Equal(t, int64(4*gran), s.Held)
	checkBooks(t, tr, a)
}

func TestRefusals(t *testing.T) {
	tr, a := newTier(t, hosttier.Options{Budget: 2 * gran, NoEvict: true})
	store(t, tr, 0, gran)
	store(t, tr, 1, gran)
	err := tr.Store(bg, key(2), 1, func([]byte) error { t.Fatal("fill called on a refused store"); return nil })
	assert.ErrorIs(t, err, hosttier.ErrFull)
	err = tr.Store(bg, key(3), 2*gran+1, func([]byte) error { return nil })
	assert.ErrorIs(t, err, hosttier.ErrTooLarge)
	err = tr.Store(bg, key(3), -1, func([]byte) error { return nil })
	assert.ErrorIs(t, err, hosttier.ErrBadSize)
	s := tr.Stats()
	assert.Equal(t, int64(2), s.Refusals)
	assert.Zero(t, s.Evictions)
	checkBooks(t, tr, a)
}

// A tier whose ledger shares its device with another taker evicts and reuses its own
// warm granules when the governor refuses more.
func TestLedgerRefusesMore(t *testing.T) {
	a := ledger(t, 3*gran)
	other := a.Governor().Authority("other", a.Device())
	require.NoError(t, other.TryAcquire(gran))
	defer other.Release(gran)
	tr, _ := newTier(t, hosttier.Options{Budget: 8 * gran, Authority: a})
	for i := range 5 {
		store(t, tr, i, gran)
	}
	s := tr.Stats()
	assert.Equal(t, int64(2*gran), s.Held, "held what the governor allowed")
	assert.Equal(t, int64(3), s.Evictions)
	assert.Equal(t, 2, s.Values)
	checkBooks(t, tr, a)

	// With nothing to evict, the governor's refusal is the error.
	tr2, err := hosttier.New(hosttier.Options{Budget: 8 * gran, Authority: other.Governor().Authority("third", a.Device()), NoEvict: true})
	require.NoError(t, err)
	defer func() { require.NoError(t, tr2.Close()) }()
	err = tr2.Store(bg, key(0), 1, func([]byte) error { return nil })
	assert.ErrorIs(t, err, accounting.ErrBudgetExceeded)
}

func TestReaderHoldsItsValue(t *testing.T) {
	tr, a := newTier(t, hosttier.Options{Budget: 2 * gran})
	store(t, tr, 0, gran)
	store(t, tr, 1, gran)
	reading := make(chan struct{})
	release := make(chan struct{})
	done := make(chan error)
	go func() {
		done <- tr.Load(bg, key(0), func(src []byte) error {
			close(reading)
			<-release
			if !bytes.Equal(src, content(0, gran)) {
				return errors.New("value changed under its reader")
			}
			return nil
		})
	}()
	<-reading
	// 0 is being read: the store evicts 1, though 0 is older.
	store(t, tr, 2, gran)
	_, err := load(tr, 1)
	assert.ErrorIs(t, err, kv.ErrTierMiss)
	// Now 0 and 2 fill the tier; 2 can go, 0 can not.
	err = tr.Store(bg, key(3), 2*gran, func([]byte) error { return nil })
	assert.ErrorIs(t, err, hosttier.ErrFull, "the only room is being read")
	// Deleting 0 while it is read keeps its bytes until the reader leaves.
	require.NoError(t, tr.Delete(bg, key(0)))
	close(release)
	require.NoError(t, <-done)
	store(t, tr, 4, 2*gran)
	checkBooks(t, tr, a)
}

func TestTrim(t *testing.T) {
	tr, a := newTier(t, hosttier.Options{Budget: 8 * gran})
	for i := range 4 {
		store(t, tr, i, gran)
	}
	require.NoError(t, tr.Delete(bg, key(1)))
	require.NoError(t, tr.Delete(bg, key(2)))
	assert.Equal(t, int64(4*gran), tr.Stats().Held, "freed granules stay warm")
	n, err := tr.Trim()
	require.NoError(t, err)
	assert.Equal(t, int64(2*gran), n)
	assert.Equal(t, int64(2*gran), tr.Stats().Held)
	checkBooks(t, tr, a)
	for _, i := range []int{0, 3} {
		got, err := load(tr, i)
		require.NoError(t, err)
		assert.Equal(t, content(i, gran), got)
	}
	store(t, tr, 5, 3*gran) // commits again
	assert.Equal(t, int64(5*gran), tr.Stats().Held)
	checkBooks(t, tr, a)
}

func TestBadOptions(t *testing.T) {
	wrong := accounting.NewGovernor().Authority("gpu", accounting.GPU(0))
	tests := []struct {
		name string
		o    hosttier.Options
	}{
		{"no budget", hosttier.Options{}},
		{"negative budget", hosttier.Options{Budget: -1}},
		{"granule not a power of two", hosttier.Options{Budget: 1 << 20, Granule: 3 << 10}},
		{"budget below a granule", hosttier.Options{Budget: 1000}},
		{"pin chunk above 64 GiB", hosttier.Options{Budget: 1 << 20, PinChunk: 65 << 30}},
		{"authority on a GPU", hosttier.Options{Budget: 1 << 20, Authority: wrong}},
		{"authority on the host", hosttier.Options{Budget: 1 << 20, Authority: accounting.NewGovernor().Authority("h", accounting.HostKey)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tr, err := hosttier.New(tt.o)
			assert.ErrorIs(t, err, hosttier.ErrBadOptions)
			assert.Nil(t, tr)
		})
	}
	// A granule the host backing refuses (below the page size).
	_, err := hosttier.New(hosttier.Options{Budget: 1 << 20, Granule: 512})
	assert.ErrorIs(t, err, hosttier.ErrBadOptions)
}

func TestMisuse(t *testing.T) {
	tr, err := hosttier.New(hosttier.Options{Budget: 1 << 20})
	require.NoError(t, err)
	assert.PanicsWithValue(t, hosttier.PanicNilFunc, func() { _ = tr.Store(bg, key(0), 1, nil) })
	assert.PanicsWithValue(t, hosttier.PanicNilFunc, func() { _ = tr.Load(bg, key(0), nil) })
	assert.PanicsWithValue(t, hosttier.PanicNilFunc, func() { _ = tr.Peek(bg, key(0), 1, nil) })
	ctx, cancel := context.WithCancel(bg)
	cancel()
	assert.ErrorIs(t, tr.Store(ctx, key(0), 1, func([]byte) error { return nil }), context.Canceled)
	assert.ErrorIs(t, tr.Load(ctx, key(0), func([]byte) error { return nil }), context.Canceled)
	_, err = tr.Contains(ctx, []tierval.Key{key(0)})
	assert.ErrorIs(t, err, context.Canceled)
	assert.ErrorIs(t, tr.Delete(ctx, key(0)), context.Canceled)

	require.NoError(t, tr.Close())
	assert.ErrorIs(t, tr.Close(), hosttier.ErrClosed)
	assert.PanicsWithValue(t, hosttier.PanicClosed, func() { _ = tr.Store(bg, key(0), 1, func([]byte) error { return nil }) })
	assert.PanicsWithValue(t, hosttier.PanicClosed, func() { _, _ = load(tr, 0) })
	assert.PanicsWithValue(t, hosttier.PanicClosed, func() { _, _ = tr.Contains(bg, nil) })
	assert.PanicsWithValue(t, hosttier.PanicClosed, func() { _ = tr.Delete(bg, key(0)) })
	assert.PanicsWithValue(t, hosttier.PanicClosed, func() { _, _ = tr.Trim() })
}

// Close waits for a Load in progress.
func TestCloseWaits(t *testing.T) {
	tr, err := hosttier.New(hosttier.Options{Budget: 1 << 20})
	require.NoError(t, err)
	store(t, tr, 0, 1000)
	reading := make(chan struct{})
	closed := make(chan struct{})
	go func() {
		<-reading
		assert.NoError(t, tr.Close())
		close(closed)
	}()
	err = tr.Load(bg, key(0), func(src []byte) error {
		close(reading)
		select {
		case <-closed:
			return errors.New("closed under a reader")
		default:
		}
		// Let Close reach its wait; it must not return while src is lent.
		for range 1000 {
			_ = src[len(src)-1]
		}
		return nil
	})
	require.NoError(t, err)
	<-closed
}

// Concurrent stores, loads, deletes and trims: every load returns the exact bytes of
// its key or a miss, and the books agree at the end.
func TestConcurrent(t *testing.T) {
	tr, a := newTier(t, hosttier.Options{Budget: 24 * gran})
	const workers, ops, keys = 4, 400, 40
	var wg sync.WaitGroup
	var loads atomic.Int64
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for range ops {
				i := rng.IntN(keys)
				size := (i%3 + 1) * gran / 2 // fixed per key
				switch op := rng.IntN(10); {
				case op < 4:
					err := tr.Store(bg, key(i), size, func(dst []byte) error {
						copy(dst, content(i, size))
						return nil
					})
					if err != nil {
						assert.ErrorIs(t, err, hosttier.ErrFull)
					}
				case op < 8:
					loads.Add(1)
					got, err := load(tr, i)
					if err != nil {
						assert.ErrorIs(t, err, kv.ErrTierMiss)
						continue
					}
					assert.True(t, bytes.Equal(content(i, size), got), "key %d: wrong bytes", i)
				case op < 9:
					assert.NoError(t, tr.Delete(bg, key(i)))
				default:
					_, err := tr.Trim()
					assert.NoError(t, err)
				}
			}
		}()
	}
	wg.Wait()
	checkBooks(t, tr, a)
	s := tr.Stats()
	assert.Equal(t, loads.Load(), s.Hits+s.Misses, "every load counted once")
}

// FuzzTier drives random operations against a map of what each key last stored: a
// load returns exactly that or a miss (an eviction), never other bytes, and a miss
// stays a miss until the key is stored again.
func FuzzTier(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3, 4, 5, 6, 7, 8, 9})
	f.Add([]byte{0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2})
	f.Fuzz(func(t *testing.T, prog []byte) {
		a := ledger(t, 6*gran)
		tr, err := hosttier.New(hosttier.Options{Budget: 6 * gran, Authority: a})
		require.NoError(t, err)
		defer func() {
			require.NoError(t, tr.Close())
			require.Zero(t, a.Stats().Owned)
		}()
		model := map[int][]byte{} // what a key may hold; absent: must miss
		for n, b := range prog {
			i := int(b>>4) % 8
			switch b & 3 {
			case 0, 1:
				size := int(b&0x0c)*gran/4 + n%7
				v := content(i+n, size)
				require.NoError(t, tr.Store(bg, key(i), size, func(dst []byte) error { copy(dst, v); return nil }))
				model[i] = v
			case 2:
				got, err := load(tr, i)
				if err != nil {
					require.ErrorIs(t, err, kv.ErrTierMiss)
					delete(model, i) // evicted: a miss from now on
					continue
				}
				want, ok := model[i]
				require.True(t, ok, "key %d loads but was deleted or evicted", i)
				require.Equal(t, want, got, "key %d", i)
			case 3:
				require.NoError(t, tr.Delete(bg, key(i)))
				delete(model, i)
			}
			s := tr.Stats()
			require.Equal(t, s.Held, a.Stats().Owned)
			require.LessOrEqual(t, s.ValueBytes, s.Held)
		}
	})
}

func ExampleTier() {
	tier, err := hosttier.New(hosttier.Options{Budget: 64 << 20})
	if err != nil {
		panic(err)
	}
	defer tier.Close()
	block := tierval.Key{Namespace: 1, Hash: 0xabc}
	ctx := context.Background()
	// Store hands the tier's own memory to fill: the block is copied once, into place.
	err = tier.Store(ctx, block, 2<<20, func(dst []byte) error {
		copy(dst, "K and V of 16 tokens of every layer")
		return nil
	})
	if err != nil {
		panic(err)
	}
	n, _ := tier.Contains(ctx, []tierval.Key{block, {Namespace: 1, Hash: 0xdef}})
	_ = tier.Load(ctx, block, func(src []byte) error {
		fmt.Printf("%d of 2 keys held; %q\n", n, src[:13])
		return nil
	})
	s := tier.Stats()
	fmt.Printf("hits %d, held %d MiB of %d MiB\n", s.Hits, s.Held>>20, s.Budget>>20)
	// Output:
	// 1 of 2 keys held; "K and V of 16"
	// hits 1, held 2 MiB of 64 MiB
}

// Without CUDA there is nothing to pin and no stream.
func TestNoCUDA(t *testing.T) {
	tr, _ := newTier(t, hosttier.Options{Budget: 1 << 20})
	assert.NoError(t, tr.WaitPinned(bg))
	assert.Nil(t, tr.Stream())
	assert.Equal(t, 1<<20, tr.MaxValueSize())
	require.NoError(t, tr.Store(bg, key(0), 10, func(dst []byte) error {
		assert.False(t, tr.IsPinned(dst))
		return nil
	}))
	assert.False(t, tr.IsPinned(nil))
	assert.Zero(t, tr.Stats().Pinned)
}
