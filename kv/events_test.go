package kv_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/cuda/cudatest"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/blockhash"
)

// evRecorder is a subscriber's view of a prefix cache: the blocks its events
// announced and did not withdraw. It checks each event as it comes: a stored block's
// hash is the one recomputed from its tokens and its parent (announced before it),
// announced once; a removed one was announced; the fields carry the cache's options.
type evRecorder struct {
	h      *blockhash.Hasher
	medium string
	blocks map[uint64]recBlock
	events int
	stored int // hashes announced
	errs   []error
}

// recBlock is an announced block: its full chained hash and its index in its sequence.
type recBlock struct {
	full  blockhash.Hash
	index int
}

func newRecorder(h *blockhash.Hasher, medium string) *evRecorder {
	return &evRecorder{h: h, medium: medium, blocks: map[uint64]recBlock{}}
}

func (r *evRecorder) fail(format string, args ...any) {
	r.errs = append(r.errs, fmt.Errorf(format, args...))
}

func (r *evRecorder) BlocksStored(e kv.BlocksStored) {
	r.events++
	bs := r.h.BlockSize()
	if e.BlockSize != bs || len(e.Tokens) != len(e.Hashes)*bs || len(e.Hashes) == 0 {
		r.fail("stored: %d hashes, %d tokens, block size %d", len(e.Hashes), len(e.Tokens), e.BlockSize)
		return
	}
	if e.Medium != r.medium || e.Group != 0 || e.LoRA != r.h.Options().LoRA {
		r.fail("stored: medium %q group %d lora %q", e.Medium, e.Group, e.LoRA)
	}
	parent, index := r.h.Root(), 0
	if e.HasParent {
		p, ok := r.blocks[e.Parent]
		if !ok {
			r.fail("stored: parent %x was not announced", e.Parent)
			return
		}
		parent, index = p.full, p.index+1
	}
	if e.ExtraKeys != nil && len(e.ExtraKeys) != len(e.Hashes) {
		r.fail("stored: %d extra keys for %d blocks", len(e.ExtraKeys), len(e.Hashes))
	}
	for i, got := range e.Hashes {
		want := r.h.ExtraKeys(index + i)
		var extra []any
		if e.ExtraKeys != nil && i < len(e.ExtraKeys) {
			extra = e.ExtraKeys[i]
		}
		if !slices.Equal(extra, want) {
			r.fail("stored: block %d's extra keys %v, want %v", index+i, extra, want)
		}
		parent = r.h.Block(parent, e.Tokens[i*bs:(i+1)*bs], want)
		if parent.Uint64() != got {
			r.fail("stored: block %d's hash %x, recomputed %x", index+i, got, parent.Uint64())
		}
		if _, dup := r.blocks[got]; dup {
			r.fail("stored: block %x announced twice", got)
		}
		r.blocks[got] = recBlock{full: parent, index: index + i}
		r.stored++
	}
}

func (r *evRecorder) BlocksRemoved(e kv.BlocksRemoved) {
	r.events++
	if e.Medium != r.medium || e.Group != 0 || len(e.Hashes) == 0 {
		r.fail("removed: medium %q group %d, %d hashes", e.Medium, e.Group, len(e.Hashes))
	}
	for _, h := range e.Hashes {
		if _, ok := r.blocks[h]; !ok {
			r.fail("removed: block %x was not announced", h)
		}
		delete(r.blocks, h)
	}
}

func (r *evRecorder) AllBlocksCleared() {
	r.events++
	clear(r.blocks)
}

// set returns the hashes the events imply are cached.
func (r *evRecorder) set() map[uint64]bool {
	out := make(map[uint64]bool, len(r.blocks))
	for h := range r.blocks {
		out[h] = true
	}
	return out
}

// blocksOf adds to set the hashes of the full blocks of tokens[:n].
func blocksOf(set map[uint64]bool, h *blockhash.Hasher, tokens []int32, n int) {
	for _, b := range h.Chain(nil, h.Root(), 0, tokens[:n]) {
		set[b.Uint64()] = true
	}
}

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
}

type liveSeq struct {
	s   *kv.Sequence
	ids []int32 // its tokens' IDs (what was written)
}

// check compares three views of what is cached: the events' (the recorder), the
// model's (the blocks of the inserted prompts the index holds, probed), and the
// index's own (every full block of every path of it).
func (m *evModel) check() {
	t := m.t
	t.Helper()
	require.Empty(t, m.rec.errs, "after %v", m.steps)
	h := m.rec.h
	model := map[uint64]bool{}
	for _, p := range m.made {
		blocksOf(model, h, p, m.pc.CachedPrefix(p))
	}
	index := map[uint64]bool{}
	for _, p := range m.pc.IndexPaths() {
		blocksOf(index, h, p, len(p))
	}
	require.Equal(t, index, model, "the model and the index differ, after %v", m.steps)
	require.Equal(t, model, m.rec.set(), "the events and the model differ, after %v", m.steps)
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
		s, _, err := serve(m.pc, ids)
		if errors.Is(err, accounting.ErrBudgetExceeded) {
			return
		}
		require.NoError(t, err)
		m.made = append(m.made, ids)
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
		require.NoError(t, writeIDs(l.s, l.ids, len(l.ids)-k, len(l.ids)))
		require.NoError(t, m.pc.Insert(l.s, l.ids))
		m.made = append(m.made, slices.Clone(l.ids))
	case op == 5 && len(m.live) > 0: // roll back into what was inserted, then rewrite
		l := m.live[m.r.IntN(len(m.live))]
		n := m.r.IntN(l.s.Len() + 1)
		m.steps = append(m.steps, fmt.Sprintf("truncate %d", n))
		if err := l.s.Truncate(n); err != nil {
			// Truncating into a shared granule copies its kept tokens: the budget may
			// refuse that, leaving the sequence as long as it says.
			require.ErrorIs(t, err, accounting.ErrBudgetExceeded)
			n = l.s.Len()
		}
		l.ids = l.ids[:n]
		if n > 0 && n-1 >= l.s.Writable() && m.r.IntN(2) == 0 {
			l.ids[n-1]++ // a changed token: lazy entries of it get ranges of their own first
			require.NoError(t, writeIDs(l.s, l.ids, n-1, n))
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
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		if other.Acquire(ctx, need) == nil {
			other.Release(need)
		}
		cancel()
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
		m.made = nil
	}
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

// TestPrefixCacheEventsModel checks every event against a model of the cache under
// random requests, decoding, rollbacks, closes, pins, eviction (by the budget, by the
// MaxBytes cap and by the reclaimer for another's waiting request) and Close: after
// every step the blocks the events announced and did not withdraw are exactly the
// full blocks the index holds, each announced once with the hash recomputed from its
// tokens and its parent's.
func TestPrefixCacheEventsModel(t *testing.T) {
	type variant struct {
		layout   kv.Layout
		bs       int
		algo     blockhash.Algorithm
		lora     string
		salt     string
		maxBytes int64
	}
	var variants []variant
	for i, layout := range layouts {
		for j, bs := range []int{1, 3, 8, 16} {
			v := variant{layout: layout, bs: bs, algo: blockhash.FNV64CBOR}
			if (i+j)%2 == 1 {
				v.algo, v.lora, v.salt = blockhash.SHA256CBOR, "lora-a", "salt"
			}
			if j == 2 {
				v.maxBytes = 24 * fakeGranule * int64(tiny8.Layers)
			}
			variants = append(variants, v)
		}
	}
	for vi, v := range variants {
		name := fmt.Sprintf("%v/bs=%d/%v/cap=%t", v.layout, v.bs, v.algo, v.maxBytes > 0)
		t.Run(name, func(t *testing.T) {
			const maxTokens = 96
			fx := newFixture(t, 96*fakeGranule*int64(tiny8.Layers))
			c := fx.cache(t, v.layout, maxTokens)
			ho := blockhash.Options{BlockSize: v.bs, Algorithm: v.algo, Seed: "s", LoRA: v.lora, CacheSalt: v.salt}
			h, err := blockhash.New(ho)
			require.NoError(t, err)
			rec := newRecorder(h, "CPU")
			opts := kv.PrefixCacheOptions{MaxBytes: v.maxBytes, Events: kv.EventOptions{Observer: rec, Hash: ho}}
			pc, err := kv.NewPrefixCache(c, opts)
			require.NoError(t, err)
			m := &evModel{t: t, r: rand.New(rand.NewPCG(27, uint64(vi))), c: c, pc: pc, opts: opts, rec: rec, gov: fx.gov, maxTok: maxTokens}
			t.Cleanup(func() {
				if t.Failed() {
					m.closeAll()
					_ = m.pc.Close()
				}
			})
			for range 400 {
				m.step()
				m.check()
			}
			st := m.pc.Stats()
			m.closeAll()
			require.NoError(t, m.pc.Close())
			require.Empty(t, rec.errs)
			assert.Empty(t, rec.blocks, "Close clears every block")
			assert.Positive(t, m.inserted+st.InsertedTokens)
			assert.Positive(t, rec.events)
			assert.Positive(t, m.evicted+st.EvictedTokens, "the budget, the cap or the reclaimer evicted")
		})
	}
}

// TestPrefixCacheEventsOptions: bad hash options are refused at construction, the
// medium follows the cache's device unless named, and a cache without an observer
// still works.
func TestPrefixCacheEventsOptions(t *testing.T) {
	fx := newFixture(t, 1<<30)
	c := fx.cache(t, kv.PerLayer, 64)
	rec := newRecorder(nil, "")
	for _, o := range []blockhash.Options{{BlockSize: -1}, {Algorithm: 7}} {
		_, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{Events: kv.EventOptions{Observer: rec, Hash: o}})
		assert.ErrorIs(t, err, kv.ErrConfig, "%+v", o)
		assert.ErrorIs(t, err, blockhash.ErrConfig, "%+v", o)
	}
	h, err := blockhash.New(blockhash.Options{BlockSize: 4})
	require.NoError(t, err)
	for _, medium := range []string{"", "CPU_PINNED"} {
		want := medium
		if want == "" {
			want = "CPU"
		}
		rec := newRecorder(h, want)
		pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{Events: kv.EventOptions{Observer: rec, Hash: blockhash.Options{BlockSize: 4}, Medium: medium}})
		require.NoError(t, err)
		s, _, err := serve(pc, []int32{1, 2, 3, 4, 5, 6, 7, 8, 9})
		require.NoError(t, err)
		require.True(t, s.Close().OK())
		assert.Equal(t, 9, pc.CachedPrefix([]int32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}))
		assert.Zero(t, pc.CachedPrefix(nil))
		require.NoError(t, pc.Close())
		assert.Zero(t, pc.CachedPrefix([]int32{1, 2}))
		assert.Empty(t, rec.errs)
		assert.Equal(t, 2, rec.events, "the two whole blocks stored in one event, then cleared")
		assert.Equal(t, 2, rec.stored)
	}

	fake := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{Granularity: 64 << 10, Memory: 64 << 20})
	t.Cleanup(func() { assert.NoError(t, fake.CheckLeaks()) })
	gc, err := newCUDACache(t, fake.Driver(), kv.PerLayer, tiny8, 64)
	require.NoError(t, err)
	grec := newRecorder(h, "GPU")
	pc, err := kv.NewPrefixCache(gc, kv.PrefixCacheOptions{Events: kv.EventOptions{Observer: grec, Hash: blockhash.Options{BlockSize: 4}}})
	require.NoError(t, err)
	s, _, err := serve(pc, []int32{1, 2, 3, 4, 5})
	require.NoError(t, err)
	require.True(t, s.Close().OK())
	require.NoError(t, pc.Close())
	assert.Empty(t, grec.errs, "a device's cache says GPU")
	assert.Equal(t, 2, grec.events)
	assert.Equal(t, 1, grec.stored)
}
