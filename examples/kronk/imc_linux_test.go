package kronk_test

// An emulation of Kronk's Incremental Message Cache load on a session store: many
// sessions snapshot their whole KV state after every turn, a third of them are
// reset halfway and start a new conversation. It runs on Kronk's RAM store and on
// a snapshot store in one process, one after the other, and measures time, RSS
// (/proc/self/statm), the Go heap and GC CPU (runtime/metrics). Linux only: RSS.

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ardanlabs/kronk/sdk/kronk/kvstorage"
	"github.com/ardanlabs/kronk/sdk/kronk/kvstorage/ram"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/examples/kronk"
	"github.com/vmarena/vmarena/snapshot"
)

// load is an IMC workload.
type load struct {
	sessions  int
	turns     int
	minGrowth int   // bytes a session's state grows per turn, at least
	maxGrowth int   // and at most
	resetAt   int   // the turn before which every third session is reset
	limit     int64 // the snapshot store's budget; 0 for none
	seed      uint64
}

// growth returns every session's growth per turn, the same for every store.
func (l load) growth() [][]int {
	rng := rand.New(rand.NewPCG(l.seed, 7))
	g := make([][]int, l.sessions)
	for i := range g {
		g[i] = make([]int, l.turns)
		for t := range g[i] {
			g[i][t] = l.minGrowth + rng.IntN(l.maxGrowth-l.minGrowth+1)
		}
	}
	return g
}

// peaks returns the sum of the sessions' peak state sizes.
func (l load) peaks() int64 {
	var sum int64
	for i, turns := range l.growth() {
		size, peak := 0, 0
		for t, grow := range turns {
			if i%3 == 0 && t == l.resetAt {
				size = 0
			}
			size += grow
			peak = max(peak, size)
		}
		sum += int64(peak)
	}
	return sum
}

// result is what one store did under a load.
type result struct {
	prepareFillCommit time.Duration // Prepare, fill and Commit, all sessions and turns
	reset             time.Duration // the Reset calls of the reset sessions
	resetHeld         int64         // bytes the reset sessions' stores held before Reset (Cap)
	peakRSS           int64         // highest RSS after a turn, above the RSS at start
	rssBeforeReset    int64         // RSS just before and just after the resets, above the start
	rssAfterReset     int64
	peakHeap          int64 // highest Go heap (live and dead objects) after a turn, above the start
	gcCPU             time.Duration
	snapshots         int // snapshots committed whole
	refused           int // snapshots the store refused (the session loses its cache)
	wrong             int // snapshots whose bytes differ from what was written
}

// chunk is the unit the fill writes: a header (session, turn, chunk index) then a
// pattern, so that a check of any chunk tells whether it is this turn's.
const chunk = 64 << 10

// fill writes the state of session i at turn t into buf, as llama's state
// extraction writes the whole KV state: every byte.
func fill(buf []byte, src []byte, i, t int) {
	for off := 0; off < len(buf); off += chunk {
		n := copy(buf[off:], src)
		if n >= 16 {
			binary.LittleEndian.PutUint32(buf[off:], uint32(i))
			binary.LittleEndian.PutUint32(buf[off+4:], uint32(t))
			binary.LittleEndian.PutUint64(buf[off+8:], uint64(off))
		}
	}
}

// check reports whether snap is what fill wrote for session i at turn t: every
// chunk's header, and the pattern of the first, a middle and the last chunk.
func check(snap, src []byte, i, t, size int) bool {
	if len(snap) != size {
		return false
	}
	for off := 0; off < len(snap); off += chunk {
		end := min(off+chunk, len(snap))
		if end-off >= 16 {
			if binary.LittleEndian.Uint32(snap[off:]) != uint32(i) ||
				binary.LittleEndian.Uint32(snap[off+4:]) != uint32(t) ||
				binary.LittleEndian.Uint64(snap[off+8:]) != uint64(off) {
				return false
			}
		}
		if off == 0 || off == (len(snap)/2)/chunk*chunk || end == len(snap) {
			lo := min(16, end-off)
			if string(snap[off+lo:end]) != string(src[lo:end-off]) {
				return false
			}
		}
	}
	return true
}

// run plays l on stores made by factory and measures it.
func run(tb testing.TB, l load, factory kvstorage.Factory) result {
	tb.Helper()
	ctx := context.Background()
	src := make([]byte, chunk)
	for i := range src {
		src[i] = byte(i*31 + 7)
	}
	growth := l.growth()
	stores := make([]kvstorage.Store, l.sessions)
	for i := range stores {
		s, err := factory(ctx)
		require.NoError(tb, err)
		stores[i] = s
	}
	settle()
	rss0, heap0, gc0 := rss(tb), heapBytes(), gcCPU()
	var r result
	sizes := make([]int, l.sessions)
	for t := range l.turns {
		if t == l.resetAt {
			r.rssBeforeReset = rss(tb) - rss0
			for i, s := range stores {
				if i%3 != 0 {
					continue
				}
				r.resetHeld += int64(s.Cap())
				start := time.Now()
				err := s.Reset(ctx)
				r.reset += time.Since(start)
				require.NoError(tb, err)
				sizes[i] = 0
			}
			r.rssAfterReset = rss(tb) - rss0
		}
		for i, s := range stores {
			sizes[i] += growth[i][t]
			size := sizes[i]
			start := time.Now()
			buf, err := s.Prepare(ctx, size)
			if err == nil {
				fill(buf, src, i, t)
				err = s.Commit(ctx, size)
			}
			r.prepareFillCommit += time.Since(start)
			if err != nil {
				// Kronk resets a store whose snapshot failed; the conversation goes on.
				require.ErrorIs(tb, err, accounting.ErrBudgetExceeded)
				require.NoError(tb, s.Reset(ctx))
				r.refused++
				continue
			}
			snap, err := s.Bytes(ctx)
			require.NoError(tb, err)
			if !check(snap, src, i, t, size) {
				r.wrong++
			}
			r.snapshots++
		}
		r.peakRSS = max(r.peakRSS, rss(tb)-rss0)
		r.peakHeap = max(r.peakHeap, heapBytes()-heap0)
	}
	r.gcCPU = gcCPU() - gc0
	for _, s := range stores {
		require.NoError(tb, s.Close())
	}
	settle()
	return r
}

// settle collects the garbage and gives freed heap back to the OS, so that one
// store's leftovers do not count against the next.
func settle() {
	runtime.GC()
	debug.FreeOSMemory()
}

// rss returns the process's resident set size.
func rss(tb testing.TB) int64 {
	b, err := os.ReadFile("/proc/self/statm")
	require.NoError(tb, err)
	fields := strings.Fields(string(b))
	require.GreaterOrEqual(tb, len(fields), 2)
	pages, err := strconv.ParseInt(fields[1], 10, 64)
	require.NoError(tb, err)
	return pages * int64(os.Getpagesize())
}

func readMetric(name string) metrics.Value {
	s := []metrics.Sample{{Name: name}}
	metrics.Read(s)
	return s[0].Value
}

// heapBytes returns the Go heap's object bytes, live and not yet swept.
func heapBytes() int64 { return int64(readMetric("/memory/classes/heap/objects:bytes").Uint64()) }

// gcCPU returns the CPU time the GC has spent, in all.
func gcCPU() time.Duration {
	return time.Duration(readMetric("/cpu/classes/gc/total:cpu-seconds").Float64() * float64(time.Second))
}

// newSnapshotFactory returns a snapshot factory under limit (0: none), as Kronk's
// store factory, and a function that closes it.
func newSnapshotFactory(tb testing.TB, limit int64, opts snapshot.Options) (kvstorage.Factory, *snapshot.Factory) {
	tb.Helper()
	g := accounting.NewGovernor()
	if limit > 0 {
		require.NoError(tb, g.SetLimit(accounting.HostKey, limit))
	}
	f, err := snapshot.NewFactory(g, opts)
	require.NoError(tb, err)
	tb.Cleanup(func() { assert.NoError(tb, f.Close()) })
	return kronk.Factory(f), f
}

const mib = 1 << 20

// TestIMCEmulation runs a small IMC load on both stores: no snapshot is ever
// wrong, Reset gives the snapshot store's memory back to its budget, and under a
// budget below the sum of the peaks the snapshot store refuses while the total
// stays within it.
func TestIMCEmulation(t *testing.T) {
	l := load{sessions: 6, turns: 8, minGrowth: 100 << 10, maxGrowth: 300 << 10, resetAt: 4, seed: 1}
	r := run(t, l, ram.NewFactory())
	assert.Zero(t, r.wrong)
	assert.Equal(t, l.sessions*l.turns, r.snapshots)

	factory, f := newSnapshotFactory(t, 0, snapshot.Options{Granularity: chunk})
	r = run(t, l, factory)
	assert.Zero(t, r.wrong)
	assert.Equal(t, l.sessions*l.turns, r.snapshots)
	assert.Positive(t, r.resetHeld)
	assert.Zero(t, f.Authority().Stats().Owned)

	l.limit = l.peaks() / 2
	factory, f = newSnapshotFactory(t, l.limit, snapshot.Options{Granularity: chunk})
	r = run(t, l, factory)
	assert.Zero(t, r.wrong)
	assert.Positive(t, r.refused, "a budget of half the peaks refused nothing")
	assert.Equal(t, l.sessions*l.turns, r.snapshots+r.refused)
	assert.LessOrEqual(t, f.Authority().Governor().Stats(accounting.HostKey).Peak, l.limit)
}

// BenchmarkIMC runs the IMC load of 64 sessions of a 7B-class model's KV state,
// each growing by 1-3 MiB a turn over 40 turns, a third of them reset and reused
// from turn 20, on Kronk's RAM store and on a snapshot store (Private, 2 MiB
// granules, huge pages where the system has them: the default) in each iteration,
// and reports both and their ratios; without a budget also on a snapshot store of
// small pages (NoHugePages), reported as small. budget=none
// runs without a budget; budget=60% gives the snapshot store 60% of the sum of the
// sessions' peaks (the RAM store has no budget to give). Run it with
// -benchtime=1x: one iteration takes minutes and up to 8.5 GiB (the RAM store's peak).
func BenchmarkIMC(b *testing.B) {
	base := load{sessions: 64, turns: 40, minGrowth: 1 * mib, maxGrowth: 3 * mib, resetAt: 20, seed: 26}
	for _, budget := range []int{0, 60} {
		name := "budget=none"
		l := base
		if budget > 0 {
			name = fmt.Sprintf("budget=%d%%", budget)
			l.limit = l.peaks() * int64(budget) / 100
		}
		b.Run(name, func(b *testing.B) {
			var ramR, snapR, smallR result
			var peakLedger int64
			for b.Loop() {
				ramR = run(b, l, ram.NewFactory())
				factory, f := newSnapshotFactory(b, l.limit, snapshot.Options{})
				snapR = run(b, l, factory)
				if l.limit == 0 {
					factory, _ := newSnapshotFactory(b, 0, snapshot.Options{NoHugePages: true})
					smallR = run(b, l, factory)
				}
				peakLedger = f.Authority().Governor().Stats(accounting.HostKey).Peak
				if ramR.wrong+snapR.wrong != 0 {
					b.Fatalf("wrong snapshots: ram %d, snapshot %d", ramR.wrong, snapR.wrong)
				}
				if l.limit > 0 && peakLedger > l.limit {
					b.Fatalf("the snapshot store's total %d exceeded its budget %d", peakLedger, l.limit)
				}
			}
			report(b, "ram", ramR)
			report(b, "snap", snapR)
			b.ReportMetric(float64(snapR.prepareFillCommit)/float64(ramR.prepareFillCommit), "pfc-snap/ram")
			b.ReportMetric(float64(snapR.reset)/float64(ramR.reset), "reset-snap/ram")
			b.ReportMetric(float64(l.peaks())/mib, "sum-peaks-MiB")
			if l.limit == 0 {
				report(b, "small", smallR)
				b.ReportMetric(float64(smallR.prepareFillCommit)/float64(ramR.prepareFillCommit), "pfc-small/ram")
				b.ReportMetric(float64(smallR.reset)/float64(ramR.reset), "reset-small/ram")
			}
			if l.limit > 0 {
				b.ReportMetric(float64(l.limit)/mib, "budget-MiB")
				b.ReportMetric(float64(peakLedger)/mib, "snap-ledger-peak-MiB")
			}
		})
	}
}

// report reports r's figures under prefix.
func report(b *testing.B, prefix string, r result) {
	b.ReportMetric(float64(r.prepareFillCommit.Milliseconds()), prefix+"-pfc-ms")
	b.ReportMetric(float64(r.reset.Microseconds()), prefix+"-reset-us")
	b.ReportMetric(float64(r.resetHeld)/mib, prefix+"-reset-held-MiB")
	b.ReportMetric(float64(r.peakRSS)/mib, prefix+"-peak-rss-MiB")
	b.ReportMetric(float64(r.rssBeforeReset-r.rssAfterReset)/mib, prefix+"-rss-drop-MiB")
	b.ReportMetric(float64(r.peakHeap)/mib, prefix+"-peak-heap-MiB")
	b.ReportMetric(float64(r.gcCPU.Milliseconds()), prefix+"-gc-cpu-ms")
	b.ReportMetric(float64(r.refused), prefix+"-refused")
}
