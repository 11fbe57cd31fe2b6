package kv_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/hosttier"
)

// swapEnv is this file's one constructor of a test's cache: openEnv with a model and
// MaxTokens (a zero Model is tiny8), on kind.
func swapEnv(t *testing.T, kind backingKind, m kv.Model, opts ...envOption) *env {
	t.Helper()
	t.Cleanup(kv.SetSwapChunk(swapTestChunk))
	return openEnv(t, append([]envOption{kind, withConfig(kv.Config{Model: m, MaxTokens: 4096})}, opts...)...)
}

// swapTestChunk is the most bytes of a value of the tests' swaps: a few granules, so
// that every swap is several values.
const swapTestChunk = 3 * envGranule

// swapRef is the plain model of one sequence: the bytes of every tensor's tokens,
// token after token, and each recurrent layer's state.
type swapRef struct {
	s       *kv.Sequence
	tensors [][]byte
	states  [][]byte
}

// swapModels are the models the round trips run on: uniform, every kind of group
// side by side (a recurrent state among them), and gpt-oss-20b's sliding windows.
var swapModels = []kv.Model{tiny8, tinyHybrid, kv.GPTOSS20B()}

// newSwapRef returns an empty sequence of c and its model.
func newSwapRef(t *testing.T, c *kv.Cache) *swapRef {
	t.Helper()
	s, err := c.NewSequence()
	require.NoError(t, err)
	tensors, states := tensorsOf(c.Config().Model)
	return &swapRef{s: s, tensors: make([][]byte, len(tensors)), states: make([][]byte, len(states))}
}

// grow appends k tokens of random bytes to r's sequence and writes them (and new
// states) into it and into the model.
func (r *swapRef) grow(t *testing.T, rnd *rand.Rand, k int) {
	t.Helper()
	m := r.s.Cache().Config().Model
	tensors, states := tensorsOf(m)
	n := r.s.Len()
	require.NoError(t, r.s.Append(k))
	for i, tr := range tensors {
		tb := tr.group.TokenBytes()
		src := randBytes(rnd, k*tb)
		require.NoError(t, r.s.WriteTokens(tr.layer, tr.kind, n, n+k, src))
		r.tensors[i] = append(r.tensors[i], src...)
	}
	for i, l := range states {
		st := randBytes(rnd, stateBytes(m, l))
		require.NoError(t, r.s.WriteState(l, st))
		r.states[i] = st
	}
}

// randBytes returns n random bytes of rnd.
func randBytes(rnd *rand.Rand, n int) []byte {
	b := make([]byte, n+7)
	for j := 0; j < n; j += 8 {
		binary.LittleEndian.PutUint64(b[j:], rnd.Uint64())
	}
	return b[:n:n]
}

// stateBytes returns the state bytes of recurrent layer l of m.
func stateBytes(m kv.Model, l int) int {
	for _, g := range m.Groups {
		for _, gl := range g.Layers {
			if gl == l {
				return g.StateBytes
			}
		}
	}
	return 0
}

// check returns an error unless s holds r's model: every token it still holds
// (from FirstHeld on) and every state, bit-exact.
func (r *swapRef) check(s *kv.Sequence) error {
	m := s.Cache().Config().Model
	tensors, states := tensorsOf(m)
	n := len(r.tensors[0]) / tensors[0].group.TokenBytes()
	if s.Len() != n {
		return fmt.Errorf("%d tokens, want %d", s.Len(), n)
	}
	for i, tr := range tensors {
		tb := tr.group.TokenBytes()
		from := s.FirstHeld(tr.layer)
		if from >= n {
			continue
		}
		got := make([]byte, (n-from)*tb)
		if err := s.ReadTokens(tr.layer, tr.kind, from, n, got); err != nil {
			return err
		}
		if want := r.tensors[i][from*tb:]; !bytes.Equal(got, want) {
			return fmt.Errorf("layer %d %v tokens [%d, %d) differ", tr.layer, tr.kind, from, n)
		}
	}
	for i, l := range states {
		if n == 0 {
			break
		}
		got := make([]byte, len(r.states[i]))
		if err := s.ReadState(l, got); err != nil {
			return err
		}
		if !bytes.Equal(got, r.states[i]) {
			return fmt.Errorf("state of layer %d differs", l)
		}
	}
	return nil
}

// helds returns the FirstHeld of every layer of s that holds tokens.
func helds(s *kv.Sequence) []int {
	tensors, _ := tensorsOf(s.Cache().Config().Model)
	out := make([]int, len(tensors))
	for i, tr := range tensors {
		out[i] = s.FirstHeld(tr.layer)
	}
	return out
}

// newHostTier returns a host tier of budget bytes that refuses rather than evicts,
// closed by the test's cleanup.
func newHostTier(t *testing.T, budget int64) *hosttier.Tier {
	t.Helper()
	tier, err := hosttier.New(hosttier.Options{Budget: budget, Granule: 64 << 10, NoEvict: true})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, tier.Close()) })
	return tier
}

// committed returns what the cache's live sequences commit (Stats).
func committed(c *kv.Cache) int64 { return c.Stats().Committed }

// seqCommitted returns what sequence id of c commits (SequenceStats).
func seqCommitted(c *kv.Cache, id uint64) int64 {
	for _, st := range c.SequenceStats() {
		if st.ID == id {
			return st.Committed
		}
	}
	return -1
}

// TestSwapRoundTrip: on each model and backing, random sequences grow; one is swapped
// out into a host tier while the others go on growing, writing and reading on other
// goroutines; the governor's used bytes drop by what it committed; it is swapped
// back into a new sequence, whose every token and state reads back bit-exact, and
// the ledger is exact after each step.
func TestSwapRoundTrip(t *testing.T) {
	for _, kind := range []backingKind{onFake, onPrivate, onShared} {
		for _, m := range swapModels {
			t.Run(backingNames[kind]+"/"+m.Name, func(t *testing.T) {
				rnd := rand.New(rand.NewPCG(uint64(kind), uint64(len(m.Name))))
				e := swapEnv(t, kind, m)
				tier := newHostTier(t, 64<<20)
				refs := make([]*swapRef, 3)
				for i := range refs {
					refs[i] = newSwapRef(t, e.c)
					e.onFail(func() { refs[i].s.Close() })
					for range 1 + rnd.IntN(3) {
						refs[i].grow(t, rnd, 1+rnd.IntN(100))
					}
				}
				for round := range 3 {
					victim := refs[rnd.IntN(len(refs))]
					others := make([]*swapRef, 0, len(refs)-1)
					for _, r := range refs {
						if r != victim {
							others = append(others, r)
						}
					}
					wantHelds := helds(victim.s)
					e.books(t, "before swap out")
					before, own := e.gov.Stats(e.auth.Device()).Used, seqCommitted(e.c, victim.s.ID())
					othersBefore := committed(e.c) - own
					var wg sync.WaitGroup
					stop := make(chan struct{})
					for i, r := range others {
						wg.Add(1)
						go func() {
							defer wg.Done()
							rnd := rand.New(rand.NewPCG(uint64(round), uint64(i)))
							for range 8 {
								select {
								case <-stop:
									return
								default:
								}
								if r.s.Len() < 300 {
									r.grow(t, rnd, 1+rnd.IntN(8))
								}
								assert.NoError(t, r.check(r.s))
							}
						}()
					}
					h, err := e.c.SwapOut(context.Background(), victim.s, tier)
					close(stop)
					wg.Wait()
					require.NoError(t, err)
					assert.Equal(t, len(victim.tensors[0])/tensorsOf1(m).TokenBytes(), h.Len())
					assert.Positive(t, h.Bytes())
					e.books(t, "after swap out")
					if kind != onShared { // NB: a pool keeps idle granules charged
						// The victim's granules went back; the others' growth meanwhile
						// was charged.
						after := e.gov.Stats(e.auth.Device()).Used
						assert.Positive(t, own)
						assert.Equal(t, before-own+(committed(e.c)-othersBefore), after, "used bytes after swap out")
					}
					s, err := e.c.SwapIn(context.Background(), h)
					require.NoError(t, err)
					victim.s = s
					require.NoError(t, victim.check(s), "round %d", round)
					assert.Equal(t, wantHelds, helds(s), "each window holds what it held")
					assert.Zero(t, tier.Stats().Values, "the swap's values are deleted")
					e.books(t, "after swap in")
					if kind != onShared {
						assert.Equal(t, committed(e.c), e.gov.Stats(e.auth.Device()).Used)
					}
					// The sequence swapped in goes on growing.
					victim.grow(t, rnd, 1+rnd.IntN(40))
					require.NoError(t, victim.check(s))
				}
				for _, r := range refs {
					require.NoError(t, r.check(r.s))
					require.True(t, r.s.Close().OK())
				}
				e.undo = nil
			})
		}
	}
}

// tensorsOf1 returns the group of m's first tensor.
func tensorsOf1(m kv.Model) kv.Group {
	tensors, _ := tensorsOf(m)
	return tensors[0].group
}

// swapTier is a tier in a map, out of process (its values' payloads are summed), that
// refuses the store numbered failAt (from 1; 0: none) and can damage a value.
type swapTier struct {
	mu     sync.Mutex
	vals   map[tierval.Key][]byte
	stores int
	failAt int
}

var errTierFull = errors.New("swap tier: full")

func (t *swapTier) Name() string { return "swap-map" }

func (t *swapTier) Store(ctx context.Context, key tierval.Key, size int, fill func(dst []byte) error) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	t.mu.Lock()
	t.stores++
	fail := t.stores == t.failAt
	t.mu.Unlock()
	if fail {
		return errTierFull
	}
	buf := make([]byte, size)
	if err := fill(buf); err != nil {
		return err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.vals == nil {
		t.vals = map[tierval.Key][]byte{}
	}
	t.vals[key] = buf
	return nil
}

func (t *swapTier) Load(ctx context.Context, key tierval.Key, use func(src []byte) error) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	t.mu.Lock()
	v, ok := t.vals[key]
	t.mu.Unlock()
	if !ok {
		return kv.ErrTierMiss
	}
	return use(v)
}

func (t *swapTier) Contains(ctx context.Context, keys []tierval.Key) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for i, k := range keys {
		if _, ok := t.vals[k]; !ok {
			return i, nil
		}
	}
	return len(keys), nil
}

func (t *swapTier) Delete(ctx context.Context, key tierval.Key) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.vals, key)
	return nil
}

// len returns the values the tier holds.
func (t *swapTier) len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.vals)
}

// damage applies f to one value the tier holds, chosen by i.
func (t *swapTier) damage(i int, f func(k tierval.Key, v []byte)) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for k, v := range t.vals {
		if i == 0 {
			f(k, v)
			return
		}
		i--
	}
}

// TestSwapOutRefused: a tier that refuses a store makes SwapOut fail with its error;
// the sequence is as it was (every token, its length, its granules) and goes on, and
// the tier holds none of the swap's values.
func TestSwapOutRefused(t *testing.T) {
	for _, m := range swapModels {
		t.Run(m.Name, func(t *testing.T) {
			rnd := rand.New(rand.NewPCG(7, 7))
			e := swapEnv(t, onFake, m)
			r := newSwapRef(t, e.c)
			e.onFail(func() { r.s.Close() })
			r.grow(t, rnd, 300)
			used := e.gov.Stats(e.auth.Device()).Used
			for _, failAt := range []int{1, 2} {
				tier := &swapTier{failAt: failAt}
				h, err := e.c.SwapOut(context.Background(), r.s, tier)
				require.ErrorIs(t, err, errTierFull)
				assert.Nil(t, h)
				assert.Zero(t, tier.len(), "no value of the failed swap is left")
				require.NoError(t, r.check(r.s))
				assert.Equal(t, used, e.gov.Stats(e.auth.Device()).Used)
			}
			ctx, cancel := context.WithCancel(context.Background())
			cancel()
			_, err := e.c.SwapOut(ctx, r.s, &swapTier{})
			require.ErrorIs(t, err, context.Canceled)
			r.grow(t, rnd, 5)
			require.NoError(t, r.check(r.s))
			require.True(t, r.s.Close().OK())
			e.undo = nil
		})
	}
}

// TestSwapInDamaged: a value damaged in the tier (a flipped byte, another value's
// bytes, one evicted) makes SwapIn fail with ErrSwapLost and the check it failed;
// nothing of the swap-in is left committed, the handle still holds the copy, and once
// the tier is whole again the swap-in works.
func TestSwapInDamaged(t *testing.T) {
	cases := []struct {
		name   string
		damage func(tier *swapTier) func()
		want   error
	}{
		{"flipped byte", func(tier *swapTier) func() {
			var key tierval.Key
			var at int
			tier.damage(0, func(k tierval.Key, v []byte) { key, at = k, len(v)-1; v[at] ^= 0x40 })
			return func() { tier.vals[key][at] ^= 0x40 }
		}, tierval.ErrChecksum},
		{"header of another swap", func(tier *swapTier) func() {
			var key tierval.Key
			var old []byte
			tier.damage(0, func(k tierval.Key, v []byte) {
				key, old = k, v
				other := bytes.Clone(v)
				tierval.Encode(other, tierval.Key{Namespace: k.Namespace + 1, Hash: k.Hash}, nil, len(v)-tierval.HeaderSize,
					func(p []byte) error { copy(p, v[tierval.HeaderSize:]); return nil })
				tier.vals[k] = other
			})
			return func() { tier.vals[key] = old }
		}, tierval.ErrNamespace},
		{"evicted", func(tier *swapTier) func() {
			var key tierval.Key
			var old []byte
			tier.damage(1, func(k tierval.Key, v []byte) { key, old = k, v; delete(tier.vals, k) })
			return func() { tier.vals[key] = old }
		}, kv.ErrTierMiss},
	}
	for _, tt := range cases {
		for _, m := range swapModels {
			t.Run(tt.name+"/"+m.Name, func(t *testing.T) {
				rnd := rand.New(rand.NewPCG(8, 8))
				e := swapEnv(t, onFake, m)
				r := newSwapRef(t, e.c)
				r.grow(t, rnd, 200)
				tier := &swapTier{}
				h, err := e.c.SwapOut(context.Background(), r.s, tier)
				require.NoError(t, err)
				require.GreaterOrEqual(t, tier.len(), 2)
				used, stats := e.gov.Stats(e.auth.Device()).Used, e.c.Stats()
				repair := tt.damage(tier)
				s, err := e.c.SwapIn(context.Background(), h)
				require.ErrorIs(t, err, kv.ErrSwapLost)
				require.ErrorIs(t, err, tt.want)
				assert.Nil(t, s)
				assert.Equal(t, used, e.gov.Stats(e.auth.Device()).Used, "nothing committed is left")
				assert.Equal(t, stats.Sequences, e.c.Stats().Sequences)
				e.books(t, "after a failed swap in")
				repair()
				s, err = e.c.SwapIn(context.Background(), h)
				require.NoError(t, err)
				r.s = s
				require.NoError(t, r.check(s))
				require.True(t, s.Close().OK())
			})
		}
	}
}

// TestSwapInWaits: a swap-in that the budget can not take waits in the governor's
// queue as an append does: a deadline ends the wait with the copy kept, and a
// sequence closed meanwhile lets a waiting swap-in through.
func TestSwapInWaits(t *testing.T) {
	rnd := rand.New(rand.NewPCG(9, 9))
	e := swapEnv(t, onFake, tiny8, withLimit(64*envGranule))
	tier := newHostTier(t, 16<<20)
	r := newSwapRef(t, e.c)
	r.grow(t, rnd, 40)
	h, err := e.c.SwapOut(context.Background(), r.s, tier)
	require.NoError(t, err)
	hog, err := e.c.NewSequence()
	require.NoError(t, err)
	e.onFail(func() { hog.Close() })
	for hog.Append(1) == nil {
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	s, err := e.c.SwapIn(ctx, h)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Nil(t, s)
	assert.Equal(t, 1, e.c.Stats().Sequences)
	done := make(chan error, 1)
	go func() {
		s, err := e.c.SwapIn(context.Background(), h)
		if err == nil {
			r.s = s
		}
		done <- err
	}()
	require.True(t, hog.Close().OK())
	require.NoError(t, <-done)
	require.NoError(t, r.check(r.s))
	require.True(t, r.s.Close().OK())
	e.undo = nil

	// A swap larger than the whole limit fails at once.
	e2 := swapEnv(t, onFake, tiny8)
	big := newSwapRef(t, e2.c)
	big.grow(t, rnd, 200)
	h2, err := e2.c.SwapOut(context.Background(), big.s, tier)
	require.NoError(t, err)
	require.NoError(t, e2.gov.SetLimit(e2.auth.Device(), envGranule))
	_, err = e2.c.SwapIn(context.Background(), h2)
	require.ErrorIs(t, err, accounting.ErrExceedsLimit)
	require.NoError(t, h2.Drop())
	assert.Zero(t, tier.Stats().Values)
}

// TestSwapBadInput: what can not be swapped is refused with a clear error, and a
// handle is swapped in once.
func TestSwapBadInput(t *testing.T) {
	ctx := context.Background()
	e := swapEnv(t, onFake, tiny8)
	other := e.cache(t, withTiny8(kv.Config{MaxTokens: 4096}))
	tier := &swapTier{}
	s, err := e.c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, s.Append(10))
	theirs, err := other.NewSequence()
	require.NoError(t, err)
	defer theirs.Close()

	_, err = e.c.SwapOut(ctx, nil, tier)
	assert.ErrorIs(t, err, kv.ErrSwap)
	_, err = e.c.SwapOut(ctx, s, nil)
	assert.ErrorIs(t, err, kv.ErrSwap)
	_, err = e.c.SwapOut(ctx, theirs, tier)
	assert.ErrorIs(t, err, kv.ErrSwap)
	_, err = e.c.SwapIn(ctx, nil)
	assert.ErrorIs(t, err, kv.ErrSwap)

	h, err := e.c.SwapOut(ctx, s, tier)
	require.NoError(t, err)
	_, err = e.c.SwapOut(ctx, s, tier)
	assert.ErrorIs(t, err, kv.ErrClosed, "the sequence swapped out is closed")
	_, err = other.SwapIn(ctx, h)
	assert.ErrorIs(t, err, kv.ErrSwap)
	s2, err := e.c.SwapIn(ctx, h)
	require.NoError(t, err)
	defer s2.Close()
	assert.Equal(t, 10, s2.Len())
	_, err = e.c.SwapIn(ctx, h)
	assert.ErrorIs(t, err, kv.ErrSwap, "a second swap-in")
	assert.NoError(t, h.Drop(), "a drop after the swap-in does nothing")

	// A dropped copy is gone from its tier and can not come back.
	h3, err := e.c.SwapOut(ctx, s2, tier)
	require.NoError(t, err)
	require.NotZero(t, tier.len())
	require.NoError(t, h3.Drop())
	assert.Zero(t, tier.len())
	_, err = e.c.SwapIn(ctx, h3)
	assert.ErrorIs(t, err, kv.ErrSwap)
	assert.NoError(t, h3.Drop())

	// An empty sequence swaps out and in.
	empty, err := e.c.NewSequence()
	require.NoError(t, err)
	h4, err := e.c.SwapOut(ctx, empty, tier)
	require.NoError(t, err)
	assert.Zero(t, h4.Len())
	empty, err = e.c.SwapIn(ctx, h4)
	require.NoError(t, err)
	assert.Zero(t, empty.Len())
	require.NoError(t, empty.Append(3))
	require.True(t, empty.Close().OK())
}

// TestSwapShared: a fork, whose first tokens map its parent's granules, swaps out and
// back in whole while the parent goes on, and then the parent does too: each new
// sequence owns every byte, bit-exact, and the books stay exact.
func TestSwapShared(t *testing.T) {
	for _, m := range swapModels {
		t.Run(m.Name, func(t *testing.T) {
			rnd := rand.New(rand.NewPCG(10, 10))
			e := swapEnv(t, onFake, m)
			tier := newHostTier(t, 64<<20)
			parent := newSwapRef(t, e.c)
			e.onFail(func() { parent.s.Close() })
			parent.grow(t, rnd, 150+rnd.IntN(100))
			fs, err := parent.s.Fork()
			require.NoError(t, err)
			child := &swapRef{s: fs, tensors: make([][]byte, len(parent.tensors)), states: make([][]byte, len(parent.states))}
			for i := range parent.tensors {
				child.tensors[i] = bytes.Clone(parent.tensors[i])
			}
			for i := range parent.states {
				child.states[i] = bytes.Clone(parent.states[i])
			}
			e.onFail(func() { child.s.Close() })
			child.grow(t, rnd, 7)
			for _, r := range []*swapRef{child, parent} {
				h, err := e.c.SwapOut(context.Background(), r.s, tier)
				require.NoError(t, err)
				e.books(t, "after swap out")
				for _, o := range []*swapRef{child, parent} {
					if o != r {
						o.grow(t, rnd, 3)
						require.NoError(t, o.check(o.s))
					}
				}
				s, err := e.c.SwapIn(context.Background(), h)
				require.NoError(t, err)
				r.s = s
				require.NoError(t, r.check(s))
				assert.Zero(t, e.c.SequenceStats()[len(e.c.SequenceStats())-1].Shared, "a sequence swapped in maps nothing")
				e.books(t, "after swap in")
			}
			for _, r := range []*swapRef{child, parent} {
				require.NoError(t, r.check(r.s))
				require.True(t, r.s.Close().OK())
			}
			e.undo = nil
		})
	}
}
