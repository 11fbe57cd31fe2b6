package hosttier_test

import (
	"bytes"
	"errors"
	"fmt"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/cuda/cudatest"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/internal/testutil"
	"github.com/vmarena/vmarena/kvtier/hosttier"
)

const block = 2 << 20 // one Blocked-layout block of Llama-3-8B: 16 tokens of every layer

// clock sums the time of each path of a benchmark, timed one after the other in the
// same loop, so that their ratio is measured under the same noise.
type clock map[string]time.Duration

func (c clock) time(name string, fn func()) {
	t0 := time.Now()
	fn()
	c[name] += time.Since(t0)
}

// BenchmarkBlock stores and loads a 2 MiB block through the tier, and copies the same
// bytes with copy() into and out of a plain buffer, in the same loop. The ratios are
// the tier's cost over a memcpy of the block's bytes: store/copy and load/copy for
// one copy each way, roundtrip/copy2 for both. keys=1 replaces one value (its two
// runs alternate, both resident); keys=64 cycles 64 keys through a tier of 32 blocks,
// so that every store evicts.
func BenchmarkBlock(b *testing.B) {
	for _, keys := range []int{1, 64} {
		b.Run(fmt.Sprintf("block=2MiB/keys=%d", keys), func(b *testing.B) {
			tr, err := hosttier.New(hosttier.Options{Budget: 32 * block, Granule: block})
			require.NoError(b, err)
			defer tr.Close()
			src := content(1, block)
			// The copy's side keeps as many plain buffers as the tier holds values, so
			// that both sides write and read the same amount of memory (64 MiB does
			// not stay in the caches; one 2 MiB buffer would).
			mids := make([][]byte, min(keys, 32))
			for i := range mids {
				mids[i] = bytes.Clone(src) // faulted in before timing
			}
			out := bytes.Clone(src)
			fill := func(dst []byte) error { copy(dst, src); return nil }
			use := func(p []byte) error { copy(out, p); return nil }
			// Untimed: every granule the loop will use is committed and resident first,
			// so the loop measures the steady state (a commit is a one-time cost).
			for i := range keys + 32 {
				testutil.NoError(b, tr.Store(bg, key(i%keys), block, fill))
			}
			evicted := tr.Stats().Evictions
			c := clock{}
			n := 0
			b.SetBytes(block)
			for b.Loop() {
				k := key(n % keys)
				mid := mids[n%len(mids)]
				n++
				c.time("store", func() { testutil.NoError(b, tr.Store(bg, k, block, fill)) })
				c.time("load", func() { testutil.NoError(b, tr.Load(bg, k, use)) })
				c.time("copyin", func() { copy(mid, src) })
				c.time("copyout", func() { copy(out, mid) })
			}
			per := func(name string) float64 { return float64(c[name]) / float64(n) }
			b.ReportMetric(per("store")/per("copyin"), "store/copy")
			b.ReportMetric(per("load")/per("copyout"), "load/copy")
			b.ReportMetric((per("store")+per("load"))/(per("copyin")+per("copyout")), "roundtrip/copy2")
			b.ReportMetric(per("store"), "store-ns/block")
			b.ReportMetric(per("load"), "load-ns/block")
			b.ReportMetric(per("copyin"), "copy-ns/block")
			if keys > 32 {
				b.ReportMetric(float64(tr.Stats().Evictions-evicted)/float64(n), "evictions/store")
			}
		})
	}
}

// BenchmarkCUDATier moves a 2 MiB block between device memory and the tier's pinned
// memory through the tier (Store with a DtoH copy in fill, Load with an HtoD copy in
// use, on the tier's stream) and, in the same loop, with cuMemcpy*Async of the same
// bytes to and from a pinned buffer of its own on a stream: the ratio tier/raw is the
// tier's share of the DMA engine's speed (the target is at least 70% on a GPU).
// driver=fake runs everywhere and checks that the path works; driver=gpu needs a GPU
// and skips without one (scripts/gpu-check.sh runs it).
func BenchmarkCUDATier(b *testing.B) {
	for _, drv := range []string{"fake", "gpu"} {
		for _, dir := range []string{"dtoh", "htod", "both"} {
			b.Run(fmt.Sprintf("driver=%s/dir=%s/block=2MiB", drv, dir), func(b *testing.B) {
				benchCUDATier(b, drv, dir)
			})
		}
	}
}

func benchCUDATier(b *testing.B, drv, dir string) {
	var d *cuda.Driver
	if drv == "fake" {
		d = cudatest.NewFakeDriver(cudatest.FakeDriverOptions{}).Driver()
	} else {
		var err error
		if d, err = cuda.LoadDriver(); err != nil {
			b.Skipf("no CUDA driver: %v", err)
		}
	}
	cb, err := cuda.New(cuda.Options{Authority: accounting.NewGovernor().Authority("gpu", accounting.GPU(0)), Driver: d})
	if errors.Is(err, backing.ErrUnsupported) {
		b.Skipf("no usable GPU: %v", err)
	}
	require.NoError(b, err)
	defer func() { require.NoError(b, cb.Close()) }()
	n := (block + cb.Granularity() - 1) / cb.Granularity() * cb.Granularity()
	r, err := cb.Reserve(n)
	require.NoError(b, err)
	defer func() { require.NoError(b, cb.Unreserve(r).Err) }()
	require.NoError(b, cb.Commit(r, 0, n))
	require.NoError(b, cb.CopyIn(r, 0, content(5, block)))

	tr, err := hosttier.New(hosttier.Options{Budget: 8 * block, Granule: block, CUDA: cb, PinChunk: 8 * block})
	require.NoError(b, err)
	defer func() { require.NoError(b, tr.Close()) }()
	require.NoError(b, tr.WaitPinned(bg))
	s := tr.Stream()

	raw, free := pinnedBuffer(b, cb, block)
	defer free()
	rs, err := cb.NewStream()
	require.NoError(b, err)
	defer func() { require.NoError(b, rs.Close()) }()

	fill := func(dst []byte) error {
		if err := s.CopyOutAsync(dst, r, 0); err != nil {
			return err
		}
		return s.Synchronize()
	}
	use := func(src []byte) error {
		if err := s.CopyInAsync(r, 0, src); err != nil {
			return err
		}
		return s.Synchronize()
	}
	rawOut := func() { testutil.NoError(b, rs.CopyOutAsync(raw, r, 0)); testutil.NoError(b, rs.Synchronize()) }
	rawIn := func() { testutil.NoError(b, rs.CopyInAsync(r, 0, raw)); testutil.NoError(b, rs.Synchronize()) }
	k := key(1)
	testutil.NoError(b, tr.Store(bg, k, block, fill))
	c := clock{}
	iters := 0
	moved := int64(block)
	if dir == "both" {
		moved *= 2
	}
	b.SetBytes(moved)
	for b.Loop() {
		iters++
		switch dir {
		case "dtoh":
			c.time("tier", func() { testutil.NoError(b, tr.Store(bg, k, block, fill)) })
			c.time("raw", rawOut)
		case "htod":
			c.time("tier", func() { testutil.NoError(b, tr.Load(bg, k, use)) })
			c.time("raw", rawIn)
		case "both":
			c.time("tier", func() { testutil.NoError(b, tr.Store(bg, k, block, fill)); testutil.NoError(b, tr.Load(bg, k, use)) })
			c.time("raw", func() { rawOut(); rawIn() })
		}
	}
	gbps := func(name string) float64 { return float64(moved) * float64(iters) / c[name].Seconds() / 1e9 }
	b.ReportMetric(gbps("tier"), "tier-GB/s")
	b.ReportMetric(gbps("raw"), "raw-GB/s")
	b.ReportMetric(100*gbps("tier")/gbps("raw"), "tier/raw-%")
}

// pinnedBuffer returns n bytes of host memory outside the Go heap, pinned on cb, and
// the func that unpins and frees them.
func pinnedBuffer(b *testing.B, cb *cuda.Backing, n int) ([]byte, func()) {
	p, err := host.NewPrivate(host.PrivateOptions{Granularity: n, Populate: true})
	require.NoError(b, err)
	r, err := p.Reserve(n)
	require.NoError(b, err)
	require.NoError(b, p.Commit(r, 0, n))
	base := p.Base(r)
	// Safety: [base, base+n) is committed host memory until free unreserves it.
	buf := unsafe.Slice((*byte)(*(*unsafe.Pointer)(unsafe.Pointer(&base))), n)
	require.NoError(b, cb.PinHost(buf))
	return buf, func() {
		require.NoError(b, cb.UnpinHost(buf))
		require.NoError(b, p.Unreserve(r).Err)
	}
}
