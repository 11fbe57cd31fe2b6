package kv_test

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/cuda/cudatest"
	"github.com/vmarena/vmarena/kv"
)

// BenchmarkCUDAAppendStep prices the memory side of a decode step on the CUDA
// backing: one AppendBatch that grows each of 8 sequences of Llama-3-8B (all 32
// layers) by one token, 1,024 steps in a row, the commits included. On a GPU the
// step's K and V are written by the model's own kernels, and the attention read is
// priced by scripts/gpu_layout_read.py (docs/gpu.md); this is the rest of it.
//
// The sequences start 130 tokens apart and at odd lengths (1, 131, ..., 911), so
// their granule boundaries fall on different steps, as in a server's batch. Before the first
// iteration every sequence grows once to its longest length and is truncated back,
// so the pool holds every handle a run needs: each commit maps a pooled handle (map +
// access), as in a server that has run for a while.
//
// Layouts commit the same bytes (64 granules of 2 MiB per sequence per 1,024 tokens)
// at different times: Blocked one granule of a sequence every 16
// tokens, PerLayer 64 granules of a sequence at once every 1,024. Each step is timed
// on its own: p50-ns/step, p99-ns/step and max-ns/step show how the commits fall;
// ns/step is the mean.
//
// driver=gpu runs on GPU 0 and skips where there is none (scripts/gpu-check.sh runs
// it); driver=fake runs the same code on the fake driver with 2 sequences, to check
// the benchmark, not to time a GPU.
func BenchmarkCUDAAppendStep(b *testing.B) {
	const steps = 1024
	for _, drv := range []string{"fake", "gpu"} {
		for _, layout := range layouts {
			b.Run(fmt.Sprintf("driver=%s/layout=%s", drv, layout), func(b *testing.B) {
				seqs := 8
				var d *cuda.Driver
				if drv == "fake" {
					seqs = 2
					d = cudatest.NewFakeDriver(cudatest.FakeDriverOptions{Granularity: 2 << 20, Memory: 1 << 30}).Driver()
				} else {
					var err error
					if d, err = cuda.LoadDriver(); err != nil {
						b.Skipf("no CUDA driver: %v", err)
					}
				}
				c := openEnv(b, onCUDA, withCUDA(cuda.Options{Driver: d}), withConfig(kv.Config{Model: kv.Llama3_8B(), MaxTokens: 2 * steps, Layout: layout})).c // NB: skips where d has no usable GPU
				start := func(k int) int { return k*steps/seqs + 2*k + 1 }
				batch := make([]kv.Growth, seqs)
				for k := range batch {
					q, err := c.NewSequence()
					require.NoError(b, err)
					b.Cleanup(func() { require.True(b, q.Close().OK()) })
					require.NoError(b, q.Append(start(k)+steps))
					batch[k] = kv.Growth{Seq: q, Tokens: 1}
				}
				lat := make([]time.Duration, 0, steps)
				b.ResetTimer()
				for range b.N {
					b.StopTimer()
					for k, gr := range batch {
						require.NoError(b, gr.Seq.Truncate(start(k)))
					}
					b.StartTimer()
					for range steps {
						t := time.Now()
						err := c.AppendBatch(batch)
						lat = append(lat, time.Since(t))
						if err != nil {
							b.Fatal(err)
						}
					}
				}
				b.StopTimer()
				slices.Sort(lat)
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*steps), "ns/step")
				b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds()), "p50-ns/step")
				b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds()), "p99-ns/step")
				b.ReportMetric(float64(lat[len(lat)-1].Nanoseconds()), "max-ns/step")
			})
		}
	}
}
