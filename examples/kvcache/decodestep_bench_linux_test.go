package main

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/internal/baseline"
)

// BenchmarkDecodeStepDType is the replay's decode step of one request (Append of one
// token, then its K and V written into every layer, as writeTokens does) on the
// shared backing, per model and KV type, beside its floor: the same bytes copied
// into resident memory with no cache between. A sequence is closed and a new one
// started every 2,048 steps, so block crossings (a commit) are in the figure at the
// rate a decode meets them. step-bytes is what one step writes.
func BenchmarkDecodeStepDType(b *testing.B) {
	for _, name := range []string{"llama3-8b", "gpt-oss-20b"} {
		for _, d := range []string{"fp16", "fp8"} {
			g, groups, err := lookupModel(name)
			require.NoError(b, err)
			dt, err := parseKVDType(d)
			require.NoError(b, err)
			g, groups, err = withDType(g, groups, dt)
			require.NoError(b, err)
			plan := planLayers(groups)
			if plan == nil {
				plan = make([]layerPlan, g.Layers)
				for l := range plan {
					plan[l] = layerPlan{kinds: keyValue, tokenBytes: g.Groups[0].TokenBytes()}
				}
			}
			stepBytes := 0
			for _, p := range plan {
				stepBytes += len(p.kinds) * p.tokenBytes
			}
			src := make([]byte, planBytes(plan, 0))
			w := Workload{Layers: g.Layers, Plan: plan, TokenBytes: len(src)}
			b.Run(fmt.Sprintf("model=%s/dtype=%s/op=cache", name, d), func(b *testing.B) {
				s := testSetup(0)
				s.model, s.groups, s.maxTokens, s.backing, s.granule = g, groups, 4096, "shared", 2<<20
				bt, err := build(nameCache, s)
				require.NoError(b, err)
				defer bt.st.Close()
				r := &replayer{w: w, st: bt.st}
				var q baseline.Sequence
				b.SetBytes(int64(stepBytes))
				for b.Loop() {
					if q == nil || q.Len() == 2048 {
						if q != nil {
							require.NoError(b, q.Close())
						}
						q, err = bt.st.NewSequence()
						require.NoError(b, err)
					}
					if err := q.Append(1); err != nil {
						b.Fatal(err)
					}
					t := q.Len() - 1
					if err := r.writeTokens(q, t, t+1, src); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(stepBytes), "step-bytes")
				require.NoError(b, q.Close())
			})
			b.Run(fmt.Sprintf("model=%s/dtype=%s/op=floor", name, d), func(b *testing.B) {
				dst := make([]byte, 2048*stepBytes)
				clear(dst)
				t := 0
				b.SetBytes(int64(stepBytes))
				for b.Loop() {
					off := t * stepBytes
					for _, p := range plan {
						for range p.kinds {
							off += copy(dst[off:], src[:p.tokenBytes])
						}
					}
					t = (t + 1) % 2048
				}
				b.ReportMetric(float64(stepBytes), "step-bytes")
			})
		}
	}
}
