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

// SetPrivateSmallTHP makes p, which must not ask for huge pages, refuse them on
// every reservation (MADV_NOHUGEPAGE) as it does where THP is "always", whatever
// this system's mode (v true), or advise nothing (v false). It must be called
// before p reserves anything.
func SetPrivateSmallTHP(p *Private, v bool) {
	if p.huge {
		panic("SetPrivateSmallTHP: the backing asks for huge pages")
	}
	p.smallTHP = v
}

// HugeAnonMode returns the system's transparent huge page mode for anonymous
// memory ("always", "madvise", "never"; "" when unknown).
func HugeAnonMode() string { return hugeAnon().mode }
