package backing

// MapReport is what one call newly took on, on the two axes a ByBacking ledger keeps
// (accounting.Authority's Owned and Mapped): the physical bytes it newly owns, the
// bytes it newly mapped, and the granules of those mappings. The zero value is a
// call that took on nothing.
//
// It mirrors the seed's per-call accounting (onnx_runtime_memory_api,
// src/allocator.rs: SharedPrefixCommitInfo's additional_owned_bytes,
// newly_mapped_bytes and granules, and MappedAllocation's newly_mapped_bytes): a
// mapping of granules that are owned already, a shared prefix's, newly owns nothing,
// since they were charged once, when they were committed; it only maps.
//
// NB: Owned counts the granules the call committed as its own. A pooling backing may
// serve them from idle granules it holds already, so its ledger's Owned (which counts
// idle granules) may move by less; what the call's granules add to is Owned minus the
// pool's Idle (see Pool).
type MapReport struct {
	Owned    int64 // physical bytes newly owned: the granules the call committed as its own
	Mapped   int64 // bytes newly mapped, own granules and shared ones together
	Granules int   // granules newly mapped (Mapped in granules)
}

// Add returns the sum of r and o: the report of two calls together.
func (r MapReport) Add(o MapReport) MapReport {
	return MapReport{Owned: r.Owned + o.Owned, Mapped: r.Mapped + o.Mapped, Granules: r.Granules + o.Granules}
}

// CommitReport returns the report of a Commit of size bytes that succeeded, on a
// backing of that granule: it owns and maps size bytes. size must be whole granules
// (else it panics with PanicReportRange).
func CommitReport(size, granule int) MapReport {
	n := granules(size, granule)
	return MapReport{Owned: int64(size), Mapped: int64(size), Granules: n}
}

// ShareReport returns the report of a [Sharer.Share] of size bytes that succeeded, on
// a backing of that granule: it maps size bytes of granules owned already and owns
// nothing new. size must be whole granules (else it panics with PanicReportRange).
// Every Sharer keeps to it: backingtest.Run's "ShareReport" property checks each
// call against the ledger. A failed Share took on nothing.
func ShareReport(size, granule int) MapReport {
	return MapReport{Mapped: int64(size), Granules: granules(size, granule)}
}

// PanicReportRange is the panic of CommitReport and ShareReport on a size that is not
// a non-negative multiple of a power-of-two granule: no call that succeeded has one.
const PanicReportRange = "backing: a report of a size that is not whole granules"

// granules returns size in granules of granule, panicking with PanicReportRange
// unless that is whole.
func granules(size, granule int) int {
	if !IsPowerOfTwo(granule) || size < 0 || size&(granule-1) != 0 {
		panic(PanicReportRange)
	}
	return size / granule
}
