// Package backing defines the one interface every kind of memory implements,
// [Backing], its optional capabilities, and the granule arithmetic they share.
//
// # States
//
// Address space inside a reservation is in one of three states:
//
//  1. Unreserved: not ours. Any access faults (or is undefined on a device).
//  2. Reserved: the range is ours but no physical memory backs it. An access faults.
//     [Backing.Reserve] moves a range from Unreserved to Reserved.
//  3. Committed: physical memory backs the range; it may be read and written (host
//     backings: by the CPU; device backings: by the device only). [Backing.Commit] moves
//     granules from Reserved to Committed, [Backing.Decommit] moves them back and
//     forfeits their contents.
//
// [Backing.Unreserve] moves the whole range, committed parts included, back to
// Unreserved. Whether memory committed again after a decommit reads as zero is a
// question for the backing ([Zeroer]), not an assumption.
//
// A committed granule is either the reservation's own or a mapping of a granule owned
// elsewhere ([Sharer]). Decommitting a shared mapping unmaps it and drops one reference
// to the physical granule; the granule is freed with its last mapping. A mapping's
// access may be narrowed to read-only in place and widened again by its owner
// ([Protector]); a granule shared read-only stays read-only to its sharer.
//
// # Safety contract
//
// Code above a backing writes through the addresses it hands out, so a backing that
// breaks one of these points turns a caller's writes into memory corruption rather
// than an error. They are the seed's (onnx_runtime_virtual_memory, src/backing.rs:
// the Safety section of VirtualBacking); backingtest.Run checks each, and its
// mutants (backing/backingtest/mutant_test.go) show that it catches a backing that
// breaks it:
//
//	point                                                  property (backingtest.Run)   mutant
//	the granularity is constant and a power of two         Identity                     granularityDrifts
//	Reserve commits nothing: address space only            ReserveCommitsNothing,       reserveCommits
//	                                                       ReserveUnreserve
//	the base never changes for the reservation's life      BaseStable                   baseMoves
//	after a Commit every byte of the range is writable     CommitWriteRead              commitsShort
//	Unreserve gives back the address space (the handle     UseAfterUnreserve,           noPanicBase,
//	is dead: its use panics) and everything still          UnreserveCommitted           unreserveKeepsGranules,
//	committed in it                                                                     lyingUnreserve
//
// A Sharer keeps one more: a Share owns nothing new and maps what it is asked to
// ([ShareReport]; properties ShareReport and ShareLastMapping, mutant ownsTwice).
//
// # Errors and panics
//
// Every method validates its arguments and reports bad ones as an error wrapped in an
// [*OpError]: a negative, misaligned or overflowing range ([ErrInvalidRange]), a range
// outside the reservation ([ErrOutOfRange]), committing a granule that is committed
// ([ErrCommitted]), decommitting one that is not ([ErrNotCommitted]), a reservation made
// by another backing ([ErrForeignReservation]). A failed call changes nothing.
// Using a reservation after Unreserve is misuse and panics with a message that names
// it, as a double free would.
//
// # Accounting
//
// Who pays for committed physical memory is the backing's [PhysicalAccounting]: with
// [ByBuffer] the caller (an arena.Buffer) takes a lease on the governor for each granule
// it commits; with [ByBacking] the backing's pool owns every physical byte it holds,
// mapped or idle, and mappings are attribution only.
//
// # Concurrency
//
// A Backing must be safe for concurrent use: distinct reservations, and distinct
// ranges of one reservation, may be committed and decommitted from several goroutines
// at once. Calls on overlapping ranges of one reservation must be serialized by the
// caller.
package backing
