package host

// Transparent huge pages: what the system allows, asked for per mapping.
//
// A 2 MiB granule populated with one huge page costs a quarter of what 512 pages of
// 4 KiB cost to populate and a tenth to free (see BENCHMARKS.md), but the kernel
// gives one only to a whole, aligned huge page inside a mapping that may have it:
// the system's mode (/sys/kernel/mm/transparent_hugepage/enabled for anonymous
// memory, .../shmem_enabled for a memfd) must be always, or madvise with the mapping
// advised MADV_HUGEPAGE. Asking is not getting: a fragmented machine falls back to
// small pages, so the backings report what their reservations really hold (smaps).

// HugePageBytes reports how much of a reservation's committed memory sits in
// transparent huge pages, from /proc/self/smaps (AnonHugePages for anonymous memory,
// ShmemPmdMapped for a memfd's): what the kernel really gave, not what was asked.
type HugePageBytes struct {
	Anon  int64 // anonymous memory in huge pages
	Shmem int64 // memfd (shmem) memory mapped by huge pages
}

// hugeMode is what the system allows for one kind of memory.
type hugeMode struct {
	pmd  int    // the huge page size in bytes; 0 when unknown
	why  string // why no huge pages may be had; "" when they may
	mode string // the selected mode ("always", "madvise", "never", ...); "" when unknown
}
