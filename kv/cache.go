package kv

import (
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sort"
	"sync"
	"sync/atomic"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/internal/invariants"
)

// Config says what a Cache holds and how: the argument of New, and of Config.Size and
// TierNamespace, which answer for a cache before it is made. A server fills one at
// start-up: Model and MaxTokens always, and Authority on a backing charged by buffer
// (host.Private); on a pooling one (host.Shared, cuda) the cache maps ahead unless
// NoMapAhead says not to.
type Config struct {
	// Model is the model's shape: one group when every layer is full attention of one
	// shape (Uniform, or a preset such as Llama3_8B), else layer groups
	// (sliding-window, chunked-local, MLA, recurrent): each group gets ranges of its
	// own, laid out by Layout, and a window group gives back the granules behind its
	// window (see the package doc). Each FP8 group may keep scales of its own
	// (Cache.GroupScales). A cache on a Model of more than one group has a prefix
	// cache under the hybrid rule, with events and tiers, and with a recurrent group
	// one of recurrent-state checkpoints, without tiers (NewPrefixCache); map-ahead
	// maps ahead each group that holds tokens (a model of recurrent groups alone has
	// none: an explicit MapAhead is refused with ErrConfig); and a model with a
	// recurrent group has no Freeze.
	Model Model
	// MaxTokens is the most tokens one sequence may hold. It is reserved as address
	// space only: a sequence commits memory for the tokens it has.
	MaxTokens int
	Layout    Layout // Blocked (the zero value) or PerLayer
	// BlockTokens asks the Blocked layout for blocks of at least this many tokens
	// (a larger copied tail per fork or prefix; longer runs per layer with a
	// RunTokens as large): a block is the
	// fewest whole granules that hold them, and holds as many tokens as fit
	// (Sequence.BlockTokens). One whose block is more than 1/8 bytes that hold no
	// token is reported (Size's GroupSizing.Block, and a Warn to Logger at New). 0, the default, chooses each group's block:
	// whole granules that a whole number of tokens fills, with no dead byte, where
	// such a block holds at most 512 tokens (or one granule's; half the window in a
	// window group), else the one of fewest dead bytes per byte within that bound
	// (blocks.go; Size's GroupSizing says which and why). It must be 0 in the other
	// layouts.
	BlockTokens int
	// RunTokens cuts each block of the Blocked layout into runs of this many tokens,
	// a power of two, where it divides the block into more than one (a group whose
	// blocks it does not divide keeps each block one run: Cache.LayerStrides says
	// which): each layer's K and V lie together within a run, run after run
	// (Layout), as a paged kernel's pages of RunTokens tokens (16 is vLLM's). A
	// decode step then writes a token's layers a run apart rather than a block's run
	// apart, and a CPU reader reads shorter runs: 7% slower on gpt-oss-20b, for no
	// gain in the write step the replays could tell from their noise
	// (docs/benchmarks/step.md, "blocks cut into runs"). 0, the default, leaves every
	// block one run. A negative one, or one that is no power of two, is refused with
	// ErrConfig; it must be 0 in the other layouts.
	RunTokens int
	// Authority is charged for committed granules when the backing's accounting is
	// ByBuffer (host.Private); it must be nil for backings that own their memory
	// (ByBacking: host.Shared, cuda).
	Authority *accounting.Authority
	// Logger receives the cache's events: a range whose release failed twice and
	// that the cache keeps for Close to retry (Warn), a summary of each eviction
	// pass of its PrefixCache (Info when a waiter on the device asked for it, Debug
	// when the cache's own growth did), and a tier's value that failed its check on
	// a lookup's load, with the check it failed (Warn). nil logs nothing; nothing
	// else is logged on Append or Truncate.
	Logger *slog.Logger
	// NoMapAhead turns map-ahead off; the zero value leaves it on. Map-ahead commits
	// the granules a growing sequence will commit next into the sequence's own
	// ranges a few tokens before the append that needs them, on a goroutine of the
	// cache (started by the first sequence that grows), so that the append makes no
	// backing call: a decode step that crosses a block boundary costs what the
	// others do. The granules are owned and charged like any (PoolStats and the
	// governor show them, and Stats.Ahead), at most the next block of each layer
	// group of each growing sequence (a recurrent state is not mapped ahead); Need
	// and AppendBatch count them as the cache's own, and a growth that needs the
	// budget takes them back: map-ahead never makes a growth of this cache refused.
	// While the budget has room (more than 1/16 of the limit free) it also keeps,
	// idle in the pool, the granules of the block after that, at most 1/32 of the
	// limit, which any growth takes first. Truncate, Close, ForkAt, Freeze and
	// PrefixCache.Insert give a sequence's back first. On a Model with
	// sliding-window or chunked-local groups, the granules a window gives back are
	// the worker's to decommit too: the step leaves them behind (Stats.Ahead shows
	// them until then), and a growth that the budget would refuse has them back
	// first. It needs a pooling backing (host.Shared, cuda); on others there is
	// nothing to turn off. It is on by default because, measured on every replay of
	// examples/kvcache, the memory layer's time with it was not above its time
	// without (docs/benchmarks/step.md, "Map-ahead on or off"); a server turns it
	// off where it wants no goroutine per cache, or no granule held before a token
	// needs it.
	NoMapAhead bool
	// MapAhead is kept for the callers that set it when map-ahead was off by
	// default: true asks for what the zero value now gives (NoMapAhead wins), and
	// is refused with ErrConfig on a model of recurrent groups alone, which has
	// nothing to map ahead. Cache.Config reports it set where the cache maps ahead.
	MapAhead bool
}

// Cache holds the K and V tensors of many sequences on one backing. Its zero value is
// not usable; call New. A server makes one per model and backing and keeps it for
// its life, closing it last (docs/server.md).
type Cache struct {
	st     store
	pool   backing.Pool          // the backing's pool, or nil
	auth   *accounting.Authority // the ledger that owns the cache's physical memory
	cfg    Config
	shape  // where the layout puts tokens: the byte arithmetic
	gran   int
	sharer bool
	// protector: the backing can protect committed memory in place, so an origin's
	// shared granules become read-only in its own mapping too.
	protector bool
	gov       *accounting.Governor
	dev       accounting.DeviceKey

	mu       sync.Mutex
	seqs     map[*Sequence]struct{}
	prefixes map[*Prefix]struct{}
	nextID   uint64
	closed   bool
	inflight int      // sequences being made: Close must wait for them
	waits    int64    // waiting appends that had to wait
	orphans  []buffer // buffers whose Close failed; retried by Close
	lost     int64    // bytes that quarantined releases left held for good
	entries  int      // sequences a PrefixCache owns: Close waits for them

	// batch numbers the batches of the cache, so that a sequence can tell it was
	// already seen in the one being checked.
	batch atomic.Uint64
	// refusals counts growths refused for memory (Refusals).
	refusals atomic.Int64

	pc atomic.Pointer[PrefixCache] // nil without one; the prefix cache's to read
	ph atomic.Pointer[prefixHooks] // set by the first PrefixCache (see hooks)

	scales scales // the FP8 scales, made by New and given back by Close
	ahead  *ahead // nil where the cache does not map ahead (Config.NoMapAhead, no pool)

	// groups is how each layer group lies (shape is the first's),
	// layers where each of the model's layers lies; multi is set for a model of more
	// than one group or of a group other than full attention or MLA (fullLike),
	// windows when one of its groups is a window.
	groups  []group
	layers  []layerRef
	multi   bool
	windows bool
	bpt     int // the model's BytesPerToken
}

// New returns a cache of sequences on b. It reserves nothing until sequences are made.
// The backing's type is inferred from b and hidden behind the Cache, which names no
// backing type: a server holds a *Cache whatever memory it runs on. A server calls it
// once per model and backing, at start-up.
//
// It refuses, with an error matching ErrModel that says what, a model Model.Validate
// refuses for MaxTokens (a window larger than MaxTokens, an MLA group with V, no
// layers, ...), and with ErrConfig what such a cache does not have (an explicit
// MapAhead); it
// allocates nothing then. It refuses with ErrConfig a device whose
// budget is 0 bytes (Governor.SetLimit), on which no token could ever be held.
//
// On a backing that leaves its granule to its user (backing.GranuleChooser:
// host.Shared made with neither Granularity nor ShareUnit), New chooses it for the
// model's smallest token (shareUnit), so that a shared prompt is not carved coarser
// than about 64 tokens; a refused New may have fixed it too.
func New[R any, B backing.Backing[R]](b B, cfg Config) (*Cache, error) {
	m, err := cfg.model()
	if err != nil {
		return nil, err
	}
	m = m.clone() // the caller's slices are the caller's to change
	cfg.Model = m
	if cfg.MaxTokens <= 0 {
		return nil, fmt.Errorf("%w: MaxTokens %d", ErrConfig, cfg.MaxTokens)
	}
	if gc, ok := any(b).(backing.GranuleChooser); ok {
		gc.ChooseGranule(shareUnit(m, cfg.Layout))
	}
	g := b.Granularity()
	groups, layers, err := newGroups(m, cfg.Layout, g, cfg.BlockTokens, cfg.RunTokens, cfg.MaxTokens)
	if err != nil {
		return nil, err
	}
	// NB: one MLA group is laid out as one full group is (a latent in place of K
	// and V), so it takes the one-group paths, the prefix cache's among them.
	multi := len(groups) > 1 || !groups[0].fullLike()
	tokens := slices.ContainsFunc(groups, func(g group) bool { return g.spec.Kind != Recurrent })
	if cfg.MapAhead && !cfg.NoMapAhead && !tokens {
		return nil, fmt.Errorf("%w: MapAhead needs a group that holds tokens; model %q has %s", ErrConfig, m.Name, groupKinds(m))
	}
	sh := groups[0].shape
	acct := b.Accounting()
	var gov *accounting.Governor
	auth := cfg.Authority
	switch {
	case acct.OwnedByBacking() && cfg.Authority != nil:
		return nil, fmt.Errorf("%w: the backing owns its memory (%v); leave Authority nil", ErrConfig, acct)
	case !acct.OwnedByBacking() && cfg.Authority == nil:
		return nil, fmt.Errorf("%w: the backing's memory is charged by buffer; set Authority", ErrConfig)
	case acct.OwnedByBacking():
		auth = acct.Authority()
		gov = auth.Governor()
	case cfg.Authority.Device() != b.Device():
		return nil, fmt.Errorf("%w: Authority is on %v, the backing on %v", ErrConfig, cfg.Authority.Device(), b.Device())
	default:
		gov = cfg.Authority.Governor()
	}
	if gov.Limit(b.Device()) == 0 {
		// NB: SetLimit takes 0 (a device drained: nothing more admitted until the
		// limit rises), but a cache made on it could not hold one token.
		return nil, fmt.Errorf("%w: the budget of %v is 0 bytes, so the first append would be refused; set a limit above 0, or none for no budget", ErrConfig, b.Device())
	}
	_, sharer := any(b).(backing.Sharer[R])
	pool, _ := any(b).(backing.Pool)
	_, protects := any(b).(backing.Protector[R])
	c := &Cache{
		st: storeOf[R, B]{b}, pool: pool, auth: auth, cfg: cfg, shape: sh, gran: g,
		sharer: sharer && acct.OwnedByBacking(), protector: protects, gov: gov, dev: b.Device(),
		seqs:     make(map[*Sequence]struct{}),
		prefixes: make(map[*Prefix]struct{}),
		groups:   groups, layers: layers, multi: multi, bpt: m.BytesPerToken(),
	}
	for i := range groups {
		c.windows = c.windows || groups[i].windowed()
	}
	c.warnBlocks()
	if err := c.newScales(); err != nil {
		return nil, err
	}
	// NB: Config reports MapAhead as what the cache does.
	c.cfg.MapAhead = !cfg.NoMapAhead && tokens && pool != nil
	if c.cfg.MapAhead {
		c.ahead = newAhead(c)
	}
	return c, nil
}

// shareUnit returns the bytes a cache on m in layout maps and shares in, per token:
// the least of its token groups' (one token of every layer in Blocked, of one tensor
// in PerLayer), or 0 for a model of recurrent groups alone. kv.New passes it to a
// backing whose granule is left to its user (backing.GranuleChooser).
func shareUnit(m Model, layout Layout) int {
	unit := 0
	for _, g := range m.Groups {
		u := g.BytesPerToken()
		if layout == PerLayer {
			u = g.TokenBytes()
		}
		if u > 0 && (unit == 0 || u < unit) {
			unit = u
		}
	}
	return unit
}

// Config returns the cache's configuration, for a caller that sizes or names what
// the cache holds (Config.Size, TierNamespace), with MapAhead set where the cache
// maps ahead. Its Model is a copy: a caller that changes it changes nothing of the
// cache's.
func (c *Cache) Config() Config {
	cfg := c.cfg
	cfg.Model = cfg.Model.clone()
	return cfg
}

// Granularity returns the backing's granule size: the granule argument of
// Config.Size and TierNamespace for a cache like this one.
func (c *Cache) Granularity() int { return c.gran }

// NewSequence returns an empty sequence, for a request that starts on no shared
// prefix (a server with a PrefixCache calls Lookup instead). It reserves address
// space for MaxTokens and commits nothing. The sequence MUST be closed.
func (c *Cache) NewSequence() (*Sequence, error) {
	s, err := c.newSequence()
	if err != nil {
		return nil, err
	}
	c.register(s)
	return s, nil
}

// newSequence reserves a new sequence's ranges. Until register or abandon, the cache
// counts it in flight and will not close.
func (c *Cache) newSequence() (*Sequence, error) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil, ErrClosed
	}
	c.nextID++
	id := c.nextID
	c.inflight++
	c.mu.Unlock()
	bufs, err := c.newRanges()
	if err != nil {
		c.abandon(nil)
		return nil, err
	}
	s := &Sequence{c: c, id: id, bufs: bufs}
	if c.multi {
		s.gs = make([]groupState, len(c.groups))
	}
	return s, nil
}

// newRanges reserves a sequence's ranges, each group's of its own capacity, all or
// none.
func (c *Cache) newRanges() ([]buffer, error) {
	if len(c.groups) == 1 {
		return c.newBuffers(c.capac)
	}
	return c.groupRanges(func(g *group) int { return g.capac })
}

// groupRanges reserves the ranges of every group, all or none, each of capac(its
// group) bytes.
func (c *Cache) groupRanges(capac func(g *group) int) ([]buffer, error) {
	bufs := make([]buffer, 0, c.groups[len(c.groups)-1].first+c.groups[len(c.groups)-1].nbuf)
	for i := range c.groups {
		g := &c.groups[i]
		for range g.nbuf {
			buf, err := c.st.newBuffer(capac(g), c.cfg.Authority)
			if err != nil {
				return nil, errors.Join(err, c.release(bufs).Err)
			}
			bufs = append(bufs, buf)
		}
	}
	return bufs, nil
}

// abandon gives back the ranges of a sequence that was never registered and returns
// what the release could not give back as an error (nil when it gave back
// everything).
func (c *Cache) abandon(s *Sequence) error {
	var err error
	if s != nil {
		err = releaseError(c.release(s.bufs))
	}
	c.mu.Lock()
	c.inflight--
	if invariants.Enabled {
		c.checkCountsLocked()
	}
	c.mu.Unlock()
	return err
}

// newBuffers reserves c.nbuf ranges of capacity bytes, all or none.
func (c *Cache) newBuffers(capacity int) ([]buffer, error) {
	bufs := make([]buffer, 0, c.nbuf)
	for range c.nbuf {
		buf, err := c.st.newBuffer(capacity, c.cfg.Authority)
		if err != nil {
			return nil, errors.Join(err, c.release(bufs).Err)
		}
		bufs = append(bufs, buf)
	}
	return bufs, nil
}

// release closes every buffer and sums the outcomes into one outcome. A close that
// fails with nothing changed is retried once (the failure may be transient); buffers
// that still fail are kept by the cache, retried by Cache.Close, and their bytes are
// reported as residual. Since the buffers leave their owner either way, the outcome is
// Complete or Quarantined, never Failed.
func (c *Cache) release(bufs []buffer) accounting.ReleaseOutcome {
	var unmapped, residual int64
	var errs []error
	for _, b := range bufs {
		if b == nil {
			continue
		}
		o := b.Close()
		if o.Status == accounting.Failed {
			o = b.Close()
		}
		if o.Status == accounting.Failed {
			residual += int64(b.Committed())
			c.mu.Lock()
			c.orphans = append(c.orphans, b)
			c.mu.Unlock()
			if l := c.cfg.Logger; l != nil {
				l.Warn("kv: a range could not be given back; the cache keeps it for Close to retry",
					"bytes", b.Committed(), "err", o.Err)
			}
		} else {
			unmapped += o.Unmapped
			residual += o.Residual
			if o.Residual > 0 {
				c.mu.Lock()
				c.lost += o.Residual
				c.mu.Unlock()
			}
		}
		if o.Err != nil {
			errs = append(errs, o.Err)
		}
	}
	return accounting.Outcome(unmapped, residual, true, errors.Join(errs...))
}

func (c *Cache) register(s *Sequence) {
	s.started = s.startReport()
	invariants.Track(&s.leak, s, "kv.Sequence")
	c.mu.Lock()
	c.seqs[s] = struct{}{}
	c.inflight--
	if invariants.Enabled {
		c.checkCountsLocked()
	}
	c.mu.Unlock()
}

// Stats is a snapshot of a cache, for metrics and logs (package metrics reads it).
type Stats struct {
	Sequences int   // live sequences
	Prefixes  int   // live prefixes
	Tokens    int64 // tokens held by live sequences
	// Used is the bytes of those tokens; on a Model, of the tokens the groups still
	// hold (a window group's from FirstHeld on) and of the recurrent states.
	Used int64
	// Committed is the bytes of granules committed in live sequences' ranges, shared
	// mappings included: what the sequences address.
	Committed int64
	// Shared is the part of Committed that maps granules the sequence did not commit
	// itself (a prefix's, a forked parent's): memory each sequence would otherwise
	// hold on its own, so the bytes that sharing saves.
	Shared int64
	Waste  int64 // Committed - Used: the partly filled granules
	// Ahead is the bytes that map-ahead (the default; Config.NoMapAhead) holds
	// outside every sequence's Committed, owned and charged: committed ahead into growing
	// sequences' ranges and taken by no step yet, and granules of their own that
	// windows left behind and the worker has not given back yet. A growth that needs the budget
	// takes both back.
	Ahead int64
	// Owned and Mapped are the ledger's readings: the physical bytes it owns (under
	// ByBacking the backing's whole pool, idle granules included; every shared
	// granule once) and the bytes of every mapping.
	Owned  int64
	Mapped int64
	Waits  int64 // waiting appends (AppendCtx, AppendBatchCtx) that had to wait
	// Refusals is the operations refused because the memory could not be had since
	// the cache was made (Append, AppendBatch and each try of a waiting one; ForkAt,
	// Freeze, NewSequenceFrom, PrefixCache.Lookup, and the copy a prefix cache entry
	// makes of an inserted sequence's tokens before they change): a scheduler's cue to
	// preempt.
	// It only grows. Each refusal counts in the governor's Counters.Refusals of the
	// device too, whether the cache refused it before committing anything
	// (accounting.Governor.Refuse) or the governor refused a commit.
	Refusals int64
	// Unreleased is the bytes that failed releases left held: ranges the cache keeps
	// and retries on Close, and what a backing quarantined for good. Owned includes
	// them.
	Unreleased int64
}

// ledger returns the authority that owns the cache's physical memory.
func (c *Cache) ledger() *accounting.Authority { return c.auth }

// Stats returns a snapshot of the cache (see Stats): a metrics collector's call.
func (c *Cache) Stats() Stats {
	var st Stats
	c.mu.Lock()
	st.Sequences = len(c.seqs)
	st.Prefixes = len(c.prefixes)
	for s := range c.seqs {
		st.Tokens += s.tokens.Load()
		st.Committed += s.committed.Load()
		st.Shared += s.sharedIn.Load()
		st.Used += s.used.Load()
	}
	st.Waits = c.waits
	st.Refusals = c.refusals.Load()
	st.Unreleased = c.lost
	for _, b := range c.orphans {
		st.Unreleased += int64(b.Committed())
	}
	c.mu.Unlock()
	st.Ahead = c.ahead.own() + c.ahead.leftBehind()
	if !c.multi {
		st.Used = st.Tokens * int64(c.bpt)
	}
	st.Waste = st.Committed - st.Used
	l := c.ledger().Stats()
	st.Owned, st.Mapped = l.Owned, l.Mapped
	return st
}

// SequenceStats is a snapshot of one sequence, for a scheduler that weighs which
// sequence to preempt, or for logs.
type SequenceStats struct {
	ID        uint64
	Tokens    int
	Committed int64 // bytes of granules in its ranges
	Shared    int64 // of which mapped from a prefix or a parent
}

// SequenceStats returns a snapshot of every live sequence, ordered by ID (see
// SequenceStats).
func (c *Cache) SequenceStats() []SequenceStats {
	c.mu.Lock()
	out := make([]SequenceStats, 0, len(c.seqs))
	for s := range c.seqs {
		out = append(out, SequenceStats{ID: s.id, Tokens: int(s.tokens.Load()), Committed: s.committed.Load(), Shared: s.sharedIn.Load()})
	}
	c.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// refreshStats updates the readings other goroutines see (SequenceStats, Cache.Stats).
func (s *Sequence) refreshStats() {
	var committed, shared, used int64
	for gi := range s.c.groups {
		g := &s.c.groups[gi]
		if s.err != nil || len(s.bufs) == 0 {
			for _, b := range s.bufs[min(g.first, len(s.bufs)):min(g.first+g.nbuf, len(s.bufs))] {
				committed += int64(b.Committed())
				shared += int64(b.Shared())
			}
		} else {
			// NB: the ranges of a group of a sequence that is not damaged are alike
			// (every operation resizes and shares them all the same, or damages it),
			// so one stands for all: a batch step then touches each group once.
			b := s.bufs[g.first]
			committed += int64(g.nbuf) * int64(b.Committed())
			shared += int64(g.nbuf) * int64(b.Shared())
		}
		used += g.used(s.n, s.heldOf(gi))
	}
	if invariants.Enabled {
		s.checkAlike()
	}
	s.tokens.Store(int64(s.n))
	s.committed.Store(committed)
	s.sharedIn.Store(shared)
	s.used.Store(used)
}

// Close closes the cache. Every sequence and prefix MUST have been closed and
// released first: while any is live Close fails with an error matching ErrBusy and
// closes nothing. It retries giving back any range whose release failed earlier and
// reports what still fails. A second Close changes nothing and returns an error
// matching ErrClosed (docs/server.md, "A second Close"). A server calls it last at
// shutdown, after its PrefixCache's Close.
func (c *Cache) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return fmt.Errorf("%w: Close called twice", ErrClosed)
	}
	if c.entries > 0 || c.pc.Load() != nil {
		defer c.mu.Unlock()
		return fmt.Errorf("%w: its PrefixCache is open (%d entries with ranges of their own); close it first", ErrBusy, c.entries)
	}
	if len(c.seqs) > 0 || len(c.prefixes) > 0 || c.inflight > 0 {
		defer c.mu.Unlock()
		return fmt.Errorf("%w: %d sequences and %d prefixes still live", ErrBusy, len(c.seqs)+c.inflight, len(c.prefixes))
	}
	c.closed = true
	orphans := c.orphans
	c.orphans = nil
	c.mu.Unlock()
	if c.ahead != nil {
		c.ahead.close()
	}
	err := c.closeScales()
	if len(orphans) > 0 {
		if out := c.release(orphans); !out.OK() {
			return errors.Join(err, releaseError(out))
		}
	}
	return err
}

// startReport returns what s holds on its creation: all of it came with the call that
// made it, since a new sequence starts empty.
func (s *Sequence) startReport() backing.MapReport {
	committed, shared := s.committed.Load(), s.sharedIn.Load()
	return backing.MapReport{Owned: committed - shared, Mapped: committed, Granules: int(committed / int64(s.c.gran))}
}

// prefixRanges reserves the ranges of a prefix of n tokens, all or none: each of
// them the whole granules its group's extent of n tokens takes (one at least).
func (c *Cache) prefixRanges(n int) ([]buffer, error) {
	if len(c.groups) == 1 {
		capacity, _ := backing.AlignUp(c.extent(n), c.gran)
		return c.newBuffers(max(capacity, c.gran))
	}
	return c.groupRanges(func(g *group) int {
		capacity, _ := backing.AlignUp(g.extent(n), c.gran)
		return max(capacity, c.gran)
	})
}
