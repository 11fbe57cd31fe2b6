package kv_test

import (
	"fmt"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/cuda/cudatest"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/blockhash"
)

// evRecorder is a subscriber's view of a prefix cache: the blocks its events
// announced and did not withdraw, per layer group. It checks each event as it comes:
// a stored block's hash is the one recomputed from its tokens and its parent (in a
// full or MLA group, announced in that group before it; in a window group, any block
// of the chain announced in some group once), announced once in its
// group; a removed one was announced in its group; the fields carry the cache's
// options and the group's kind and window.
type evRecorder struct {
	mu     sync.Mutex // the events come from the prefix cache's goroutine
	h      *blockhash.Hasher
	medium string
	groups []kv.Group // the model's; nil: one full-attention or MLA group
	blocks map[recKey]recBlock
	known  map[uint64]recBlock // every block ever announced, in any group
	events int
	stored int // hashes announced
	// removedIn counts the hashes withdrawn, per group.
	removedIn map[int]int
	errs      []error
}

// recKey is an announced block: its group and its hash.
type recKey struct {
	group int
	hash  uint64
}

// recBlock is an announced block: its full chained hash and its index in its sequence.
type recBlock struct {
	full  blockhash.Hash
	index int
}

func newRecorder(h *blockhash.Hasher, medium string) *evRecorder {
	return &evRecorder{h: h, medium: medium, blocks: map[recKey]recBlock{}, known: map[uint64]recBlock{}, removedIn: map[int]int{}}
}

func (r *evRecorder) fail(format string, args ...any) {
	r.errs = append(r.errs, fmt.Errorf(format, args...))
}

// windowed reports whether group g of the recorder's model is a window group.
func (r *evRecorder) windowed(g int) bool {
	return r.groups != nil && (r.groups[g].Kind == kv.SlidingWindow || r.groups[g].Kind == kv.ChunkedLocal)
}

// groupOK reports whether a group index, kind and window are the model's.
func (r *evRecorder) groupOK(g int, a kv.Attention, window int) bool {
	if r.groups == nil {
		return g == 0 && (a == kv.FullAttention || a == kv.MLALatent) && window == 0
	}
	if g < 0 || g >= len(r.groups) || a != r.groups[g].Kind {
		return false
	}
	if r.windowed(g) {
		return window == r.groups[g].Window
	}
	return window == 0
}

func (r *evRecorder) BlocksStored(e kv.BlocksStored) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events++
	bs := r.h.BlockSize()
	if e.BlockSize != bs || len(e.Tokens) != len(e.Hashes)*bs || len(e.Hashes) == 0 {
		r.fail("stored: %d hashes, %d tokens, block size %d", len(e.Hashes), len(e.Tokens), e.BlockSize)
		return
	}
	if e.Medium != r.medium || !r.groupOK(e.Group, e.Attention, e.Window) || e.LoRA != r.h.Options().LoRA {
		r.fail("stored: medium %q group %d (%v, window %d) lora %q", e.Medium, e.Group, e.Attention, e.Window, e.LoRA)
	}
	parent, index := r.h.Root(), 0
	if e.HasParent {
		p, ok := r.blocks[recKey{e.Group, e.Parent}]
		if !ok && r.windowed(e.Group) {
			p, ok = r.known[e.Parent]
		}
		if !ok {
			r.fail("stored: parent %x was not announced in group %d", e.Parent, e.Group)
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
		k := recKey{e.Group, got}
		if _, dup := r.blocks[k]; dup {
			r.fail("stored: block %x announced twice in group %d", got, e.Group)
		}
		r.blocks[k] = recBlock{full: parent, index: index + i}
		r.known[got] = r.blocks[k]
		r.stored++
	}
}

func (r *evRecorder) BlocksRemoved(e kv.BlocksRemoved) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events++
	if e.Medium != r.medium || (r.groups == nil && e.Group != 0) || e.Group < 0 || (r.groups != nil && e.Group >= len(r.groups)) || len(e.Hashes) == 0 {
		r.fail("removed: medium %q group %d, %d hashes", e.Medium, e.Group, len(e.Hashes))
	}
	for _, h := range e.Hashes {
		k := recKey{e.Group, h}
		if _, ok := r.blocks[k]; !ok {
			r.fail("removed: block %x was not announced in group %d", h, e.Group)
		}
		delete(r.blocks, k)
		r.removedIn[e.Group]++
	}
}

func (r *evRecorder) AllBlocksCleared() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events++
	clear(r.blocks)
}

// set returns the blocks the events imply are cached, per group.
func (r *evRecorder) set() map[recKey]bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make(map[recKey]bool, len(r.blocks))
	for k := range r.blocks {
		out[k] = true
	}
	return out
}

// holds reports whether the blocks announced and not withdrawn are exactly set's.
func (r *evRecorder) holds(set map[recKey]bool) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.blocks) != len(set) {
		return false
	}
	for k := range set {
		if _, ok := r.blocks[k]; !ok {
			return false
		}
	}
	return true
}

// heldPrefix returns how many leading tokens of tokens the cache holds, the last
// included: what BlockEvents' doc says to ask Match.
func heldPrefix(pc *kv.PrefixCache, tokens []int32) int {
	return pc.Match(append(slices.Clip(tokens), 0))
}

// errors returns the failed checks so far.
func (r *evRecorder) errors() []error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.errs)
}

// TestPrefixCacheEventsOptions: bad hash options are refused at construction, the
// medium follows the cache's device unless named, and a cache without an observer
// still works.
func TestPrefixCacheEventsOptions(t *testing.T) {
	e := openEnv(t, withLimit(1<<30), withConfig(kv.Config{MaxTokens: 64, Layout: kv.PerLayer}))
	c := e.c
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
		assert.Equal(t, 9, heldPrefix(pc, []int32{1, 2, 3, 4, 5, 6, 7, 8, 9}), "the whole prompt, its last token too")
		assert.Equal(t, 9, heldPrefix(pc, []int32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}))
		assert.Zero(t, heldPrefix(pc, nil))
		require.NoError(t, pc.Close())
		assert.Zero(t, heldPrefix(pc, []int32{1, 2}))
		assert.Empty(t, rec.errs)
		assert.Equal(t, 2, rec.events, "the two whole blocks stored in one event, then cleared")
		assert.Equal(t, 2, rec.stored)
	}

	fake := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{Granularity: 64 << 10, Memory: 64 << 20})
	t.Cleanup(func() { assert.NoError(t, fake.CheckLeaks()) })
	gc := openEnv(t, onCUDA, withCUDA(cuda.Options{Driver: fake.Driver()}), withConfig(kv.Config{Model: tiny8, MaxTokens: 64, Layout: kv.PerLayer})).c
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

// blockingObserver holds its first BlocksStored until release is closed.
type blockingObserver struct {
	entered, release chan struct{}
	once             sync.Once
	mu               sync.Mutex
	stored           int
}

func (o *blockingObserver) BlocksStored(e kv.BlocksStored) {
	o.once.Do(func() {
		close(o.entered)
		<-o.release
	})
	o.mu.Lock()
	o.stored += len(e.Hashes)
	o.mu.Unlock()
}
func (o *blockingObserver) BlocksRemoved(kv.BlocksRemoved) {}
func (o *blockingObserver) AllBlocksCleared()              {}

// TestFlushEvents: the cache's calls only queue what changed, so an observer that
// is slow does not hold them up; FlushEvents waits until the observer has been told
// everything before it, and returns at once without an observer or after Close.
func TestFlushEvents(t *testing.T) {
	e := openEnv(t, withLimit(1<<30), withConfig(kv.Config{MaxTokens: 64, Layout: kv.PerLayer}))
	c := e.c
	obs := &blockingObserver{entered: make(chan struct{}), release: make(chan struct{})}
	pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{Events: kv.EventOptions{Observer: obs, Hash: blockhash.Options{BlockSize: 4}}})
	require.NoError(t, err)
	s, _, err := serve(pc, promptIDs(1, 9))
	require.NoError(t, err)
	<-obs.entered // the observer is held inside its first call
	s2, _, err := serve(pc, promptIDs(2, 13))
	require.NoError(t, err, "the cache goes on while its observer is held")
	flushed := make(chan struct{})
	go func() {
		pc.FlushEvents()
		close(flushed)
	}()
	select {
	case <-flushed:
		t.Fatal("FlushEvents returned with the observer still held")
	case <-time.After(20 * time.Millisecond):
	}
	close(obs.release)
	<-flushed
	obs.mu.Lock()
	assert.Equal(t, 2+3, obs.stored, "every whole block of both prompts told")
	obs.mu.Unlock()
	require.True(t, s.Close().OK())
	require.True(t, s2.Close().OK())
	require.NoError(t, pc.Close())
	pc.FlushEvents()

	plain, err := kv.NewPrefixCache(e.cache(t, kv.Config{MaxTokens: 64, Layout: kv.PerLayer}), kv.PrefixCacheOptions{})
	require.NoError(t, err)
	plain.FlushEvents()
	require.NoError(t, plain.Close())
}

// TestEventQueueAllocatesNothing: what a cache's call does for its events, queueing
// the change along the path, allocates nothing once the queue has grown (a fresh copy
// of each path, under the cache's lock, cost the calls more than all the rest).
func TestEventQueueAllocatesNothing(t *testing.T) {
	for _, n := range []int{1, 16, 4096} {
		assert.Zero(t, kv.EventQueueAllocs(n), "%d tokens", n)
	}
}

// TestPrefixCacheEventsAllocateNothing: an observer costs the cache's calls no
// allocation: a request (look up, append, write, an Insert that evicts, close) allocates
// as much with events as without. The events' goroutine is held off the queue while
// the request runs, so that what it allocates (its copy of each path, the events) is
// not counted as the calls'; it applies everything between requests, as it keeps up
// in a server. Medians of the requests: a stray allocation of another goroutine's
// can not tip them.
func TestPrefixCacheEventsAllocateNothing(t *testing.T) {
	const prompt, rounds = 64, 40
	probe := openEnv(t, noCache, withLimit(1<<30))
	pc, err := kv.NewPrefixCache(probe.cache(t, kv.Config{MaxTokens: prompt, Layout: kv.PerLayer}), kv.PrefixCacheOptions{})
	require.NoError(t, err)
	s, _, err := serve(pc, promptIDs(0, prompt))
	require.NoError(t, err)
	require.True(t, s.Close().OK())
	entry := pc.Stats().CachedBytes
	require.Positive(t, entry)
	require.NoError(t, pc.Close())

	perRequest := func(obs kv.BlockEvents) (median int64, evicted int64) {
		e := openEnv(t, noCache, withLimit(1<<30))
		pc, err := kv.NewPrefixCache(e.cache(t, kv.Config{MaxTokens: prompt, Layout: kv.PerLayer}), kv.PrefixCacheOptions{
			MaxBytes: 4 * entry, // every Insert past the fourth evicts
			Events:   kv.EventOptions{Observer: obs, Hash: blockhash.Options{BlockSize: 4}},
		})
		require.NoError(t, err)
		park, resume := pc.HoldEvents()
		var allocs []int64
		var before, after runtime.MemStats
		for r := range rounds + 8 {
			ids := promptIDs(r*prompt, prompt)
			pc.FlushEvents()
			held := park != nil && r > 0 // the goroutine runs from the first change
			if held {
				park()
			}
			runtime.ReadMemStats(&before)
			s, _, err := serve(pc, ids)
			require.NoError(t, err)
			ok := s.Close().OK()
			runtime.ReadMemStats(&after)
			if held {
				resume()
			}
			require.True(t, ok)
			if r >= 8 { // the queue's and the index's buffers grown
				allocs = append(allocs, int64(after.Mallocs-before.Mallocs))
			}
		}
		evicted = pc.Stats().EvictedTokens
		require.NoError(t, pc.Close())
		slices.Sort(allocs)
		return allocs[len(allocs)/2], evicted
	}
	plain, plainEvicted := perRequest(nil)
	rec := &countingObserver{}
	events, evicted := perRequest(rec)
	require.Positive(t, plainEvicted, "no evictions: not the scenario")
	require.Equal(t, plainEvicted, evicted)
	assert.Equal(t, plain, events, "allocations a request: without events, with them")
	assert.Positive(t, rec.stored.Load(), "the events were told")
	assert.Positive(t, rec.removed.Load())
}

// countingObserver counts the blocks it is told of.
type countingObserver struct{ stored, removed atomic.Int64 }

func (o *countingObserver) BlocksStored(e kv.BlocksStored)   { o.stored.Add(int64(len(e.Hashes))) }
func (o *countingObserver) BlocksRemoved(e kv.BlocksRemoved) { o.removed.Add(int64(len(e.Hashes))) }
func (o *countingObserver) AllBlocksCleared()                {}

// BenchmarkEventQueue is what a 4,096-token request's events cost the cache's calls,
// measured directly: queueing its Insert's and its eviction's change, as the calls
// do, the eviction's after the index lost the path (round-ns: the two calls alone,
// timed one by one; clock-ns: two clock pairs around nothing, the same way, which
// net-ns takes off; medians of the rounds). With cold=true, 48 MiB are written before each
// call, as a request's K/V writes are in kvevents' BenchmarkPublishCost, so the
// call finds the queue out of the CPU caches; the entry and its leaf are read after
// the writes, as the cache's call has read them before it queues.
func BenchmarkEventQueue(b *testing.B) {
	for _, cold := range []bool{false, true} {
		b.Run(fmt.Sprintf("cold=%v", cold), func(b *testing.B) {
			scribble := make([]byte, 48<<20)
			var before func()
			if cold {
				before = func() {
					for i := 0; i < len(scribble); i += 64 {
						scribble[i]++
					}
				}
			}
			round := kv.EventQueueRound(4096, true, before)
			var rounds, clocks []int64 // medians taken: a preemption inside one would swamp a sum
			for b.Loop() {
				rounds = append(rounds, round().Nanoseconds())
				var clock time.Duration
				for range 2 {
					t0 := time.Now()
					clock += time.Since(t0)
				}
				clocks = append(clocks, clock.Nanoseconds())
			}
			slices.Sort(rounds)
			slices.Sort(clocks)
			total, clock := rounds[len(rounds)/2], clocks[len(clocks)/2]
			b.ReportMetric(float64(total), "round-ns")
			b.ReportMetric(float64(clock), "clock-ns")
			b.ReportMetric(float64(total-clock), "net-ns")
		})
	}
}
