package kv_test

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/cuda/cudatest"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
)

// The sharing backings a cache can run on, for tests that run the same checks on each.
const (
	onShared = iota // host.Shared (memfd pool)
	onCUDA          // cuda on its fake driver
	onFake          // backingtest.Fake under ByBacking (sharing)
	sharingBackings
)

var sharingNames = [sharingBackings]string{"host.Shared", "cuda", "backingtest.Fake"}

// envGranule is every env's granule: a Blocked block of tiny8's 3 KiB tokens leaves
// bytes free at its end, and a PerLayer tensor holds 8 tokens per granule.
const envGranule = 4 << 10

// envGranuleOf returns the granule of backing kind: envGranule, but host.Shared on
// Windows maps views at the 64 KiB allocation granularity and can not go below it.
func envGranuleOf(kind int) int {
	if kind == onShared && runtime.GOOS == "windows" {
		return 64 << 10
	}
	return envGranule
}

// faultInjector is what a test uses of a backingtest.Faulty, whatever its R.
type faultInjector interface {
	FailAt(n int, err error)
	FailOp(op backingtest.Op, n int, err error)
	Calls() int
	Reset()
}

// env is a cache on one sharing backing, with what tests look at.
type env struct {
	name   string
	c      *kv.Cache
	gov    *accounting.Governor
	auth   *accounting.Authority // the backing's ledger (ByBacking)
	pool   backing.Pool          // the backing's pool; nil for the Fake
	faults faultInjector         // nil unless faulty
	memfd  string                // host.Shared's memfd name, else ""
	// quiet waits out background work in the backing, so its books can be read.
	quiet func()
	// closeBacking closes the backing after the cache; leaks reports what the backing
	// itself says is left after that.
	closeBacking func() error
	leaks        func() error
	// finished says that finish closed the backing; until then the test's cleanup
	// runs undo (last first), then closes the cache and the backing.
	finished bool
	undo     []func()
}

// onFail has the test's cleanup run f when the test ends before finish closed the
// backing: f gives back what the test holds (a sequence, a prefix), so that the
// backing can close and stop its goroutines even after a failure.
func (e *env) onFail(f func()) { e.undo = append(e.undo, f) }

var envSeq atomic.Int64

// newEnv returns a cache of tiny8 tokens on backing kind (one of onShared, onCUDA,
// onFake) in layout with blocks of blockTokens (Config.BlockTokens), under a governor
// limit of limit bytes (0: none), wrapped in a backingtest.Faulty when faulty. ok is false where the backing does not exist on
// this system (host.Shared off Linux and Windows). The caller MUST call finish, which
// checks the books; a test that fails before it still has the cache and the backing
// closed by a cleanup, so that no goroutine of theirs outlives the test.
func newEnv(t testing.TB, kind int, layout kv.Layout, blockTokens, maxTokens int, limit int64, faulty bool) (e *env, ok bool) {
	t.Helper()
	e = &env{name: sharingNames[kind], gov: accounting.NewGovernor(), quiet: func() {}}
	if limit > 0 {
		require.NoError(t, e.gov.SetLimit(accounting.HostKey, limit))
		require.NoError(t, e.gov.SetLimit(accounting.GPU(0), limit))
	}
	cfg := kv.Config{Geometry: tiny8, MaxTokens: maxTokens, Layout: layout, BlockTokens: blockTokens}
	var err error
	switch kind {
	case onShared:
		e.auth = e.gov.Authority("shared", accounting.HostKey)
		e.memfd = fmt.Sprintf("vmkv-%d-%d", os.Getpid(), envSeq.Add(1))
		b, nerr := host.NewShared(host.SharedOptions{Granularity: envGranuleOf(kind), Authority: e.auth, Name: e.memfd, High: 16})
		if errors.Is(nerr, errors.ErrUnsupported) {
			return nil, false
		}
		require.NoError(t, nerr)
		e.pool, e.closeBacking = b, b.Close
		e.leaks = func() error {
			if m := mapsOf(t, "/memfd:"+e.memfd+" "); len(m) > 0 {
				return fmt.Errorf("%d mappings of the memfd left: %s", len(m), m[0])
			}
			return nil
		}
		e.c, err = newCache(b, cfg, faulty, &e.faults)
	case onCUDA:
		e.auth = e.gov.Authority("cuda", accounting.GPU(0))
		f := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{Granularity: envGranule, Memory: 1 << 30})
		b, nerr := cuda.New(cuda.Options{Authority: e.auth, Driver: f.Driver(), High: 16, Low: 2, Background: true})
		require.NoError(t, nerr)
		e.pool, e.closeBacking, e.leaks, e.quiet = b, b.Close, f.CheckLeaks, b.Quiesce
		e.c, err = newCache(b, cfg, faulty, &e.faults)
	case onFake:
		e.auth = e.gov.Authority("fake", accounting.HostKey)
		f := backingtest.NewFake(backingtest.FakeOptions{Granularity: envGranule, Authority: e.auth})
		e.closeBacking = func() error { return nil }
		e.leaks = func() error {
			if n, r := f.LiveGranules(), f.LiveReservations(); n+r > 0 {
				return fmt.Errorf("backingtest: %d granules and %d reservations left", n, r)
			}
			return nil
		}
		e.c, err = newCache(f, cfg, faulty, &e.faults)
	default:
		t.Fatalf("no sharing backing %d", kind)
	}
	t.Cleanup(func() {
		if e.finished {
			return
		}
		if e.faults != nil {
			e.faults.Reset()
		}
		for _, f := range slices.Backward(e.undo) {
			f()
		}
		if e.c != nil {
			_ = e.c.Close() // NB: the test failed already; this only stops what runs
		}
		_ = e.closeBacking()
	})
	require.NoError(t, err)
	return e, true
}

// newCache is kv.New on b, through a backingtest.Faulty when faulty.
func newCache[R any, B backing.Backing[R]](b B, cfg kv.Config, faulty bool, faults *faultInjector) (*kv.Cache, error) {
	if !faulty {
		return kv.New(b, cfg)
	}
	f := backingtest.NewFaulty[R](b)
	*faults = f
	return kv.New(f, cfg)
}

// books checks that the backing's pool and its ledger agree (nothing may be in flight).
func (e *env) books(t testing.TB, what string) {
	t.Helper()
	e.quiet()
	as := e.auth.Stats()
	if e.pool != nil {
		ps := e.pool.PoolStats()
		assert.Equal(t, ps.Owned, as.Owned, "%s: %s: pool owned vs ledger", e.name, what)
		assert.Equal(t, ps.Mapped, as.Mapped, "%s: %s: pool mapped vs ledger", e.name, what)
	}
	assert.Equal(t, as.Owned, e.gov.Stats(e.auth.Device()).Used, "%s: %s: ledger vs governor", e.name, what)
}

// finish closes the cache and the backing and checks that nothing is left: the
// ledger and governor at zero, and no granule, reservation or mapping in the backing.
func (e *env) finish(t testing.TB) {
	t.Helper()
	if e.faults != nil {
		e.faults.Reset()
	}
	require.NoError(t, e.c.Close(), e.name)
	e.books(t, "closed cache")
	require.NoError(t, e.closeBacking(), e.name)
	e.finished = true
	as := e.auth.Stats()
	assert.Zero(t, as.Owned, "%s: owned bytes after Close", e.name)
	assert.Zero(t, as.Mapped, "%s: mapped bytes after Close", e.name)
	assert.Zero(t, e.gov.Stats(e.auth.Device()).Used, "%s: governor", e.name)
	assert.NoError(t, e.leaks(), e.name)
}

// mapsOf returns the lines of /proc/self/maps that contain s.
func mapsOf(t testing.TB, s string) []string {
	t.Helper()
	raw, err := os.ReadFile("/proc/self/maps")
	if errors.Is(err, os.ErrNotExist) {
		return nil // no /proc: nothing to check here
	}
	require.NoError(t, err)
	var out []string
	for _, line := range strings.Split(string(raw), "\n") {
		if strings.Contains(line, s) {
			out = append(out, line)
		}
	}
	return out
}
