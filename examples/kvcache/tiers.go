package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/internal/redisup"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/hosttier"
	"github.com/vmarena/vmarena/kvtier/redistier"
)

// namePrefixTiers is vmarena's prefix cache with the tiers of -tiers below it.
const namePrefixTiers = "vmarena+tiers"

// The tiers -tiers names.
const (
	tierHost  = "host"
	tierRedis = "redis"
)

// tierSetup is what the tier flags say, and the Redis client the replicas share.
type tierSetup struct {
	order      []string      // -tiers, in order
	hostBudget int64         // each replica's host tier; 0 without one
	wait       time.Duration // -tier-wait; 0: kv's default
	redisAddr  string        // -redis, or the address of the server started here
	replicas   int
	killAt     int  // -redis-kill-at: requests of the first replica done; 0: never
	through    bool // -tier-write-through
	minHits    int  // -tier-min-hits; 0: every block

	client redis.UniversalClient // nil without the redis tier
	keys   string                // the Redis keys' prefix: one per run
	server *redisServer          // the one started here, or nil
	book   *tierBook
	file   fileTierSetup // -tiers file (filetier.go)
}

// has reports whether -tiers names tier.
func (t *tierSetup) has(tier string) bool {
	for _, n := range t.order {
		if n == tier {
			return true
		}
	}
	return false
}

// validateTiers checks the tier flags, and sets s.tiers when -tiers is given.
func (c *config) validateTiers(s *setup) error {
	if err := c.validateFileTier(); err != nil {
		return err
	}
	if c.tiers == "" {
		for _, f := range []string{"host-tier-budget", "redis", "redis-kill-at", "replicas", "tier-wait", "tier-write-through", "tier-min-hits"} {
			if c.set[f] {
				return fmt.Errorf("-%s needs -tiers", f)
			}
		}
		return nil
	}
	t := &tierSetup{hostBudget: int64(c.hostTier), redisAddr: c.redisAddr, replicas: c.replicas, killAt: c.redisKillAt, wait: c.tierWait,
		through: c.tierThrough, minHits: c.tierMinHits}
	for _, n := range strings.Split(c.tiers, ",") {
		n = strings.TrimSpace(n)
		switch {
		case n != tierHost && n != tierRedis && n != tierFile:
			return fmt.Errorf("-tiers %q: unknown tier %q (known: %s, %s, %s)", c.tiers, n, tierHost, tierRedis, tierFile)
		case t.has(n):
			return fmt.Errorf("-tiers %q: %s twice", c.tiers, n)
		}
		t.order = append(t.order, n)
	}
	switch {
	case !c.prefix:
		return fmt.Errorf("-tiers needs a trace with token IDs (-trace %s): only the prefix-cache replay has tiers", mooncakeFlag)
	case s.layout != kv.Blocked:
		return fmt.Errorf("-tiers stores whole blocks, which only -layout %v lays out as one unit (not %v)", kv.Blocked, s.layout)
	case c.rounds > 0:
		return fmt.Errorf("-tiers can not be used with -rounds %d (each strategy replays in a process of its own)", c.rounds)
	case c.set["host-tier-budget"] && !t.has(tierHost):
		return fmt.Errorf("-host-tier-budget needs %s in -tiers", tierHost)
	case c.redisAddr != "" && !t.has(tierRedis):
		return fmt.Errorf("-redis needs %s in -tiers", tierRedis)
	case c.tierWait < 0:
		return fmt.Errorf("-tier-wait %v is negative", c.tierWait)
	case c.tierMinHits < 0:
		return fmt.Errorf("-tier-min-hits %d is negative (0 stores every block)", c.tierMinHits)
	case c.redisKillAt < 0:
		return fmt.Errorf("-redis-kill-at %d is negative", c.redisKillAt)
	case c.redisKillAt > 0 && !t.has(tierRedis):
		return fmt.Errorf("-redis-kill-at needs %s in -tiers", tierRedis)
	case c.redisKillAt > 0 && c.redisAddr != "":
		return fmt.Errorf("-redis-kill-at kills the redis-server the example starts: it can not be used with -redis %s", c.redisAddr)
	case c.replicas != 1 && c.replicas != 2:
		return fmt.Errorf("-replicas %d: want 1 or 2", c.replicas)
	case c.replicas == 2 && !t.has(tierRedis):
		return fmt.Errorf("-replicas 2 share a Redis: -tiers must name %s", tierRedis)
	}
	if c.redisAddr != "" {
		if _, _, err := net.SplitHostPort(c.redisAddr); err != nil {
			return fmt.Errorf("-redis %q: want host:port: %w", c.redisAddr, err)
		}
	}
	if t.has(tierHost) {
		if !c.set["host-tier-budget"] {
			t.hostBudget = int64(c.budget)
		}
		if t.hostBudget == 0 && c.budgetIdeal == 0 {
			return errors.New("-tiers host needs a budget: -host-tier-budget, or a -budget it copies")
		}
	} else {
		t.hostBudget = 0
	}
	t.file = fileTierSetup{dir: c.fileTier}
	s.tiers = t
	return nil
}

// connect makes the Redis client the replicas share, starting a redis-server on a
// free 127.0.0.1 port when -redis gave no address. The client and the server MUST be
// released with close.
func (t *tierSetup) connect() error {
	t.book = newTierBook()
	if !t.has(tierRedis) {
		return nil
	}
	if t.redisAddr == "" {
		srv, err := startRedis()
		if err != nil {
			return err
		}
		t.server, t.redisAddr = srv, srv.addr
	}
	// The tier counts every failure (a server down is a miss or a dropped store):
	// go-redis's own lines about them would only interleave with the output. The
	// logger is go-redis's global, read by every client's pool: set once, before the
	// first client, never under one that is still dialling.
	quietRedisOnce.Do(func() { redis.SetLogger(quietRedis{}) })
	t.client = redis.NewUniversalClient(&redis.UniversalOptions{Addrs: []string{t.redisAddr},
		ContextTimeoutEnabled: true, MaxRetries: 1, DialTimeout: time.Second})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := t.client.Ping(ctx).Err(); err != nil {
		return errors.Join(fmt.Errorf("-redis %s: %w", t.redisAddr, err), t.close())
	}
	// Keys of this run only, so that a server kept between runs gives no hit that
	// this run did not store.
	t.keys = fmt.Sprintf("%skvcache:%d-%d:", redistier.DefaultPrefix, os.Getpid(), time.Now().UnixNano())
	return nil
}

// close closes the Redis client and stops the server started here.
func (t *tierSetup) close() error {
	var err error
	if t.client != nil {
		err = t.client.Close()
		t.client = nil
	}
	if t.server != nil {
		err = errors.Join(err, t.server.stop())
		t.server = nil
	}
	return err
}

// options returns the prefix cache's options for one replica's tiers b: the tiers,
// the wait and the policy of the flags.
func (t *tierSetup) options(b builtTiers) kv.PrefixCacheOptions {
	return kv.PrefixCacheOptions{Tiers: b.tiers, TierWait: t.wait, TierWriteThrough: t.through, TierMinHits: t.minHits}
}

// policy says when blocks go down, as the flags set it.
func (t *tierSetup) policy() string {
	p := "write-back"
	if t.through {
		p = "write-through"
	}
	if t.minHits > 0 {
		p += fmt.Sprintf(", entries hit %d times", t.minHits)
	}
	return p
}

// builtTiers are one replica's tiers, in -tiers order.
type builtTiers struct {
	tiers []kv.Tier
	// stores returns the values each tier kept (its own count).
	stores []func() int64
	close  func() error
}

// build makes replica's tiers in -tiers order, its host tier charged to gov on a
// device of tier accounting.HostTier, each tier that bounds its values taking values
// of valueSize bytes (kv.TierValueSize of the cache they serve).
func (t *tierSetup) build(gov *accounting.Governor, replica, valueSize int) (builtTiers, error) {
	var b builtTiers
	var closers []func() error
	closeAll := func() error {
		var err error
		for _, c := range closers {
			err = errors.Join(err, c())
		}
		return err
	}
	for _, n := range t.order {
		switch n {
		case tierHost:
			dev := accounting.DeviceKey{Tier: accounting.HostTier}
			if err := gov.SetLimit(dev, t.hostBudget); err != nil {
				return b, errors.Join(err, closeAll())
			}
			ht, err := hosttier.New(hosttier.Options{Budget: t.hostBudget, Authority: gov.Authority(namePrefixTiers+"/host", dev)})
			if err != nil {
				return b, errors.Join(fmt.Errorf("host tier: %w", err), closeAll())
			}
			b.tiers, closers = append(b.tiers, ht), append(closers, ht.Close)
			b.stores = append(b.stores, func() int64 { return ht.Stats().Stores })
		case tierRedis:
			if valueSize > redistier.MaxValueSizeLimit {
				return b, errors.Join(fmt.Errorf("redis tier: the model's tier values are %d bytes, above Redis's largest string (%d)", valueSize, redistier.MaxValueSizeLimit), closeAll())
			}
			rt, err := redistier.New(t.client, redistier.Options{Prefix: t.keys, MaxValueSize: max(valueSize, redistier.DefaultMaxValueSize)})
			if err != nil {
				return b, errors.Join(fmt.Errorf("redis tier: %w", err), closeAll())
			}
			b.tiers = append(b.tiers, &bookTier{Tier: rt, book: t.book, replica: replica})
			b.stores = append(b.stores, func() int64 { return rt.Stats().Stores })
		case tierFile:
			ft, err := t.file.open(valueSize)
			if err != nil {
				return b, errors.Join(err, closeAll())
			}
			b.tiers, closers = append(b.tiers, ft), append(closers, ft.Close)
			b.stores = append(b.stores, func() int64 { return ft.Stats().Stores })
		}
	}
	b.close = closeAll
	return b, nil
}

// quietRedisOnce sets quietRedis as go-redis's logger, once.
var quietRedisOnce sync.Once

// quietRedis drops go-redis's log lines.
type quietRedis struct{}

func (quietRedis) Printf(context.Context, string, ...any) {}

// tieredStrategy is a prefix strategy with tiers below its device.
type tieredStrategy interface {
	// tierStats returns the prefix cache's counts of each tier, nil without tiers.
	tierStats() []kv.TierStats
	// foreignLoads returns the blocks it loaded from the shared tier that another
	// replica stored there.
	foreignLoads() int64
	// written returns the tokens of the blocks each tier kept, and the tokens the
	// prefix cache evicted.
	written() (tiers []int64, evicted int64)
	// probe asks the prefix cache, before a lookup of tokens, what it would find
	// (kv.PrefixCache.ProbeIn).
	probe(a padapter, tokens []int32) (kv.Probe, error)
}

func (k *kvPrefix) probe(a padapter, tokens []int32) (kv.Probe, error) {
	return k.pc.ProbeIn(a.ns, tokens)
}

func (k *kvPrefix) written() ([]int64, int64) {
	if k.pc == nil {
		return nil, 0
	}
	out := make([]int64, len(k.tierStores))
	for i, f := range k.tierStores {
		out[i] = f() * int64(k.blockTokens)
	}
	return out, k.pc.Stats().EvictedTokens
}

// loadsWhole reports whether, from the tiers' counts before a lookup to after, no
// load was cut by the budget (Unfit), dropped or refused as invalid, and nothing was
// stored: a lookup that evicts to make room for its loads writes the evicted blocks
// down, and a full tier may then evict the very values the lookup found (a tier's
// Contains marks nothing used), which its Probe could not know.
func loadsWhole(before, after []kv.TierStats) bool {
	for i := range after {
		b, a := before[i], after[i]
		if a.Unfit != b.Unfit || a.Drops != b.Drops || a.Invalid != b.Invalid || a.StoreBytes != b.StoreBytes {
			return false
		}
	}
	return true
}

func (k *kvPrefix) tierStats() []kv.TierStats {
	if k.pc == nil {
		return nil
	}
	return k.pc.Stats().Tiers
}

func (k *kvPrefix) foreignLoads() int64 {
	var n int64
	for _, t := range k.tierList {
		if b, ok := t.(*bookTier); ok {
			n += b.foreign.Load()
		}
	}
	return n
}

// tierBook records which replicas stored each key into the shared tier, so that a
// replica's loads of another's blocks can be told from loads of its own.
type tierBook struct {
	mu     sync.Mutex
	stored map[tierval.Key]uint64 // a bit per replica
}

func newTierBook() *tierBook { return &tierBook{stored: map[tierval.Key]uint64{}} }

// bookTier is a shared tier that writes its replica's stores in the book.
type bookTier struct {
	kv.Tier
	book    *tierBook
	replica int
	foreign atomic.Int64 // loads of keys only other replicas stored
}

func (b *bookTier) Store(ctx context.Context, key tierval.Key, size int, fill func(dst []byte) error) error {
	err := b.Tier.Store(ctx, key, size, fill)
	if err == nil {
		b.book.mu.Lock()
		b.book.stored[key] |= 1 << b.replica
		b.book.mu.Unlock()
	}
	return err
}

func (b *bookTier) Load(ctx context.Context, key tierval.Key, use func(src []byte) error) error {
	used := false
	err := b.Tier.Load(ctx, key, func(src []byte) error {
		err := use(src)
		used = err == nil
		return err
	})
	if used {
		b.book.mu.Lock()
		bits := b.book.stored[key]
		b.book.mu.Unlock()
		if bits != 0 && bits&(1<<b.replica) == 0 {
			b.foreign.Add(1)
		}
	}
	return err
}

func (b *bookTier) Delete(ctx context.Context, key tierval.Key) error {
	err := b.Tier.Delete(ctx, key)
	if err == nil {
		b.book.mu.Lock()
		delete(b.book.stored, key)
		b.book.mu.Unlock()
	}
	return err
}

// errNoRedisServer: -tiers names redis, no -redis address was given, and there is
// no redis-server to start.
var errNoRedisServer = errors.New("-tiers redis without -redis starts a redis-server, and none is installed (Debian: apt-get install redis-server), or give -redis HOST:PORT of a running server")

// redisServer is a redis-server process the example started on 127.0.0.1, with no
// persistence, in a directory of its own.
type redisServer struct {
	addr string
	dir  string
	cmd  *exec.Cmd
	done chan struct{} // closed when the process has exited
	out  bytes.Buffer  // its output; read only after done
}

// startRedis starts redis-server on a free 127.0.0.1 port and waits until it
// answers PING. A port another process took between the choice and the server's
// start is given up for another, up to three tries. The server MUST be stopped.
func startRedis() (*redisServer, error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errNoRedisServer, err)
	}
	for try := 1; ; try++ {
		r, err := startRedisOn(bin)
		if err == nil || !redisup.Retry(err) || try == 3 {
			return r, err
		}
	}
}

// startRedisOn is one try of startRedis: it returns the server, or the error with
// the server stopped and its directory removed.
func startRedisOn(bin string) (*redisServer, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("redis-server: a free port: %w", err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	if err := l.Close(); err != nil {
		return nil, fmt.Errorf("redis-server: a free port: %w", err)
	}
	dir, err := os.MkdirTemp("", "kvcache-redis-")
	if err != nil {
		return nil, fmt.Errorf("redis-server: %w", err)
	}
	r := &redisServer{addr: "127.0.0.1:" + strconv.Itoa(port), dir: dir, done: make(chan struct{})}
	r.cmd = exec.Command(bin, "--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", dir, "--protected-mode", "no", "--daemonize", "no", "--loglevel", "warning")
	r.cmd.Stdout, r.cmd.Stderr, r.cmd.SysProcAttr = &r.out, &r.out, redisAttrs()
	if err := r.cmd.Start(); err != nil {
		return nil, errors.Join(fmt.Errorf("redis-server: %w", err), os.RemoveAll(dir))
	}
	go func() { _ = r.cmd.Wait(); close(r.done) }()
	switch err := redisup.Wait(r.addr, r.cmd.Process.Pid, r.done, 10*time.Second); {
	case err == nil:
		return r, nil
	case errors.Is(err, redisup.ErrExited):
		return nil, errors.Join(fmt.Errorf("redis-server on %s exited: %s: %w", r.addr, strings.TrimSpace(r.out.String()), err), os.RemoveAll(dir))
	default:
		return nil, errors.Join(err, r.stop())
	}
}

// kill stops the server at once (SIGKILL) and waits for it to exit; a server that
// has exited is left alone.
func (r *redisServer) kill() {
	select {
	case <-r.done:
		return
	default:
	}
	_ = r.cmd.Process.Kill()
	<-r.done
}

// killed reports whether the server has exited.
func (r *redisServer) killed() bool {
	select {
	case <-r.done:
		return true
	default:
		return false
	}
}

// stop kills the server and removes its directory.
func (r *redisServer) stop() error {
	r.kill()
	return os.RemoveAll(r.dir)
}

// printTierHeader says what the tiers are.
func printTierHeader(w io.Writer, t *tierSetup) {
	var parts []string
	for _, n := range t.order {
		switch n {
		case tierHost:
			parts = append(parts, fmt.Sprintf("host (kvtier/hosttier, %s per replica)", formatBytes(t.hostBudget)))
		case tierRedis:
			how := "given by -redis"
			if t.server != nil {
				how = "redis-server started here"
			}
			parts = append(parts, fmt.Sprintf("redis (kvtier/redistier at %s, %s)", t.redisAddr, how))
		case tierFile:
			parts = append(parts, fmt.Sprintf("file (kvtier/filetier in %s)", t.file.dir))
		}
	}
	fmt.Fprintf(w, "Tiers:   %s; %s", strings.Join(parts, ", then "), t.policy())
	if t.replicas > 1 {
		fmt.Fprintf(w, "; %d replicas share the Redis, B replays the requests after A", t.replicas)
	}
	if t.killAt > 0 {
		fmt.Fprintf(w, "; redis-server killed once %d requests are done", t.killAt)
	}
	fmt.Fprintln(w)
}

// printTierTable writes where each strategy's hits came from: the device or a tier.
func printTierTable(w io.Writer, rs []PrefixResult, t *tierSetup) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	head := "strategy\thit rate\t/ideal\tdevice\t"
	for _, n := range t.order {
		head += n + "\t"
	}
	fmt.Fprintln(tw, head+"evicted\twritten down\tstored\tloaded\tunfit\tdropped\tinvalid\tfrom another replica\tprobe exact\tchecked\t")
	for _, r := range rs {
		pct := func(h int64) string {
			if r.Queries == 0 {
				return "-"
			}
			return fmt.Sprintf("%.2f%%", 100*float64(h)/float64(r.Queries))
		}
		ideal := "-"
		if r.IdealHits > 0 {
			ideal = fmt.Sprintf("%.1f%%", 100*float64(r.Hits)/float64(r.IdealHits))
		}
		device := r.Hits
		for _, h := range r.TierHits {
			device -= h
		}
		row := fmt.Sprintf("%s\t%s\t%s\t%s\t", r.Strategy, pct(r.Hits), ideal, pct(device))
		var loaded, stored int64
		var written, unfit, drops, invalid []string
		for i := range t.order {
			if i >= len(r.TierHits) {
				row += "-\t"
				continue
			}
			row += pct(r.TierHits[i]) + "\t"
			ts := r.Tiers[i]
			loaded, stored = loaded+ts.LoadBytes, stored+ts.StoreBytes
			unfit = append(unfit, fmt.Sprint(ts.Unfit))
			w := "-"
			if r.EvictedTokens > 0 {
				w = fmt.Sprintf("%.0f%%", 100*float64(r.WrittenTokens[i])/float64(r.EvictedTokens))
			}
			written, drops, invalid = append(written, w), append(drops, fmt.Sprint(ts.Drops)), append(invalid, fmt.Sprint(ts.Invalid))
		}
		orDash := func(s []string) string {
			if len(s) == 0 {
				return "-"
			}
			return strings.Join(s, " / ")
		}
		foreign := "-"
		if r.ForeignLoads > 0 {
			foreign = fmt.Sprintf("%d blocks", r.ForeignLoads)
		}
		evicted := "-"
		if r.TierHits != nil {
			evicted = fmt.Sprintf("%d tokens", r.EvictedTokens)
		}
		probed := "-"
		if r.Probed > 0 {
			probed = fmt.Sprintf("%d / %d", r.ProbeExact, r.Probed)
		}
		fmt.Fprintf(tw, "%s%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d tokens\t\n", row, evicted, orDash(written), formatBytes(stored),
			formatBytes(loaded), orDash(unfit), orDash(drops), orDash(invalid), foreign, probed, r.Verified)
	}
	tw.Flush()
	fmt.Fprintln(w, `
/ideal     hit rate over an unbounded cache's
device, host, redis  the hit rate's prompt tokens found on the device, and loaded from each tier
evicted    prompt tokens the prefix cache evicted from the device
written down  tokens of the whole blocks each tier kept, over those evicted (the rest: tails
           short of a block, evictions not written down, stores dropped)
stored     bytes of the values stored into every tier
loaded     bytes of the values loaded back from every tier (each checked)
unfit      per tier: blocks a lookup found that the device's budget could not take, even
           after eviction (it loaded those before them)
dropped    per tier: blocks not stored and loads failed (a tier down, a timeout): misses,
           never errors
invalid    per tier: values that failed their check: misses, never mapped
probe exact  lookups that started on the tokens kv.PrefixCache.Probe said just before, of
           those whose loads all succeeded (none unfit, dropped or invalid) and whose own
           evictions stored nothing into a tier
checked    hit tokens read back and compared, byte for byte, with what was written for them`)
}

// blockTokens returns the tokens of one block of c's tiers: the unit a tier stores,
// one block of c's sequences, or, on a model of layer groups, the least common
// multiple of the groups' blocks (kv's tier block there).
func blockTokens(c *kv.Cache) (int, error) {
	bt := 0 // none: the PerLayer layout has no blocks
	for l := range c.Config().Model.Layers {
		st, err := c.LayerStrides(l)
		if err != nil {
			return 0, err
		}
		if st.BlockTokens == 0 {
			continue // a recurrent layer
		}
		if bt == 0 {
			bt = st.BlockTokens
			continue
		}
		a, b := bt, st.BlockTokens
		for b != 0 {
			a, b = b, a%b
		}
		bt = bt / a * st.BlockTokens
	}
	return bt, nil
}
