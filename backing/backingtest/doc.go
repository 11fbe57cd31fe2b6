// Package backingtest checks that a backing keeps the [backing.Backing] contract, and
// provides two backings for tests of the code above the backings.
//
// [Run] is the conformance suite, shaped like testing/fstest.TestFS: it takes a
// factory, makes a fresh backing for each property and runs each property as its own
// subtest. Optional capabilities are probed by type assertion and checked when present.
// A new backing is done when it passes Run.
//
// [RunOps] is the body of a fuzz test for any backing: it decodes a byte string into
// a sequence of operations and checks each result against a model of the physical
// granules; [SeedOps] is its short seed corpus.
//
// [Fake] is a backing on Go-heap memory with a synthetic address space: fast, exact
// about what is alive (LiveGranules, LiveReservations), and able to share granules (and,
// when asked, to wait for the budget) under ByBacking accounting, so that arenas and
// caches can be tested without the OS.
//
// [Faulty] wraps any backing and makes chosen calls fail (the n-th call of any
// operation, or of one), for fault-injection tests of rollback paths: the typical test
// counts the calls of a clean run with Calls, then injects a failure at every one of
// them in turn and checks that nothing leaked.
//
// # Memory management
//
// A Fake's memory is Go-heap slices, freed by the GC once the last mapping of a granule
// goes; its reservations must still be given back with Unreserve so that the leak
// counters mean something. Run unreserves every reservation it makes, also when a
// property fails, through t.Cleanup.
//
// # Concurrency
//
// Fake and Faulty are safe for concurrent use. Run calls the backing from several
// goroutines in its "Concurrent" property, on distinct ranges, and in its "BudgetWait"
// properties, where CommitCtx waits in other goroutines while the test goroutine
// decommits; those goroutines end before the property does. Those properties set the
// device's limit on the backing's governor while they run.
//
// # Dependencies
//
// The suite reports through github.com/stretchr/testify, which this module's own tests
// use throughout. A backing's author calls Run and writes no testify code; what the
// import costs that module is a test-only requirement in go.mod (testify and its three
// small dependencies), while a failing property prints the expected and actual ledger
// or byte ranges as a diff, which is what one needs to find the broken rule. The
// standard library's suites (testing/fstest, slogtest) avoid outside imports because
// they live in the standard library; a suite outside it is free to choose.
package backingtest
