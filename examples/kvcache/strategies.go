package main

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"strings"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/internal/baseline"
	"github.com/vmarena/vmarena/kv"
)

// Strategy names, in the order they run.
const (
	nameCache  = "vmarena"
	nameEager  = "eager"
	namePaged  = "paged"
	nameAppend = "append"
)

var allStrategies = []string{nameCache, nameEager, namePaged, nameAppend}

// Backing names for -backing.
var backings = []string{"shared", "private", "cuda"}

// defaultBacking is the shared host backing where it exists (Linux: it needs
// memfd_create) and private host memory elsewhere.
var defaultBacking = func() string {
	if runtime.GOOS == "linux" {
		return "shared"
	}
	return "private"
}()

// setup is what every strategy is built from.
type setup struct {
	model kv.Model // a uniform model: the shape of every layer's K and V
	// groups is, for a model of layer groups (-model gpt-oss-20b), the model vmarena's
	// cache is built on (kv.Config.Model); nil for a uniform model.
	groups    *kv.Model
	notes     []string // what the flags' defaults gave up for groups, for the header
	backing   string
	layout    kv.Layout
	runTokens int // kv.Config.RunTokens
	granule   int // 0: the backing's default
	populate  bool
	huge      bool
	poolLow   int // idle granules the pool refills to in the background
	poolHigh  int // most idle granules the pool keeps (0: see high)
	mapAhead  bool
	maxTokens int
	budget    int64 // bytes; 0: unlimited

	metrics *metricsServer // -metrics: serves the strategy replaying; nil: none
	tiers   *tierSetup     // -tiers: the prefix cache's tiers; nil: none
}

// high is the pool's High water mark: -pool-high, or else as many granules as the
// budget holds, so that decay rather than a water mark decides how long idle memory
// stays (a busy replay keeps its granules warm, an idle one gives them back within
// seconds), or max(poolLow, 64) without a budget.
func (s setup) high() int {
	if s.poolHigh > 0 {
		return s.poolHigh
	}
	if s.budget > 0 {
		g := s.granule
		if g == 0 {
			g = 2 << 20 // the shared and CUDA backings' usual granule
		}
		return max(s.poolLow, int(s.budget/int64(g)))
	}
	return max(s.poolLow, 64)
}

func (s setup) shape() baseline.Shape {
	return baseline.Shape{Layers: s.model.Layers, TokenBytes: s.model.Groups[0].TokenBytes(), MaxTokens: s.maxTokens}
}

// built is a strategy ready to replay, with the governor that bounds it.
type built struct {
	st  baseline.Strategy
	gov *accounting.Governor
	dev accounting.DeviceKey
	// pool reports the cache's pool after Close (nil for the baselines and for
	// backings without a pool).
	pool func() *backing.PoolStats
}

// newGovernor returns a governor with s.budget on dev and an authority there.
func (s setup) newGovernor(name string, dev accounting.DeviceKey) (*accounting.Governor, *accounting.Authority, error) {
	g := accounting.NewGovernor()
	if s.budget > 0 {
		if err := g.SetLimit(dev, s.budget); err != nil {
			return nil, nil, err
		}
	}
	return g, g.Authority(name, dev), nil
}

// build makes the strategy called name (vmarena's twin with map-ahead off too: see
// noahead.go).
func build(name string, s setup) (*built, error) {
	base, off := splitAhead(name)
	if off {
		s.mapAhead = false
	}
	dev := accounting.HostKey
	if base == nameCache && s.backing == "cuda" {
		dev = accounting.GPU(0)
	}
	gov, auth, err := s.newGovernor(name, dev)
	if err != nil {
		return nil, err
	}
	b := &built{gov: gov, dev: dev}
	switch base {
	case nameEager:
		b.st, err = baseline.NewEager(s.shape(), baseline.EagerOptions{Authority: auth})
	case namePaged:
		o := baseline.PagedOptions{Authority: auth}
		if s.groups != nil {
			// Sliding windows: groupsOnly let paged run only where it can model them.
			var ok bool
			if o.Windows, ok = pagedWindows(s.groups); !ok {
				return nil, fmt.Errorf("strategy %s can not model %s (%s)", name, s.groups.Name, groupKinds(*s.groups))
			}
		}
		if s.budget > 0 {
			// Chunks of at most a sixteenth of the budget, so that the last chunk does
			// not strand much of it. A block holds one layer group: ask a pool that
			// allocates nothing its size.
			probe, perr := baseline.NewPaged(s.shape(), o)
			if perr != nil {
				return nil, perr
			}
			block := int64(probe.BlockBytes())
			_ = probe.Close()
			o.ChunkBlocks = int(max(1, min(baseline.DefaultChunkBytes, s.budget/16)/block))
		}
		b.st, err = baseline.NewPaged(s.shape(), o)
	case nameAppend:
		b.st, err = baseline.NewAppend(s.shape(), baseline.AppendOptions{Authority: auth})
	case nameCache:
		err = s.buildCache(b, auth, name)
	default:
		err = fmt.Errorf("unknown strategy %q (known: %s)", name, strings.Join(allStrategies, ", "))
	}
	if err != nil {
		return nil, err
	}
	return b, nil
}

// warnings is the caches' logger: what kv logs at Warn (a range it could not give
// back, a tier's value that failed its check, with why) goes to stderr; its eviction
// summaries (Info, Debug) are the report's counters already.
var warnings = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))

// buildCache puts a kv.Cache on the chosen backing, a strategy called name. Only the
// backing's constructor differs: the cache names no backing type.
func (s setup) buildCache(b *built, auth *accounting.Authority, name string) error {
	cfg := kv.Config{Model: s.model, MaxTokens: s.maxTokens, Layout: s.layout, RunTokens: s.runTokens, NoMapAhead: !s.mapAhead, Logger: warnings}
	if s.groups != nil {
		cfg.Model = *s.groups
	}
	var (
		c     *kv.Cache
		pool  backing.Pool
		close func() error
		err   error
	)
	switch s.backing {
	case "shared":
		var bk *host.Shared
		if bk, err = host.NewShared(host.SharedOptions{Granularity: s.granule, Authority: auth, Populate: s.populate, Name: "kvcache",
			Low: s.poolLow, High: s.high(), NoHugePages: !s.huge}); err == nil {
			pool, close = bk, bk.Close
			c, err = kv.New(bk, cfg)
		}
	case "private":
		var bk *host.Private
		if bk, err = host.NewPrivate(host.PrivateOptions{Granularity: s.granule, Populate: s.populate, Name: "kvcache", NoHugePages: !s.huge}); err == nil {
			cfg.Authority = auth
			c, err = kv.New(bk, cfg)
		}
	case "cuda":
		var bk *cuda.Backing
		if bk, err = cuda.New(cuda.Options{Authority: auth, Low: s.poolLow, High: s.high(), Background: s.poolLow > 0}); err == nil {
			pool, close = bk, bk.Close
			c, err = kv.New(bk, cfg)
		}
	default:
		return fmt.Errorf("unknown backing %q (known: %s)", s.backing, strings.Join(backings, ", "))
	}
	if err != nil {
		if close != nil {
			_ = close()
		}
		return fmt.Errorf("backing %s: %w", s.backing, err)
	}
	cs := newCacheStrategy(name, c, pool, auth, close)
	if s.groups != nil {
		if cs.groups, err = newGroupMeter(c, *s.groups); err != nil {
			return errors.Join(fmt.Errorf("backing %s: %w", s.backing, err), cs.Close())
		}
	}
	b.st, b.pool = cs, cs.poolAfterClose
	return nil
}
