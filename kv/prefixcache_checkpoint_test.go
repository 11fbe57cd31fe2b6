package kv_test

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/blockhash"
	"github.com/vmarena/vmarena/kvtier/tiertest"
)

// tinyNext is Qwen3-Next's pattern in small: recurrent layers (a state of 700 bytes
// each, so that the group's range holds 2,100 bytes) beside one full-attention layer.
var tinyNext = kv.Model{Name: "tiny-next", Layers: 4, Groups: []kv.Group{
	{Kind: kv.Recurrent, Layers: []int{0, 1, 2}, StateBytes: 700},
	{Kind: kv.FullAttention, Layers: []int{3}, KVHeads: 2, HeadDim: 16, DType: arena.Float16},
}}

// tinyNextWin adds a sliding window of 6 tokens: a checkpoint serves a hit only where
// the window rule holds too.
var tinyNextWin = kv.Model{Name: "tiny-next-win", Layers: 5, Groups: []kv.Group{
	{Kind: kv.Recurrent, Layers: []int{0, 2}, StateBytes: 300},
	{Kind: kv.FullAttention, Layers: []int{1}, KVHeads: 1, HeadDim: 32, DType: arena.Float16},
	{Kind: kv.SlidingWindow, Window: 6, Layers: []int{3, 4}, KVHeads: 1, HeadDim: 16, DType: arena.Float16},
}}

// ckptEnv opens a cache of m with a prefix cache on kind, with a limit of limit bytes
// (0: 1 GiB).
func ckptEnv(t *testing.T, m kv.Model, kind backingKind, layout kv.Layout, limit int64) *env {
	if limit == 0 {
		limit = 1 << 30
	}
	cfg := kv.Config{Model: m, MaxTokens: 256, Layout: layout}
	return openEnv(t, kind, withConfig(cfg), withLimit(limit), withPrefixCache(kv.PrefixCacheOptions{}))
}

// stateOf fills buf with the state of layer after the tokens ids: a function of every
// one of them, as a recurrent layer's is.
func stateOf(buf []byte, ids []int32, layer int) {
	h := fnv.New64a()
	var b [4]byte
	for _, id := range ids {
		binary.LittleEndian.PutUint32(b[:], uint32(id))
		h.Write(b[:])
	}
	r := rand.New(rand.NewPCG(h.Sum64(), uint64(layer)))
	for i := range buf {
		buf[i] = byte(r.Uint32())
	}
}

// recurrentLayers returns m's recurrent layers and their state bytes.
func recurrentLayers(m kv.Model) map[int]int {
	ls := map[int]int{}
	for _, g := range m.Groups {
		if g.Kind == kv.Recurrent {
			for _, l := range g.Layers {
				ls[l] = g.StateBytes
			}
		}
	}
	return ls
}

// writeStates writes the states after ids into s's recurrent layers.
func writeStates(s *kv.Sequence, ids []int32) error {
	for l, n := range recurrentLayers(s.Cache().Config().Model) {
		buf := make([]byte, n)
		stateOf(buf, ids, l)
		if err := s.WriteState(l, buf); err != nil {
			return err
		}
	}
	return nil
}

// checkStates reports a recurrent layer of s whose state is not the one after ids.
func checkStates(s *kv.Sequence, ids []int32) error {
	for l, n := range recurrentLayers(s.Cache().Config().Model) {
		got, want := make([]byte, n), make([]byte, n)
		if err := s.ReadState(l, got); err != nil {
			return err
		}
		stateOf(want, ids, l)
		if !bytes.Equal(got, want) {
			return fmt.Errorf("%w: layer %d's state is not the one after %d tokens", errCorrupt, l, len(ids))
		}
	}
	return nil
}

// prefillTo grows s, which holds ids[:s.Len()], to hold ids[:n] as a server's
// prefill would: chunk by chunk, each chunk's tokens written, the states stepped to
// the chunk's end, and a checkpoint recorded at each multiple of every (none for 0).
func prefillTo(s *kv.Sequence, ids []int32, n, every int) error {
	for s.Len() < n {
		to := n
		if every > 0 {
			to = min(n, (s.Len()/every+1)*every)
		}
		from := s.Len()
		if err := s.Append(to - from); err != nil {
			return err
		}
		if err := writeHeldIDs(s, ids, from, to); err != nil {
			return err
		}
		if err := writeStates(s, ids[:to]); err != nil {
			return err
		}
		if every > 0 && to%every == 0 {
			if err := s.Checkpoint(to); err != nil {
				return err
			}
		}
	}
	return nil
}

// ckptBytes returns the bytes one checkpoint of c commits: each recurrent group's
// states in whole granules.
func ckptBytes(c *kv.Cache) int64 {
	var n int64
	for _, g := range c.Config().Model.Groups {
		if g.Kind == kv.Recurrent {
			n += int64((len(g.Layers)*g.StateBytes + c.Granularity() - 1) / c.Granularity() * c.Granularity())
		}
	}
	return n
}

// TestCheckpointHit: a prompt that shares tokens with an inserted one starts on the
// latest checkpoint at or below what it shares, its tokens and states read back
// bit-exact; with no checkpoint that low the hit is 0. Match, Need and Probe say what
// Lookup does, and the books hold after each step.
func TestCheckpointHit(t *testing.T) {
	onEachSharing(t, []envOption{withConfig(kv.Config{Model: tinyNext, MaxTokens: 256}), withLimit(1 << 30), withPrefixCache(kv.PrefixCacheOptions{})}, func(t *testing.T, e *env) {
		ids := promptIDs(100, 90)
		s, m, err := e.pc.Lookup(ids)
		require.NoError(t, err)
		require.Zero(t, m)
		require.NoError(t, prefillTo(s, ids, 80, 16))
		require.NoError(t, prefillTo(s, ids, 90, 0))
		one := ckptBytes(e.c)
		st := e.pc.Stats()
		assert.Equal(t, 5*one, st.PendingCheckpointBytes, "five checkpoints recorded, none inserted")
		assert.Zero(t, st.CheckpointBytes)
		e.books(t, "recorded")
		require.NoError(t, e.pc.Insert(s, ids))
		st = e.pc.Stats()
		assert.Equal(t, 5, st.Checkpoints)
		assert.Equal(t, 5*one, st.CheckpointBytes)
		assert.Zero(t, st.PendingCheckpointBytes)
		assert.GreaterOrEqual(t, st.CachedBytes, st.CheckpointBytes)
		e.books(t, "inserted")

		cases := []struct {
			name   string
			shared int // tokens shared with ids
			want   int
		}{
			{"past the last checkpoint", 85, 80},
			{"between two", 70, 64},
			{"on one", 48, 48},
			{"on one, its last token", 49, 48},
			{"below the first", 15, 0},
		}
		for _, tc := range cases {
			p := append(slices.Clone(ids[:tc.shared]), promptIDs(5000, 20)...)
			require.Equal(t, tc.want, e.pc.Match(p), tc.name)
			probe, err := e.pc.Probe(p)
			require.NoError(t, err)
			require.Equal(t, tc.want, probe.Device, tc.name)
			owned := e.auth.Stats().Owned - poolIdle(e)
			q, m, err := e.pc.Lookup(p)
			require.NoError(t, err, tc.name)
			require.Equal(t, tc.want, m, tc.name)
			assert.Equal(t, probe.Commit, e.auth.Stats().Owned-poolIdle(e)-owned, "%s: the Lookup committed what the Probe said", tc.name)
			require.NoError(t, checkHeldIDs(q, p, 0, m), tc.name)
			if m > 0 {
				require.NoError(t, checkStates(q, p[:m]), tc.name)
			}
			// The new sequence's states are its own: stepping them changes no checkpoint.
			require.NoError(t, prefillTo(q, p, len(p), 0), tc.name)
			e.books(t, tc.name)
			require.True(t, q.Close().OK())
		}
		require.True(t, s.Close().OK())
		st = e.pc.Stats()
		assert.Equal(t, 5*one, st.CheckpointBytes, "the entry holds them after the sequence closed")
		assert.Zero(t, st.PendingCheckpointBytes)
		q, m, err := e.pc.Lookup(ids)
		require.NoError(t, err)
		require.Equal(t, 80, m)
		require.NoError(t, checkStates(q, ids[:80]))
		require.True(t, q.Close().OK())
		e.finish(t)
	})
}

// poolIdle returns the bytes e's pool holds idle (0 without a pool).
func poolIdle(e *env) int64 {
	if e.pool == nil {
		return 0
	}
	e.quiet()
	return e.pool.PoolStats().Idle
}

// TestCheckpointLedger: on a backing without a pool each checkpoint moves the ledger
// and the governor by exactly its states' granules, counted once however many
// entries and sequences hold it; a sequence that closes with checkpoints nothing
// inserted gives them back, and a truncate gives back those past it.
func TestCheckpointLedger(t *testing.T) {
	e := ckptEnv(t, tinyNext, onFake, kv.Blocked, 0)
	one := ckptBytes(e.c)
	owned := func() int64 { return e.auth.Stats().Owned }
	ids := promptIDs(1, 64)
	s, err := e.c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, prefillTo(s, ids, 32, 0))
	before := owned()
	require.NoError(t, s.Checkpoint(32))
	assert.Equal(t, before+one, owned(), "one checkpoint: its granules")
	assert.Equal(t, owned(), e.gov.Stats(e.auth.Device()).Used)
	require.NoError(t, s.Checkpoint(32), "a second checkpoint at the same length keeps the first")
	assert.Equal(t, before+one, owned())
	require.NoError(t, prefillTo(s, ids, 48, 0))
	require.NoError(t, s.Checkpoint(48))
	assert.Equal(t, 2*one, e.pc.Stats().PendingCheckpointBytes)
	require.NoError(t, s.Truncate(40))
	assert.Equal(t, one, e.pc.Stats().PendingCheckpointBytes, "the one past the truncate went")
	e.books(t, "truncated")
	grown := owned()
	require.True(t, s.Close().OK())
	assert.Zero(t, e.pc.Stats().PendingCheckpointBytes)
	assert.Zero(t, owned(), "the sequence's ranges and its checkpoint went: nothing was inserted")
	assert.Positive(t, grown)

	// Two entries that hold one checkpoint count it once.
	a, _, err := e.pc.Lookup(ids)
	require.NoError(t, err)
	require.NoError(t, prefillTo(a, ids, 64, 32))
	require.NoError(t, e.pc.Insert(a, ids[:40]))
	require.NoError(t, e.pc.Insert(a, ids[:64]))
	st := e.pc.Stats()
	assert.Equal(t, 2, st.Checkpoints)
	assert.Equal(t, 2*one, st.CheckpointBytes)
	b, m, err := e.pc.Lookup(append(slices.Clone(ids[:50]), 9999, 9998))
	require.NoError(t, err)
	require.Equal(t, 32, m)
	require.NoError(t, prefillTo(b, append(slices.Clone(ids[:50]), 9999, 9998), 52, 0))
	require.NoError(t, e.pc.Insert(b, append(slices.Clone(ids[:50]), 9999, 9998)))
	st = e.pc.Stats()
	assert.Equal(t, 2, st.Checkpoints, "the second entry holds the first's checkpoint at 32, once")
	assert.Equal(t, 2*one, st.CheckpointBytes)
	e.books(t, "two entries")
	require.True(t, a.Close().OK())
	require.True(t, b.Close().OK())
	e.finish(t)
}

// TestCheckpointEviction: eviction takes the least recently used entry's checkpoints
// below its latest first (its tokens stay, and a hit on its latest), then cuts the
// entry to a checkpoint, then takes it whole; each gives back its bytes, in
// EvictedBytes, and the books hold.
func TestCheckpointEviction(t *testing.T) {
	e := ckptEnv(t, tinyNext, onFake, kv.Blocked, 0)
	one := ckptBytes(e.c)
	ids := promptIDs(1, 200)
	s, _, err := e.pc.Lookup(ids)
	require.NoError(t, err)
	require.NoError(t, prefillTo(s, ids, 192, 32))
	require.NoError(t, e.pc.Insert(s, ids[:192]))
	st := e.pc.Stats()
	require.Equal(t, 6, st.Checkpoints)
	require.Zero(t, st.PendingCheckpointBytes, "the insert handed them to the entry")

	// The sequence lives on, mapping the entry's units: its checkpoints are the
	// entry's alone, and eviction takes those below the latest.
	got, err := e.pc.Evict(1)
	require.NoError(t, err)
	assert.Equal(t, 5*one, got, "the five checkpoints below the latest, in one step")
	require.True(t, s.Close().OK())
	require.Zero(t, e.pc.Stats().PinnedBytes)
	st = e.pc.Stats()
	assert.Equal(t, 1, st.Checkpoints)
	assert.Equal(t, 1, st.Entries)
	assert.Equal(t, int64(192), st.CachedTokens, "the tokens stay")
	assert.Equal(t, 5*one, st.EvictedBytes)
	assert.Equal(t, 192, e.pc.Match(ids), "a hit on the latest")
	assert.Zero(t, e.pc.Match(ids[:150]), "none below it")
	e.books(t, "trimmed")

	got, err = e.pc.Evict(1)
	require.NoError(t, err)
	assert.Positive(t, got)
	st = e.pc.Stats()
	assert.Zero(t, st.Entries, "cut below its only checkpoint, the entry goes whole")
	assert.Zero(t, st.CachedBytes)
	assert.Zero(t, st.Checkpoints)
	assert.Zero(t, e.auth.Stats().Owned)
	e.finish(t)
}

// TestCheckpointCut: an entry cut by eviction is cut to its latest checkpoint at or
// below the cut (no hit starts past it), giving back the units past it and the
// checkpoints there; what a live sequence holds stays.
func TestCheckpointCut(t *testing.T) {
	e := ckptEnv(t, tinyNext, onFake, kv.PerLayer, 0)
	ids := promptIDs(1, 200)
	s, _, err := e.pc.Lookup(ids)
	require.NoError(t, err)
	require.NoError(t, prefillTo(s, ids, 160, 64))
	require.NoError(t, e.pc.Insert(s, ids[:160]))
	// A second sequence starts on the checkpoint at 64 and lives on: it holds the
	// entry's first 64 tokens and that checkpoint, so trimming takes none.
	q, m, err := e.pc.Lookup(ids[:100])
	require.NoError(t, err)
	require.Equal(t, 64, m)
	require.True(t, s.Close().OK())
	require.Equal(t, 2, e.pc.Stats().Checkpoints)

	for _, want := range []struct{ tokens, ckpts int }{{128, 2}, {64, 1}, {64, 1}} {
		before := e.pc.Stats()
		got, err := e.pc.Evict(1)
		require.NoError(t, err)
		st := e.pc.Stats()
		assert.Equal(t, before.EvictedBytes+got, st.EvictedBytes)
		assert.Equal(t, want.ckpts, st.Checkpoints)
		assert.Equal(t, int64(want.tokens), st.CachedTokens, "cut to the checkpoint at %d", want.tokens)
		assert.Equal(t, want.tokens, e.pc.Match(ids))
		if st.CachedTokens == before.CachedTokens {
			assert.Zero(t, got, "what is left a live sequence holds")
		}
		e.books(t, "cut")
	}
	require.NoError(t, checkStates(q, ids[:64]))
	require.True(t, q.Close().OK())
	e.finish(t)
}

// TestCheckpointWindow: on a model with a window group too, a checkpoint serves a hit
// only where the entry's window still holds what the step reads.
func TestCheckpointWindow(t *testing.T) {
	e := ckptEnv(t, tinyNextWin, onFake, kv.PerLayer, 0)
	ids := promptIDs(1, 100)
	s, _, err := e.pc.Lookup(ids)
	require.NoError(t, err)
	require.NoError(t, prefillTo(s, ids, 96, 16))
	require.NoError(t, e.pc.Insert(s, ids[:96]))
	for _, shared := range []int{96, 70, 33, 10} {
		p := append(slices.Clone(ids[:shared]), 7777)
		q, m, err := e.pc.Lookup(p)
		require.NoError(t, err)
		require.Equal(t, e.pc.Match(p), m)
		assert.Zero(t, m%16, "a hit starts on a checkpoint")
		require.NoError(t, checkHeldIDs(q, p, 0, m))
		if m > 0 {
			require.NoError(t, checkStates(q, p[:m]))
		}
		require.True(t, q.Close().OK())
	}
	require.True(t, s.Close().OK())
	e.finish(t)
}

// TestCheckpointRefusals: a checkpoint on a model without a recurrent group, on a
// cache without a prefix cache, at a length other than the sequence's or at 0, or
// that the budget can not hold, fails with a clear error and changes nothing; a
// prefix cache on recurrent groups alone, and tiers on a recurrent model in the
// PerLayer layout, are refused.
func TestCheckpointRefusals(t *testing.T) {
	t.Run("no recurrent group", func(t *testing.T) {
		e := openEnv(t, withConfig(kv.Config{MaxTokens: 64}), withPrefixCache(kv.PrefixCacheOptions{}))
		s, err := e.c.NewSequence()
		require.NoError(t, err)
		defer s.Close()
		require.NoError(t, s.Append(4))
		err = s.Checkpoint(4)
		require.ErrorIs(t, err, kv.ErrConfig)
		assert.ErrorContains(t, err, "needs a model with a recurrent group")
	})
	t.Run("no prefix cache", func(t *testing.T) {
		e := openEnv(t, withConfig(kv.Config{Model: tinyNext, MaxTokens: 64}))
		s, err := e.c.NewSequence()
		require.NoError(t, err)
		defer s.Close()
		require.NoError(t, s.Append(4))
		before := e.auth.Stats()
		err = s.Checkpoint(4)
		require.ErrorIs(t, err, kv.ErrConfig)
		assert.ErrorContains(t, err, "has none")
		assert.Equal(t, before, e.auth.Stats())
	})
	t.Run("lengths", func(t *testing.T) {
		e := ckptEnv(t, tinyNext, onFake, kv.Blocked, 0)
		s, err := e.c.NewSequence()
		require.NoError(t, err)
		defer s.Close()
		require.ErrorIs(t, s.Checkpoint(0), kv.ErrRange, "no tokens")
		require.NoError(t, s.Append(10))
		before := e.auth.Stats()
		for _, n := range []int{-1, 0, 11} {
			err := s.Checkpoint(n)
			require.ErrorIs(t, err, kv.ErrRange, "at %d", n)
			assert.ErrorContains(t, err, "must be 1 to its length")
		}
		assert.Equal(t, before, e.auth.Stats())
		assert.Zero(t, e.pc.Stats().PendingCheckpointBytes)
		require.NoError(t, s.Checkpoint(8), "below its length: the server's step is there")
		before = e.auth.Stats()
		err = s.Checkpoint(7)
		require.ErrorIs(t, err, kv.ErrRange)
		assert.ErrorContains(t, err, "below the sequence's last at 8")
		assert.Equal(t, before, e.auth.Stats())
		assert.Equal(t, ckptBytes(e.c), e.pc.Stats().PendingCheckpointBytes)
	})
	t.Run("budget", func(t *testing.T) {
		e := ckptEnv(t, tinyNext, onFake, kv.Blocked, 0)
		s, err := e.c.NewSequence()
		require.NoError(t, err)
		defer s.Close()
		require.NoError(t, s.Append(10))
		require.NoError(t, e.gov.SetLimit(e.auth.Device(), e.auth.Stats().Owned+ckptBytes(e.c)-1))
		before := e.auth.Stats()
		err = s.Checkpoint(10)
		require.ErrorIs(t, err, accounting.ErrBudgetExceeded)
		assert.Equal(t, before, e.auth.Stats())
		assert.Zero(t, e.pc.Stats().PendingCheckpointBytes)
	})
	t.Run("states alone", func(t *testing.T) {
		e := openEnv(t, withConfig(kv.Config{Model: kv.Model{Name: "states", Layers: 1, Groups: []kv.Group{
			{Kind: kv.Recurrent, Layers: []int{0}, StateBytes: 64}}}, MaxTokens: 64}))
		_, err := kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{})
		require.ErrorIs(t, err, kv.ErrConfig)
		assert.ErrorContains(t, err, "keeps tokens")
	})
	t.Run("tiers", func(t *testing.T) {
		// Taken (prefixcache_tier_states_shared_test.go), but not in the
		// PerLayer layout, where no block is one contiguous unit.
		e := openEnv(t, withConfig(kv.Config{Model: tinyNext, MaxTokens: 64, Layout: kv.PerLayer}))
		_, err := kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{Tiers: []kv.Tier{tiertest.NewMap(1 << 20)}})
		require.ErrorIs(t, err, kv.ErrConfig)
		e = openEnv(t, withConfig(kv.Config{Model: tinyNext, MaxTokens: 64}))
		pc, err := kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{Tiers: []kv.Tier{tiertest.NewMap(1 << 20)}})
		require.NoError(t, err)
		require.NoError(t, pc.Close())
	})
}

// ckptRef is the plain model of a prefix cache with checkpoints and no memory
// pressure: the prompts' prefixes at which an entry holds a checkpoint. An insert of
// n tokens of a sequence adds the checkpoints it recorded at or below n; a lookup
// takes the longest of them that is a prefix of the prompt, short of its last token.
type ckptRef struct{ held map[string]bool }

func ckptKey(ids []int32) string {
	b := make([]byte, 4*len(ids))
	for i, id := range ids {
		binary.LittleEndian.PutUint32(b[4*i:], uint32(id))
	}
	return string(b)
}

func (r *ckptRef) match(ids []int32) int {
	for c := len(ids) - 1; c > 0; c-- {
		if r.held[ckptKey(ids[:c])] {
			return c
		}
	}
	return 0
}

// ckptLive is a live sequence of the random test: its prompt's token IDs (all it
// holds) and the lengths at which it recorded checkpoints.
type ckptLive struct {
	s     *kv.Sequence
	ids   []int32
	ckpts []int
}

// FuzzCheckpoints drives random operations (lookups of prompts that share system
// prompts and extend earlier turns, prefills with checkpoints every few tokens,
// decode growth, inserts, closes, evictions) against ckptRef: every lookup hits what
// the model says (at most that, once an eviction took something), Match and Probe
// say it first, every hit token and state reads back bit-exact, and the books and
// the prefix cache's counts hold after each operation.
func FuzzCheckpoints(f *testing.F) {
	for _, seed := range []uint64{1, 2, 3, 43} {
		f.Add(seed, uint8(0))
		f.Add(seed, uint8(1))
	}
	f.Fuzz(func(t *testing.T, seed uint64, layout uint8) {
		l := []kv.Layout{kv.Blocked, kv.PerLayer}[layout%2]
		e := ckptEnv(t, tinyNext, onFake, l, 0)
		r := rand.New(rand.NewPCG(seed, 43))
		ref := &ckptRef{held: map[string]bool{}}
		exact := true // no eviction yet: the model is exact
		var live []*ckptLive
		var turns [][]int32 // inserted prompts, for conversations to extend
		e.onFail(func() {
			for _, q := range live {
				q.s.Close()
			}
		})
		closeOne := func(i int) {
			require.True(t, live[i].s.Close().OK())
			live = slices.Delete(live, i, i+1)
		}
		insert := func(q *ckptLive) {
			n := q.s.Len()
			if r.IntN(4) == 0 {
				n = r.IntN(n + 1)
			}
			require.NoError(t, e.pc.Insert(q.s, q.ids[:n]))
			for _, c := range q.ckpts {
				if c <= n {
					ref.held[ckptKey(q.ids[:c])] = true
				}
			}
			if n > 0 {
				turns = append(turns, q.ids[:n])
			}
		}
		for op := range 120 {
			where := fmt.Sprintf("seed %d op %d", seed, op)
			switch k := r.IntN(10); {
			case k < 5 || len(live) == 0: // a request
				var ids []int32
				switch {
				case len(turns) > 0 && r.IntN(2) == 0: // the conversation's next turn
					ids = slices.Clone(turns[r.IntN(len(turns))])
				default: // a system prompt
					ids = promptIDs(1000*r.IntN(3), 8+r.IntN(40))
				}
				ids = append(ids, promptIDs(100000+r.IntN(1<<20), 1+r.IntN(40))...)
				ids = ids[:min(len(ids), 200)]
				want := ref.match(ids)
				probe, err := e.pc.Probe(ids)
				require.NoError(t, err, where)
				require.Equal(t, e.pc.Match(ids), probe.Device, where)
				s, m, err := e.pc.Lookup(ids)
				require.NoError(t, err, where)
				require.Equal(t, probe.Device, m, "%s: Lookup hits what Probe said", where)
				if exact {
					require.Equal(t, want, m, where)
				} else {
					require.LessOrEqual(t, m, want, where)
				}
				q := &ckptLive{s: s, ids: ids}
				live = append(live, q)
				require.NoError(t, checkHeldIDs(s, ids, 0, m), where)
				if m > 0 {
					require.NoError(t, checkStates(s, ids[:m]), where)
				}
				every := []int{4, 8, 16}[r.IntN(3)]
				for s.Len() < len(ids) {
					to := min(len(ids), (s.Len()/every+1)*every)
					require.NoError(t, prefillTo(s, ids, to, 0), where)
					if to%every == 0 || r.IntN(3) == 0 {
						require.NoError(t, s.Checkpoint(to), where)
						q.ckpts = append(q.ckpts, to)
					}
				}
				if r.IntN(3) > 0 {
					insert(q)
				}
			case k < 6: // decode growth, and perhaps an insert of the longer turn
				q := live[r.IntN(len(live))]
				if len(q.ids) >= 200 {
					break
				}
				q.ids = append(q.ids, promptIDs(200000+r.IntN(1<<20), 1+r.IntN(min(8, 200-len(q.ids))))...)
				require.NoError(t, prefillTo(q.s, q.ids, len(q.ids), 0), where)
				if r.IntN(2) == 0 {
					require.NoError(t, q.s.Checkpoint(len(q.ids)), where)
					q.ckpts = append(q.ckpts, len(q.ids))
				}
				if r.IntN(2) == 0 {
					insert(q)
				}
			case k < 8:
				closeOne(r.IntN(len(live)))
			default:
				before := e.pc.Stats()
				got, err := e.pc.Evict(int64(r.IntN(64 << 10)))
				require.NoError(t, err, where)
				after := e.pc.Stats()
				require.Equal(t, before.EvictedBytes+got, after.EvictedBytes, where)
				if after.EvictedTokens != before.EvictedTokens || after.Checkpoints != before.Checkpoints {
					exact = false
				}
			}
			st := e.pc.Stats()
			require.LessOrEqual(t, st.CheckpointBytes, st.CachedBytes, where)
			require.LessOrEqual(t, st.PinnedBytes, st.CachedBytes, where)
			require.Equal(t, int64(st.Checkpoints)*ckptBytes(e.c), st.CheckpointBytes, where)
			e.books(t, where)
		}
		for len(live) > 0 {
			closeOne(0)
		}
		st := e.pc.Stats()
		assert.Zero(t, st.PendingCheckpointBytes)
		assert.Zero(t, st.PinnedBytes)
		got, err := e.pc.Evict(1 << 40)
		require.NoError(t, err)
		assert.Equal(t, st.CachedBytes, got, "every cached byte comes back")
		assert.Zero(t, e.auth.Stats().Owned)
		e.finish(t)
	})
}

// TestCheckpointEvents: on a model with a recurrent group an entry announces its full
// group's blocks, every block of its tokens, under that group's index, and the
// recurrent group nothing; an entry cut to a checkpoint withdraws the blocks past it.
func TestCheckpointEvents(t *testing.T) {
	e := openEnv(t, withConfig(kv.Config{Model: tinyNext, MaxTokens: 256}), withLimit(1<<30))
	const bs = 16
	ho := blockhash.Options{BlockSize: bs}
	h, err := blockhash.New(ho)
	require.NoError(t, err)
	log := &evLog{}
	pc, err := kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{Events: kv.EventOptions{Observer: log, Hash: ho}})
	require.NoError(t, err)
	ids := promptIDs(1, 160)
	chain := h.Chain(nil, h.Root(), 0, ids)
	s, _, err := pc.Lookup(ids)
	require.NoError(t, err)
	require.NoError(t, prefillTo(s, ids, 100, 64))
	require.NoError(t, pc.Insert(s, ids[:100]))
	require.True(t, s.Close().OK())
	pc.FlushEvents()
	evs := log.take()
	require.Len(t, evs, 1, "one group announces")
	st, ok := evs[0].(kv.BlocksStored)
	require.True(t, ok, "%T", evs[0])
	assert.Equal(t, 1, st.Group)
	assert.Equal(t, kv.FullAttention, st.Attention)
	assert.Equal(t, hashesOf(chain, 0, 6), st.Hashes, "every whole block of the entry's tokens")

	_, err = pc.Evict(1)
	require.NoError(t, err)
	pc.FlushEvents()
	evs = log.take()
	require.Len(t, evs, 1)
	assert.Equal(t, kv.BlocksRemoved{Hashes: hashesOf(chain, 4, 6), Group: 1, Medium: st.Medium}, evs[0], "cut to the checkpoint at 64")
	require.NoError(t, pc.Close())
}
