//go:build linux || windows

package kv_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/blockhash"
	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/tiertest"
)

// TestPrefixCacheMLATiersAndEvents: on a model of one MLA group, on host.Shared and
// the CUDA fake, an evicted entry's whole blocks go down into a tier and a lookup
// loads them back (every latent read back), and the events announce exactly the
// blocks the index holds (group 0: the model's one group), all withdrawn with it.
func TestPrefixCacheMLATiersAndEvents(t *testing.T) {
	for _, kind := range []backingKind{onShared, onCUDA} {
		t.Run(sharingNames[kind], func(t *testing.T) {
			e := openEnv(t, kind, withGranule(64<<10), withConfig(kv.Config{Model: tinyMLA, MaxTokens: 512}))
			h, err := blockhash.New(blockhash.Options{BlockSize: 4})
			require.NoError(t, err)
			medium := "GPU"
			if kind == onShared {
				medium = "CPU"
			}
			rec := newRecorder(h, medium)
			tier := tiertest.NewMap(16 << 20)
			pc, err := kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{
				Tiers: []kv.Tier{tier}, TierPrefix: t.Name(), TierWait: time.Minute,
				Events: kv.EventOptions{Observer: rec, Hash: h.Options()},
			})
			require.NoError(t, err)
			defer func() { assert.NoError(t, pc.Close()) }()
			s, err := e.c.NewSequence()
			require.NoError(t, err)
			tpb, blk := s.BlockTokens(), s.BlockStride()
			require.True(t, s.Close().OK())

			ids := promptIDs(7, 3*tpb+5)
			s, _, err = serve(pc, ids)
			require.NoError(t, err)
			require.True(t, s.Close().OK())
			pc.FlushEvents()
			assert.Len(t, rec.set(), heldPrefix(pc, ids)/4, "one announced block per 4 tokens held")

			_, err = pc.Evict(1 << 40)
			require.NoError(t, err)
			require.Zero(t, pc.Stats().CachedTokens)
			pc.FlushEvents()
			assert.Empty(t, rec.set(), "every block withdrawn with the entry")
			st := pc.Stats().Tiers
			require.Len(t, st, 1)
			assert.EqualValues(t, 3*tierval.Size(tpb, blk), st[0].StoreBytes, "three whole blocks went down")

			q, m, err := pc.Lookup(ids)
			require.NoError(t, err)
			assert.Equal(t, 3*tpb, m, "the whole blocks below the last token, from the tier")
			require.NoError(t, checkIDs(q, ids, 0, m))
			require.NoError(t, q.Append(len(ids)-m))
			require.NoError(t, writeIDs(q, ids, m, len(ids)))
			require.NoError(t, checkIDs(q, ids, 0, len(ids)))
			require.True(t, q.Close().OK())
			assert.EqualValues(t, 3*tpb, pc.Stats().Tiers[0].Hits)
			assert.Empty(t, rec.errors())
			e.books(t, "after the tier's load")
		})
	}
}
