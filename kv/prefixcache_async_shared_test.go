//go:build linux || windows

package kv_test

import (
	"context"
	"slices"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/tiertest"
)

// gateTier is a tier whose loads, from the free-th after arm on, wait until open is
// closed or their context ends; each load that waits first sends its number (0 the
// first after arm) on waiting, if there is room. Stores and Contains never wait.
type gateTier struct {
	kv.Tier
	mu      sync.Mutex
	loads   int
	free    int
	armed   bool
	waiting chan int
	open    chan struct{}
}

func newGateTier() *gateTier {
	return &gateTier{Tier: tiertest.NewMap(4 << 20), waiting: make(chan int, 16), open: make(chan struct{})}
}

// arm makes the loads from the free-th on wait, counting from now.
func (g *gateTier) arm(free int) {
	g.mu.Lock()
	g.loads, g.free, g.armed = 0, free, true
	g.mu.Unlock()
}

func (g *gateTier) Load(ctx context.Context, key tierval.Key, use func(src []byte) error) error {
	g.mu.Lock()
	n := g.loads
	g.loads++
	wait := g.armed && n >= g.free
	g.mu.Unlock()
	if wait {
		select {
		case g.waiting <- n:
		default:
		}
		select {
		case <-g.open:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return g.Tier.Load(ctx, key, use)
}

// asyncEnv is a cache of 64 KiB granules on kind with a prefix cache over tier, and
// a prompt of four whole blocks and a tail whose blocks went down into the tier
// (evictAll), so that nothing of it is on the device.
func asyncEnv(t *testing.T, kind backingKind, tier kv.Tier) (*env, *kv.PrefixCache, []int32, int) {
	t.Helper()
	e := openEnv(t, kind, withGranule(64<<10), withConfig(kv.Config{MaxTokens: 512}))
	pc := newTierCache(t, e.c, tier)
	tpb, _ := blockTokens(t, e.c)
	ids := promptIDs(3, 4*tpb+3)
	evictAll(t, pc, ids)
	return e, pc, ids, tpb
}

// finish prefills what q lacks of ids, inserts it and closes q, as a server does
// after a lookup.
func finish(t *testing.T, pc *kv.PrefixCache, q *kv.Sequence, ids []int32, m int) {
	t.Helper()
	require.NoError(t, q.Append(len(ids)-m))
	require.NoError(t, writeIDs(q, ids, m, len(ids)))
	require.NoError(t, pc.Insert(q, ids))
	require.True(t, q.Close().OK())
}

// TestLookupAsync: LookupAsync maps the device's part of a hit before it returns
// (Device) and loads the blocks after it from the tier: Wait returns a sequence that
// holds exactly the device's match and the tier's blocks, each token the one written,
// counted as Lookup counts them; a second Wait returns the same. On host memory and
// the CUDA fake, from an in-memory tier and the host tier.
func TestLookupAsync(t *testing.T) {
	for _, be := range tierBackends {
		for _, tk := range tierKinds {
			t.Run(be.name+"/"+tk.name, func(t *testing.T) {
				e, pc, ids, tpb := asyncEnv(t, be.kind, tk.make(t))
				// The device holds the first block and a token again (loaded from the
				// tier by a Lookup, then inserted): a device hit, the rest from the tier.
				s, m, err := serve(pc, ids[:tpb+1])
				require.NoError(t, err)
				require.Equal(t, tpb, m)
				require.True(t, s.Close().OK())
				before := pc.Stats()

				p, err := pc.LookupAsync(context.Background(), kv.Namespace{}, ids)
				require.NoError(t, err)
				assert.Equal(t, tpb+1, p.Device(), "the device's entry: a block and a token")
				q, m := p.Wait()
				<-p.Done()
				require.NotNil(t, q)
				assert.Equal(t, 4*tpb, m, "the device's match, then the tier's whole blocks")
				assert.Equal(t, m, q.Len())
				require.NoError(t, checkIDs(q, ids, 0, m))
				q2, m2 := p.Wait()
				assert.Same(t, q, q2)
				assert.Equal(t, m, m2)
				st := pc.Stats()
				assert.EqualValues(t, 4*tpb, st.Hits-before.Hits)
				assert.EqualValues(t, len(ids), st.Queries-before.Queries)
				assert.EqualValues(t, 4*tpb-(tpb+1), st.Tiers[0].Hits-before.Tiers[0].Hits, "the tokens past the device's match")
				assert.Equal(t, before.Tiers[0].Drops, st.Tiers[0].Drops)
				finish(t, pc, q, ids, m)
				idleBooks(t, e, pc, "after an async lookup")
			})
		}
	}
}

// TestLookupAsyncOverlaps: LookupAsync returns while the tier's loads still run, and
// the caller goes on meanwhile (here: serves another request from the device and
// inserts it); nothing is counted until the loads end. Then Wait returns what the
// tier held, each token the one written.
func TestLookupAsyncOverlaps(t *testing.T) {
	for _, be := range tierBackends {
		t.Run(be.name, func(t *testing.T) {
			tier := newGateTier()
			e, pc, ids, tpb := asyncEnv(t, be.kind, tier)
			other := promptIDs(7000, 2*tpb+1)
			s, _, err := serve(pc, other)
			require.NoError(t, err)
			require.True(t, s.Close().OK())
			before := pc.Stats()

			tier.arm(1) // the first block loads; the second waits
			p, err := pc.LookupAsync(context.Background(), kv.Namespace{}, ids)
			require.NoError(t, err)
			assert.Zero(t, p.Device())
			assert.Equal(t, 1, <-tier.waiting, "the second block's load waits")
			select {
			case <-p.Done():
				t.Fatal("done while a load waits")
			default:
			}
			// The scheduler's other work, while the load waits.
			s, m, err := serve(pc, other)
			require.NoError(t, err)
			assert.Equal(t, len(other)-1, m, "a device hit meanwhile")
			require.True(t, s.Close().OK())
			assert.Equal(t, before.Tiers[0].Hits, pc.Stats().Tiers[0].Hits, "nothing counted before the loads end")

			close(tier.open)
			q, m := p.Wait()
			assert.Equal(t, 4*tpb, m)
			require.NoError(t, checkIDs(q, ids, 0, m))
			st := pc.Stats()
			assert.EqualValues(t, 4*tpb, st.Tiers[0].Hits-before.Tiers[0].Hits)
			finish(t, pc, q, ids, m)
			idleBooks(t, e, pc, "after the overlapped lookup")
		})
	}
}

// TestLookupAsyncCancel: the caller's context ends the loads at the block that waits:
// Wait returns exactly the blocks loaded before it (the sequence holds them and no
// more), the rest is the caller's to prefill, and the cancel is no drop of the tier,
// nor a miss.
// A context ended before the call loads nothing.
func TestLookupAsyncCancel(t *testing.T) {
	for _, be := range tierBackends {
		t.Run(be.name, func(t *testing.T) {
			tier := newGateTier()
			e, pc, ids, tpb := asyncEnv(t, be.kind, tier)
			for _, free := range []int{0, 2} {
				before := pc.Stats()
				tier.arm(free)
				ctx, cancel := context.WithCancel(context.Background())
				p, err := pc.LookupAsync(ctx, kv.Namespace{}, ids)
				require.NoError(t, err)
				assert.Equal(t, free, <-tier.waiting)
				cancel()
				q, m := p.Wait()
				assert.Equal(t, free*tpb, m, "the blocks loaded before the cancel, free=%d", free)
				assert.Equal(t, m, q.Len())
				require.NoError(t, checkIDs(q, ids, 0, m))
				st := pc.Stats()
				assert.Equal(t, before.Tiers[0].Drops, st.Tiers[0].Drops, "a cancel is no drop")
				assert.Equal(t, before.Tiers[0].Misses, st.Tiers[0].Misses, "nor a miss")
				assert.EqualValues(t, m, st.Tiers[0].Hits-before.Tiers[0].Hits)
				assert.EqualValues(t, m, st.Hits-before.Hits)
				require.True(t, q.Close().OK(), "closed without an insert: the tier keeps every block")
				idleBooks(t, e, pc, "after a cancelled lookup")
			}

			tier.arm(1 << 30)
			ctx, cancel := context.WithCancel(context.Background())
			cancel()
			p, err := pc.LookupAsync(ctx, kv.Namespace{}, ids)
			require.NoError(t, err)
			q, m := p.Wait()
			assert.Zero(t, m, "a context ended first: nothing loaded")
			finish(t, pc, q, ids, m)
			idleBooks(t, e, pc, "after a lookup whose context had ended")
		})
	}
}

// TestLookupAsyncClose: the prefix cache's Close waits for a lookup's loads, which
// then end as they would have; the sequence is the caller's to close after it, and
// a LookupAsync after Close is refused with ErrClosed.
func TestLookupAsyncClose(t *testing.T) {
	tier := newGateTier()
	e, pc, ids, tpb := asyncEnv(t, onShared, tier)
	tier.arm(0)
	p, err := pc.LookupAsync(context.Background(), kv.Namespace{}, ids)
	require.NoError(t, err)
	<-tier.waiting
	closed := make(chan error)
	go func() { closed <- pc.Close() }()
	close(tier.open)
	require.NoError(t, <-closed)
	select {
	case <-p.Done():
	default:
		t.Fatal("Close returned before the loads ended")
	}
	q, m := p.Wait()
	assert.Equal(t, 4*tpb, m)
	require.NoError(t, checkIDs(q, ids, 0, m))
	require.True(t, q.Close().OK())
	e.books(t, "after the close")

	_, err = pc.LookupAsync(context.Background(), kv.Namespace{}, ids)
	assert.ErrorIs(t, err, kv.ErrClosed)
}

// TestLookupAsyncBadInput: a nil context panics, naming the call; no prompt, or no
// tiers, leaves nothing to load (done at once, as Lookup); the caller's slice is not
// kept: changed after the call, the loads still check the prompt's own tokens.
func TestLookupAsyncBadInput(t *testing.T) {
	e, pc, ids, tpb := asyncEnv(t, onShared, tiertest.NewMap(4<<20))
	assert.PanicsWithValue(t, "kv: PrefixCache.LookupAsync with a nil Context", func() {
		//lint:ignore SA1012 the nil context is the point: the call must panic on it
		_, _ = pc.LookupAsync(nil, kv.Namespace{}, ids)
	})

	p, err := pc.LookupAsync(context.Background(), kv.Namespace{}, nil)
	require.NoError(t, err)
	select {
	case <-p.Done():
	default:
		t.Fatal("an empty prompt left something to load")
	}
	q, m := p.Wait()
	assert.Zero(t, m)
	assert.Zero(t, q.Len())
	require.True(t, q.Close().OK())

	mine := slices.Clone(ids)
	p, err = pc.LookupAsync(context.Background(), kv.Namespace{}, mine)
	require.NoError(t, err)
	for i := range mine {
		mine[i] = -1
	}
	q, m = p.Wait()
	assert.Equal(t, 4*tpb, m)
	require.NoError(t, checkIDs(q, ids, 0, m))
	finish(t, pc, q, ids, m)

	// Without tiers: Lookup's device hit, done at once.
	plain, err := kv.NewPrefixCache(openEnv(t, onShared, withGranule(64<<10), withConfig(kv.Config{MaxTokens: 512})).c, kv.PrefixCacheOptions{})
	require.NoError(t, err)
	closeAtCleanup(t, plain)
	s, _, err := serve(plain, ids)
	require.NoError(t, err)
	require.True(t, s.Close().OK())
	p, err = plain.LookupAsync(context.Background(), kv.Namespace{}, ids)
	require.NoError(t, err)
	select {
	case <-p.Done():
	default:
		t.Fatal("no tiers, yet not done")
	}
	q, m = p.Wait()
	assert.Equal(t, len(ids)-1, m)
	assert.Equal(t, m, p.Device())
	require.True(t, q.Close().OK())
	idleBooks(t, e, pc, "after the bad inputs")
}

// TestLookupAsyncGroups: on models of window groups beside full and MLA ones and on
// recurrent hybrids, LookupAsync's Wait returns what Lookup does: the whole tier
// blocks the window rule serves, every token (and state) the one written.
func TestLookupAsyncGroups(t *testing.T) {
	for _, model := range groupTierModels {
		t.Run(model.Name, func(t *testing.T) {
			e := openEnv(t, onShared, scaled, withConfig(kv.Config{Model: model, MaxTokens: 2048}))
			pc := newGroupTierCache(t, e.c, t.Name(), tiertest.NewMap(4<<20))
			bt := tierBlock(t, e.c)
			ids := promptIDs(7, 5*bt+5)
			evictGroups(t, e, pc, ids)
			p, err := pc.LookupAsync(context.Background(), kv.Namespace{}, ids)
			require.NoError(t, err)
			q, m := p.Wait()
			assert.Equal(t, 5*bt, m)
			require.NoError(t, checkHeldIDs(q, ids, 0, m))
			require.True(t, q.Close().OK())
			idleBooks(t, e, pc, "after an async lookup")
		})
	}
	for _, model := range stateTierModels {
		t.Run(model.Name, func(t *testing.T) {
			tier := newGateTier()
			tier.Tier = tiertest.NewMap(64 << 20)
			e, pc, bt := stateTierEnv(t, model, onShared, tier)
			ids := promptIDs(7, 5*bt+5)
			evictStates(t, e, pc, ids, bt)
			p, err := pc.LookupAsync(context.Background(), kv.Namespace{}, ids)
			require.NoError(t, err)
			q, m := p.Wait()
			assert.Equal(t, 5*bt, m)
			require.NoError(t, checkHeldIDs(q, ids, 0, m))
			require.NoError(t, checkStates(q, ids[:m]))
			require.True(t, q.Close().OK())
			idleBooks(t, e, pc, "after an async lookup")

			// Cancelled at the third block: the sequence starts on the second's
			// states, with the tokens they follow and none past them; with a
			// window group, on the last state at or below them where the window
			// rule holds (none here: the values of the first blocks went down
			// without the window units the entry had given back).
			tier.arm(2)
			misses := pc.Stats().Tiers[0].Misses
			ctx, cancel := context.WithCancel(context.Background())
			p, err = pc.LookupAsync(ctx, kv.Namespace{}, ids)
			require.NoError(t, err)
			assert.Equal(t, 2, <-tier.waiting)
			cancel()
			q, m = p.Wait()
			want := 2 * bt
			if slices.ContainsFunc(model.Groups, func(g kv.Group) bool { return g.Window > 0 }) {
				want = 0
			}
			assert.Equal(t, want, m)
			assert.Equal(t, m, q.Len())
			require.NoError(t, checkHeldIDs(q, ids, 0, m))
			if m > 0 {
				require.NoError(t, checkStates(q, ids[:m]))
			}
			require.True(t, q.Close().OK())
			assert.Zero(t, pc.Stats().Tiers[0].Drops)
			assert.Equal(t, misses, pc.Stats().Tiers[0].Misses, "a cancel is no miss")
			idleBooks(t, e, pc, "after a cancelled async lookup")
		})
	}
}
