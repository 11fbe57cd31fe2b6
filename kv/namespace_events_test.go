package kv_test

import (
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/internal/testutil"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/blockhash"
)

// nsRecorder keeps the BlocksStored a prefix cache tells it (the others it counts).
type nsRecorder struct {
	mu      sync.Mutex
	stored  []kv.BlocksStored
	removed int
}

func (r *nsRecorder) BlocksStored(s kv.BlocksStored) {
	r.mu.Lock()
	r.stored = append(r.stored, s)
	r.mu.Unlock()
}

func (r *nsRecorder) BlocksRemoved(kv.BlocksRemoved) {
	r.mu.Lock()
	r.removed++
	r.mu.Unlock()
}

func (r *nsRecorder) AllBlocksCleared() {}

// take returns the BlocksStored told since the last take.
func (r *nsRecorder) take() []kv.BlocksStored {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := r.stored
	r.stored = nil
	return out
}

// TestNamespaceEventsGolden inserts one prompt in each of five namespaces, under two
// EventOptions (no extra keys of the cache's own, and a LoRA name and salt of the
// cache's own), first its first Split tokens, then all of them, and checks every
// announcement against Python's vectors: the 64-bit hashes, the lora_name, each
// block's extra keys, and the parent that chains the second announcement to the
// first. So a router that hashes a request with its adapter and salt as vLLM does
// finds the blocks. The same tokens in two namespaces are two announcements.
func TestNamespaceEventsGolden(t *testing.T) {
	v := struct{ Cases []testutil.NamespaceEvent }{testutil.NamespaceEvents(t, "testdata/namespace_events.json")}
	require.Len(t, v.Cases, 10)
	type base struct{ lora, salt string }
	// One cache per EventOptions, every namespace's prompt in it.
	recs := map[base]*nsRecorder{}
	envs := map[base]*env{}
	for _, tc := range v.Cases {
		if b := (base{tc.BaseLoRA, tc.BaseSalt}); envs[b] == nil {
			recs[b] = &nsRecorder{}
			envs[b] = newNSCache(t, kv.Config{MaxTokens: 64}, 0, kv.PrefixCacheOptions{Events: kv.EventOptions{
				Observer: recs[b],
				Hash:     blockhash.Options{BlockSize: tc.BlockSize, Algorithm: blockhash.SHA256CBOR, LoRA: tc.BaseLoRA, CacheSalt: tc.BaseSalt},
			}})
		}
	}
	for i, tc := range v.Cases {
		t.Run(fmt.Sprintf("%d-lora=%s-salt=%s-base=%s,%s", i, tc.Adapter, tc.Salt, tc.BaseLoRA, tc.BaseSalt), func(t *testing.T) {
			b := base{tc.BaseLoRA, tc.BaseSalt}
			e, rec := envs[b], recs[b]
			ns := kv.Namespace{Adapter: tc.Adapter, Salt: tc.Salt}
			s, _, err := e.pc.LookupIn(ns, tc.Tokens)
			require.NoError(t, err)
			defer s.Close()
			require.NoError(t, s.Append(len(tc.Tokens)-s.Len()))
			first := tc.Split / tc.BlockSize
			for k, n := range []int{tc.Split, len(tc.Tokens)} {
				require.NoError(t, e.pc.InsertIn(ns, s, tc.Tokens[:n]))
				e.pc.FlushEvents()
				got := rec.take()
				require.Len(t, got, 1, "one announcement of the new blocks")
				st := got[0]
				from, to := 0, first
				if k == 1 {
					from, to = first, n/tc.BlockSize
				}
				assert.Equal(t, tc.Hashes[from:to], st.Hashes, "hashes")
				assert.Equal(t, tc.LoRAName, st.LoRA, "lora_name")
				assert.Equal(t, tc.Tokens[from*tc.BlockSize:to*tc.BlockSize], st.Tokens)
				assert.Equal(t, tc.BlockSize, st.BlockSize)
				assert.Equal(t, from > 0, st.HasParent)
				if from > 0 {
					assert.Equal(t, tc.Hashes[from-1], st.Parent, "chained to the first announcement")
				}
				want := tc.ExtraKeys[from:to]
				if testutil.NoExtraKeys(want) {
					assert.Nil(t, st.ExtraKeys, "no block has extra keys")
				} else {
					require.Len(t, st.ExtraKeys, len(want))
					for j := range want {
						if want[j] == nil {
							assert.Empty(t, st.ExtraKeys[j], "block %d", from+j)
						} else {
							assert.Equal(t, want[j], st.ExtraKeys[j], "block %d", from+j)
						}
					}
				}
			}
		})
	}
}

// TestNamespaceEventsWithdrawn: eviction withdraws a namespace's blocks only, and
// the events forget a namespace once none of its entries is left (Close then clears
// nothing of it twice).
func TestNamespaceEventsWithdrawn(t *testing.T) {
	rec := &nsRecorder{}
	e := newNSCache(t, kv.Config{MaxTokens: 64}, 0, kv.PrefixCacheOptions{Events: kv.EventOptions{
		Observer: rec, Hash: blockhash.Options{BlockSize: 4, Algorithm: blockhash.SHA256CBOR},
	}})
	ids := nsIDs(1, 24)
	for ns := range nsSpaces[:3] {
		s, _, err := nsServe(e.pc, ns, ids)
		require.NoError(t, err)
		require.True(t, s.Close().OK())
	}
	e.pc.FlushEvents()
	stored := rec.take()
	require.Len(t, stored, 3, "one announcement per namespace, though the tokens are the same")
	seen := map[uint64]bool{}
	for _, st := range stored {
		for _, h := range st.Hashes {
			assert.False(t, seen[h], "a block hash announced by two namespaces")
			seen[h] = true
		}
	}
	kept, entries := e.pc.EventPaths()
	assert.Equal(t, entries, kept)
	_, err := e.pc.Evict(1 << 30)
	require.NoError(t, err)
	e.pc.FlushEvents()
	assert.Equal(t, 3, rec.removed, "each namespace's blocks withdrawn apart")
	kept, entries = e.pc.EventPaths()
	assert.Zero(t, entries)
	assert.Zero(t, kept, "no path kept for a namespace with no entry")
}
