package host

// The few internals the private backing's tests need.

// PrivateBytes returns the n bytes at addr as a slice, for tests that touch memory.
func PrivateBytes(addr uintptr, n int) []byte { return privateBytes(addr, 0, n) }

// PrivateRawCommit and PrivateRawDecommit are the OS layer alone (the syscalls,
// without validation or bookkeeping): the floor the benchmarks compare against.
var (
	PrivateRawReserve  = privateReserveOS
	PrivateRawRelease  = privateReleaseOS
	PrivateRawCommit   = privateCommitOS
	PrivateRawDecommit = privateDecommitOS
	PrivateRawPopulate = privatePopulateOS
)
