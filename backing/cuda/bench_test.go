package cuda_test

import (
	"fmt"
	"runtime"
	"slices"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/cuda/cudatest"
	"github.com/vmarena/vmarena/internal/testutil"
)

// Benchmarks run on three drivers:
//   - null: every entry point succeeds at once and does nothing: what is left is the
//     Go side's own cost per operation (locks, bookkeeping, the thread lock, the
//     context set, the ledger);
//   - fake: the in-memory driver that checks every rule (its bookkeeping included);
//   - gpu: libcuda on GPU 0, skipped where there is none (scripts/gpu-check.sh runs
//     them on a GPU machine; -fakegpu puts the fake driver there instead).
//
// Each benchmark times its operations one by one and reports their median and 99th
// percentile (p50-ns/commit, p99-ns/commit, ...) next to ns/op, which covers the whole
// iteration (an operation and the one that undoes it). Only the growth with writes
// reports bytes per second: mapping moves no bytes.

var benchDrivers = []string{"null", "fake", "gpu"}

// nullDriver returns a driver whose calls all succeed and do nothing but hand out
// addresses and handle numbers.
func nullDriver() *cuda.Driver {
	var next atomic.Uint64
	next.Store(1 << 40)
	ok1 := func(uint32) cuda.Code { return cuda.Success }
	return &cuda.Driver{
		Init:             ok1,
		DriverGetVersion: func(v *int32) cuda.Code { *v = 12060; return cuda.Success },
		DeviceGetCount:   func(n *int32) cuda.Code { *n = 1; return cuda.Success },
		DeviceGet:        func(d *int32, o int32) cuda.Code { *d = o; return cuda.Success },
		DeviceGetAttribute: func(v *int32, attr, dev int32) cuda.Code {
			*v = 1
			return cuda.Success
		},
		DevicePrimaryCtxRetain:  func(c *uintptr, dev int32) cuda.Code { *c = 1; return cuda.Success },
		DevicePrimaryCtxRelease: func(int32) cuda.Code { return cuda.Success },
		CtxSetCurrent:           func(uintptr) cuda.Code { return cuda.Success },
		CtxSynchronize:          func() cuda.Code { return cuda.Success },
		MemGetInfo:              func(f, t *uintptr) cuda.Code { *f, *t = 1<<40, 1<<40; return cuda.Success },
		MemGetAllocationGranularity: func(g *uintptr, p *cuda.MemAllocationProp, o int32) cuda.Code {
			*g = 2 << 20
			return cuda.Success
		},
		MemAddressReserve: func(p *uint64, size, align uintptr, addr, flags uint64) cuda.Code {
			*p = next.Add(uint64(size)+(2<<20)) &^ (2<<20 - 1)
			return cuda.Success
		},
		MemAddressFree: func(uint64, uintptr) cuda.Code { return cuda.Success },
		MemCreate: func(h *uint64, size uintptr, p *cuda.MemAllocationProp, flags uint64) cuda.Code {
			*h = next.Add(1)
			return cuda.Success
		},
		MemRelease:   func(uint64) cuda.Code { return cuda.Success },
		MemMap:       func(uint64, uintptr, uintptr, uint64, uint64) cuda.Code { return cuda.Success },
		MemUnmap:     func(uint64, uintptr) cuda.Code { return cuda.Success },
		MemSetAccess: func(uint64, uintptr, *cuda.MemAccessDesc, uintptr) cuda.Code { return cuda.Success },
		MemsetD8:     func(uint64, uint8, uintptr) cuda.Code { return cuda.Success },
		MemcpyHtoD:   func(uint64, unsafe.Pointer, uintptr) cuda.Code { return cuda.Success },
		MemcpyDtoH:   func(unsafe.Pointer, uint64, uintptr) cuda.Code { return cuda.Success },
		MemcpyDtoD:   func(uint64, uint64, uintptr) cuda.Code { return cuda.Success },
		GetErrorName: func(cuda.Code, **byte) cuda.Code { return cuda.CodeInvalidValue },
	}
}

// benchDriver returns the driver of kind, or skips b.
func benchDriver(b *testing.B, kind string) *cuda.Driver {
	switch kind {
	case "null":
		return nullDriver()
	case "fake":
		return cudatest.NewFakeDriver(cudatest.FakeDriverOptions{Memory: 8 << 30}).Driver()
	}
	return gpuDriver(b)
}

// benchBacking returns a Backing on a driver of kind, closed at cleanup, or skips b.
func benchBacking(b *testing.B, kind string, o cuda.Options) *cuda.Backing {
	b.Helper()
	return gpuBacking(b, benchDriver(b, kind), o)
}

// latencies records how long each of a benchmark's operations took.
type latencies map[string][]time.Duration

// time runs fn and records its duration under name.
func (l latencies) time(name string, fn func()) {
	t := time.Now()
	fn()
	l[name] = append(l[name], time.Since(t))
}

// report reports the median and 99th percentile of every recorded operation.
func (l latencies) report(b *testing.B) {
	for name, d := range l {
		slices.Sort(d)
		b.ReportMetric(float64(d[len(d)/2].Nanoseconds()), "p50-ns/"+name)
		b.ReportMetric(float64(d[len(d)*99/100].Nanoseconds()), "p99-ns/"+name)
	}
}

// BenchmarkCommit commits granules on a reservation and decommits them again:
// handle=pooled maps handles from the pool (map + access), handle=new creates them
// first (create + map + access) and releases them after.
func BenchmarkCommit(b *testing.B) {
	for _, kind := range benchDrivers {
		for _, n := range []int{1, 16} {
			b.Run(fmt.Sprintf("driver=%s/handle=pooled/granules=%d", kind, n), func(b *testing.B) {
				bk := benchBacking(b, kind, cuda.Options{})
				g := bk.Granularity()
				r, err := bk.Reserve(n * g)
				testutil.NoError(b, err)
				defer bk.Unreserve(r)
				testutil.NoError(b, bk.Prefill(n))
				b.ReportAllocs()
				lat := latencies{}
				for b.Loop() {
					lat.time("commit", func() { testutil.NoError(b, bk.Commit(r, 0, n*g)) })
					lat.time("decommit", func() { testutil.NoError(b, bk.Decommit(r, 0, n*g)) })
				}
				lat.report(b)
			})
		}
		b.Run(fmt.Sprintf("driver=%s/handle=new/granules=1", kind), func(b *testing.B) {
			bk := benchBacking(b, kind, cuda.Options{})
			g := bk.Granularity()
			r, err := bk.Reserve(g)
			testutil.NoError(b, err)
			defer bk.Unreserve(r)
			b.ReportAllocs()
			lat := latencies{}
			for b.Loop() {
				lat.time("commit", func() { testutil.NoError(b, bk.Commit(r, 0, g)) })
				testutil.NoError(b, bk.Decommit(r, 0, g))
				lat.time("release", func() {
					if _, err := bk.Trim(0); err != nil {
						b.Fatal(err)
					}
				})
			}
			lat.report(b)
		})
	}
}

// BenchmarkShare maps a committed granule into another reservation read-only (map +
// access) and unmaps it again: the cost of starting a sequence on a shared prefix,
// per granule.
func BenchmarkShare(b *testing.B) {
	for _, kind := range benchDrivers {
		b.Run(fmt.Sprintf("driver=%s/granules=1", kind), func(b *testing.B) {
			bk := benchBacking(b, kind, cuda.Options{})
			g := bk.Granularity()
			src, err := bk.Reserve(g)
			testutil.NoError(b, err)
			defer bk.Unreserve(src)
			dst, err := bk.Reserve(g)
			testutil.NoError(b, err)
			defer bk.Unreserve(dst)
			testutil.NoError(b, bk.Commit(src, 0, g))
			b.ReportAllocs()
			lat := latencies{}
			for b.Loop() {
				lat.time("share", func() { testutil.NoError(b, bk.Share(dst, 0, src, 0, g, backing.ReadOnly)) })
				lat.time("unshare", func() { testutil.NoError(b, bk.Decommit(dst, 0, g)) })
			}
			lat.report(b)
		})
	}
}

// BenchmarkGrowTensor grows one KV tensor of 2 KiB per token (one layer's K of
// Llama-3-8B in fp16) by 1,024 tokens, token by token, committing a pooled granule
// whenever the tensor crosses a granule boundary; with write=true each token's 2 KiB
// is also copied in from the host, as a decode step would write it. Each iteration
// then decommits the tensor back to the pool. scripts/torch_grow.py measures the same
// growth with PyTorch's expandable segments.
func BenchmarkGrowTensor(b *testing.B) {
	const tokens, perToken = 1024, 2 << 10
	for _, kind := range benchDrivers {
		for _, write := range []bool{false, true} {
			b.Run(fmt.Sprintf("driver=%s/tokens=%d/bytes-per-token=2KiB/write=%v", kind, tokens, write), func(b *testing.B) {
				bk := benchBacking(b, kind, cuda.Options{})
				g := bk.Granularity()
				size, _ := backing.AlignUp(tokens*perToken, g)
				r, err := bk.Reserve(size)
				testutil.NoError(b, err)
				defer bk.Unreserve(r)
				testutil.NoError(b, bk.Prefill(size/g))
				token := make([]byte, perToken)
				if write {
					b.SetBytes(tokens * perToken) // bytes copied in per grow
				}
				b.ReportAllocs()
				lat := latencies{}
				var steps int
				for b.Loop() {
					committed := 0
					steps = 0
					lat.time("grow", func() {
						for t := range tokens {
							end := (t + 1) * perToken
							if end > committed {
								testutil.NoError(b, bk.Commit(r, committed, g))
								committed += g
								steps++
							}
							if write {
								token[0] = byte(t)
								testutil.NoError(b, bk.CopyIn(r, t*perToken, token))
							}
						}
						if write {
							testutil.NoError(b, bk.Synchronize())
						}
					})
					lat.time("shrink", func() { testutil.NoError(b, bk.Decommit(r, 0, committed)) })
				}
				lat.report(b)
				b.ReportMetric(float64(steps), "granule-steps/grow")
				d := lat["grow"]
				b.ReportMetric(float64(d[len(d)/2].Nanoseconds())/tokens, "p50-ns/token")
			})
		}
	}
}

// BenchmarkDriverCalls times the raw driver calls behind one granule, one by one, for
// comparison with published figures (kvcached on A100, per 2 MiB: cuMemCreate 193 µs,
// cuMemMap 1.5 µs, cuMemSetAccess 36 µs, cuMemUnmap 26 µs).
func BenchmarkDriverCalls(b *testing.B) {
	for _, kind := range benchDrivers {
		b.Run(fmt.Sprintf("driver=%s", kind), func(b *testing.B) {
			d := benchDriver(b, kind)
			bk := gpuBacking(b, d, cuda.Options{}) // initialises the driver and keeps the context
			g := uintptr(bk.Granularity())
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			var ctx uintptr
			if d.DevicePrimaryCtxRetain(&ctx, 0) != cuda.Success || d.CtxSetCurrent(ctx) != cuda.Success {
				b.Fatal("no context")
			}
			defer d.DevicePrimaryCtxRelease(0)
			var va uint64
			if c := d.MemAddressReserve(&va, g, g, 0, 0); c != cuda.Success {
				b.Fatal(c)
			}
			defer d.MemAddressFree(va, g)
			prop := cuda.MemAllocationProp{Type: cuda.AllocationPinned, Location: cuda.MemLocation{Type: cuda.LocationDevice}}
			desc := cuda.MemAccessDesc{Location: prop.Location, Flags: cuda.AccessReadWrite}
			check := func(c cuda.Code) {
				if c != cuda.Success {
					b.Fatal(c)
				}
			}
			b.ReportAllocs()
			lat := latencies{}
			for b.Loop() {
				var h uint64
				lat.time("cuMemCreate", func() { check(d.MemCreate(&h, g, &prop, 0)) })
				lat.time("cuMemMap", func() { check(d.MemMap(va, g, 0, h, 0)) })
				lat.time("cuMemSetAccess", func() { check(d.MemSetAccess(va, g, &desc, 1)) })
				lat.time("cuMemUnmap", func() { check(d.MemUnmap(va, g)) })
				lat.time("cuMemRelease", func() { check(d.MemRelease(h)) })
			}
			lat.report(b)
		})
	}
}
