package backing

import (
	"context"

	"github.com/vmarena/vmarena/accounting"
)

// Backing is a kind of memory that can reserve address space once and commit physical
// memory into it granule by granule. R is the backing's reservation: one reserved
// range plus whatever the backing must remember about it. R values are handles; the
// backing owns what they point to.
type Backing[R any] interface {
	// Granularity returns the granule size in bytes: a constant power of two (a
	// GranuleChooser's from its first call on). Offsets and sizes passed to Commit
	// and Decommit must be multiples of it.
	Granularity() int

	// Device returns which memory this backing commits.
	Device() accounting.DeviceKey

	// Accounting returns who charges committed physical bytes to the governor.
	Accounting() PhysicalAccounting

	// Reserve moves size bytes of address space from Unreserved to Reserved and
	// commits nothing. size must be a non-negative multiple of Granularity; a zero
	// size yields a valid empty reservation. The reservation MUST be given back with
	// Unreserve.
	Reserve(size int) (R, error)

	// Base returns the first address of the reservation. It never changes.
	// A device address must never be dereferenced on the CPU.
	Base(r R) uintptr

	// Size returns the reserved size in bytes.
	Size(r R) int

	// Commit moves [off, off+size) from Reserved to Committed. Every granule of the
	// range must be Reserved; on any error nothing was committed.
	Commit(r R, off, size int) error

	// Decommit moves [off, off+size) from Committed to Reserved: the contents are
	// forfeit and the physical memory goes back (to the OS, or to the backing's pool).
	// Every granule of the range must be Committed. The range stays reserved.
	Decommit(r R, off, size int) error

	// Unreserve decommits whatever is still committed in r and moves the whole range
	// to Unreserved. The outcome is honest: Complete, Failed when nothing changed (r
	// is then still valid and Unreserve may be called again), or Quarantined when a
	// step failed midway (r is then unusable; the residual bytes stay lost to the
	// process and are reported).
	Unreserve(r R) accounting.ReleaseOutcome
}

// PhysicalAccounting says who charges committed physical bytes to the governor.
// The zero value is ByBuffer.
type PhysicalAccounting struct {
	authority *accounting.Authority
}

// ByBuffer returns the accounting under which the caller that commits (a Buffer)
// charges each granule to its own authority.
func ByBuffer() PhysicalAccounting { return PhysicalAccounting{} }

// ByBacking returns the accounting under which the backing's pool owns every physical
// byte it holds and charges them to a. Callers must not charge committed bytes again.
func ByBacking(a *accounting.Authority) PhysicalAccounting {
	if a == nil {
		panic("backing: ByBacking with a nil authority")
	}
	return PhysicalAccounting{authority: a}
}

// OwnedByBacking reports whether the backing owns and charges physical bytes.
func (p PhysicalAccounting) OwnedByBacking() bool { return p.authority != nil }

// Authority returns the backing's authority, or nil under ByBuffer.
func (p PhysicalAccounting) Authority() *accounting.Authority { return p.authority }

func (p PhysicalAccounting) String() string {
	if p.authority == nil {
		return "by buffer"
	}
	return "by backing (" + p.authority.Name() + ")"
}

// HostAccessible is implemented by backings whose committed memory the CPU may read
// and write directly at Base(r)+off.
type HostAccessible interface {
	HostAccessible() bool
}

// IsHostAccessible reports whether b's memory may be dereferenced on the CPU.
func IsHostAccessible(b any) bool {
	h, ok := b.(HostAccessible)
	return ok && h.HostAccessible()
}

// GranuleChooser is implemented by backings whose granule may be left to their
// first user (host.Shared made with neither Granularity nor ShareUnit): a user that
// maps and shares in units smaller than a granule (a KV cache: one token of every
// layer) asks for a granule that does not carve what it shares coarser than that.
type GranuleChooser interface {
	// ChooseGranule fixes the granule for a user that maps and shares in units of
	// unit bytes, if it is not fixed yet, and returns the granule in force, which
	// Granularity returns from then on. The first of ChooseGranule, Granularity,
	// Reserve and the backing's other entry points fixes it; later calls change
	// nothing. unit must not be negative; 0 asks for the backing's default.
	ChooseGranule(unit int) int
}

// Copier is implemented by backings that can copy bytes into and out of committed
// memory from host memory: directly on the host, through the driver on a device.
// The range [off, off+len(p)) must be Committed; it need not be granule-aligned.
type Copier[R any] interface {
	CopyIn(r R, off int, src []byte) error
	CopyOut(dst []byte, r R, off int) error
}

// Populator is implemented by backings that can make committed memory resident ahead
// of first touch, so that later accesses take no faults. [off, off+size) must be
// Committed and granule-aligned.
type Populator[R any] interface {
	Populate(r R, off, size int) error
}

// Protection is the access a mapping grants.
type Protection uint8

const (
	// ReadWrite mappings may be read and written.
	ReadWrite Protection = iota
	// ReadOnly mappings may only be read; a write faults on the host.
	ReadOnly
)

func (p Protection) String() string {
	if p == ReadOnly {
		return "read-only"
	}
	return "read-write"
}

// Sharer is implemented by backings that can map one physical granule into several
// reservations (the shared-prefix mechanism).
type Sharer[R any] interface {
	// Share moves [dstOff, dstOff+size) of dst from Reserved to Committed by mapping
	// the physical granules committed at [srcOff, srcOff+size) of src, with access
	// prot. Every source granule must be Committed (owned or itself shared) and every
	// destination granule Reserved; src and dst must come from this backing. Each
	// physical granule is reference-counted and freed only with its last mapping.
	//
	// ReadWrite may be asked only of memory src may write now: every source granule
	// must be ReadWrite in src (committed by it, or shared to it with ReadWrite, and
	// not protected ReadOnly by [Protector.Protect]). Otherwise Share fails with an
	// error wrapping [ErrReadOnly], so that whoever holds read-only memory (a sharer
	// of a prefix, or an owner that protected it because others map it) can never
	// obtain a writable mapping of it elsewhere. ReadOnly may be asked of any
	// committed source granule: that is how a read-only prefix is shared onward. The
	// range errors ([ErrInvalidRange], [ErrOutOfRange], [ErrNotCommitted],
	// [ErrCommitted], [ErrForeignReservation]) come before ErrReadOnly.
	//
	// On error nothing changed.
	Share(dst R, dstOff int, src R, srcOff, size int, prot Protection) error
}

// Protector is implemented by backings that can change the access of committed memory
// in place, so that the owner of granules it shares read-only can stop writing them
// too.
type Protector[R any] interface {
	// Protect sets the access of the committed range [off, off+size) of r to prot,
	// without moving, copying or decommitting anything: the contents and every other
	// mapping of the same physical granules are untouched. The range must be
	// granule-aligned and inside r, and every granule of it Committed (owned or
	// shared); the errors are those of Decommit ([ErrInvalidRange], [ErrOutOfRange],
	// [ErrNotCommitted], [ErrForeignReservation]) and an unknown prot is refused. Use
	// after Unreserve panics as for every method.
	//
	// ReadWrite may be granted only on granules this reservation may write: ones it
	// committed itself, or mapped by Share with ReadWrite. A granule mapped into r by
	// Share with ReadOnly stays read-only for good: asking ReadWrite on a range that
	// holds one fails with an error wrapping [ErrReadOnly], so that a sharer never
	// gains write access to memory it does not own alone. The owner may go from
	// ReadWrite to ReadOnly and back as often as it likes.
	//
	// A write to a ReadOnly range is refused where the backing sees it (Copier.CopyIn
	// fails with an error wrapping ErrReadOnly). A write the backing does not see
	// faults: on the host a store through Base(r) raises SIGSEGV, which kills the
	// process unless the goroutine runs under runtime/debug.SetPanicOnFault(true),
	// where it becomes a recoverable Go panic; on a device a kernel's write is an
	// illegal-address fault of the context (where the driver grants read-only
	// access; a backing whose driver does not says so and guards only its own
	// copies). Protection lasts until Decommit: a granule committed again is
	// ReadWrite. A mapping Share made has the access Share was given, and Protect of
	// one mapping leaves the others as they are; but Share refuses ReadWrite from a
	// source granule that is ReadOnly in its source (see [Sharer]).
	//
	// On error nothing changed.
	Protect(r R, off, size int, prot Protection) error
}

// PoolStats is a snapshot of a pooling backing.
type PoolStats struct {
	Granule  int   // granule size in bytes
	Owned    int64 // physical bytes the pool holds: mapped plus idle
	Idle     int64 // physical bytes pooled and mapped nowhere
	Mapped   int64 // bytes of mappings (a granule mapped twice counts twice)
	Resident int64 // idle bytes known to be populated (no fault on first touch)
	Low      int   // low water mark, in granules
	High     int   // high water mark, in granules
	// Created and GivenBack count granules since the pool was made: charged to its
	// authority (made, or charged for a commit that then rolled back) and given back.
	// Owned is (Created - GivenBack) × Granule.
	Created, GivenBack int64
}

// Pool is implemented by backings that keep physical granules in a pool (ByBacking).
type Pool interface {
	// Prefill makes at least n idle granules resident in the pool, creating and
	// populating them off the hot path, within the budget.
	Prefill(n int) error
	// Trim gives idle granules back until at most keep remain; it returns the bytes
	// given back.
	Trim(keep int) (int64, error)
	// PoolStats returns a snapshot of the pool.
	PoolStats() PoolStats
}

// Waiter is implemented by backings that own their physical memory (ByBacking) and can
// wait for the budget to commit.
type Waiter[R any] interface {
	// CommitCtx is Commit that waits, in FIFO order with other waiters on the device,
	// until the budget covers the granules the commit must create, or ctx ends.
	CommitCtx(ctx context.Context, r R, off, size int) error
}

// PoolWaiter is implemented by pools whose budget is not the caller's governor's
// alone: a node pool's client (backing/nodepool), whose granules the node's owner
// grants. There the caller's FIFO queue can grant a commit that the backing still
// refuses, so a wait for memory waits here instead: kv's AppendCtx and
// AppendBatchCtx do, after their own queue granted a step the backing refused.
type PoolWaiter interface {
	// PrefillCtx is Prefill that waits, in FIFO order with the other waiters of the
	// budget that refused, until the pool holds at least n idle granules or ctx
	// ends; it fails with ErrUnsupported where the pool keeps no idle granules.
	PrefillCtx(ctx context.Context, n int) error
}

// Zeroer is implemented by backings that know whether freshly committed memory reads
// as zero.
type Zeroer interface {
	// CommitZeroes reports whether a granule reads as zero right after Commit.
	CommitZeroes() bool
}
