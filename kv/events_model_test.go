package kv_test

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/blockhash"
)

// The model of a prefix cache's block events (TestPrefixCacheEventsModel,
// FuzzPrefixCacheEvents): random requests, decoding, rollbacks, closes, pins,
// eviction (by the budget, by the MaxBytes cap and by the reclaimer for another's
// waiting request; on a model of window groups, older window units given back too)
// and Close, each followed by a check that the blocks the events announced and did
// not withdraw (evRecorder) are exactly, per layer group, the whole blocks the index
// holds there, each announced once with the hash recomputed from its tokens and its
// parent's: every whole block of every path in a full or MLA group, and in a window
// group those each entry's sequence holds from its FirstHeld on.

// evModel drives a prefix cache at random and keeps what it inserted: the cached
// blocks are those of its inserted prompts that the index holds whole.
type evModel struct {
	t      *testing.T
	r      *rand.Rand
	c      *kv.Cache
	pc     *kv.PrefixCache
	opts   kv.PrefixCacheOptions
	rec    *evRecorder
	made   [][]int32
	live   []*liveSeq
	pins   []*kv.PrefixPin
	gov    *accounting.Governor
	steps  []string
	maxTok int
	// evicted and inserted count tokens over every prefix cache the model opened.
	evicted, inserted int64
	// chains holds the block-hash chain of every path check hashed, by its tokens:
	// the same paths come back step after step, and hashing them again was most of
	// a step's time.
	chains map[string][]blockhash.Hash
	key    []byte // chainOf's key, reused
	// distinct is made without repeats (seen holds their keys), which is all check
	// reads of it; index and model are check's sets, cleared and refilled each time.
	distinct     [][]int32
	seen         map[string]bool
	index, model map[recKey]bool
	// groups is the model's layer groups (hybrid: several, window ones among them).
	groups []kv.Group
	hybrid bool
}

// chainOf returns the hashes of the whole blocks of tokens[:n], from the chain kept
// for them or, the first time, hashed.
func (m *evModel) chainOf(tokens []int32, n int) []blockhash.Hash {
	h := m.rec.h
	n -= n % h.BlockSize()
	key := m.keyOf(tokens[:n])
	chain, ok := m.chains[string(key)]
	if !ok {
		chain = h.Chain(nil, h.Root(), 0, tokens[:n])
		if m.chains == nil {
			m.chains = map[string][]blockhash.Hash{}
		}
		m.chains[string(key)] = chain
	}
	return chain
}

// keyOf returns tokens as the bytes of a map key, in a buffer the next call reuses.
func (m *evModel) keyOf(tokens []int32) []byte {
	m.key = slices.Grow(m.key[:0], 4*len(tokens))[:4*len(tokens)]
	for i, t := range tokens {
		binary.LittleEndian.PutUint32(m.key[4*i:], uint32(t))
	}
	return m.key
}

// addMade records ids, a prompt inserted.
func (m *evModel) addMade(ids []int32) {
	m.made = append(m.made, ids)
	if key := m.keyOf(ids); !m.seen[string(key)] {
		if m.seen == nil {
			m.seen = map[string]bool{}
		}
		m.seen[string(key)] = true
		m.distinct = append(m.distinct, ids)
	}
}

// blocksOf adds to set the whole blocks of tokens[:n] in every group of the model, a
// window group's from the first token held there (held[g]) on.
func (m *evModel) blocksOf(set map[recKey]bool, tokens []int32, n int, held []int) {
	bs := m.rec.h.BlockSize()
	for i, b := range m.chainOf(tokens, n) {
		for g, grp := range m.groups {
			if (grp.Kind == kv.SlidingWindow || grp.Kind == kv.ChunkedLocal) && i*bs < held[g] {
				continue
			}
			set[recKey{g, b.Uint64()}] = true
		}
	}
}

type liveSeq struct {
	s   *kv.Sequence
	ids []int32 // its tokens' IDs (what was written)
}

// check compares three views of what is cached: the events' (the recorder), the
// model's (the blocks of the inserted prompts the index holds, probed), and the
// index's own (every full block of every path of it). NB: a reclaimer started by a
// pressure step may still evict, on a goroutine of its own, while they are read: the
// views are read again until no change was queued meanwhile.
func (m *evModel) check() {
	t := m.t
	t.Helper()
	if m.index == nil {
		m.index, m.model = map[recKey]bool{}, map[recKey]bool{}
	}
	for {
		queued := m.pc.EventsQueued()
		m.pc.FlushEvents()
		index := m.index
		clear(index)
		paths, held := m.pc.IndexEntries()
		for i, p := range paths {
			m.blocksOf(index, p, len(p), held[i])
		}
		// NB: on a model of window groups Match answers the hit rule (the windows
		// held before the match), not what the index holds: the prompts' view is
		// one group's. A prompt made twice adds its blocks once.
		model := index
		if !m.hybrid {
			model = m.model
			clear(model)
			for _, p := range m.distinct {
				m.blocksOf(model, p, heldPrefix(m.pc, p), []int{0})
			}
		}
		same, errs := m.rec.holds(model), m.rec.errors()
		if m.pc.EventsQueued() != queued {
			continue
		}
		require.Empty(t, errs, "after %v", m.steps)
		// NB: maps.Equal first, as require.Equal's reflection was a tenth of a
		// step's time; require.Equal then says how they differ.
		if !maps.Equal(index, model) {
			require.Equal(t, index, model, "the model and the index differ, after %v", m.steps)
		}
		if !same {
			require.Equal(t, model, m.rec.set(), "the events and the model differ, after %v", m.steps)
		}
		kept, entries := m.pc.EventPaths()
		require.Equal(t, entries, kept, "the events keep a path for each entry in the index and no more, after %v", m.steps)
		return
	}
}

// stream returns a prompt that often extends or shares a prefix of one made before.
func (m *evModel) stream() []int32 {
	var out []int32
	if len(m.made) > 0 && m.r.IntN(4) > 0 {
		base := m.made[m.r.IntN(len(m.made))]
		out = append(out, base[:m.r.IntN(len(base)+1)]...)
	}
	for range 1 + m.r.IntN(40) {
		out = append(out, int32(m.r.IntN(3)))
	}
	return out[:min(len(out), m.maxTok)]
}

// step runs one random operation.
func (m *evModel) step() {
	t := m.t
	switch op := m.r.IntN(10); {
	case op < 4: // a request: look up, prefill, insert; maybe keep the sequence open
		ids := m.stream()
		m.steps = append(m.steps, fmt.Sprintf("serve %d", len(ids)))
		var s *kv.Sequence
		var err error
		if m.hybrid {
			s, _, _, err = serveHybrid(m.pc, ids)
		} else {
			s, _, err = serve(m.pc, ids)
		}
		if errors.Is(err, accounting.ErrBudgetExceeded) {
			return
		}
		require.NoError(t, err)
		m.addMade(ids)
		if m.r.IntN(2) == 0 {
			m.live = append(m.live, &liveSeq{s: s, ids: slices.Clone(ids)})
		} else {
			require.True(t, s.Close().OK())
		}
	case op == 4 && len(m.live) > 0: // decode and insert again
		l := m.live[m.r.IntN(len(m.live))]
		k := 1 + m.r.IntN(12)
		if l.s.Len()+k > m.maxTok {
			return
		}
		m.steps = append(m.steps, fmt.Sprintf("decode %d", k))
		if err := l.s.Append(k); err != nil {
			return
		}
		for range k {
			l.ids = append(l.ids, int32(m.r.IntN(3)))
		}
		err := m.write(l.s, l.ids, len(l.ids)-k, len(l.ids))
		if err == nil {
			err = m.pc.Insert(l.s, l.ids)
		}
		if m.hybrid && errors.Is(err, accounting.ErrBudgetExceeded) {
			// A write into a unit the cache shares copies it first, and an insert
			// on a model of window groups copies each group's last unit: the budget
			// may refuse either. The request ends.
			m.end(l)
			return
		}
		require.NoError(t, err)
		m.addMade(slices.Clone(l.ids))
	case op == 5 && len(m.live) > 0: // roll back into what was inserted, then rewrite
		l := m.live[m.r.IntN(len(m.live))]
		n := m.r.IntN(l.s.Len() + 1)
		m.steps = append(m.steps, fmt.Sprintf("truncate %d", n))
		if err := l.s.Truncate(n); err != nil {
			// Truncating into a shared granule copies its kept tokens: the budget may
			// refuse that, leaving the sequence as long as it says; on a model of
			// window groups, a window may have given back what a step at n reads.
			if !m.hybrid || !errors.Is(err, kv.ErrDropped) {
				require.ErrorIs(t, err, accounting.ErrBudgetExceeded)
			}
			n = l.s.Len()
		}
		l.ids = l.ids[:n]
		if n > 0 && n-1 >= l.s.Writable() && m.r.IntN(2) == 0 {
			l.ids[n-1]++ // a changed token: lazy entries of it get ranges of their own first
			if err := m.write(l.s, l.ids, n-1, n); !m.hybrid || !errors.Is(err, accounting.ErrBudgetExceeded) {
				require.NoError(t, err)
			} else {
				m.end(l)
			}
		}
	case op == 6 && len(m.live) > 0: // a request ends
		i := m.r.IntN(len(m.live))
		m.steps = append(m.steps, "close")
		require.True(t, m.live[i].s.Close().OK())
		m.live = slices.Delete(m.live, i, i+1)
	case op == 7: // memory pressure from outside: the reclaimer evicts
		need := int64(1+m.r.IntN(24)) * fakeGranule
		m.steps = append(m.steps, fmt.Sprintf("pressure %d", need))
		other := m.gov.Authority("other", accounting.HostKey)
		// A wait starts the reclaimer, which evicts on a goroutine of its own; when
		// it can not free enough the request would wait on, so it ends as the
		// reclaim returns (not at a time-out, which was most of a run's time).
		// NB: a request the budget covers at once starts no wait and no reclaim.
		ctx, cancel := context.WithCancel(context.Background())
		m.pc.OnReclaimed(cancel)
		if other.Acquire(ctx, need) == nil {
			other.Release(need)
		}
		cancel()
		m.pc.OnReclaimed(nil)
		require.NoError(t, other.Close())
	case op == 8: // pin a prefix, or release a pin
		if len(m.pins) > 0 && m.r.IntN(2) == 0 {
			m.steps = append(m.steps, "unpin")
			m.pins[0].Release()
			m.pins = m.pins[1:]
			return
		}
		if len(m.made) == 0 {
			return
		}
		p := m.made[m.r.IntN(len(m.made))]
		m.steps = append(m.steps, "pin")
		pin, err := m.pc.Pin(p[:m.r.IntN(len(p)+1)])
		require.NoError(t, err)
		m.pins = append(m.pins, pin)
	case op == 9 && m.r.IntN(8) == 0: // the prefix cache closes; a new one starts
		m.steps = append(m.steps, "reopen")
		m.closeAll()
		st := m.pc.Stats()
		m.evicted += st.EvictedTokens
		m.inserted += st.InsertedTokens
		require.NoError(t, m.pc.Close())
		require.Empty(t, m.rec.blocks, "Close clears every block")
		pc, err := kv.NewPrefixCache(m.c, m.opts)
		require.NoError(t, err)
		m.pc = pc
		m.made, m.distinct = nil, nil
		clear(m.seen)
	}
}

// write writes ids' tokens [from, to) into s: those s holds on a model of window
// groups.
func (m *evModel) write(s *kv.Sequence, ids []int32, from, to int) error {
	if m.hybrid {
		return writeHeldIDs(s, ids, from, to)
	}
	return writeIDs(s, ids, from, to)
}

// end closes l, a live request, and forgets it.
func (m *evModel) end(l *liveSeq) {
	require.True(m.t, l.s.Close().OK())
	m.live = slices.DeleteFunc(m.live, func(x *liveSeq) bool { return x == l })
}

func (m *evModel) closeAll() {
	for _, p := range m.pins {
		p.Release()
	}
	m.pins = nil
	for _, l := range m.live {
		require.True(m.t, l.s.Close().OK())
	}
	m.live = nil
}

// evVariant is one configuration of the cache and its events the model runs on.
type evVariant struct {
	model    kv.Model // zero: tiny8
	layout   kv.Layout
	bs       int
	algo     blockhash.Algorithm
	lora     string
	salt     string
	maxBytes int64
}

func (v evVariant) String() string {
	name := "tiny8"
	if v.model.Name != "" {
		name = v.model.Name
	}
	return fmt.Sprintf("%s/%v/bs=%d/%v/cap=%t", name, v.layout, v.bs, v.algo, v.maxBytes > 0)
}

// evVariants are every layout with blocks of 1, 3, 8 and 16 tokens, half of them
// hashed by sha256_cbor with a LoRA name and a cache salt, one block size in four
// under a MaxBytes cap.
func evVariants() []evVariant {
	var out []evVariant
	for i, layout := range layouts {
		for j, bs := range []int{1, 3, 8, 16} {
			v := evVariant{layout: layout, bs: bs, algo: blockhash.FNV64CBOR}
			if (i+j)%2 == 1 {
				v.algo, v.lora, v.salt = blockhash.SHA256CBOR, "lora-a", "salt"
			}
			if j == 2 {
				v.maxBytes = 24 * fakeGranule * int64(tiny8.Layers)
			}
			out = append(out, v)
		}
	}
	// Models of window groups beside full (and MLA) ones: blocks of 3 and 8
	// tokens, one of them under a cap.
	for i, model := range hybridModels {
		for j, layout := range layouts {
			v := evVariant{model: model, layout: layout, bs: 3 + 5*j, algo: blockhash.FNV64CBOR}
			if (i+j)%2 == 1 {
				v.algo, v.lora, v.salt = blockhash.SHA256CBOR, "lora-a", "salt"
			}
			if j == 1 {
				v.maxBytes = 24 * fakeGranule * int64(model.Layers)
			}
			out = append(out, v)
		}
	}
	return out
}

// evModelMaxTokens is the model's MaxTokens.
const evModelMaxTokens = 96

// newEvModel returns the model on a fresh cache of variant v, drawing its choices
// from r.
func newEvModel(t *testing.T, v evVariant, r *rand.Rand) *evModel {
	e := openEnv(t, noCache, withLimit(96*fakeGranule*int64(tiny8.Layers)))
	hybrid := v.model.Name != ""
	var c *kv.Cache
	if hybrid {
		c = e.cache(t, kv.Config{Model: v.model, MaxTokens: evModelMaxTokens, Layout: v.layout, BlockTokens: blockTokensFor(v.layout)})
	} else {
		c = e.cache(t, kv.Config{MaxTokens: evModelMaxTokens, Layout: v.layout, BlockTokens: blockTokensFor(v.layout)})
	}
	ho := blockhash.Options{BlockSize: v.bs, Algorithm: v.algo, Seed: "s", LoRA: v.lora, CacheSalt: v.salt}
	h, err := blockhash.New(ho)
	require.NoError(t, err)
	rec := newRecorder(h, "CPU")
	if hybrid {
		rec.groups = v.model.Groups
	}
	opts := kv.PrefixCacheOptions{MaxBytes: v.maxBytes, Events: kv.EventOptions{Observer: rec, Hash: ho}}
	pc, err := kv.NewPrefixCache(c, opts)
	require.NoError(t, err)
	m := &evModel{t: t, r: r, c: c, pc: pc, opts: opts, rec: rec, gov: e.gov, maxTok: evModelMaxTokens,
		groups: []kv.Group{{Kind: kv.FullAttention}}, hybrid: hybrid}
	if hybrid {
		m.groups = v.model.Groups
	}
	t.Cleanup(func() {
		if t.Failed() {
			m.closeAll()
			_ = m.pc.Close()
		}
	})
	return m
}

// finish closes everything and checks that Close withdrew every block; it returns
// the prefix cache's stats from just before.
func (m *evModel) finish() kv.PrefixCacheStats {
	st := m.pc.Stats()
	m.closeAll()
	require.NoError(m.t, m.pc.Close())
	require.Empty(m.t, m.rec.errs)
	assert.Empty(m.t, m.rec.blocks, "Close clears every block")
	return st
}

// TestPrefixCacheEventsModel runs the model 400 steps on each variant.
func TestPrefixCacheEventsModel(t *testing.T) {
	for vi, v := range evVariants() {
		t.Run(v.String(), func(t *testing.T) {
			m := newEvModel(t, v, rand.New(rand.NewPCG(27, uint64(vi))))
			for range 400 {
				m.step()
				m.check()
			}
			st := m.finish()
			assert.Positive(t, m.inserted+st.InsertedTokens)
			assert.Positive(t, m.rec.events)
			assert.Positive(t, m.evicted+st.EvictedTokens, "the budget, the cap or the reclaimer evicted")
			for g, grp := range m.groups {
				if m.hybrid && (grp.Kind == kv.SlidingWindow || grp.Kind == kv.ChunkedLocal) {
					assert.Positive(t, m.rec.removedIn[g], "group %d (%v) withdrew blocks", g, grp.Kind)
				}
			}
		})
	}
}

// FuzzPrefixCacheEvents runs the model with its choices taken from the input: the
// first byte picks the variant, and each choice the next byte (see byteSource).
// Every event is checked as it comes, and the announced blocks against the index
// after every step. The run lasts as long as its input, up to 200 steps (a step
// draws a choice per prompt token: the seeds' 512 bytes are 30 to 40 steps, most
// of them with evictions): past its end the choices would come from a PCG the
// fuzzer does not steer, each step at the cost of a check of the whole index.
// TestPrefixCacheEventsModel runs 400 steps on each variant.
func FuzzPrefixCacheEvents(f *testing.F) {
	vs := evVariants()
	for vi := range vs {
		seed := make([]byte, 1, 1+evSeedBytes)
		seed[0] = byte(vi)
		r := rand.New(rand.NewPCG(27, uint64(vi)))
		for range evSeedBytes {
			seed = append(seed, byte(r.Uint32()))
		}
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		if len(in) == 0 {
			return
		}
		src := newByteSource(in[1:])
		m := newEvModel(t, vs[int(in[0])%len(vs)], rand.New(src))
		for i := 0; i < 200 && len(src.in) > 0; i++ {
			m.step()
			m.check()
		}
		m.finish()
	})
}

// evSeedBytes is the length of FuzzPrefixCacheEvents' seeds' choices.
const evSeedBytes = 512

// byteSource is a rand.Source that draws the fuzzer's input: each Uint64 is the next
// byte repeated in all eight (so that rand.IntN of a power of two, which masks the
// low bits, and of any other n, which scales the high ones, both follow the byte).
// Once the input is spent it goes on as a PCG seeded with the input's length.
type byteSource struct {
	in   []byte
	rest *rand.PCG
}

func newByteSource(in []byte) *byteSource {
	return &byteSource{in: in, rest: rand.NewPCG(uint64(len(in)), 27)}
}

func (s *byteSource) Uint64() uint64 {
	if len(s.in) == 0 {
		return s.rest.Uint64()
	}
	b := s.in[0]
	s.in = s.in[1:]
	return binary.LittleEndian.Uint64([]byte{b, b, b, b, b, b, b, b})
}
