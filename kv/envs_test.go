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
//   - openEnv(t, opts...) is the one constructor of a test's backing and cache: a
//     backing (onFake unless an option names another) with its ledger and
//     governor, a cache (env.c) unless noCache, and a prefix cache over it (env.pc)
//     with withPrefixCache; env.cache makes more caches on the same backing and
//     env.tryCache returns kv.New's error. The test's cleanup gives back, in
//     order, what env.onFail names (the sequences and prefixes the test still
//     holds), the prefix cache, the caches (a test may close env.c and env.pc
//     itself), the backing, and checks the books: ledger and governor at zero,
//     nothing left in the backing. env.finish does all that sooner; env.books
//     checks the books at any quiet moment.
//   - A scenario runs over backings by table: onEachSharing runs it on a fresh env
//     of each sharing backing and layout; or for kind := range sharingBackings,
//     named sharingNames[kind]. openEnv skips the test where its backing is not on
//     this system.
//   - Data: writeTokens and checkTokens (tryWrite, tryCheck) write and check each
//     writer's pattern, over eachToken; writeOrRefuse checks Writable as it writes;
//     promptIDs, prefilled and serve drive a prefix cache; goWorkers runs workers.

// backingKind is the backing an env's caches run on; each is an envOption. The three
// that share come first, so that a test runs a scenario on each with `for kind :=
// range sharingBackings`.
type backingKind int

const (
	onShared        backingKind = iota // host.Shared (memfd pool)
	onCUDA                             // cuda on its fake driver (or withCUDA's Driver)
	onFake                             // backingtest.Fake under ByBacking (sharing): the default
	sharingBackings                    // the count of the backings above, which share
	// onPrivate is host.Private, which charges by buffer (the cache's
	// Config.Authority, set by the env) and can not share.
	onPrivate = sharingBackings
)

func (k backingKind) apply(sp *envSpec) { sp.kind = k }

// backingNames names each backing kind; sharingNames those that share.
var (
	backingNames = [...]string{"host.Shared", "cuda", "backingtest.Fake", "host.Private"}
	sharingNames = backingNames[:sharingBackings]
)

// envGranule is every env's granule unless withGranule says otherwise: a Blocked
// block of tiny8's 3 KiB tokens leaves bytes free at its end, and a PerLayer tensor
// holds 8 tokens per granule.
const envGranule = 4 << 10

// envGranuleOf returns the granule of backing kind: envGranule, but host.Shared on
// Windows maps views at the 64 KiB allocation granularity and can not go below it,
// and host.Private's granule is a whole number of pages.
func envGranuleOf(kind backingKind) int {
	switch {
	case kind == onShared && runtime.GOOS == "windows":
		return 64 << 10
	case kind == onPrivate:
		return max(envGranule, os.Getpagesize())
	}
	return envGranule
}

// scaleOf is the factor a scaled env multiplies its Model's bytes per token and its
// limit by on kind: its granule over envGranule, at least 1. A test that sizes a
// tier or an eviction in bytes scales them by it too.
func scaleOf(kind backingKind) int {
	return max(1, envGranuleOf(kind)/envGranule)
}

// faultInjector is what a test uses of a backingtest.Faulty, whatever its R.
type faultInjector interface {
	FailAt(n int, err error)
	FailOp(op backingtest.Op, n int, err error)
	Calls() int
	Reset()
}

// An envOption sets what openEnv builds: a backingKind, or one of the options below.
type envOption interface{ apply(*envSpec) }

type envFunc func(*envSpec)

func (f envFunc) apply(sp *envSpec) { f(sp) }

// The env's options besides its backingKind. Every one left out takes a default.
var (
	// noCache builds the backing alone: the test makes its caches with env.cache.
	noCache envOption = envFunc(func(sp *envSpec) { sp.noCache = true })
	// withFaults has the caches reach the backing through a backingtest.Faulty
	// (env.faults).
	withFaults envOption = envFunc(func(sp *envSpec) { sp.faulty = true })
	// scaled: where the backing's granule is k times envGranule (host.Shared on
	// Windows), the cache's Model's head dims and the limit are k times larger, so
	// that a granule holds as many tokens on every backing and the test's token
	// figures hold on each.
	scaled envOption = envFunc(func(sp *envSpec) { sp.scaled = true })
	// pooled has host.Shared keep up to 16 idle granules, and cuda 2 to 16 refilled
	// in the background: pools as a server runs them.
	pooled envOption = envFunc(func(sp *envSpec) {
		sp.shared.High = 16
		sp.cuda.High, sp.cuda.Low, sp.cuda.Background = 16, 2, true
	})
)

// withConfig makes env.c of cfg; a zero Model is tiny8, and onPrivate's Authority
// is the env's.
func withConfig(cfg kv.Config) envOption { return envFunc(func(sp *envSpec) { sp.cfg = cfg }) }

// withLimit sets the governor's limit on the backing's device; 0: none.
func withLimit(n int64) envOption { return envFunc(func(sp *envSpec) { sp.limit = n }) }

// withGranule sets the backing's granule; 0: envGranuleOf(kind), or a given driver's.
func withGranule(n int) envOption { return envFunc(func(sp *envSpec) { sp.granule = n }) }

// withShared and withCUDA (and withPrivate, envs_linux_test.go) give the rest of a
// backing's options: the env sets their Granularity, Authority and Name, and a nil
// cuda.Driver is a fake driver of the env's granule whose leaks the env's finish
// checks.
func withShared(o host.SharedOptions) envOption { return envFunc(func(sp *envSpec) { sp.shared = o }) }

func withCUDA(o cuda.Options) envOption { return envFunc(func(sp *envSpec) { sp.cuda = o }) }

// withDefaultAhead makes the env's caches with map-ahead as the library defaults
// it (on where the backing pools). Without it, map-ahead is off unless the test's
// Config asks for it (MapAhead): the tests written when it was off by default count
// exact books of what the sequences hold.
var withDefaultAhead envOption = envFunc(func(sp *envSpec) { sp.defaultAhead = true })

// withPrefixCache makes env.pc, a prefix cache of o over env.c.
func withPrefixCache(o kv.PrefixCacheOptions) envOption {
	return envFunc(func(sp *envSpec) { sp.pc, sp.pcOpts = true, o })
}

// envSpec is what the options ask openEnv for.
type envSpec struct {
	kind    backingKind
	cfg     kv.Config
	noCache bool
	granule int
	limit   int64
	faulty  bool
	auth    *accounting.Authority
	name    string
	shared  host.SharedOptions
	cuda    cuda.Options
	private host.PrivateOptions
	scaled  bool
	pc      bool
	pcOpts  kv.PrefixCacheOptions
	// defaultAhead: withDefaultAhead
	defaultAhead bool
}

// specOf returns the spec opts ask for, on onFake unless one names a backing.
func specOf(opts []envOption) envSpec {
	sp := envSpec{kind: onFake}
	for _, o := range opts {
		o.apply(&sp)
	}
	return sp
}

// env is a cache on one backing, with what tests look at.
type env struct {
	name   string
	kind   backingKind
	c      *kv.Cache             // nil with noCache
	pc     *kv.PrefixCache       // nil without withPrefixCache
	gov    *accounting.Governor  // nil withAuthority
	auth   *accounting.Authority // the ledger
	pool   backing.Pool          // the backing's pool; nil for the Fake and host.Private
	faults faultInjector         // nil without withFaults
	memfd  string                // host.Shared's memfd name, else ""
	shared *host.Shared          // the backing, when it is host.Shared
	fake   *backingtest.Fake     // the backing, when it is backingtest.Fake
	// mk makes a cache of cfg on the backing (through the Faulty when there is one).
	mk func(cfg kv.Config) (*kv.Cache, error)
	// defaultAhead: the caches map ahead as the library defaults (withDefaultAhead)
	defaultAhead bool
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

// onEachSharing runs run on a fresh env of opts on each backing that shares, in each
// layout (the backing and cfg.Layout set so, subtests named backing/layout),
// skipping a backing this system lacks: the way a scenario runs over backings by
// table.
func onEachSharing(t *testing.T, opts []envOption, run func(t *testing.T, e *env)) {
	for kind := range sharingBackings {
		for _, layout := range layouts {
			t.Run(sharingNames[kind]+"/"+layout.String(), func(t *testing.T) {
				sp := specOf(opts)
				sp.kind, sp.cfg.Layout = kind, layout
				if layout != kv.Blocked {
					sp.cfg.BlockTokens = 0 // a block asked for is the Blocked runs'
				}
				run(t, openSpec(t, sp))
			})
		}
	}
}

// openEnv builds the env opts ask for: the one constructor of the tests' caches and
// backings. It skips the test where the backing does not exist on this system
// (host.Shared off Linux and Windows, a driver without a GPU). The test's cleanup
// closes the prefix cache, the cache and the backing and checks that the ledger,
// the governor and the backing hold nothing (see finish), after every cleanup
// registered later: a test may call finish itself to check the books sooner.
func openEnv(t testing.TB, opts ...envOption) *env {
	t.Helper()
	return openSpec(t, specOf(opts))
}

// openSpec is openEnv of sp.
func openSpec(t testing.TB, sp envSpec) *env {
	t.Helper()
	if k := scaleOf(sp.kind); sp.scaled && sp.granule == 0 && k > 1 {
		sp.cfg.Model, sp.limit = scaledModel(sp.cfg.Model, k), sp.limit*int64(k)
	}
	e := &env{name: backingNames[sp.kind], kind: sp.kind, auth: sp.auth, defaultAhead: sp.defaultAhead, quiet: func() {}, leaks: func() error { return nil }, closeBacking: func() error { return nil }}
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
	skip := func(err error) {
		if errors.Is(err, errors.ErrUnsupported) {
			t.Skipf("%s: %v", e.name, err)
		}
		require.NoError(t, err)
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
		skip(err)
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
		skip(err)
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
		skip(err)
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
		if e.pc != nil {
			_ = e.pc.Close()
		}
		if e.c != nil {
			_ = e.c.Close() // NB: the test failed already; this only stops what runs
		}
		_ = e.closeBacking()
	})
	if !sp.noCache {
		var err error
		e.c, err = e.tryCache(sp.cfg)
		require.NoError(t, err)
		if sp.pc {
			e.pc, err = kv.NewPrefixCache(e.c, sp.pcOpts)
			require.NoError(t, err)
		}
	}
	return e
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
	c, err := e.tryCache(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, c.Close()) })
	return c
}

// tryCache returns kv.New of cfg (a zero Model is tiny8) on e's backing: for a
// test of what New refuses, or one that closes the cache itself (it MUST, before
// e's finish).
func (e *env) tryCache(cfg kv.Config) (*kv.Cache, error) {
	cfg = withTiny8(cfg)
	if !e.defaultAhead && !cfg.MapAhead {
		cfg.NoMapAhead = true // NB: see withDefaultAhead
	}
	return e.mk(cfg)
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

// finish closes the prefix cache, the cache and the backing and checks that nothing is left: the
// ledger and governor at zero, and no granule, reservation or mapping in the backing.
func (e *env) finish(t testing.TB) {
	t.Helper()
	if e.faults != nil {
		e.faults.Reset()
	}
	if e.pc != nil {
		if err := e.pc.Close(); !errors.Is(err, kv.ErrClosed) {
			require.NoError(t, err, e.name)
		}
	}
	if e.c != nil {
		if err := e.c.Close(); !errors.Is(err, kv.ErrClosed) {
			require.NoError(t, err, e.name) // NB: a test may close env.c itself
		}
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
