package redistier

import (
	"context"
	"errors"
	"fmt"
	"math/bits"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
)

// Defaults of Options' zero fields.
const (
	DefaultPrefix       = "vmkv:"
	DefaultTimeout      = 500 * time.Millisecond
	DefaultBackoff      = time.Second
	DefaultMaxValueSize = 8 << 20
	// MaxValueSizeLimit is Redis's largest string (proto-max-bulk-len's default).
	MaxValueSizeLimit = 512 << 20
)

// Options configure a Tier. The zero value is DefaultPrefix, DefaultTimeout,
// DefaultBackoff, DefaultMaxValueSize and no expiry.
type Options struct {
	// Prefix starts every key, so that tiers of different applications on one server
	// keep apart; "" means DefaultPrefix. It may not contain '{', which would make a
	// cluster put every block in one hash slot.
	Prefix string
	// Timeout bounds each call (one GET, SET, DEL, or one pipeline of EXISTS); 0
	// means DefaultTimeout. See the package doc on ContextTimeoutEnabled.
	Timeout time.Duration
	// Backoff is how long after a failure of the network or the server every call
	// fails at once with ErrUnavailable; 0 means DefaultBackoff, a negative value
	// never backs off.
	Backoff time.Duration
	// MaxValueSize bounds a value; 0 means DefaultMaxValueSize. It may not exceed
	// MaxValueSizeLimit.
	MaxValueSize int
	// TTL, when positive, makes each stored block expire that long after its Store;
	// 0 keeps it until the server's eviction policy drops it (maxmemory with
	// maxmemory-policy allkeys-lru is the usual setting of a cache server).
	TTL time.Duration
}

// Stats are a Tier's counters since New, one to one with metrics.TierStats's
// counters (whose TierCollector exports them; a Redis tier leaves its HeldBytes and
// BudgetBytes 0). vLLM's names where the meaning matches:
// BytesStored is kv_offload_store_bytes_total and BytesLoaded
// kv_offload_load_bytes_total for this tier; Queries and QueryHits are
// external_prefix_cache_queries_total and external_prefix_cache_hits_total counted
// in blocks.
type Stats struct {
	Hits        int64 // Loads that found their key
	Misses      int64 // Loads of a key the server does not hold
	BytesLoaded int64 // value bytes Loads read
	Stores      int64 // Stores the server took
	BytesStored int64 // value bytes of those Stores
	// DroppedStores counts Stores that kept nothing for a reason of the server or
	// the network (down, timed out, backing off, refused by the server), the
	// caller's context, or a size above MaxValueSize; not those whose fill failed.
	DroppedStores int64
	Queries       int64 // keys asked of Contains
	QueryHits     int64 // keys Contains found, in the runs it returned
	// Errors counts calls of every kind that failed for a reason other than a miss
	// or the caller's own fill or use: a timeout, a server down, a back-off, a
	// context done, an error reply.
	Errors int64
	// Backoffs counts the failures that started a back-off.
	Backoffs int64
}

// Tier is a [kv.Tier] on a Redis or Valkey server or cluster. Make one with New.
type Tier struct {
	client  redis.UniversalClient
	prefix  string
	timeout time.Duration
	backoff time.Duration
	max     int
	ttl     time.Duration

	downUntil atomic.Int64 // UnixNano until which calls fail at once; 0: none

	hits, misses, bytesLoaded         atomic.Int64
	stores, bytesStored, droppedStore atomic.Int64
	queries, queryHits                atomic.Int64
	errs, backoffs                    atomic.Int64
}

// New returns a tier over client, which the caller configures (cluster, sentinel,
// TLS, ACL, pool) and closes after the tier's last call. A nil client or an option
// out of range is refused with ErrConfig.
func New(client redis.UniversalClient, opts Options) (*Tier, error) {
	if client == nil {
		return nil, fmt.Errorf("%w: nil client", ErrConfig)
	}
	t := &Tier{client: client, prefix: opts.Prefix, timeout: opts.Timeout, backoff: opts.Backoff, max: opts.MaxValueSize, ttl: opts.TTL}
	if t.prefix == "" {
		t.prefix = DefaultPrefix
	}
	for _, c := range t.prefix {
		if c == '{' {
			return nil, fmt.Errorf("%w: prefix %q has a hash tag brace", ErrConfig, t.prefix)
		}
	}
	switch {
	case t.timeout < 0:
		return nil, fmt.Errorf("%w: negative timeout %v", ErrConfig, t.timeout)
	case t.timeout == 0:
		t.timeout = DefaultTimeout
	}
	if t.backoff == 0 {
		t.backoff = DefaultBackoff
	}
	switch {
	case t.max < 0 || t.max > MaxValueSizeLimit:
		return nil, fmt.Errorf("%w: MaxValueSize %d (at most %d)", ErrConfig, t.max, MaxValueSizeLimit)
	case t.max == 0:
		t.max = DefaultMaxValueSize
	}
	if t.ttl < 0 {
		return nil, fmt.Errorf("%w: negative TTL %v", ErrConfig, t.ttl)
	}
	return t, nil
}

// Name returns "redis".
func (t *Tier) Name() string { return "redis" }

// MaxValueSize returns the largest value Store accepts.
func (t *Tier) MaxValueSize() int { return t.max }

// Stats returns the counters.
func (t *Tier) Stats() Stats {
	return Stats{
		Hits: t.hits.Load(), Misses: t.misses.Load(), BytesLoaded: t.bytesLoaded.Load(),
		Stores: t.stores.Load(), BytesStored: t.bytesStored.Load(), DroppedStores: t.droppedStore.Load(),
		Queries: t.queries.Load(), QueryHits: t.queryHits.Load(),
		Errors: t.errs.Load(), Backoffs: t.backoffs.Load(),
	}
}

// Key returns the Redis key a block is stored under: the prefix, then the namespace
// and the hash in 16 hex digits each.
func (t *Tier) Key(key tierval.Key) string {
	b := make([]byte, 0, len(t.prefix)+33)
	b = append(b, t.prefix...)
	b = appendHex(b, key.Namespace)
	b = append(b, ':')
	b = appendHex(b, key.Hash)
	return string(b)
}

func appendHex(b []byte, v uint64) []byte {
	const digits = "0123456789abcdef"
	for shift := 60; shift >= 0; shift -= 4 {
		b = append(b, digits[v>>uint(shift)&0xf])
	}
	return b
}

// Store fills a buffer of size bytes and SETs it under key (with the TTL, if any).
// fill's error is Store's and nothing is sent. dst's contents are unspecified (a
// recycled buffer): fill must write all of it, and must not keep it.
func (t *Tier) Store(ctx context.Context, key tierval.Key, size int, fill func(dst []byte) error) error {
	if size < 0 || size > t.max {
		t.droppedStore.Add(1)
		return fmt.Errorf("%w: %d bytes (at most %d)", tierval.ErrSize, size, t.max)
	}
	c, cancel, err := t.begin(ctx)
	if err != nil {
		t.droppedStore.Add(1)
		return err
	}
	defer cancel()
	buf := getBuffer(size)
	defer putBuffer(buf)
	if err := fill(buf); err != nil {
		return err
	}
	if err := t.client.Set(c, t.Key(key), buf, t.ttl).Err(); err != nil {
		t.droppedStore.Add(1)
		return t.failed(ctx, "SET", err)
	}
	t.stores.Add(1)
	t.bytesStored.Add(int64(size))
	return nil
}

// Load GETs key and calls use with the value. A key the server does not hold is
// kv.ErrTierMiss; every other failure is an error (see the package doc).
func (t *Tier) Load(ctx context.Context, key tierval.Key, use func(src []byte) error) error {
	c, cancel, err := t.begin(ctx)
	if err != nil {
		return err
	}
	defer cancel()
	v, err := t.client.Get(c, t.Key(key)).Bytes()
	if errors.Is(err, redis.Nil) {
		t.misses.Add(1)
		return kv.ErrTierMiss
	}
	if err != nil {
		return t.failed(ctx, "GET", err)
	}
	t.hits.Add(1)
	t.bytesLoaded.Add(int64(len(v)))
	return use(v)
}

// Peek asks GETRANGE of key's first n bytes, and EXISTS in the same pipeline (an
// empty value and a missing key read the same to GETRANGE), and calls use with them
// (kv.TierPeeker). It counts no hit or miss. A key the server does not hold is
// kv.ErrTierMiss.
func (t *Tier) Peek(ctx context.Context, key tierval.Key, n int, use func(head []byte) error) error {
	if n < 1 {
		panic(kv.PanicPeekLength)
	}
	c, cancel, err := t.begin(ctx)
	if err != nil {
		return err
	}
	defer cancel()
	k := t.Key(key)
	var exists *redis.IntCmd
	var head *redis.StringCmd
	// Pipelined's own error is the first failed command's: each is read below.
	_, _ = t.client.Pipelined(c, func(p redis.Pipeliner) error {
		exists = p.Exists(c, k)
		head = p.GetRange(c, k, 0, int64(n)-1)
		return nil
	})
	held, err := exists.Result()
	if err != nil {
		return t.failed(ctx, "EXISTS", err)
	}
	v, err := head.Bytes()
	if err != nil {
		return t.failed(ctx, "GETRANGE", err)
	}
	if held == 0 {
		return kv.ErrTierMiss
	}
	return use(v)
}

// Contains asks EXISTS of every key in one pipeline and returns the length of the
// run of held keys from the first.
func (t *Tier) Contains(ctx context.Context, keys []tierval.Key) (int, error) {
	c, cancel, err := t.begin(ctx)
	if err != nil {
		return 0, err
	}
	defer cancel()
	if len(keys) == 0 {
		return 0, nil
	}
	t.queries.Add(int64(len(keys)))
	cmds := make([]*redis.IntCmd, len(keys))
	// Pipelined's own error is the first failed command's: each is read below.
	_, _ = t.client.Pipelined(c, func(p redis.Pipeliner) error {
		for i, k := range keys {
			cmds[i] = p.Exists(c, t.Key(k))
		}
		return nil
	})
	for i, cmd := range cmds {
		n, err := cmd.Result()
		if err != nil {
			return 0, t.failed(ctx, "EXISTS", err)
		}
		if n == 0 {
			t.queryHits.Add(int64(i))
			return i, nil
		}
	}
	t.queryHits.Add(int64(len(keys)))
	return len(keys), nil
}

// Delete DELs key.
func (t *Tier) Delete(ctx context.Context, key tierval.Key) error {
	c, cancel, err := t.begin(ctx)
	if err != nil {
		return err
	}
	defer cancel()
	if err := t.client.Del(c, t.Key(key)).Err(); err != nil {
		return t.failed(ctx, "DEL", err)
	}
	return nil
}

// begin returns the context of one call under the tier's timeout, or the reason it
// must not be made: the caller's context is done, or the tier is backing off.
func (t *Tier) begin(ctx context.Context) (context.Context, context.CancelFunc, error) {
	if err := ctx.Err(); err != nil {
		t.errs.Add(1)
		return nil, nil, err
	}
	if until := t.downUntil.Load(); until != 0 && time.Now().UnixNano() < until {
		t.errs.Add(1)
		return nil, nil, ErrUnavailable
	}
	c, cancel := context.WithTimeout(ctx, t.timeout)
	return c, cancel, nil
}

// failed counts a call's failure and returns its error. A failure of the network or
// of the server's availability starts a back-off, unless the caller's own context
// ended the call.
func (t *Tier) failed(ctx context.Context, op string, err error) error {
	t.errs.Add(1)
	if cerr := callerDone(ctx); cerr != nil {
		return fmt.Errorf("redistier: %s: %w (%w)", op, cerr, err)
	}
	if t.backoff > 0 && unavailable(err) {
		t.downUntil.Store(time.Now().Add(t.backoff).UnixNano())
		t.backoffs.Add(1)
	}
	return fmt.Errorf("redistier: %s: %w", op, err)
}

// callerDone returns why the caller's ctx ended, or nil while it has not. NB: a
// socket deadline that go-redis took from the context fires as the deadline passes,
// a moment before the context's own timer marks it done, so a deadline that has
// passed counts as done although ctx.Err() may still be nil.
func callerDone(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if d, ok := ctx.Deadline(); ok && !time.Now().Before(d) {
		return context.DeadlineExceeded
	}
	return nil
}

// unavailable reports whether err says the server can not be reached or can not
// serve now, as opposed to an answer about this one command.
func unavailable(err error) bool {
	var reply redis.Error
	if !errors.As(err, &reply) {
		return true // the network, a timeout, a closed pool
	}
	return redis.IsLoadingError(err) || redis.IsClusterDownError(err) || redis.IsMasterDownError(err) ||
		redis.IsTryAgainError(err) || redis.IsMaxClientsError(err)
}

// Buffers for Store, pooled by power-of-two size class, so that a stream of 2 MiB
// stores does not allocate 2 MiB each.
var buffers [bits.UintSize]sync.Pool

// pooledMin is the smallest buffer worth pooling.
const pooledMin = 4 << 10

func getBuffer(size int) []byte {
	if size < pooledMin {
		return make([]byte, size)
	}
	class := bits.Len(uint(size - 1))
	if p, ok := buffers[class].Get().(*[]byte); ok {
		return (*p)[:size]
	}
	return make([]byte, size, 1<<class)
}

func putBuffer(b []byte) {
	if cap(b) < pooledMin || cap(b)&(cap(b)-1) != 0 {
		return
	}
	b = b[:cap(b)]
	buffers[bits.Len(uint(cap(b)-1))].Put(&b)
}
