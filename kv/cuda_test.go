package kv_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/kv"
)

// newCUDACache returns a cache on GPU 0 of drv; the granule is the driver's.
// It returns cuda.New's error, so a test can skip where there is no usable GPU.
func newCUDACache(t *testing.T, drv *cuda.Driver, layout kv.Layout, g kv.Geometry, maxTokens int) (*kv.Cache, error) {
	t.Helper()
	gov := accounting.NewGovernor()
	pool := gov.Authority("kv", accounting.GPU(0))
	b, err := cuda.New(cuda.Options{Authority: pool, Driver: drv})
	if err != nil {
		return nil, err
	}
	c, err := kv.New(b, kv.Config{Geometry: g, MaxTokens: maxTokens, Layout: layout})
	require.NoError(t, err)
	t.Cleanup(func() {
		assert.NoError(t, c.Close())
		assert.NoError(t, b.Close())
		assert.Zero(t, pool.Stats().Owned, "ledger does not balance")
		assert.Zero(t, pool.Stats().Mapped)
	})
	return c, nil
}

// TestCUDAFakeDriver runs the cache on the CUDA backing over the fake driver, which
// enforces the driver's VMM rules: K/V are written and read through the driver's
// copies, prefixes map one handle into many reservations.
func TestCUDAFakeDriver(t *testing.T) {
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			fake := cuda.NewFakeDriver(cuda.FakeDriverOptions{Granularity: 64 << 10, Memory: 256 << 20})
			t.Cleanup(func() { assert.NoError(t, fake.CheckLeaks()) })
			c, err := newCUDACache(t, fake.Driver(), layout, tiny8, 512)
			require.NoError(t, err)
			shareForkTruncate(t, c)
			s, err := c.NewSequence()
			require.NoError(t, err)
			_, err = s.Bytes(0, kv.K)
			assert.ErrorIs(t, err, kv.ErrLayout, "device memory is never handed out as a slice")
			assert.NotZero(t, s.Base(0, kv.K))
			assert.True(t, s.Close().OK())
		})
	}
}

// TestGPUCache runs the same checks on a real GPU, with Llama-3-8B's token size and the
// driver's granule. It skips itself where no CUDA driver or device is present.
func TestGPUCache(t *testing.T) {
	drv, err := cuda.LoadDriver()
	if err != nil {
		t.Skipf("no CUDA driver: %v", err)
	}
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			g := kv.Llama3_8B
			g.Layers = 4 // keep the test small: 4 layers × 2 KiB per token
			c, err := newCUDACache(t, drv, layout, g, 4096)
			if errors.Is(err, backing.ErrUnsupported) {
				t.Skipf("no usable GPU: %v", err)
			}
			require.NoError(t, err)
			shareForkTruncate(t, c)
		})
	}
}
