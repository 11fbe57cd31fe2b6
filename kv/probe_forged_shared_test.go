//go:build linux || windows

package kv_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/tiertest"
)

// namedMap is a tiertest.Map under a name of its own, so that two of them are two
// tiers of one prefix cache.
type namedMap struct {
	*tiertest.Map
	name string
}

func (n namedMap) Name() string { return n.name }

// tinyTwoWindows has two window groups of different kinds beside a full one: a
// sliding window of 40 tokens and chunks of 64.
var tinyTwoWindows = kv.Model{Name: "tiny-two-windows", Layers: 4, Groups: []kv.Group{
	{Kind: kv.SlidingWindow, Window: 40, Layers: []int{0, 2}, KVHeads: 1, HeadDim: 16, DType: arena.Float16},
	{Kind: kv.ChunkedLocal, Window: 64, Layers: []int{1}, KVHeads: 1, HeadDim: 16, DType: arena.Float16},
	{Kind: kv.FullAttention, Layers: []int{3}, KVHeads: 2, HeadDim: 32, DType: arena.Float16},
}}

// TestProbeForgedTierValues: over two tiers whose values are forged with random part
// lengths (each window group's part whole, empty or some of its last units; the
// states present or not; some blocks missing from a tier), and a device entry that
// often ends inside a tier block, Probe's Total and its count per tier equal what the
// Lookup made next serves and each tier's Hits grew by: the first tier cut short by
// the window rule, the second going on from there, on window hybrids of one, two and
// three window groups, chunked ones, and a recurrent one with a window.
func TestProbeForgedTierValues(t *testing.T) {
	models := []kv.Model{tinyOSS, tinyGemma, tinyChunks, tinyOSSLong, tinyTwoWindows, tinyWindows, tinyNextWin}
	for _, model := range models {
		t.Run(model.Name, func(t *testing.T) {
			e := openEnv(t, onShared, scaled, withLimit(1<<30), withConfig(kv.Config{Model: model, MaxTokens: 2048}))
			bt := tierBlock(t, e.c)
			// Each group's block tokens (0: recurrent).
			tpb := make([]int, len(model.Groups))
			for gi, g := range model.Groups {
				if g.Kind != kv.Recurrent {
					st, err := e.c.LayerStrides(g.Layers[0])
					require.NoError(t, err)
					tpb[gi] = st.BlockTokens
				}
			}
			r := rand.New(rand.NewPCG(61, uint64(len(model.Name))))
			ctx := context.Background()
			var served, both, midBlock int
			for it := range 120 {
				what := fmt.Sprintf("lookup %d", it)
				prefix := fmt.Sprintf("%s-%d", t.Name(), it)
				t0, t1 := tiertest.NewMap(64<<20), tiertest.NewMap(64<<20)
				pc := newGroupTierCache(t, e.c, prefix, namedMap{t0, "first"}, namedMap{t1, "second"})
				blocks := 1 + r.IntN(min(8, 2000/bt))
				ids := promptIDs(r.IntN(1000)*10, min(2048, blocks*bt+1+r.IntN(bt)))
				if r.IntN(2) == 0 {
					// A device entry of a prefix, ending anywhere.
					s, _, _, err := serveHybrid(pc, ids[:1+r.IntN(len(ids)-1)])
					require.NoError(t, err, what)
					require.True(t, s.Close().OK(), what)
				}
				l, whole := kv.TierLayout(pc)
				require.NotNil(t, l)
				keys := groupTierKeys(t, e.c, prefix, ids)
				for _, tier := range []*tiertest.Map{t0, t1} {
					for k := range keys {
						if r.IntN(4) == 0 {
							continue // a block this tier lacks
						}
						parts := forgedParts(r, model, tpb, bt, whole)
						require.NoError(t, tier.Store(ctx, keys[k], l.Size(bt, parts), func(dst []byte) error {
							return tierval.EncodeGroups(dst, keys[k], l, ids[k*bt:(k+1)*bt], parts, func(int, []byte) error { return nil })
						}))
					}
				}
				was := pc.Stats()
				p, err := pc.Probe(ids)
				require.NoError(t, err, what)
				s, m, err := pc.Lookup(ids)
				require.NoError(t, err, what)
				now := pc.Stats()
				var hits [2]int
				for i := range hits {
					require.Zero(t, now.Tiers[i].Invalid-was.Tiers[i].Invalid, what)
					require.Zero(t, now.Tiers[i].Drops-was.Tiers[i].Drops, what)
					require.Zero(t, now.Tiers[i].Unfit-was.Tiers[i].Unfit, what)
					hits[i] = int(now.Tiers[i].Hits - was.Tiers[i].Hits)
					require.Equal(t, hits[i], p.Tiers[i], "%s: tier %d (device %d)", what, i, p.Device)
				}
				require.Equal(t, m, p.Total, "%s: Probe is the lookup (device %d)", what, p.Device)
				if m > p.Device {
					served++
					if p.Device%bt != 0 {
						midBlock++
					}
				}
				if hits[0] > 0 && hits[1] > 0 {
					both++
				}
				require.True(t, s.Close().OK(), what)
				require.NoError(t, pc.Close(), what)
			}
			assert.Positive(t, served, "lookups the tiers served")
			assert.Positive(t, both, "lookups the second tier went on for")
			if model.Name != tinyNextWin.Name { // its device hits start on checkpoints, at tier blocks' ends here
				assert.Positive(t, midBlock, "tier hits past a device hit inside a tier block")
			}
		})
	}
}

// forgedParts returns random part lengths of a tier value of model (tier blocks of bt
// tokens, each group's blocks of tpb[gi] tokens, whole parts of whole[gi] bytes): the
// full and MLA groups' parts whole, as every value holds them; each window group's
// whole, empty or some of its last units; the recurrent groups' states all present or
// all absent.
func forgedParts(r *rand.Rand, model kv.Model, tpb []int, bt int, whole []int) []int {
	parts := make([]int, len(whole))
	states := r.IntN(3) != 0
	for gi, g := range model.Groups {
		switch g.Kind {
		case kv.Recurrent:
			if states {
				parts[gi] = whole[gi]
			}
		case kv.SlidingWindow, kv.ChunkedLocal:
			per := bt / tpb[gi]
			units := per
			switch r.IntN(3) {
			case 1:
				units = 0
			case 2:
				units = r.IntN(per + 1)
			}
			parts[gi] = units * (whole[gi] / per)
		default:
			parts[gi] = whole[gi]
		}
	}
	return parts
}
