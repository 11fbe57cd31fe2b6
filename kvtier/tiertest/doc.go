// Package tiertest checks that a tier keeps the [kv.Tier] contract, and provides an
// in-memory tier for tests of the code above the tiers.
//
// [Run] is the conformance suite, shaped like testing/fstest.TestFS and
// backing/backingtest.Run: it takes a factory, makes a fresh tier for each property and
// runs each property as its own subtest. A tier that bounds its values says so with a
// MaxValueSize() int method, which the suite probes by type assertion and checks. A new
// tier is done when it passes Run.
//
// [Map] is a tier on Go-heap memory: exact, fast, and safe for concurrent use. Its
// [Map.Len] and [Map.Bytes] let a test check what a cache wrote down.
//
// # Memory management
//
// A Map's values are Go-heap slices it owns; Delete and replacement drop them for the GC.
// The suite deletes every key it stores, also when a property fails, through
// t.Cleanup, so a tier shared by several properties (a Redis database, say) is left as
// it was found.
//
// # Concurrency
//
// Map is safe for concurrent use. Run calls the tier from several goroutines in its
// "Concurrent" property, on keys of their own and on one key that all of them replace;
// those goroutines end before the property does.
//
// # Keys
//
// Every property draws its keys from a namespace of its own, taken at random when the
// property starts, so that properties run against one shared server do not see each
// other's keys.
package tiertest
