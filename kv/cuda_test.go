package kv_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/cuda/cudatest"
	"github.com/vmarena/vmarena/kv"
)

// TestGPUCache runs the same checks on a real GPU, with Llama-3-8B's token size and the
// driver's granule. It skips itself where no CUDA driver or device is present.
func TestGPUCache(t *testing.T) {
	drv, err := cuda.LoadDriver()
	if err != nil {
		t.Skipf("no CUDA driver: %v", err)
	}
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			llamaShareForkTruncate(t, drv, layout)
		})
	}
}

// TestCUDAFakeDriverLlama runs TestGPUCache's checks on the fake driver with a real
// GPU's 2 MiB granule, so that they are known to hold before a GPU runs them.
func TestCUDAFakeDriverLlama(t *testing.T) {
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			fake := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{Granularity: 2 << 20, Memory: 1 << 30})
			t.Cleanup(func() { assert.NoError(t, fake.CheckLeaks()) })
			llamaShareForkTruncate(t, fake.Driver(), layout)
		})
	}
}

// llamaShareForkTruncate runs shareForkTruncate on drv's GPU 0 with Llama-3-8B's token
// size (four layers, to keep it small), its token counts scaled to the driver's
// granule: a PerLayer tensor of 2 KiB tokens has 1,024 tokens per 2 MiB granule, and
// a prefix shorter than that shares nothing.
func llamaShareForkTruncate(t *testing.T, drv *cuda.Driver, layout kv.Layout) {
	t.Helper()
	l := kv.Llama3_8B().Groups[0]
	g := kv.Uniform("llama3-8b-4", 4, l.KVHeads, l.HeadDim, l.DType)
	c := openEnv(t, onCUDA, withCUDA(cuda.Options{Driver: drv}), withConfig(kv.Config{Model: g, MaxTokens: 4096, Layout: layout})).c // NB: skips where drv has no usable GPU
	perTensor := c.Granularity() / g.Groups[0].TokenBytes()
	shareForkTruncateN(t, c, (perTensor+127)/128)
}

// On the CUDA pool a closed sequence's handles go back to the pool, not to the
// governor: a batch waiting for memory is woken by them all the same, and the step
// takes them.
func TestCUDAWaitWokenByIdleHandles(t *testing.T) {
	const g = 64 << 10 // 128 tiny8 tokens per tensor
	e := openEnv(t, onCUDA, withGranule(g), withLimit(12*g), withConfig(kv.Config{MaxTokens: 512, Layout: kv.PerLayer}))
	c, gov, pool := e.c, e.gov, e.auth
	a, err := c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, a.Append(129)) // 12 granules: the whole budget
	seqs := newSeqs(t, c, 2)
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		done <- c.AppendBatchCtx(ctx, []kv.Growth{{seqs[0], 100}, {seqs[1], 100}})
	}()
	require.Eventually(t, func() bool { return gov.Stats(accounting.GPU(0)).Waiters == 1 }, 5*time.Second, time.Millisecond)
	require.True(t, a.Close().OK())
	require.NoError(t, <-done)
	assert.Equal(t, []int{100, 100}, lens(seqs))
	assert.Equal(t, int64(12*g), pool.Stats().Owned, "the step took the idle handles")
	closeAll(t, seqs...)
}

// After Fork the origin's own mapping of the shared granules is read-only on the
// CUDA backing (cuMemSetAccess with PROT_READ on the fake driver), its tail
// read-write; where the driver refuses read-only access the fork still works and the
// backing guards its copies.
func TestCUDAOriginProtected(t *testing.T) {
	for _, layout := range layouts {
		for _, noRO := range []bool{false, true} {
			t.Run(fmt.Sprintf("%v/noReadOnly=%v", layout, noRO), func(t *testing.T) {
				const g = 64 << 10
				fake := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{Granularity: g, Memory: 256 << 20, NoReadOnly: noRO})
				t.Cleanup(func() { assert.NoError(t, fake.CheckLeaks()) })
				c := openEnv(t, onCUDA, withCUDA(cuda.Options{Driver: fake.Driver()}), withConfig(kv.Config{Model: tiny8, MaxTokens: 1024, Layout: layout})).c
				s, err := c.NewSequence()
				require.NoError(t, err)
				require.NoError(t, s.Append(300))
				writeTokens(t, s, 1, 0, 300)
				before, ok := fake.MappingAccess(uint64(s.Base(0, kv.K)))
				require.True(t, ok)
				assert.Equal(t, int32(cuda.AccessReadWrite), before)
				f, err := s.ForkAt(200)
				require.NoError(t, err)
				base := uint64(s.Base(0, kv.K))
				got, ok := fake.MappingAccess(base)
				require.True(t, ok)
				if noRO {
					assert.Equal(t, int32(cuda.AccessReadWrite), got, "the driver can not: the backing guards its copies instead")
				} else {
					assert.Equal(t, int32(cuda.AccessRead), got, "the origin's shared granule is read-only")
				}
				// The origin's last granule holds its own tail: read-write.
				tail := uint64(tokenAddr(s, 0, kv.K, s.Len()-1))
				got, ok = fake.MappingAccess(tail)
				require.True(t, ok)
				assert.Equal(t, int32(cuda.AccessReadWrite), got)
				tok := make([]byte, tiny8.Groups[0].TokenBytes())
				assert.ErrorIs(t, s.WriteToken(0, kv.K, 0, tok), kv.ErrReadOnly)
				require.NoError(t, s.WriteToken(0, kv.K, 299, tok))
				checkTokens(t, f, 1, 0, f.Len())
				closeAll(t, f, s)
			})
		}
	}
}
