// Package invariants holds the project's checks that run only in the invariants
// build (go test -tags invariants, which CI's race run uses): the bookkeeping of
// reference counts and ledgers checked at each transition, and owners reported when
// they are garbage-collected without being closed. It follows pebble's
// internal/invariants: in the normal build Enabled is a constant false, so a check
// written as
//
//	if invariants.Enabled {
//		s.checkLedger()
//	}
//
// is removed by the compiler, and a Tracker takes no space and does nothing.
//
// # Leaks
//
// An owner that MUST be closed (a kv.Sequence, an arena.Buffer, a reservation)
// embeds a Tracker, calls Track where it is made and Tracker.Close where it is
// closed. In the invariants build Track records the caller's stack and attaches a
// runtime.AddCleanup to the owner; when the owner is collected still open, the
// cleanup writes a report to standard error and keeps it for Leaks. A panic in a
// cleanup would kill the process far from the cause, so nothing panics there: tests
// fail through Exit (a TestMain's exit hook) or by reading Leaks themselves.
//
// # Layout
//
// Comments that claim a size or a packing are checked at compile time, in every
// build, at the end of their package's unsafe.go: an array whose length stops
// matching, or goes negative, when the claim breaks. On64Bit scales a claim made for
// 64-bit platforms. No tag is needed for those.
package invariants
