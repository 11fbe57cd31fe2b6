package backing

import "errors"

// ErrNotLent: a Borrow named a granule that is not lent to this process any more,
// though it was: its lender gave it back (decommitted it, or ended) before the
// borrow, or this process borrows it already. The borrow maps nothing and the
// backing stays usable; the caller's loan is stale.
var ErrNotLent = errors.New("backing: granule not lent any more")

// Lender is implemented by backings whose committed granules another process can
// map with no copy: a node pool's client (backing/nodepool), where one owner
// process holds every granule and the processes attached to it are numbered. Code
// above a backing (kv's Prefix.Lend and Cache.BorrowPrefix) probes for it by type
// assertion, as for Sharer, so it names no concrete backing.
//
// A lent granule is owned once: it stays charged to the lender until the last
// borrower gives it back, also after the lender decommitted it or ended. A borrower
// maps it read-only for good; only the process that committed it may write it.
type Lender[R any] interface {
	// Lend lets the process numbered to borrow the granules committed at [off,
	// off+size) of r and returns their ids, in order, for that process to pass to
	// Borrow; the caller carries them there its own way. The range must be
	// granule-aligned and every granule of it one this process committed (or maps by
	// Share from one it committed), not one it borrowed: only its lender lends a
	// granule (ErrReadOnly). The ids mean nothing to any other process. A lent
	// granule is never handed to a later commit of this process, since another
	// process may map it.
	Lend(r R, off, size int, to uint64) ([]uint64, error)

	// Borrow moves [off, off+len(ids)×granule) of dst from Reserved to Committed by
	// mapping, read-only, the granules another process lent to this one (Lend), in
	// order: the same physical memory, no copy. They add to this process's mappings,
	// never to what it owns. Protect can not make them writable (ErrReadOnly), and
	// Share maps them onward in this process read-only only. Each granule may be
	// borrowed once per process (map it again with Share); its last mapping here
	// gives it back to its lender's count. A granule whose lender gave it back
	// before the borrow, or that this process borrows already, fails the borrow
	// with ErrNotLent. On error nothing changed.
	Borrow(dst R, off int, ids []uint64) error

	// Number returns this process's number among those attached: what a lender
	// passes to Lend as to.
	Number() uint64
}
