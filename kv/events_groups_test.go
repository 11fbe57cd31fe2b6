package kv_test

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/blockhash"
)

// evLog keeps every event in the order told.
type evLog struct {
	mu  sync.Mutex
	evs []any
}

func (l *evLog) BlocksStored(e kv.BlocksStored)   { l.add(e) }
func (l *evLog) BlocksRemoved(e kv.BlocksRemoved) { l.add(e) }
func (l *evLog) AllBlocksCleared()                { l.add("cleared") }

func (l *evLog) add(e any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.evs = append(l.evs, e)
}

// take returns the events told since the last take.
func (l *evLog) take() []any {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := l.evs
	l.evs = nil
	return out
}

// hashesOf returns the uint64 hashes of chain[from:to].
func hashesOf(chain []blockhash.Hash, from, to int) []uint64 {
	var out []uint64
	for _, h := range chain[from:to] {
		out = append(out, h.Uint64())
	}
	return out
}

// TestPrefixCacheEventsWindowTrim: on gpt-oss's pattern (tinyOSS: a sliding window
// of 24 as group 0, full attention as group 1), an insert announces the prompt's
// blocks in each group with its index, kind and window; eviction that gives back
// the entry's older window units withdraws exactly the window group's blocks below
// the first token it still holds, and nothing of the full group; eviction of the
// entry's last units withdraws them in both groups; Close clears all. It was refused
// with ErrConfig before events had groups.
func TestPrefixCacheEventsWindowTrim(t *testing.T) {
	onEachSharing(t, []envOption{scaled, withConfig(kv.Config{Model: tinyOSS, MaxTokens: 512})}, func(t *testing.T, e *env) {
		const bs = 4
		ho := blockhash.Options{BlockSize: bs}
		h, err := blockhash.New(ho)
		require.NoError(t, err)
		log := &evLog{}
		pc, err := kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{Events: kv.EventOptions{Observer: log, Hash: ho}})
		require.NoError(t, err)
		turn := make([]int32, 400)
		for i := range turn {
			turn[i] = int32(i % 11)
		}
		chain := h.Chain(nil, h.Root(), 0, turn)
		s, _, _, err := serveHybrid(pc, turn)
		require.NoError(t, err)
		require.True(t, s.Close().OK())
		pc.FlushEvents()
		_, held := pc.IndexEntries()
		require.Len(t, held, 1)
		first := (held[0][0] + bs - 1) / bs // the window group's first whole block
		evs := log.take()
		require.Len(t, evs, 2, "one event per group")
		full, ok := evs[0].(kv.BlocksStored)
		require.True(t, ok, "%T", evs[0])
		assert.Equal(t, 1, full.Group)
		assert.Equal(t, kv.FullAttention, full.Attention)
		assert.Zero(t, full.Window)
		assert.False(t, full.HasParent)
		assert.Equal(t, hashesOf(chain, 0, 100), full.Hashes)
		assert.Equal(t, turn, full.Tokens)
		win, ok := evs[1].(kv.BlocksStored)
		require.True(t, ok, "%T", evs[1])
		assert.Equal(t, 0, win.Group)
		assert.Equal(t, kv.SlidingWindow, win.Attention)
		assert.Equal(t, 24, win.Window)
		assert.Equal(t, hashesOf(chain, first, 100), win.Hashes, "the blocks its window units hold")
		assert.Equal(t, turn[first*bs:], win.Tokens)
		assert.Equal(t, first > 0, win.HasParent)
		if first > 0 {
			assert.Equal(t, chain[first-1].Uint64(), win.Parent, "the chain's block before, held there or not")
		}

		// Older window units go: the window group's blocks below them, exactly.
		_, err = pc.Evict(1)
		require.NoError(t, err)
		pc.FlushEvents()
		_, held = pc.IndexEntries()
		trimmed := (held[0][0] + bs - 1) / bs
		require.Greater(t, trimmed, first, "the window gave units back")
		evs = log.take()
		require.Len(t, evs, 1, "the full group loses nothing")
		assert.Equal(t, kv.BlocksRemoved{Hashes: hashesOf(chain, first, trimmed), Group: 0, Medium: win.Medium}, evs[0])

		// The entry's last units go: in both groups.
		_, err = pc.Evict(1)
		require.NoError(t, err)
		pc.FlushEvents()
		paths, held := pc.IndexEntries()
		require.Len(t, paths, 1)
		end := len(paths[0]) / bs
		require.Less(t, end, 100)
		evs = log.take()
		require.Len(t, evs, 2)
		assert.Equal(t, kv.BlocksRemoved{Hashes: hashesOf(chain, max(trimmed, end), 100), Group: 0, Medium: win.Medium}, evs[0])
		assert.Equal(t, kv.BlocksRemoved{Hashes: hashesOf(chain, end, 100), Group: 1, Medium: win.Medium}, evs[1])
		assert.Equal(t, trimmed, (held[0][0]+bs-1)/bs, "the window's first unit stays")

		require.NoError(t, pc.Close())
		assert.Equal(t, []any{"cleared"}, log.take())
	})
}
