package filetier

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/vmarena/vmarena/internal/nocopy"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
)

// A block's life cycle, as the file system and the index see it:
//
//  1. Writing: Store reserved its file's bytes against the budget (evicting what it
//     had to) and writes the file under a temporary name, "<hash>.<n>.tmp". No Load
//     or Contains sees it; a process killed now leaves the temporary file, which the
//     next New removes.
//  2. Held: the file was renamed to its key's name under the lock, in one step that
//     replaces any file of that key, and is in the index and the LRU list.
//  3. Gone: evicted, replaced, deleted or refused as corrupt: out of the index, its
//     name unlinked under the lock. A Load that opened it before keeps reading the
//     whole old file (POSIX keeps an unlinked file's data while it is open).
//
// Transitions: Writing → Held (written and renamed) or Gone (fill or the write
// failed: the temporary file is removed); Held → Gone. The index holds a key exactly
// while its file is Held, since both change together under the lock.

// Defaults of Options' zero fields.
const (
	// DefaultMaxValueSize bounds a value when Options.MaxValueSize is 0 (or the
	// budget, if that is smaller).
	DefaultMaxValueSize = 64 << 20
	// DefaultAlign is the unit every file is padded to and every buffer aligned to:
	// what O_DIRECT needs on every Linux block device (4 KiB logical sectors and 512).
	DefaultAlign = 4 << 10
	// DefaultLoads and DefaultStores bound the loads and the stores in flight.
	DefaultLoads  = 8
	DefaultStores = 4
	// DefaultBudgetShare is the share of the file system's free space (plus what
	// the directory's blocks already hold) a zero Options.Budget takes, in percent.
	DefaultBudgetShare = 90

	tierName = "file"
	lockName = "LOCK"
	tmpExt   = ".tmp"
)

// Options configure a Tier.
type Options struct {
	// Dir is the directory of the blocks. Required; it must exist and be writable.
	// The tier keeps a LOCK file and one subdirectory per namespace in it, and
	// nothing else should write there.
	Dir string
	// Budget is the most bytes of files the tier keeps (each block padded to whole
	// alignment units); New refuses one above what the file system has free plus what
	// the directory's blocks hold (ErrNoSpace). 0 means DefaultBudgetShare percent of
	// that sum.
	Budget int64
	// Namespace, when not 0, is the only namespace the tier serves: the namespace of
	// the cache above it (kv.TierNamespace). New then ignores (and logs) the blocks of
	// every other namespace it finds in Dir, and Store refuses keys of another
	// (ErrNamespace). 0 serves every namespace.
	Namespace uint64
	// MaxValueSize bounds a value; 0 means DefaultMaxValueSize, or less when the
	// budget is smaller.
	MaxValueSize int
	// Loads and Stores bound the loads and the stores in flight; a call past the
	// bound waits for a slot within its context. 0 means DefaultLoads and
	// DefaultStores.
	Loads, Stores int
	// Buffered turns direct I/O off: every file goes through the page cache.
	Buffered bool
	// Sync fsyncs each file before its rename, and the directory after, so that a
	// block survives a power loss too; without it a block written shortly before a
	// power loss may be lost or refused by its checksum (a miss), never served torn.
	Sync bool
	// Logger takes the tier's few lines (what a warm start found, what it ignored,
	// a fall back from direct I/O); nil means slog.Default().
	Logger *slog.Logger
}

// Stats is a snapshot of a Tier's counters.
type Stats struct {
	Hits        int64 // loads that found and checked their block
	Misses      int64 // loads of a key the tier does not hold
	Stores      int64 // blocks written
	StoredBytes int64 // value bytes of those blocks
	LoadedBytes int64 // value bytes handed to use
	// Drops counts stores that kept nothing for a reason of the tier (full, a write
	// error, a size out of range, another namespace, the caller's context); not those
	// whose fill failed. WriteErrors is the part of them the file system refused.
	Drops, WriteErrors int64
	// ReadErrors counts loads whose file could not be read.
	ReadErrors int64
	// Corrupt counts blocks refused by a check (ErrCorrupt) at a load or at start.
	Corrupt   int64
	Evictions int64 // blocks evicted to keep within the budget
	// Warm is the blocks New found in Dir and kept; Foreign the blocks of other
	// namespaces it ignored; Leftovers the temporary files of writes a killed process
	// left, which it removed.
	Warm, Foreign, Leftovers int64
	Blocks                   int   // blocks held now
	Bytes                    int64 // their files' bytes
	Budget                   int64 // the most Bytes can be
	// IO is how files are read and written: "O_DIRECT" (Linux), "F_NOCACHE" (macOS)
	// or "buffered".
	IO string
}

// Tier is a kv.Tier that keeps each block in a file of its own on a local file
// system, with direct I/O where the file system takes it. It finds the blocks of a
// previous run on the same directory (a warm start), checks every block it reads
// (key, namespace, length, CRC-32C) and evicts the least recently used blocks to
// stay within its budget.
//
// A Tier is safe for concurrent use. It MUST be closed with Close, which releases the
// directory's lock; the blocks stay for the next run.
type Tier struct {
	_ nocopy.NoCopy

	dir    string
	ns     uint64
	budget int64
	max    int
	align  int
	direct bool
	sync   bool
	log    *slog.Logger
	lockF  *os.File
	loads  chan struct{}
	stores chan struct{}
	seq    atomic.Uint64
	free   sync.Map // buffer class (bytes) → chan *[]byte: free aligned buffers
	// writeHook, nil outside tests (export_test.go), replaces the write of a file's
	// bytes, so that a test can fail it as a full disk would.
	writeHook func(f *os.File, b []byte) error

	mu      sync.Mutex
	closed  bool
	ops     int       // calls in progress
	idle    sync.Cond // on mu: signalled when ops drops to 0 during Close
	index   map[tierval.Key]*entry
	lru     entry // sentinel: lru.next is the most recently used
	nsDirs  map[uint64]bool
	held    int64 // bytes of Held files
	pending int64 // bytes reserved by Writing files
	counter Stats
}

// entry is one Held block.
type entry struct {
	key        tierval.Key
	size       int64 // the file's bytes
	prev, next *entry
}

var _ kv.Tier = (*Tier)(nil)

// New opens the tier on opts.Dir: it locks the directory, finds out whether its file
// system takes direct I/O, removes what killed writers left, indexes the blocks a
// previous run stored (those of opts.Namespace, or all), sizes the budget against the
// file system's free space and evicts down to it. Errors: ErrBadOptions, ErrDir (a
// missing, read-only or unwritable directory, wrapping the OS's error), ErrLocked,
// ErrNoSpace.
func New(opts Options) (*Tier, error) {
	switch {
	case opts.Dir == "":
		return nil, fmt.Errorf("%w: no directory", ErrBadOptions)
	case opts.Budget < 0:
		return nil, fmt.Errorf("%w: budget %d bytes", ErrBadOptions, opts.Budget)
	case opts.MaxValueSize < 0:
		return nil, fmt.Errorf("%w: MaxValueSize %d", ErrBadOptions, opts.MaxValueSize)
	case opts.Loads < 0 || opts.Stores < 0:
		return nil, fmt.Errorf("%w: Loads %d, Stores %d: neither may be negative", ErrBadOptions, opts.Loads, opts.Stores)
	}
	t := &Tier{dir: opts.Dir, ns: opts.Namespace, align: DefaultAlign, sync: opts.Sync, log: opts.Logger,
		index: make(map[tierval.Key]*entry), nsDirs: make(map[uint64]bool)}
	if t.log == nil {
		t.log = slog.Default()
	}
	t.idle.L = &t.mu
	t.lru.next, t.lru.prev = &t.lru, &t.lru
	t.loads = make(chan struct{}, cmpOr(opts.Loads, DefaultLoads))
	t.stores = make(chan struct{}, cmpOr(opts.Stores, DefaultStores))

	if st, err := os.Stat(opts.Dir); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrDir, err)
	} else if !st.IsDir() {
		return nil, fmt.Errorf("%w: %s is not a directory", ErrDir, opts.Dir)
	}
	lf, err := os.OpenFile(filepath.Join(opts.Dir, lockName), os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrDir, err)
	}
	if err := lockFile(lf); err != nil {
		lf.Close()
		if errors.Is(err, ErrLocked) {
			return nil, fmt.Errorf("%w: %s", ErrLocked, opts.Dir)
		}
		return nil, fmt.Errorf("%w: lock %s: %w", ErrDir, lf.Name(), err)
	}
	t.lockF = lf
	fail := func(err error) (*Tier, error) {
		lf.Close()
		return nil, err
	}
	if err := t.probe(!opts.Buffered); err != nil {
		return fail(err)
	}
	if err := t.scan(); err != nil {
		return fail(err)
	}
	if err := t.size(opts); err != nil {
		return fail(err)
	}
	t.mu.Lock()
	victims := t.evictTo(t.budget)
	t.mu.Unlock()
	if victims > 0 {
		t.log.Info("filetier: evicted blocks of the last run to fit the budget", "dir", t.dir, "blocks", victims, "budget", t.budget)
	}
	return t, nil
}

func cmpOr(v, def int) int {
	if v == 0 {
		return def
	}
	return v
}

// probe writes and removes one aligned file, with direct I/O when direct: a
// directory that takes no file (read-only, no permission, full) is ErrDir; a file
// system that refuses direct I/O (tmpfs: EINVAL) gets buffered I/O, logged.
func (t *Tier) probe(direct bool) error {
	name := filepath.Join(t.dir, ".probe-"+strconv.Itoa(os.Getpid())+tmpExt)
	b := alignedBytes(t.align, t.align)
	try := func(direct bool) error {
		f, err := createFile(name, direct)
		if err != nil {
			return err
		}
		_, err = f.WriteAt(b, 0)
		return errors.Join(err, f.Close(), os.Remove(name))
	}
	if direct && directName != "" {
		err := try(true)
		if err == nil {
			t.direct = true
			return nil
		}
		_ = os.Remove(name)
		t.log.Info("filetier: the file system refuses direct I/O; files go through the page cache", "dir", t.dir, "io", directName, "err", err)
	}
	if err := try(false); err != nil {
		_ = os.Remove(name)
		if errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT) {
			return fmt.Errorf("%w: %s takes no file: %w", ErrNoSpace, t.dir, err)
		}
		return fmt.Errorf("%w: %s takes no file: %w", ErrDir, t.dir, err)
	}
	return nil
}

// size sets the budget and MaxValueSize from opts, the free space and what the
// warm start found.
func (t *Tier) size(opts Options) error {
	free, err := freeSpace(t.dir)
	switch {
	case errors.Is(err, errors.ErrUnsupported):
		if opts.Budget == 0 {
			return fmt.Errorf("%w: the free space is not known on this system: a Budget is required", ErrBadOptions)
		}
		t.budget = opts.Budget
	case err != nil:
		return fmt.Errorf("%w: statfs %s: %w", ErrDir, t.dir, err)
	default:
		room := free + t.held
		t.budget = opts.Budget
		if t.budget == 0 {
			t.budget = room / 100 * DefaultBudgetShare
		}
		if t.budget > room {
			return fmt.Errorf("%w: budget %d bytes, %s has %d free and its blocks hold %d", ErrNoSpace, t.budget, t.dir, free, t.held)
		}
	}
	t.max = opts.MaxValueSize
	if t.max == 0 {
		t.max = DefaultMaxValueSize
		if lim := t.budget - int64(t.align); int64(t.max) > lim {
			t.max = int(max(lim, 0)) / t.align * t.align
		}
	}
	if int64(fileSize(t.max, t.align)) > t.budget {
		return fmt.Errorf("%w: a value of MaxValueSize %d bytes takes a file of %d, above the budget %d",
			cmpErr(opts.Budget == 0, ErrNoSpace, ErrBadOptions), t.max, fileSize(t.max, t.align), t.budget)
	}
	t.counter.Budget = t.budget
	return nil
}

func cmpErr(c bool, a, b error) error {
	if c {
		return a
	}
	return b
}

// Name returns "file".
func (t *Tier) Name() string { return tierName }

// MaxValueSize returns the largest value Store accepts.
func (t *Tier) MaxValueSize() int { return t.max }

// Dir returns the tier's directory.
func (t *Tier) Dir() string { return t.dir }

// Stats returns the counters.
func (t *Tier) Stats() Stats {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := t.counter
	s.Blocks, s.Bytes, s.Budget = len(t.index), t.held, t.budget
	s.IO = "buffered"
	if t.direct {
		s.IO = directName
	}
	return s
}

// Store fills a buffer of size bytes and writes it as key's block: to a temporary
// file, then renamed over key's name, so that a reader (or a later run) sees the old
// block or the new one, never part of one. fill's error is Store's and nothing is
// kept. dst's contents are unspecified (a recycled buffer): fill must write all of
// it, and must not keep it. A full budget evicts the least recently used blocks; a
// file system that refuses the write (full, read-only) is ErrWrite, counted.
func (t *Tier) Store(ctx context.Context, key tierval.Key, size int, fill func(dst []byte) error) error {
	if fill == nil {
		panic(PanicNilFunc)
	}
	t.enter()
	defer t.leave()
	switch {
	case ctx.Err() != nil:
		return t.dropped(ctx.Err())
	case size < 0:
		return t.dropped(fmt.Errorf("%w: %d bytes", ErrBadSize, size))
	case size > t.max:
		return t.dropped(fmt.Errorf("%w: %d bytes (at most %d)", ErrTooLarge, size, t.max))
	case t.ns != 0 && key.Namespace != t.ns:
		return t.dropped(fmt.Errorf("%w: %016x, the tier serves %016x", ErrNamespace, key.Namespace, t.ns))
	}
	if err := acquire(ctx, t.stores); err != nil {
		return t.dropped(err)
	}
	defer func() { <-t.stores }()
	fsz := int64(fileSize(size, t.align))
	if err := t.reserve(fsz); err != nil {
		return t.dropped(err)
	}
	kept := false
	defer func() {
		if !kept {
			t.mu.Lock()
			t.pending -= fsz
			t.mu.Unlock()
		}
	}()
	bp := t.buffer(int(fsz))
	defer t.putBuffer(bp)
	b := (*bp)[:fsz]
	if err := fill(b[headerSize : headerSize+size]); err != nil {
		return err
	}
	seal(b, key, size, t.align)
	dir, err := t.nsDir(key.Namespace)
	if err != nil {
		return t.writeFailed(err)
	}
	tmp := filepath.Join(dir, hex(key.Hash)+"."+strconv.FormatUint(t.seq.Add(1), 10)+tmpExt)
	if err := t.write(tmp, b); err != nil {
		_ = os.Remove(tmp)
		return t.writeFailed(err)
	}
	t.mu.Lock()
	if err := renameOver(tmp, filepath.Join(dir, hex(key.Hash))); err != nil {
		t.counter.Drops++
		t.counter.WriteErrors++
		t.mu.Unlock()
		_ = os.Remove(tmp)
		return fmt.Errorf("%w: %w", ErrWrite, err)
	}
	if old := t.index[key]; old != nil {
		t.forget(old) // its file was replaced by the rename
	}
	e := &entry{key: key, size: fsz}
	t.index[key] = e
	t.pushFront(e)
	t.pending -= fsz
	t.held += fsz
	kept = true
	t.counter.Stores++
	t.counter.StoredBytes += int64(size)
	t.mu.Unlock()
	if t.sync {
		syncDir(dir)
	}
	return nil
}

// write writes b, a whole file, to name, which must not exist.
func (t *Tier) write(name string, b []byte) error {
	f, err := createFile(name, t.direct)
	if err != nil {
		return err
	}
	if t.writeHook != nil {
		err = t.writeHook(f, b)
	} else {
		_, err = f.WriteAt(b, 0)
	}
	if err == nil && t.sync {
		err = f.Sync()
	}
	return errors.Join(err, f.Close())
}

// syncDir fsyncs dir, so that a rename in it is durable; a failure costs the block
// at a power loss only, and is not reported.
func syncDir(dir string) {
	if d, err := os.Open(dir); err == nil {
		_ = d.Sync()
		_ = d.Close()
	}
}

func (t *Tier) dropped(err error) error {
	t.mu.Lock()
	t.counter.Drops++
	t.mu.Unlock()
	return err
}

func (t *Tier) writeFailed(err error) error {
	t.mu.Lock()
	t.counter.Drops++
	t.counter.WriteErrors++
	t.mu.Unlock()
	return fmt.Errorf("%w: %w", ErrWrite, err)
}

// reserve takes n bytes of the budget for a file being written, evicting the least
// recently used blocks to make room: ErrFull when even an empty index leaves none
// (the rest of the budget is being written).
func (t *Tier) reserve(n int64) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.evictTo(t.budget - n - t.pending)
	if t.held+t.pending+n > t.budget {
		return fmt.Errorf("%w: %d bytes held, %d being written, %d asked, budget %d", ErrFull, t.held, t.pending, n, t.budget)
	}
	t.pending += n
	return nil
}

// evictTo evicts the least recently used blocks until the held bytes are at most
// limit, and returns how many it evicted. The lock must be held.
func (t *Tier) evictTo(limit int64) int {
	n := 0
	for t.held > limit && t.lru.prev != &t.lru {
		t.unlink(t.lru.prev)
		t.counter.Evictions++
		n++
	}
	return n
}

// unlink makes e Gone: out of the index and the list, its file removed. The lock
// must be held.
func (t *Tier) unlink(e *entry) {
	t.forget(e)
	_ = os.Remove(t.path(e.key))
}

// forget takes e out of the index and the list and its bytes off the held ones. The
// lock must be held.
func (t *Tier) forget(e *entry) {
	delete(t.index, e.key)
	e.prev.next, e.next.prev = e.next, e.prev
	e.prev, e.next = nil, nil
	t.held -= e.size
}

func (t *Tier) pushFront(e *entry) {
	e.prev, e.next = &t.lru, t.lru.next
	e.prev.next, e.next.prev = e, e
}

func (t *Tier) touch(e *entry) {
	e.prev.next, e.next.prev = e.next, e.prev
	t.pushFront(e)
}

// bufferClass is the step of the buffers' sizes: a file takes the buffers of its size
// rounded up to it, so that blocks of one size (the usual case) share them.
const bufferClass = 64 << 10

// buffer returns an aligned buffer of at least n bytes, a free one of its class if
// there is one. It MUST be given back with putBuffer. NB: a free list, not a
// sync.Pool: a pool empties at every collection, and a fresh 2 MiB buffer costs its
// page faults (about 1.4 ms/MiB here), more than the block's I/O.
func (t *Tier) buffer(n int) *[]byte {
	c := roundUp(max(n, 1), bufferClass)
	if free, ok := t.free.Load(c); ok {
		select {
		case b := <-free.(chan *[]byte):
			return b
		default:
		}
	}
	b := alignedBytes(c, t.align)
	return &b
}

// putBuffer gives b back to its class's free list, which keeps as many as can be in
// flight at once (Loads + Stores) and drops the rest for the collector.
func (t *Tier) putBuffer(b *[]byte) {
	free, ok := t.free.Load(cap(*b))
	if !ok {
		free, _ = t.free.LoadOrStore(cap(*b), make(chan *[]byte, cap(t.loads)+cap(t.stores)))
	}
	select {
	case free.(chan *[]byte) <- b:
	default:
	}
}

// nsDir returns the directory of namespace ns's blocks, made if it is not there.
func (t *Tier) nsDir(ns uint64) (string, error) {
	dir := filepath.Join(t.dir, hex(ns))
	t.mu.Lock()
	made := t.nsDirs[ns]
	t.mu.Unlock()
	if made {
		return dir, nil
	}
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return "", err
	}
	t.mu.Lock()
	t.nsDirs[ns] = true
	t.mu.Unlock()
	return dir, nil
}

// path returns the name of key's file.
func (t *Tier) path(key tierval.Key) string {
	return filepath.Join(t.dir, hex(key.Namespace), hex(key.Hash))
}

// Load reads key's block and calls use with its value, once every check passed. A
// key the tier does not hold is kv.ErrTierMiss. A block that fails a check is
// ErrCorrupt: counted, removed, never handed to use.
func (t *Tier) Load(ctx context.Context, key tierval.Key, use func(src []byte) error) error {
	if use == nil {
		panic(PanicNilFunc)
	}
	t.enter()
	defer t.leave()
	if err := ctx.Err(); err != nil {
		return err
	}
	t.mu.Lock()
	e := t.index[key]
	if e == nil {
		t.counter.Misses++
		t.mu.Unlock()
		return kv.ErrTierMiss
	}
	t.touch(e)
	t.mu.Unlock()
	if err := acquire(ctx, t.loads); err != nil {
		return err
	}
	defer func() { <-t.loads }()
	v, bp, err := t.read(key, 0)
	if err != nil {
		return err
	}
	defer t.putBuffer(bp)
	t.mu.Lock()
	t.counter.Hits++
	t.counter.LoadedBytes += int64(len(v))
	t.mu.Unlock()
	return use(v)
}

// Peek calls use with the first min(n, size) bytes of the value under key
// (kv.TierPeeker): one read of the first whole alignment units of its file that hold
// them, within a load slot. It checks the file's header (its key, its length) but not
// the checksum, which covers the whole value: the cache's Load checks that. It marks
// nothing used and counts no hit or miss; a file whose header fails is refused
// (counted as corrupt) as by Load.
func (t *Tier) Peek(ctx context.Context, key tierval.Key, n int, use func(head []byte) error) error {
	if n < 1 {
		panic(kv.PanicPeekLength)
	}
	if use == nil {
		panic(PanicNilFunc)
	}
	t.enter()
	defer t.leave()
	if err := ctx.Err(); err != nil {
		return err
	}
	t.mu.Lock()
	held := t.index[key] != nil
	t.mu.Unlock()
	if !held {
		return kv.ErrTierMiss
	}
	if err := acquire(ctx, t.loads); err != nil {
		return err
	}
	defer func() { <-t.loads }()
	v, bp, err := t.read(key, min(n, t.max))
	if err != nil {
		return err
	}
	defer t.putBuffer(bp)
	return use(v[:min(n, len(v))])
}

// read reads and checks key's file into a buffer of the pool and returns its value
// and the buffer, which the caller MUST give back with putBuffer once it is done
// with the value. With head 0 it reads the whole file and checks everything; with
// head above 0 (a Peek) only the first alignment units that hold head bytes of the
// value, and checks everything but the checksum, and a file gone since the index
// said it was held is no counted miss.
func (t *Tier) read(key tierval.Key, head int) ([]byte, *[]byte, error) {
	name := t.path(key)
	f, err := openFile(name, t.direct)
	if errors.Is(err, fs.ErrNotExist) {
		// Deleted or evicted since the index lookup.
		if head == 0 {
			t.mu.Lock()
			t.counter.Misses++
			t.mu.Unlock()
		}
		return nil, nil, kv.ErrTierMiss
	}
	if err != nil {
		return nil, nil, t.readFailed(err)
	}
	defer f.Close()
	info, err := f.Stat()
	if err != nil {
		return nil, nil, t.readFailed(err)
	}
	n := info.Size()
	if limit := int64(fileSize(t.max, t.align)); n < int64(t.align) || n%int64(t.align) != 0 || n > limit {
		return nil, nil, t.refuse(key, info, corrupt("file of %d bytes (whole units of %d, at most %d)", n, t.align, limit))
	}
	want := n
	if head > 0 {
		want = min(int64(roundUp(headerSize+head, t.align)), n)
	}
	bp := t.buffer(int(want))
	b := (*bp)[:want]
	got, err := f.ReadAt(b, 0)
	if got == len(b) {
		var v []byte
		if head > 0 {
			v, err = openHead(b, key, t.align, n)
		} else {
			v, err = open(b, key, t.align)
		}
		if err == nil {
			return v, bp, nil
		}
	} else if err == nil || errors.Is(err, io.EOF) {
		err = corrupt("read %d bytes of %d", got, want)
	} else {
		t.putBuffer(bp)
		return nil, nil, t.readFailed(err)
	}
	t.putBuffer(bp)
	return nil, nil, t.refuse(key, info, err)
}

func (t *Tier) readFailed(err error) error {
	t.mu.Lock()
	t.counter.ReadErrors++
	t.mu.Unlock()
	return fmt.Errorf("%w: %w", ErrRead, err)
}

// refuse counts a corrupt block and forgets it, if the file under its name is still
// the one that failed (not a block stored since), and returns err.
func (t *Tier) refuse(key tierval.Key, bad os.FileInfo, err error) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.counter.Corrupt++
	if e := t.index[key]; e != nil {
		if now, serr := os.Stat(t.path(key)); serr == nil && os.SameFile(now, bad) {
			t.unlink(e)
		}
	}
	return fmt.Errorf("filetier: block %016x:%016x: %w", key.Namespace, key.Hash, err)
}

// Contains returns how many of keys, from the first, the index holds. It reads no
// file: a block found corrupt is refused by the Load that reads it.
func (t *Tier) Contains(ctx context.Context, keys []tierval.Key) (int, error) {
	t.enter()
	defer t.leave()
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for i, k := range keys {
		if t.index[k] == nil {
			return i, nil
		}
	}
	return len(keys), nil
}

// Delete forgets key and removes its file; a key not held is not an error.
func (t *Tier) Delete(ctx context.Context, key tierval.Key) error {
	t.enter()
	defer t.leave()
	if err := ctx.Err(); err != nil {
		return err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if e := t.index[key]; e != nil {
		t.unlink(e)
	}
	return nil
}

// Close waits for the calls in progress and releases the directory's lock. The
// blocks stay on disk for the next New on the directory. A second Close changes
// nothing and returns ErrClosed (docs/server.md, "A second Close").
func (t *Tier) Close() error {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return ErrClosed
	}
	t.closed = true
	for t.ops > 0 {
		t.idle.Wait()
	}
	t.mu.Unlock()
	return t.lockF.Close()
}

// enter counts a call in progress; after Close it panics.
func (t *Tier) enter() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		panic(PanicClosed)
	}
	t.ops++
}

func (t *Tier) leave() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.ops--
	if t.ops == 0 && t.closed {
		t.idle.Broadcast()
	}
}

// acquire takes a slot of sem within ctx.
func acquire(ctx context.Context, sem chan struct{}) error {
	select {
	case sem <- struct{}{}:
		return nil
	default:
	}
	select {
	case sem <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// hex returns v in 16 lower-case hex digits.
func hex(v uint64) string {
	const digits = "0123456789abcdef"
	var b [16]byte
	for i := 15; i >= 0; i-- {
		b[i] = digits[v&0xf]
		v >>= 4
	}
	return string(b[:])
}
