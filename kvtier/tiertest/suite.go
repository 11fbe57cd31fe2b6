package tiertest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
)

// MinValueSize is the least value size a tier must hold: a 2 MiB block (one granule
// of every layer of a Blocked cache, the transfer unit) and room for its header and
// tokens. A tier with a MaxValueSize method must report at least this.
const MinValueSize = 2<<20 + 64<<10

// Run runs every property against fresh tiers from newTier (one per subtest).
// newTier registers its own teardown with t.Cleanup; it may return the same tier, or
// tiers over one shared server, to several properties, since each property uses keys
// of its own namespace and deletes them when it ends.
//
// The properties cover the [kv.Tier] contract: a stable Name; Store then Load gives the
// bytes stored, for sizes 0, 1, an odd size and 2 MiB; fill is called once with exactly
// size bytes; a key never stored is [kv.ErrTierMiss] and use is not called; Store
// replaces; Delete forgets, and deleting a missing key is not an error; keys differing
// in namespace alone are distinct; fill's error is Store's and keeps nothing (a held
// key keeps its old value or nothing, never a partial one); use's error is Load's and
// the value stays; the value does not change when the caller's buffers or other keys
// do; Contains returns the run up to the first gap; concurrent stores, loads,
// Contains and deletes under -race, where a Load of a key others replace sees one whole
// value; a context already cancelled or past its deadline is refused by every method
// with an error wrapping ctx.Err() and changes nothing; a negative size, and a size
// above MaxValueSize when the tier has that method, is refused with
// [tierval.ErrSize] before fill is called.
func Run(t *testing.T, newTier func(t *testing.T) kv.Tier) {
	t.Helper()
	props := []struct {
		name string
		fn   func(e *env)
	}{
		{"Name", testName},
		{"Bounds", testBounds},
		{"StoreLoad", testStoreLoad},
		{"Miss", testMiss},
		{"Replace", testReplace},
		{"Delete", testDelete},
		{"NamespaceDistinct", testNamespaceDistinct},
		{"FillError", testFillError},
		{"FillErrorKeepsNoPartial", testFillErrorHeld},
		{"UseError", testUseError},
		{"SourceNotRetained", testSourceNotRetained},
		{"Contains", testContains},
		{"Concurrent", testConcurrent},
		{"Cancelled", testCancelled},
		{"BadSize", testBadSize},
		{"Peek", testPeek},
	}
	for _, p := range props {
		t.Run(p.name, func(t *testing.T) {
			tier := newTier(t)
			require.NotNil(t, tier, "the factory returned no tier")
			e := &env{t: t, tier: tier, ns: rand.Uint64() | 1}
			t.Cleanup(e.cleanup)
			p.fn(e)
		})
	}
}

// env is one property's view of its tier: its namespace and the keys it stored.
type env struct {
	t    *testing.T
	tier kv.Tier
	ns   uint64

	mu     sync.Mutex
	stored map[tierval.Key]bool
}

// key returns the property's i-th key. The hash spreads i over 64 bits, as a chained
// block hash would, so that a tier that shards by key sees many shards.
func (e *env) key(i int) tierval.Key {
	return tierval.Key{Namespace: e.ns, Hash: uint64(i+1) * 0x9e3779b97f4a7c15}
}

func (e *env) remember(k tierval.Key) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.stored == nil {
		e.stored = map[tierval.Key]bool{}
	}
	e.stored[k] = true
}

// cleanup deletes every key the property may have stored.
func (e *env) cleanup() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	e.mu.Lock()
	defer e.mu.Unlock()
	for k := range e.stored {
		assert.NoError(e.t, e.tier.Delete(ctx, k), "cleanup: Delete(%v)", k)
	}
}

// store stores data under k and checks that fill was called once with exactly
// len(data) bytes.
func (e *env) store(ctx context.Context, k tierval.Key, data []byte) error {
	e.t.Helper()
	e.remember(k)
	calls := 0
	err := e.tier.Store(ctx, k, len(data), func(dst []byte) error {
		calls++
		if len(dst) != len(data) {
			return fmt.Errorf("tiertest: fill got %d bytes, want %d", len(dst), len(data))
		}
		copy(dst, data)
		return nil
	})
	if err == nil {
		assert.Equal(e.t, 1, calls, "Store(%v) succeeded with fill called %d times", k, calls)
	} else {
		assert.LessOrEqual(e.t, calls, 1, "Store(%v) called fill %d times", k, calls)
	}
	return err
}

// mustStore stores data under k and fails the property if that fails.
func (e *env) mustStore(k tierval.Key, data []byte) {
	e.t.Helper()
	require.NoError(e.t, e.store(context.Background(), k, data), "Store(%v, %d bytes)", k, len(data))
}

// load returns a copy of the value under k, checking that use was called once.
func (e *env) load(ctx context.Context, k tierval.Key) ([]byte, error) {
	e.t.Helper()
	var got []byte
	calls := 0
	err := e.tier.Load(ctx, k, func(src []byte) error {
		calls++
		got = bytes.Clone(src)
		if got == nil {
			got = []byte{}
		}
		return nil
	})
	if err != nil {
		if calls != 0 && errors.Is(err, kv.ErrTierMiss) {
			e.t.Errorf("Load(%v) called use and then answered a miss", k)
		}
		return nil, err
	}
	assert.Equal(e.t, 1, calls, "Load(%v) succeeded with use called %d times", k, calls)
	return got, nil
}

// mustLoad checks that k holds want.
func (e *env) mustLoad(k tierval.Key, want []byte, msg string) {
	e.t.Helper()
	got, err := e.load(context.Background(), k)
	require.NoError(e.t, err, "Load(%v): %s", k, msg)
	if !bytes.Equal(got, want) {
		e.t.Fatalf("Load(%v): %s: got %s, want %s", k, msg, describe(got), describe(want))
	}
}

// mustMiss checks that k is a miss.
func (e *env) mustMiss(k tierval.Key, msg string) {
	e.t.Helper()
	got, err := e.load(context.Background(), k)
	require.ErrorIs(e.t, err, kv.ErrTierMiss, "Load(%v): %s (got %s)", k, msg, describe(got))
}

func (e *env) contains(keys []tierval.Key) int {
	e.t.Helper()
	n, err := e.tier.Contains(context.Background(), keys)
	require.NoError(e.t, err, "Contains")
	return n
}

// pattern returns n bytes that depend on seed and on every position, so that a
// shifted, truncated or mixed value differs from it.
func pattern(n int, seed uint64) []byte {
	b := make([]byte, n)
	x := seed*0x9e3779b97f4a7c15 + 0x2545f4914f6cdd1d
	for i := range b {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		b[i] = byte(x)
	}
	return b
}

// describe names a value briefly for a failure message, instead of printing 2 MiB.
func describe(b []byte) string {
	if b == nil {
		return "no value"
	}
	head := b[:min(len(b), 8)]
	return fmt.Sprintf("%d bytes starting % x", len(b), head)
}

func testName(e *env) {
	name := e.tier.Name()
	assert.NotEmpty(e.t, name, "Name")
	assert.Equal(e.t, name, e.tier.Name(), "Name is stable")
}

func testBounds(e *env) {
	m, ok := e.tier.(interface{ MaxValueSize() int })
	if !ok {
		e.t.Log("no MaxValueSize method: the tier bounds no value size")
		return
	}
	assert.GreaterOrEqual(e.t, m.MaxValueSize(), MinValueSize, "MaxValueSize must hold a 2 MiB block and its header")
}

func testStoreLoad(e *env) {
	for i, size := range []int{0, 1, 4099, 2 << 20} {
		k := e.key(i)
		data := pattern(size, uint64(i))
		e.mustStore(k, data)
		e.mustLoad(k, data, fmt.Sprintf("size %d", size))
		e.mustLoad(k, data, fmt.Sprintf("size %d, loaded again", size))
	}
}

func testMiss(e *env) {
	e.mustMiss(e.key(0), "a key never stored")
	called := false
	err := e.tier.Load(context.Background(), e.key(1), func([]byte) error { called = true; return nil })
	assert.ErrorIs(e.t, err, kv.ErrTierMiss)
	assert.False(e.t, called, "use called on a miss")
}

func testReplace(e *env) {
	k := e.key(0)
	e.mustStore(k, pattern(5000, 1))
	second := pattern(300, 2)
	e.mustStore(k, second)
	e.mustLoad(k, second, "after a shorter replacement")
	third := pattern(9000, 3)
	e.mustStore(k, third)
	e.mustLoad(k, third, "after a longer replacement")
	e.mustStore(k, nil)
	e.mustLoad(k, []byte{}, "after an empty replacement")
}

func testDelete(e *env) {
	ctx := context.Background()
	k, other := e.key(0), e.key(1)
	e.mustStore(k, pattern(100, 1))
	e.mustStore(other, pattern(100, 2))
	require.NoError(e.t, e.tier.Delete(ctx, k))
	e.mustMiss(k, "after Delete")
	assert.Zero(e.t, e.contains([]tierval.Key{k}), "Contains after Delete")
	e.mustLoad(other, pattern(100, 2), "another key after Delete")
	assert.NoError(e.t, e.tier.Delete(ctx, k), "deleting a deleted key")
	assert.NoError(e.t, e.tier.Delete(ctx, e.key(2)), "deleting a key never stored")
	e.mustStore(k, pattern(50, 3))
	e.mustLoad(k, pattern(50, 3), "stored again after Delete")
}

func testNamespaceDistinct(e *env) {
	k := e.key(0)
	other := tierval.Key{Namespace: e.ns ^ 0x8000_0000_0000_0000, Hash: k.Hash}
	e.remember(other)
	e.mustStore(k, pattern(64, 1))
	e.mustMiss(other, "same hash, other namespace")
	assert.Zero(e.t, e.contains([]tierval.Key{other}), "Contains of the same hash in another namespace")
	e.mustStore(other, pattern(64, 2))
	e.mustLoad(k, pattern(64, 1), "the first namespace's value")
	e.mustLoad(other, pattern(64, 2), "the second namespace's value")
}

func testFillError(e *env) {
	boom := errors.New("tiertest: fill failed")
	k := e.key(0)
	e.remember(k)
	err := e.tier.Store(context.Background(), k, 1000, func(dst []byte) error {
		copy(dst, pattern(len(dst), 1))
		return boom
	})
	require.ErrorIs(e.t, err, boom, "fill's error is Store's")
	e.mustMiss(k, "after a failed fill")
	assert.Zero(e.t, e.contains([]tierval.Key{k}), "Contains after a failed fill")
}

func testFillErrorHeld(e *env) {
	boom := errors.New("tiertest: fill failed")
	k := e.key(0)
	old := pattern(1000, 1)
	e.mustStore(k, old)
	err := e.tier.Store(context.Background(), k, 1000, func(dst []byte) error {
		copy(dst[:500], pattern(500, 2))
		return boom
	})
	require.ErrorIs(e.t, err, boom, "fill's error is Store's")
	got, err := e.load(context.Background(), k)
	if errors.Is(err, kv.ErrTierMiss) {
		return
	}
	require.NoError(e.t, err)
	if !bytes.Equal(got, old) {
		e.t.Fatalf("after a failed replacement the key holds %s: neither its old value nor nothing", describe(got))
	}
}

func testUseError(e *env) {
	boom := errors.New("tiertest: use failed")
	k := e.key(0)
	data := pattern(777, 1)
	e.mustStore(k, data)
	err := e.tier.Load(context.Background(), k, func([]byte) error { return boom })
	require.ErrorIs(e.t, err, boom, "use's error is Load's")
	assert.NotErrorIs(e.t, err, kv.ErrTierMiss, "use's error is not a miss")
	e.mustLoad(k, data, "after use failed")
}

func testSourceNotRetained(e *env) {
	k, twin := e.key(0), e.key(1)
	data := pattern(4096, 1)
	want := bytes.Clone(data)
	e.mustStore(k, data)
	e.mustStore(twin, data)
	for i := range data {
		data[i] ^= 0xff // the caller reuses its buffer
	}
	e.mustLoad(k, want, "after the caller overwrote the bytes it stored")
	e.mustStore(twin, pattern(4096, 2))
	e.mustLoad(k, want, "after another key holding the same bytes was replaced")
	var kept []byte
	require.NoError(e.t, e.tier.Load(context.Background(), k, func(src []byte) error {
		kept = bytes.Clone(src)
		return nil
	}))
	require.NoError(e.t, e.tier.Delete(context.Background(), twin))
	e.mustStore(e.key(2), pattern(4096, 3))
	e.mustLoad(k, kept, "a second Load after other stores and deletes")
}

func testContains(e *env) {
	keys := make([]tierval.Key, 6)
	for i := range keys {
		keys[i] = e.key(i)
	}
	assert.Zero(e.t, e.contains(nil), "Contains(nil)")
	assert.Zero(e.t, e.contains([]tierval.Key{}), "Contains of no keys")
	assert.Zero(e.t, e.contains(keys), "Contains before any Store")
	for _, i := range []int{0, 1, 2, 4, 5} { // a gap at 3
		e.mustStore(keys[i], pattern(10+i, uint64(i)))
	}
	assert.Equal(e.t, 3, e.contains(keys), "Contains stops at the first gap")
	assert.Equal(e.t, 0, e.contains(keys[3:]), "Contains from the gap")
	assert.Equal(e.t, 2, e.contains(keys[4:]), "Contains past the gap")
	assert.Equal(e.t, 1, e.contains(keys[2:3]), "Contains of one held key")
	assert.Equal(e.t, 2, e.contains([]tierval.Key{keys[5], keys[0], keys[3], keys[1]}), "Contains in the caller's order")
	require.NoError(e.t, e.tier.Delete(context.Background(), keys[1]))
	assert.Equal(e.t, 1, e.contains(keys), "Contains after deleting the second key")
	e.mustStore(keys[1], pattern(1, 9))
	e.mustStore(keys[3], pattern(1, 9))
	assert.Equal(e.t, 6, e.contains(keys), "Contains once the gaps are filled")
	many := make([]tierval.Key, 300)
	for i := range many {
		many[i] = e.key(100 + i)
	}
	for _, k := range many[:257] {
		e.mustStore(k, nil)
	}
	assert.Equal(e.t, 257, e.contains(many), "Contains of a long run")
}

// testConcurrent runs goroutines that each store, load, check and delete keys of
// their own, while all of them replace one shared key, whose every Load must be one
// whole value of one writer.
func testConcurrent(e *env) {
	const workers, rounds = 8, 12
	shared := e.key(1 << 20)
	e.remember(shared)
	sharedValue := func(w, r int) []byte {
		v := pattern(1000+w*37+r, uint64(w)<<8|uint64(r))
		v[0], v[1] = byte(w), byte(r)
		return v
	}
	var wg sync.WaitGroup
	errs := make(chan error, workers*rounds*4)
	ctx := context.Background()
	for w := range workers {
		wg.Go(func() {
			for r := range rounds {
				k := e.key(w*rounds + r)
				data := pattern(512+r*w, uint64(w*rounds+r))
				if err := e.store(ctx, k, data); err != nil {
					errs <- fmt.Errorf("worker %d: Store: %w", w, err)
					return
				}
				got, err := e.load(ctx, k)
				if err != nil || !bytes.Equal(got, data) {
					errs <- fmt.Errorf("worker %d: Load of its own key: %s, err %v", w, describe(got), err)
				}
				if err := e.store(ctx, shared, sharedValue(w, r)); err != nil {
					errs <- fmt.Errorf("worker %d: Store of the shared key: %w", w, err)
				}
				got, err = e.load(ctx, shared)
				switch {
				case err != nil:
					errs <- fmt.Errorf("worker %d: Load of the shared key: %w", w, err)
				case len(got) < 2 || !bytes.Equal(got, sharedValue(int(got[0]), int(got[1]))):
					errs <- fmt.Errorf("worker %d: the shared key holds a mixed value: %s", w, describe(got))
				}
				if n, err := e.tier.Contains(ctx, []tierval.Key{k}); err != nil || n != 1 {
					errs <- fmt.Errorf("worker %d: Contains of its own key: %d, err %v", w, n, err)
				}
				if r%3 == 0 {
					if err := e.tier.Delete(ctx, k); err != nil {
						errs <- fmt.Errorf("worker %d: Delete: %w", w, err)
					} else if _, err := e.load(ctx, k); !errors.Is(err, kv.ErrTierMiss) {
						errs <- fmt.Errorf("worker %d: Load after its Delete: %v, want a miss", w, err)
					}
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		e.t.Error(err)
	}
}

func testCancelled(e *env) {
	held, fresh := e.key(0), e.key(1)
	e.remember(fresh)
	data := pattern(256, 1)
	e.mustStore(held, data)

	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	expired, cancel2 := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel2()
	for _, c := range []struct {
		name string
		ctx  context.Context
		want error
	}{{"cancelled", cancelled, context.Canceled}, {"past its deadline", expired, context.DeadlineExceeded}} {
		filled := false
		err := e.tier.Store(c.ctx, fresh, 16, func(dst []byte) error { filled = true; return nil })
		assert.ErrorIs(e.t, err, c.want, "Store with a context %s", c.name)
		err = e.tier.Store(c.ctx, held, 16, func(dst []byte) error { filled = true; return nil })
		assert.ErrorIs(e.t, err, c.want, "Store over a held key with a context %s", c.name)
		if filled {
			e.t.Logf("Store called fill with a context %s (allowed, but the value must not be kept)", c.name)
		}
		used := false
		err = e.tier.Load(c.ctx, held, func([]byte) error { used = true; return nil })
		assert.ErrorIs(e.t, err, c.want, "Load with a context %s", c.name)
		assert.False(e.t, used, "Load with a context %s called use", c.name)
		_, err = e.tier.Contains(c.ctx, []tierval.Key{held})
		assert.ErrorIs(e.t, err, c.want, "Contains with a context %s", c.name)
		err = e.tier.Delete(c.ctx, held)
		assert.ErrorIs(e.t, err, c.want, "Delete with a context %s", c.name)
	}
	e.mustMiss(fresh, "a Store with a done context keeps nothing")
	e.mustLoad(held, data, "Store and Delete with a done context change nothing")
}

func testBadSize(e *env) {
	k := e.key(0)
	e.remember(k)
	filled := false
	fill := func([]byte) error { filled = true; return nil }
	err := e.tier.Store(context.Background(), k, -1, fill)
	assert.ErrorIs(e.t, err, tierval.ErrSize, "Store of size -1")
	assert.False(e.t, filled, "Store of size -1 called fill")
	if m, ok := e.tier.(interface{ MaxValueSize() int }); ok {
		err = e.tier.Store(context.Background(), k, m.MaxValueSize()+1, fill)
		assert.ErrorIs(e.t, err, tierval.ErrSize, "Store of MaxValueSize()+1 bytes")
		assert.False(e.t, filled, "Store above MaxValueSize called fill")
	}
	e.mustMiss(k, "after refused Stores")
}

// testPeek checks kv.TierPeeker, where the tier implements it: the first bytes of a
// value, whole where fewer are held, an empty value as no bytes, a miss, use's error,
// a done context, a replaced and a deleted value, and the panic of a length below 1.
func testPeek(e *env) {
	p, ok := e.tier.(kv.TierPeeker)
	if !ok {
		e.t.Skip("the tier does not implement kv.TierPeeker")
	}
	ctx := context.Background()
	peek := func(k tierval.Key, n int) ([]byte, error) {
		e.t.Helper()
		var got []byte
		calls := 0
		err := p.Peek(ctx, k, n, func(head []byte) error {
			calls++
			got = bytes.Clone(head)
			if got == nil {
				got = []byte{}
			}
			return nil
		})
		if err == nil {
			assert.Equal(e.t, 1, calls, "Peek(%v, %d) succeeded with use called %d times", k, n, calls)
		} else {
			assert.Zero(e.t, calls, "Peek(%v, %d) called use and failed: %v", k, n, err)
		}
		return got, err
	}
	k := e.key(0)
	data := pattern(9000, 1)
	e.mustStore(k, data)
	for _, n := range []int{1, 48, 511, 4096, 4097, 9000, 9001, 1 << 20} {
		got, err := peek(k, n)
		require.NoError(e.t, err, "Peek(%d)", n)
		if want := data[:min(n, len(data))]; !bytes.Equal(got, want) {
			e.t.Fatalf("Peek(%d): got %s, want %s", n, describe(got), describe(want))
		}
	}
	_, err := peek(e.key(1), 16)
	assert.ErrorIs(e.t, err, kv.ErrTierMiss, "Peek of a key never stored")

	boom := errors.New("tiertest: use failed")
	err = p.Peek(ctx, k, 16, func([]byte) error { return boom })
	assert.ErrorIs(e.t, err, boom, "use's error is Peek's")
	assert.NotErrorIs(e.t, err, kv.ErrTierMiss)
	e.mustLoad(k, data, "after Peek's use failed")

	e.mustStore(e.key(2), nil)
	got, err := peek(e.key(2), 16)
	require.NoError(e.t, err, "Peek of an empty value")
	assert.Empty(e.t, got, "Peek of an empty value")

	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	used := false
	err = p.Peek(cancelled, k, 16, func([]byte) error { used = true; return nil })
	assert.ErrorIs(e.t, err, context.Canceled, "Peek with a cancelled context")
	assert.False(e.t, used, "Peek with a cancelled context called use")

	assert.PanicsWithValue(e.t, kv.PanicPeekLength, func() {
		_ = p.Peek(ctx, k, 0, func([]byte) error { return nil })
	}, "Peek of 0 bytes")

	second := pattern(100, 2)
	e.mustStore(k, second)
	got, err = peek(k, 4096)
	require.NoError(e.t, err)
	if !bytes.Equal(got, second) {
		e.t.Fatalf("Peek after a replacement: got %s, want %s", describe(got), describe(second))
	}
	require.NoError(e.t, e.tier.Delete(ctx, k))
	_, err = peek(k, 16)
	assert.ErrorIs(e.t, err, kv.ErrTierMiss, "Peek after Delete")
	e.mustLoad(e.key(2), []byte{}, "Peek changed nothing")
}
