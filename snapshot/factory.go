package snapshot

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/internal/nocopy"
)

// Kind names the memory a factory's stores commit from.
type Kind uint8

const (
	// Private is host.Private: every store commits anonymous memory of its own,
	// which goes back to the OS at Reset. The default.
	Private Kind = iota
	// Shared is host.Shared: the stores of one factory commit granules from one pool,
	// which keeps the granules a Reset gives back warm for the next Prepare of any
	// store and returns idle ones to the OS by decay (see host.SharedOptions).
	Shared
)

func (k Kind) String() string {
	switch k {
	case Private:
		return "private"
	case Shared:
		return "shared"
	}
	return fmt.Sprintf("Kind(%d)", uint8(k))
}

// Defaults of Options.
const (
	// DefaultGranularity is the granule a store commits in: a snapshot holds at most
	// one partly used granule.
	DefaultGranularity = 2 << 20
	// DefaultMaxSize is the address space each store reserves, the largest snapshot
	// it can hold: more than the KV state of a 7B model with no grouped-query
	// attention at a 32k-token context in fp16 (512 KiB a token, 16 GiB). It costs
	// address space, not memory.
	DefaultMaxSize = 64 << 30
	// DefaultName labels the factory's ledger and, on Linux, its mappings.
	DefaultName = "snapshot"
)

// Options configure NewFactory. The zero value gives stores on host.Private with
// 2 MiB granules in huge pages where the system has them, populated at commit,
// that refuse at once what the budget can not cover.
type Options struct {
	// Backing picks the memory: Private (the default) or Shared.
	Backing Kind
	// Granularity is the granule size in bytes: a power of two and a multiple of the
	// page size (64 KiB or more for Shared on Windows). 0 means DefaultGranularity.
	Granularity int
	// MaxSize is the largest snapshot a store can hold: the address space it reserves
	// at its first Prepare. 0 means DefaultMaxSize.
	MaxSize int
	// NoPopulate leaves new granules to be faulted in by the caller's first writes.
	// By default a commit populates them (MADV_POPULATE_WRITE on Linux), which costs
	// about a quarter of the faults: the caller of Prepare writes the whole slice.
	NoPopulate bool
	// NoHugePages makes granules of small pages. By default, where the granule is a
	// multiple of the huge page (2 MiB on x86-64) and the system allows transparent
	// huge pages, each granule is one huge page, also on a virtual machine that
	// reports its free memory to its host in huge-page blocks, where the backings'
	// own default is small pages (host.PrivateOptions.AlwaysHugePages): a store
	// fills every granule it commits and gives them all back at Reset, and a huge
	// page is given back 14-21 times faster than 512 small ones. On such a virtual
	// machine Prepare, fill and Commit then cost 1.2-1.6 times what they cost on
	// small pages, where elsewhere a fresh huge page is the cheaper (BENCHMARKS.md).
	NoHugePages bool
	// WaitFor is how long a Prepare that the budget refuses waits for other stores or
	// ledgers of the device to give bytes back (the governor's FIFO queue), within its
	// context, before it is refused. 0 refuses at once.
	WaitFor time.Duration
	// Name labels the factory's ledger (and the mappings or memfd on Linux). ""
	// means DefaultName.
	Name string
	// Pool holds the pool's other settings (Low, High, Decay, huge pages, Logger)
	// when Backing is Shared. Its Granularity, Authority, Populate and Name must be
	// zero: the factory sets them from the fields above. Ignored for Private.
	Pool host.SharedOptions
}

// buffer is what a Store needs of its arena.Buffer, whatever the backing: it
// erases the Buffer's type parameters so that Store names none.
type buffer interface {
	Resize(n int) error
	ResizeCtx(ctx context.Context, n int) error
	Bytes() []byte
	Base() uintptr
	Committed() int
	Close() accounting.ReleaseOutcome
}

// Factory makes the Stores of one server, which all charge one ledger on the
// governor's host budget. Its zero value is not usable; call NewFactory.
type Factory struct {
	_ nocopy.NoCopy

	auth    *accounting.Authority
	pool    *host.Shared // nil for Private
	reserve func(size int) (buffer, error)
	zeroes  bool // whether a granule reads as zero right after its commit
	gran    int
	maxSize int
	waitFor time.Duration

	mu     sync.Mutex
	open   int // stores made and not closed
	closed bool

	committed atomic.Int64 // bytes committed by all stores (the sum of their Cap)
	snapshots atomic.Int64 // bytes of all committed snapshots (the sum of their Len)
	refusals  atomic.Int64 // Prepares the budget refused
}

// NewFactory returns a Factory whose stores draw from g's host budget through one
// ledger named opts.Name. It returns an error matching ErrOptions for a nil
// governor or options out of their domain, those the backing refuses included (the
// error then matches host's ErrPrivateOptions or ErrSharedOptions too), and the
// backing's error (errors.ErrUnsupported, say) when the backing can not be made
// otherwise. The Factory MUST be closed with Close once its stores are.
func NewFactory(g *accounting.Governor, opts Options) (*Factory, error) {
	switch {
	case g == nil:
		return nil, fmt.Errorf("%w: nil governor", ErrOptions)
	case opts.Granularity < 0, opts.MaxSize < 0:
		return nil, fmt.Errorf("%w: granularity %d, max size %d", ErrOptions, opts.Granularity, opts.MaxSize)
	case opts.WaitFor < 0:
		return nil, fmt.Errorf("%w: negative wait %v", ErrOptions, opts.WaitFor)
	case opts.Backing > Shared:
		return nil, fmt.Errorf("%w: backing %v", ErrOptions, opts.Backing)
	case opts.Backing == Shared && (opts.Pool.Granularity != 0 || opts.Pool.Authority != nil || opts.Pool.Populate || opts.Pool.Name != ""):
		return nil, fmt.Errorf("%w: Pool's Granularity, Authority, Populate and Name are the factory's", ErrOptions)
	}
	gran := cmpOr(opts.Granularity, DefaultGranularity)
	maxSize := cmpOr(opts.MaxSize, DefaultMaxSize)
	name := opts.Name
	if name == "" {
		name = DefaultName
	}
	f := &Factory{
		auth:    g.Authority(name, accounting.HostKey),
		gran:    gran,
		maxSize: maxSize,
		waitFor: opts.WaitFor,
	}
	switch opts.Backing {
	case Private:
		p, err := host.NewPrivate(host.PrivateOptions{Granularity: gran, Populate: !opts.NoPopulate, Name: name, NoHugePages: opts.NoHugePages, AlwaysHugePages: !opts.NoHugePages})
		if err != nil {
			_ = f.auth.Close() // holds nothing yet
			return nil, optionsError(err)
		}
		f.zeroes = p.CommitZeroes()
		f.reserve = func(size int) (buffer, error) { return arena.NewBuffer(p, size, f.auth) }
	case Shared:
		po := opts.Pool
		po.Granularity, po.Authority, po.Populate, po.Name = gran, f.auth, !opts.NoPopulate, name
		po.NoHugePages = po.NoHugePages || opts.NoHugePages
		po.AlwaysHugePages = po.AlwaysHugePages || !po.NoHugePages
		s, err := host.NewShared(po)
		if err != nil {
			_ = f.auth.Close()
			return nil, optionsError(err)
		}
		f.pool = s
		f.zeroes = s.CommitZeroes()
		f.reserve = func(size int) (buffer, error) { return arena.NewBuffer(s, size, nil) }
	}
	return f, nil
}

// optionsError returns err, the backing's refusal, wrapped in ErrOptions where it
// refuses options (so that both sentinels match), else as it is.
func optionsError(err error) error {
	if errors.Is(err, host.ErrPrivateOptions) || errors.Is(err, host.ErrSharedOptions) {
		return fmt.Errorf("%w: %w", ErrOptions, err)
	}
	return err
}

func cmpOr(v, def int) int {
	if v == 0 {
		return def
	}
	return v
}

// New returns a new, empty Store of the factory. It reserves nothing until its
// first Prepare, so a server may make one per session up front. It returns ctx's
// error when ctx is done and ErrFactoryClosed after Close. The Store MUST be closed
// with Store.Close.
func (f *Factory) New(ctx context.Context) (*Store, error) {
	if ctx == nil {
		panic(PanicNilContext)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return nil, ErrFactoryClosed
	}
	f.open++
	return &Store{f: f}, nil
}

// storeClosed records that one of the factory's stores closed.
func (f *Factory) storeClosed() {
	f.mu.Lock()
	f.open--
	f.mu.Unlock()
}

// Close gives back what the factory holds of its own (a Shared pool's idle
// granules and memfd) and retires its ledger. It returns an error matching
// ErrFactoryBusy, and changes nothing, while a store is open. A second Close changes
// nothing and returns ErrFactoryClosed (docs/server.md, "A second Close").
func (f *Factory) Close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	switch {
	case f.closed:
		return ErrFactoryClosed
	case f.open > 0:
		return fmt.Errorf("%w: %d open", ErrFactoryBusy, f.open)
	}
	if f.pool != nil {
		if err := f.pool.Close(); err != nil {
			return err
		}
	}
	f.closed = true
	// NB: a ledger still owning bytes here is one whose release was Quarantined; it
	// stays on its device's list, so those bytes stay visible.
	_ = f.auth.Close()
	return nil
}

// Authority returns the ledger every store of the factory charges: its owned bytes
// are what the stores hold (and, for Shared, the pool's idle granules).
func (f *Factory) Authority() *accounting.Authority { return f.auth }

// Granularity returns the granule the stores commit in.
func (f *Factory) Granularity() int { return f.gran }

// MaxSize returns the largest snapshot a store can hold.
func (f *Factory) MaxSize() int { return f.maxSize }

// Stats is a snapshot of a factory.
type Stats struct {
	Stores    int   // open stores
	Committed int64 // bytes the stores hold: the sum of their Cap
	Snapshots int64 // bytes of committed snapshots: the sum of their Len
	Refusals  int64 // Prepares the budget refused, since NewFactory
	Idle      int64 // bytes of idle granules a Shared pool keeps for later commits; 0 for Private
	// Ledger is the factory's ledger. At rest its Owned is Committed + Idle.
	Ledger accounting.AuthorityStats
}

// Stats returns a snapshot of the factory. It may be called from any goroutine, also
// after Close.
func (f *Factory) Stats() Stats {
	f.mu.Lock()
	open := f.open
	f.mu.Unlock()
	var idle int64
	if f.pool != nil {
		idle = f.pool.PoolStats().Idle
	}
	return Stats{
		Idle:      idle,
		Stores:    open,
		Committed: f.committed.Load(),
		Snapshots: f.snapshots.Load(),
		Refusals:  f.refusals.Load(),
		Ledger:    f.auth.Stats(),
	}
}

// FactoryFunc returns f.New as a function that returns S, the store interface a
// server defines, so that the function converts to the server's factory type with
// no wrapper of the caller's. For Kronk (sdk/kronk/kvstorage in v1.32.6):
//
//	cfg.SessionStoreFactory = snapshot.FactoryFunc[kvstorage.Store](f)
//
// The function returns the zero S (a nil interface) with New's error. It panics
// with PanicNotStore when *Store does not implement S.
func FactoryFunc[S any](f *Factory) func(context.Context) (S, error) {
	if _, ok := any((*Store)(nil)).(S); !ok {
		panic(PanicNotStore)
	}
	return func(ctx context.Context) (S, error) {
		s, err := f.New(ctx)
		if err != nil {
			var zero S
			return zero, err
		}
		return any(s).(S), nil
	}
}
