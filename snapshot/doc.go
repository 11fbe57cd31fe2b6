// Package snapshot keeps a server's session snapshots, opaque byte strings that
// grow turn by turn (an LLM session's serialized KV state), in memory outside the
// Go heap under one memory budget. A [Store] holds one snapshot on an
// [arena.Buffer]: [Store.Prepare] commits granules at the end of a range reserved
// once, so that growth never copies or moves the base; [Store.Reset] decommits
// them, so that the memory goes back to the OS (or to the pool) rather than being
// overwritten with zeros and kept. Every Store of one [Factory] charges one ledger
// on the governor's host budget, so that the sessions of a server can not hold more
// than it allows: a Prepare the budget refuses returns the governor's
// [*accounting.BudgetError] and leaves that store empty.
//
// The Store implements, with standard types only, the session-store contract of
// Kronk (github.com/ardanlabs/kronk, v1.32.6: sdk/kronk/kvstorage.Store), and
// [FactoryFunc] turns a Factory into its kvstorage.Factory; examples/kronk, a
// module of its own, plugs it in and runs on it, unchanged, the cases of Kronk's
// own tests of its RAM store that hold for any store (docs/kronk.md lists the
// cases about the RAM store's capacity policy, and what a Store does instead).
// Where Kronk's RAM store (kvstorage/ram) keeps a Go []byte per session that grows
// by reallocating with a quarter of headroom, never shrinks, and is zeroed on
// Reset, a Store commits exactly the granules that cover its snapshot and holds
// none after Reset.
//
// # Backings
//
// [Options].Backing picks [Private] (host.Private, the default: each store's own
// anonymous memory, given back to the OS at Reset) or [Shared] (host.Shared: one
// pool of granules for the factory's stores, which keeps recently freed granules
// warm for the next Prepare and gives idle ones back by decay). Options.Granularity
// sets the granule (2 MiB by default): a snapshot holds at most one partly used one.
// A 2 MiB granule is one transparent huge page where the system allows them
// (Options.NoHugePages turns that off): Reset then gives a granule back 14-21
// times faster than as 512 small pages, which is what makes it cheaper than
// writing zeros (BENCHMARKS.md).
//
// # Memory management
//
// A Store reserves [Options].MaxSize bytes of address space at its first Prepare
// (address space only) and commits granules as snapshots need them. Every Store
// MUST be closed with [Store.Close], which gives back its memory and its range;
// the Factory MUST be closed with [Factory.Close] once all its stores are, which
// gives back a Shared pool and retires the ledger. The slices that Bytes and
// Prepare return are borrowed: they point into the store's memory, are valid only
// until the next Prepare, Commit, Reset or Close, and must not be kept past it (a
// touch of a range given back faults). The memory holds bytes only, never Go
// pointers.
//
// The ledger ([Factory.Authority]) owns exactly the bytes the stores hold
// (the sum of their Cap, [Factory.Stats]) under Private; under Shared it also owns
// the pool's idle granules until they decay.
//
// # Concurrency
//
// A Store is used by one goroutine at a time, as Kronk does (it serializes each
// session's store), except Len and Cap, which may be read from any goroutine.
// Different stores of one Factory may be used concurrently, and a Factory's New,
// Stats and Close are safe for concurrent use. There is one lock, the Factory's,
// held only to count open stores; the governor's own locks are taken inside the
// buffer's calls.
package snapshot
