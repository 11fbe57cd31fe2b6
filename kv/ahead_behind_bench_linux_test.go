package kv_test

import (
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
)

// BenchmarkWindowStep measures the decode steps of gpt-oss-20b sequences (a
// 128-token sliding window beside full attention) with map-ahead on host.Shared (2
// MiB granules, populated), where the window gives a block back every 85 tokens and
// a long prompt's first step gives back all of the prompt's window but the last 128
// tokens. Each iteration forks 16 sequences from a 1,024-token system prompt (their
// first blocks map the prompt's), appends prompts of 1,000 to 1,555 tokens, then
// makes 400 steps of each: Append(1) and the token's K and V in every layer, one
// sequence after another. leave=true leaves the window's blocks behind for the
// worker (the default); leave=false gives them back on the step, as before. It
// reports the p50 of the steps that gave a block back (drop-p50-ns), of the first
// step after each prompt (first-p50-ns), and the p99 of all steps (p99-ns): the
// memory layer's share of a step's tail.
func BenchmarkWindowStep(b *testing.B) {
	const seqs, system, steps = 16, 1024, 400
	m := kv.GPTOSS20B()
	for _, leave := range []bool{true, false} {
		b.Run(fmt.Sprintf("leave=%v", leave), func(b *testing.B) {
			var all, drops, firsts []time.Duration
			for b.Loop() {
				gov := accounting.NewGovernor()
				require.NoError(b, gov.SetLimit(accounting.HostKey, 8<<30))
				pool, err := host.NewShared(host.SharedOptions{Authority: gov.Authority("kv", accounting.HostKey), Populate: true,
					Name: fmt.Sprintf("kv-bench-window-%d", os.Getpid())})
				require.NoError(b, err)
				c, err := kv.New(pool, kv.Config{Model: m, MaxTokens: 4096, MapAhead: true})
				require.NoError(b, err)
				c.SetLeaveBehind(leave)
				st, err := c.LayerStrides(0)
				require.NoError(b, err)
				tok := make([]byte, st.TokenBytes)
				sys, err := c.NewSequence()
				require.NoError(b, err)
				require.NoError(b, sys.Append(system))
				qs := make([]*kv.Sequence, seqs)
				for i := range qs {
					qs[i], err = sys.ForkAt(system)
					require.NoError(b, err)
					require.NoError(b, qs[i].Append(1000+37*i))
				}
				for k := range steps {
					for _, q := range qs {
						held, n := q.FirstHeld(0), q.Len()
						t0 := time.Now()
						require.NoError(b, q.Append(1))
						for l := range m.Layers {
							if err := q.WriteTokens(l, kv.K, n, n+1, tok); err != nil {
								b.Fatal(err)
							}
							if err := q.WriteTokens(l, kv.V, n, n+1, tok); err != nil {
								b.Fatal(err)
							}
						}
						dt := time.Since(t0)
						all = append(all, dt)
						switch {
						case k == 0:
							firsts = append(firsts, dt)
						case q.FirstHeld(0) > held:
							drops = append(drops, dt)
						}
					}
				}
				for _, q := range qs {
					require.True(b, q.Close().OK())
				}
				require.True(b, sys.Close().OK())
				require.NoError(b, c.Close())
				require.NoError(b, pool.Close())
			}
			b.ReportMetric(float64(p(drops, 0.5).Nanoseconds()), "drop-p50-ns")
			b.ReportMetric(float64(p(firsts, 0.5).Nanoseconds()), "first-p50-ns")
			b.ReportMetric(float64(p(all, 0.99).Nanoseconds()), "p99-ns")
		})
	}
}
