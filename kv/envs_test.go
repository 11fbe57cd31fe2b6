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
	"github.com/vmarena/vmarena/internal/testutil"
	"github.com/vmarena/vmarena/kv"
)

// The tests' harness (this file and harness_test.go):
//
//   - openEnv(t, envSpec{...}) is the one constructor of a test's backing and cache:
//     a backing of envSpec.kind with its ledger and governor, and a cache (env.c)
//     unless noCache; env.cache makes more on the same backing. The test's cleanup
//     closes them and checks the books; env.finish checks them sooner, env.books at
//     any quiet moment, and env.onFail gives back what a failed test still holds.
//   - Its thin forms: newEnv (a sharing backing by kind), newFixture and
//     faultyFixture (backingtest.Fake; fx.cache), and on host.Shared of 64 KiB
//     granules openHost, newHostCache, hostCacheOf, sharedPool and
//     newHostPrefixCache; newCUDACache (a given driver) and newPrivateCache.
//   - A scenario runs over backings by table: onEachSharing runs it on a fresh env
//     of each sharing backing and layout; or for kind := range sharingBackings,
//     named sharingNames[kind], skipping where openEnv says the backing is not here.
//   - Data: writeTokens and checkTokens (tryWrite, tryCheck) write and check each
//     writer's pattern, over eachToken; writeOrRefuse checks Writable as it writes;
//     promptIDs, prefilled and serve drive a prefix cache; goWorkers runs workers.

// The backings a test cache can run on (envSpec.kind): the three that share come
// first, so that a test runs a scenario on each with `for kind := range
// sharingBackings`.
const (
	onShared        = iota // host.Shared (memfd pool)
	onCUDA                 // cuda on its fake driver (or envSpec.cuda.Driver)
	onFake                 // backingtest.Fake under ByBacking (sharing)
	sharingBackings        // the count of the backings above, which share
	// onPrivate is host.Private, which charges by buffer (the cache's
	// Config.Authority, set by the env) and can not share.
	onPrivate = sharingBackings
)

// backingNames names each backing kind; sharingNames those that share.
var (
	backingNames = [...]string{"host.Shared", "cuda", "backingtest.Fake", "host.Private"}
	sharingNames = backingNames[:sharingBackings]
)

// envGranule is every env's granule unless envSpec.granule says otherwise: a Blocked
// block of tiny8's 3 KiB tokens leaves bytes free at its end, and a PerLayer tensor
// holds 8 tokens per granule.
const envGranule = 4 << 10

// envGranuleOf returns the granule of backing kind: envGranule, but host.Shared on
// Windows maps views at the 64 KiB allocation granularity and can not go below it,
// and host.Private's granule is a whole number of pages.
func envGranuleOf(kind int) int {
	switch {
	case kind == onShared && runtime.GOOS == "windows":
		return 64 << 10
	case kind == onPrivate:
		return max(envGranule, os.Getpagesize())
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

// envSpec is what openEnv builds: a backing of kind, its ledger and governor, and a
// cache of cfg on it. Only kind is needed; every other zero field takes a default.
type envSpec struct {
	kind int       // onShared, onCUDA, onFake or onPrivate
	cfg  kv.Config // the cache's; a zero Model is tiny8, and onPrivate's Authority is the env's
	// noCache builds the backing alone: the test makes its caches with env.cache.
	noCache bool
	granule int   // the backing's granule; 0: envGranuleOf(kind), or a given driver's
	limit   int64 // the governor's limit on the backing's device; 0: none
	faulty  bool  // the caches reach the backing through a backingtest.Faulty (env.faults)
	// auth is the ledger the backing (or, onPrivate, the cache) charges; nil: a new
	// governor's. With a given ledger the env knows no governor and limit is unused.
	auth *accounting.Authority
	name string // host.Shared's memfd name; "": one of the process's own
	// shared and cuda are the rest of host.Shared's and cuda's options: the env sets
	// their Granularity, Authority and Name, and a nil cuda.Driver is a fake driver of
	// granule bytes whose leaks finish checks.
	shared  host.SharedOptions
	cuda    cuda.Options
	private host.PrivateOptions // the env sets Granularity
	// scaled: where the backing's granule is k times envGranule (host.Shared on
	// Windows), cfg.Model's head dims and limit are k times larger, so that a granule
	// holds as many tokens on every backing and the test's token figures hold on each.
	scaled bool
}

// env is a cache on one backing, with what tests look at.
type env struct {
	name   string
	kind   int                   // envSpec.kind
	c      *kv.Cache             // nil with envSpec.noCache
	gov    *accounting.Governor  // nil with a given envSpec.auth
	auth   *accounting.Authority // the ledger
	pool   backing.Pool          // the backing's pool; nil for the Fake and host.Private
	faults faultInjector         // nil unless faulty
	memfd  string                // host.Shared's memfd name, else ""
	shared *host.Shared          // the backing, when it is host.Shared
	fake   *backingtest.Fake     // the backing, when it is backingtest.Fake
	// mk makes a cache of cfg on the backing (through the Faulty when there is one).
	mk func(cfg kv.Config) (*kv.Cache, error)
	// quiet waits out background work in the backing, so its books can be read.
	quiet func()
	// closeBacking closes the backing after the cache; leaks reports what the backing
	// itself says is left after that.
	closeBacking func() error
	leaks        func() error
	// finished says that finish closed the backing; until then the test's cleanup
	// runs undo (last first), then finishes: closes the cache and the backing, and
	// checks the books unless the test failed already.
	finished bool
	undo     []func()
}

// onFail has the test's cleanup run f when the test ends before finish closed the
// backing: f gives back what the test holds (a sequence, a prefix), so that the
// backing can close and stop its goroutines even after a failure.
func (e *env) onFail(f func()) { e.undo = append(e.undo, f) }

var envSeq atomic.Int64

// onEachSharing runs run on a fresh env of sp on each backing that shares, in each
// layout (sp's kind and cfg.Layout set so, subtests named backing/layout), skipping
// a backing this system lacks: the way a scenario runs over backings by table.
func onEachSharing(t *testing.T, sp envSpec, run func(t *testing.T, e *env)) {
	for kind := range sharingBackings {
		for _, layout := range layouts {
			t.Run(sharingNames[kind]+"/"+layout.String(), func(t *testing.T) {
				sp := sp
				sp.kind, sp.cfg.Layout = kind, layout
				if layout != kv.Blocked {
					sp.cfg.BlockTokens = 0 // a block asked for is the Blocked runs'
				}
				e, err := openEnv(t, sp)
				if err != nil {
					t.Skip(err)
				}
				run(t, e)
			})
		}
	}
}

// newEnv returns a cache of tiny8 tokens on backing kind (one of onShared, onCUDA,
// onFake) in layout with blocks of blockTokens (Config.BlockTokens), under a governor
// limit of limit bytes (0: none), wrapped in a backingtest.Faulty when faulty: openEnv
// with those fields. ok is false where the backing does not exist on this system.
func newEnv(t testing.TB, kind int, layout kv.Layout, blockTokens, maxTokens int, limit int64, faulty bool) (e *env, ok bool) {
	t.Helper()
	e, err := openEnv(t, envSpec{kind: kind, cfg: kv.Config{MaxTokens: maxTokens, Layout: layout, BlockTokens: blockTokens}, limit: limit, faulty: faulty,
		shared: host.SharedOptions{High: 16}, cuda: cuda.Options{High: 16, Low: 2, Background: true}})
	return e, err == nil
}

// openEnv builds sp: the one constructor of the tests' caches and backings. It
// returns an error, which wraps errors.ErrUnsupported, only where the backing does
// not exist on this system (host.Shared off Linux and Windows, a driver without a
// GPU). The test's cleanup closes the cache and the backing and checks that the
// ledger, the governor and the backing hold nothing (see finish), after every cleanup
// registered later: a test may call finish itself to check the books sooner.
func openEnv(t testing.TB, sp envSpec) (*env, error) {
	t.Helper()
	if k := envGranuleOf(sp.kind) / envGranule; sp.scaled && sp.granule == 0 && k > 1 {
		sp.cfg.Model, sp.limit = scaledModel(sp.cfg.Model, k), sp.limit*int64(k)
	}
	e := &env{name: backingNames[sp.kind], kind: sp.kind, auth: sp.auth, quiet: func() {}, leaks: func() error { return nil }, closeBacking: func() error { return nil }}
	dev := accounting.HostKey
	if sp.kind == onCUDA {
		dev = accounting.GPU(0)
	}
	if e.auth == nil {
		e.gov = accounting.NewGovernor()
		if sp.limit > 0 {
			require.NoError(t, e.gov.SetLimit(dev, sp.limit))
		}
		e.auth = e.gov.Authority(strings.ToLower(e.name), dev)
	}
	gran := sp.granule
	if gran == 0 {
		gran = envGranuleOf(sp.kind)
	}
	switch sp.kind {
	case onShared:
		e.memfd = sp.name
		if e.memfd == "" {
			e.memfd = fmt.Sprintf("vmkv-%d-%d", os.Getpid(), envSeq.Add(1))
		}
		opts := sp.shared
		opts.Granularity, opts.Authority, opts.Name = gran, e.auth, e.memfd
		b, err := host.NewShared(opts)
		if errors.Is(err, errors.ErrUnsupported) {
			return nil, err
		}
		require.NoError(t, err)
		e.pool, e.shared, e.closeBacking = b, b, b.Close
		e.leaks = func() error {
			if m := testutil.MapsWith(t, "/memfd:"+e.memfd+" "); len(m) > 0 {
				return fmt.Errorf("%d mappings of the memfd left: %s", len(m), m[0])
			}
			return nil
		}
		e.mk = cacheMaker(b, sp.faulty, &e.faults)
	case onCUDA:
		opts := sp.cuda
		opts.Authority = e.auth
		if opts.Driver == nil {
			f := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{Granularity: gran, Memory: 1 << 30})
			opts.Driver, e.leaks = f.Driver(), f.CheckLeaks
		}
		b, err := cuda.New(opts)
		if errors.Is(err, errors.ErrUnsupported) {
			return nil, err
		}
		require.NoError(t, err)
		e.pool, e.closeBacking, e.quiet = b, b.Close, b.Quiesce
		e.mk = cacheMaker(b, sp.faulty, &e.faults)
	case onFake:
		f := backingtest.NewFake(backingtest.FakeOptions{Granularity: gran, Authority: e.auth})
		e.fake = f
		e.leaks = func() error {
			if n, r := f.LiveGranules(), f.LiveReservations(); n+r > 0 {
				return fmt.Errorf("backingtest: %d granules and %d reservations left", n, r)
			}
			return nil
		}
		e.mk = cacheMaker(f, sp.faulty, &e.faults)
	case onPrivate:
		opts := sp.private
		opts.Granularity = gran
		b, err := host.NewPrivate(opts)
		if errors.Is(err, errors.ErrUnsupported) {
			return nil, err
		}
		require.NoError(t, err)
		mk := cacheMaker(b, sp.faulty, &e.faults)
		e.mk = func(cfg kv.Config) (*kv.Cache, error) {
			if cfg.Authority == nil {
				cfg.Authority = e.auth // NB: host.Private charges by buffer, through the cache
			}
			return mk(cfg)
		}
	default:
		t.Fatalf("no backing %d", sp.kind)
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
		if !t.Failed() {
			e.finish(t)
			return
		}
		if e.c != nil {
			_ = e.c.Close() // NB: the test failed already; this only stops what runs
		}
		_ = e.closeBacking()
	})
	if !sp.noCache {
		var err error
		e.c, err = e.mk(withTiny8(sp.cfg))
		require.NoError(t, err)
	}
	return e, nil
}

// withTiny8 returns cfg with tiny8 for a zero Model.
func withTiny8(cfg kv.Config) kv.Config {
	if cfg.Model.Name == "" && cfg.Model.Layers == 0 && cfg.Model.Groups == nil {
		cfg.Model = tiny8
	}
	return cfg
}

// cache returns another cache of cfg (a zero Model is tiny8) on e's backing; the
// test's cleanup closes it before e's finish.
func (e *env) cache(t testing.TB, cfg kv.Config) *kv.Cache {
	t.Helper()
	c, err := e.mk(withTiny8(cfg))
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, c.Close()) })
	return c
}

// cacheMaker returns kv.New on b, through a backingtest.Faulty when faulty.
func cacheMaker[R any, B backing.Backing[R]](b B, faulty bool, faults *faultInjector) func(kv.Config) (*kv.Cache, error) {
	if !faulty {
		return func(cfg kv.Config) (*kv.Cache, error) { return kv.New(b, cfg) }
	}
	f := backingtest.NewFaulty[R](b)
	*faults = f
	return func(cfg kv.Config) (*kv.Cache, error) { return kv.New(f, cfg) }
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
	if e.gov != nil {
		assert.Equal(t, as.Owned, e.gov.Stats(e.auth.Device()).Used, "%s: %s: ledger vs governor", e.name, what)
	}
}

// finish closes the cache and the backing and checks that nothing is left: the
// ledger and governor at zero, and no granule, reservation or mapping in the backing.
func (e *env) finish(t testing.TB) {
	t.Helper()
	if e.faults != nil {
		e.faults.Reset()
	}
	if e.c != nil {
		require.NoError(t, e.c.Close(), e.name)
	}
	e.books(t, "closed cache")
	require.NoError(t, e.closeBacking(), e.name)
	e.finished = true
	as := e.auth.Stats()
	assert.Zero(t, as.Owned, "%s: owned bytes after Close", e.name)
	assert.Zero(t, as.Mapped, "%s: mapped bytes after Close", e.name)
	if e.gov != nil {
		assert.Zero(t, e.gov.Stats(e.auth.Device()).Used, "%s: governor", e.name)
	}
	assert.NoError(t, e.leaks(), e.name)
}

// scaledModel returns m with every group's head dim k times larger (its tokens k
// times the bytes), on a copy of its groups.
func scaledModel(m kv.Model, k int) kv.Model {
	m.Groups = slices.Clone(m.Groups)
	for i := range m.Groups {
		m.Groups[i].HeadDim *= k
	}
	return m
}
