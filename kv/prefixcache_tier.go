package kv

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/vmarena/vmarena/internal/radix"
	"github.com/vmarena/vmarena/kv/blockhash"
)

// Defaults of PrefixCacheOptions' tier fields.
const (
	// DefaultTierStores is the stores into tiers that run at once when
	// PrefixCacheOptions.TierStores is 0.
	DefaultTierStores = 2
	// DefaultTierWait bounds a lookup's wait on the tiers, and one store, when
	// PrefixCacheOptions.TierWait is 0.
	DefaultTierWait = 100 * time.Millisecond
)

// TierStats counts what a prefix cache did with one of its tiers.
type TierStats struct {
	Name string // the tier's Name
	// Hits is the prompt tokens lookups found in the tier and loaded (they count in
	// PrefixCacheStats.Hits too); Misses the lookups that asked the tier and loaded
	// nothing from it.
	Hits   int64
	Misses int64
	// LoadBytes and StoreBytes are the bytes of the values loaded from the tier (those
	// that passed their check) and stored into it.
	LoadBytes  int64
	StoreBytes int64
	// Drops counts the blocks not stored (the tier failed, or the copy out did) and
	// the loads that failed other than by a value's check: each a miss, never an
	// error of the caller.
	Drops int64
	// Invalid counts the values that failed DecodeTierValue's check: misses, never
	// mapped.
	Invalid int64
}

// pcTiers is a prefix cache's tiers: the keys of its blocks, the bound on stores that
// run at once, and the counts. Its lock is taken after every other of the package's
// and guards only the counts.
type pcTiers struct {
	c     *Cache
	tiers []Tier
	ns    uint64
	hash  *blockhash.Hasher
	wait  time.Duration
	slots chan struct{} // one token per store running
	// inProc[i]: tier i keeps its values in this process's memory (InProcessTier),
	// so their payloads go unsummed.
	inProc []bool

	// bg counts the write-backs running behind an Insert or a lookup (later):
	// Close waits for them.
	bg sync.WaitGroup

	mu     sync.Mutex
	counts []TierStats
}

// tierWrite is what eviction picked of an entry to write down: the tokens of its
// path and the blocks from first on.
type tierWrite struct {
	t      *pcTiers
	tokens []int32
	first  int
}

// newTiers returns the tiers of opts for c, nil without any, or an error matching
// ErrConfig: a layout other than Blocked (only its block is one contiguous unit of
// every layer), a nil tier, two tiers of one name (their counts are told apart by
// it), a negative bound.
func newTiers(c *Cache, opts PrefixCacheOptions) (*pcTiers, error) {
	if opts.TierStores < 0 || opts.TierWait < 0 {
		return nil, fmt.Errorf("%w: TierStores %d, TierWait %v", ErrConfig, opts.TierStores, opts.TierWait)
	}
	if len(opts.Tiers) == 0 {
		return nil, nil
	}
	if c.cfg.Layout != Blocked || c.nbuf != 1 || c.tpb <= 0 {
		return nil, fmt.Errorf("%w: tiers store whole blocks, and only the Blocked layout lays a block out as one contiguous unit (layout %v)", ErrConfig, c.cfg.Layout)
	}
	names := make(map[string]int, len(opts.Tiers))
	for i, t := range opts.Tiers {
		if t == nil {
			return nil, fmt.Errorf("%w: tier %d is nil", ErrConfig, i)
		}
		if j, ok := names[t.Name()]; ok {
			return nil, fmt.Errorf("%w: tiers %d and %d are both named %q", ErrConfig, j, i, t.Name())
		}
		names[t.Name()] = i
	}
	ns, err := TierNamespace(c.cfg, c.gran, opts.TierPrefix)
	if err != nil {
		return nil, err
	}
	h, err := blockhash.New(blockhash.Options{BlockSize: c.tpb})
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	t := &pcTiers{
		c: c, tiers: append([]Tier(nil), opts.Tiers...), ns: ns, hash: h,
		wait: opts.TierWait, slots: make(chan struct{}, opts.TierStores),
		counts: make([]TierStats, len(opts.Tiers)), inProc: make([]bool, len(opts.Tiers)),
	}
	if t.wait == 0 {
		t.wait = DefaultTierWait
	}
	if opts.TierStores == 0 {
		t.slots = make(chan struct{}, DefaultTierStores)
	}
	for i, tier := range t.tiers {
		t.counts[i].Name = tier.Name()
		t.inProc[i] = inProcess(tier)
	}
	return t, nil
}

// stats returns a copy of the counts, nil without tiers.
func (t *pcTiers) stats() []TierStats {
	if t == nil {
		return nil
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	return append([]TierStats(nil), t.counts...)
}

// count applies f to tier i's counts.
func (t *pcTiers) count(i int, f func(*TierStats)) {
	t.mu.Lock()
	f(&t.counts[i])
	t.mu.Unlock()
}

// keys returns the keys of the whole blocks of tokens from block first on.
func (t *pcTiers) keys(tokens []int32, first int) []TierKey {
	hs := t.hash.Chain(nil, t.hash.Root(), 0, tokens)
	if first >= len(hs) {
		return nil
	}
	keys := make([]TierKey, 0, len(hs)-first)
	for _, h := range hs[first:] {
		keys = append(keys, TierKey{Namespace: t.ns, Hash: h.Uint64()})
	}
	return keys
}

// pick marks e, which eviction takes out of the index whole, to be written down when
// it closes: its blocks from the one holding its parent's last token on (those below
// stay cached in the index, held by the parent's other entries). A lazy entry has
// none to write: its origin keeps its ranges, and no memory comes back. pc.mu is held.
func (t *pcTiers) pick(e *pcEntry, leaf *radix.Node[*pcEntry]) {
	if t == nil || e.seq == nil || e.seq.err != nil {
		return
	}
	tokens := leaf.Tokens()
	n := min(len(tokens), e.n)
	first := leaf.Parent().Depth() / t.c.tpb
	if first >= n/t.c.tpb {
		return
	}
	e.wb = &tierWrite{t: t, tokens: tokens[:n], first: first}
}

// writeBack stores the blocks w picked of s, an evicted entry's ranges, into every
// tier, at most len(t.slots) stores at once across the cache. No lock is held: s is
// the cache's alone until it closes, after this returns. A store that fails is a
// drop, counted.
func (t *pcTiers) writeBack(s *Sequence, w *tierWrite) {
	keys := t.keys(w.tokens, w.first)
	bt, unit := t.c.tpb, t.c.unit
	buf := s.bufs[0]
	for j, key := range keys {
		b := w.first + j
		tokens := w.tokens[b*bt : (b+1)*bt]
		size := TierValueSize(len(tokens), unit)
		for i, tier := range t.tiers {
			t.slots <- struct{}{}
			ctx, cancel := context.WithTimeout(context.Background(), t.wait)
			var flags uint16
			if t.inProc[i] {
				flags = tierPayloadUnsummed
			}
			err := tier.Store(ctx, key, size, func(dst []byte) error {
				return encodeTierValue(dst, key, tokens, unit, func(p []byte) error {
					return buf.readAt(b*unit, p)
				}, flags)
			})
			cancel()
			<-t.slots
			t.count(i, func(st *TierStats) {
				if err != nil {
					st.Drops++
				} else {
					st.StoreBytes += int64(size)
				}
			})
		}
	}
}

// load extends s, a lookup's new sequence holding the prompt's first m tokens, by
// the blocks of tokens that follow which the tiers hold, asking them in order, up to
// limit tokens, within the wait. Each value is checked against the prompt's tokens
// before its bytes are copied into s's own fresh granules; the first block that
// fails ends the run, and s keeps the tokens before it. It returns s's length. No
// lock is held.
func (t *pcTiers) load(s *Sequence, tokens []int32, m, limit int) int {
	bt := t.c.tpb
	if limit/bt*bt <= m {
		return m
	}
	ctx, cancel := context.WithTimeout(context.Background(), t.wait)
	defer cancel()
	keys := t.keys(tokens[:limit/bt*bt], m/bt)
	b := m / bt // the next block to load
	for i, tier := range t.tiers {
		if len(keys) == 0 || ctx.Err() != nil {
			break
		}
		got := t.loadFrom(ctx, i, tier, s, tokens, b, keys)
		if got == 0 {
			t.count(i, func(st *TierStats) { st.Misses++ })
			continue
		}
		n := max(m, (b+got)*bt)
		t.count(i, func(st *TierStats) { st.Hits += int64(n - m) })
		m, b, keys = n, b+got, keys[got:]
	}
	// NB: a Truncate that failed left s fewer tokens, all checked ones.
	return min(m, s.n)
}

// loadFrom loads from tier i the longest run of keys it holds, blocks b on, into s,
// and returns the blocks loaded; s holds them (and nothing past them) on return.
func (t *pcTiers) loadFrom(ctx context.Context, i int, tier Tier, s *Sequence, tokens []int32, b int, keys []TierKey) int {
	run, err := tier.Contains(ctx, keys)
	if err != nil || run <= 0 {
		if err != nil {
			t.count(i, func(st *TierStats) { st.Drops++ })
		}
		return 0
	}
	run = min(run, len(keys))
	bt, unit := t.c.tpb, t.c.unit
	before := s.n
	if err := s.Append((b+run)*bt - before); err != nil {
		t.count(i, func(st *TierStats) { st.Drops++ })
		return 0
	}
	got := 0
	for ; got < run; got++ {
		blk := b + got
		want := tokens[blk*bt : (blk+1)*bt]
		var invalid bool
		var size int
		err := tier.Load(ctx, keys[got], func(src []byte) error {
			payload, err := decodeTierValue(src, keys[got], want, unit, t.inProc[i])
			if err != nil {
				invalid = true
				return err
			}
			size = len(src)
			return s.bufs[0].writeAt(blk*unit, payload)
		})
		if err != nil {
			t.count(i, func(st *TierStats) {
				if invalid {
					st.Invalid++
				} else if !errors.Is(err, ErrTierMiss) {
					st.Drops++
				}
			})
			break
		}
		t.count(i, func(st *TierStats) { st.LoadBytes += int64(size) })
	}
	if keep := max(before, (b+got)*bt); keep < s.n {
		if err := s.Truncate(keep); err != nil {
			// It left s the whole tokens below a granule it could not keep, all
			// checked (load takes no more than s holds).
			return max(s.n/bt-b, 0)
		}
	}
	return got
}

// later tells whether the entries in drop, which an eviction to MaxBytes took after an
// Insert or a lookup, have blocks to write down: those are then written, and the
// entries closed, on a goroutine of their own (closeAll), off the request's path,
// counted in bg so that Close waits for them. pc.mu is held: an Insert holds it from
// its check that the prefix cache is open, and a lookup is counted in pc.working,
// which Close waits for before bg.
func (t *pcTiers) later(drop []*pcEntry) bool {
	if t == nil {
		return false
	}
	for _, d := range drop {
		if d.wb != nil {
			t.bg.Add(1)
			return true
		}
	}
	return false
}

// closeAll closes the entries in drop, on a goroutine of its own when later said so.
// No lock is held.
func (t *pcTiers) closeAll(drop []*pcEntry, later bool) {
	if !later {
		for _, d := range drop {
			d.close()
		}
		return
	}
	go func() {
		defer t.bg.Done()
		for _, d := range drop {
			d.close()
		}
	}()
}

// waitBackground waits for the write-backs running on their own goroutines.
func (t *pcTiers) waitBackground() {
	if t != nil {
		t.bg.Wait()
	}
}
