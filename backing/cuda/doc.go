// Package cuda is a backing of GPU memory on the CUDA driver's virtual memory
// management API, called at run time through purego: no cgo, and a binary built with
// CGO_ENABLED=0 runs on any Linux machine with glibc, GPU or not.
//
// A [Reservation] is a range of device virtual addresses (cuMemAddressReserve) whose
// base never moves. Committing a granule maps one physical allocation handle into it
// (cuMemMap) and grants access (cuMemSetAccess, once per contiguous run); decommitting
// unmaps it (cuMemUnmap) and returns the handle to a pool, so that the next commit
// maps an existing handle instead of paying for cuMemCreate. [Backing.Share] maps the
// same handles into another reservation: the shared-prefix mechanism of the KV cache.
//
// [Driver] is the seam: the driver's entry points as Go functions. [LoadDriver] binds
// them to libcuda.so.1 (looking up every symbol first, so an old or missing driver is
// an error, never a panic); cudatest.NewFakeDriver, in the test-support package
// backing/cuda/cudatest, fills it with an in-memory driver that enforces the VMM
// rules, for tests and examples on machines without a GPU.
//
// Across processes, a Backing made with Options.Exportable hands a committed granule
// to another process as a POSIX file descriptor ([Backing.Export],
// cuMemExportToShareableHandle), which that process maps into a reservation of its
// own with [Backing.Import] (cuMemImportFromShareableHandle, cuMemMap,
// cuMemSetAccess): one physical allocation, mapped in both, no copy (export.go).
//
// Below the device, [Backing.PinHost] page-locks host memory for the DMA engine
// (cuMemHostRegister, in registrations of at most [MaxPinChunk]) and a [Stream] of
// one's own queues copies between device ranges and host memory
// ([Stream.CopyOutAsync], [Stream.CopyInAsync]) that [Stream.Synchronize] waits for:
// what a tier of host memory below a cache (kvtier/hosttier) is built on.
//
// # States
//
// A granule of a reservation is Reserved (no mapping) or Committed (one mapping of
// one handle, with read-write or, after a read-only Share or Protect, read access;
// where the driver refuses read-only device mappings the mapping stays read-write and
// only this package's copies refuse the write). A handle is
// idle (in the pool, mapped nowhere), mapped (once or, when shared, several times), or
// released (given back to the driver). A handle returns to the pool only when its last
// mapping goes, and is released exactly once: by Trim, by Close, or by a decommit that
// finds the pool above its High mark.
//
// # Memory management
//
// The Backing owns every handle it creates and charges it to its [accounting.Authority]
// (ByBacking accounting) before creating it, whether the handle is mapped or idle;
// mapped bytes are attribution only (Authority.Map) and a shared handle is owned once.
// An exported handle stays owned by its exporter and is released, not pooled, when
// its last mapping there goes; an imported one is mapped, never owned, and released
// when its last mapping goes. Export's descriptors are the caller's to close, and so
// are the ones it passes to Import.
// Every Reservation MUST be given back with Unreserve, and the Backing MUST be closed
// with Close, which releases the pool and the primary context. Base addresses are
// device addresses: they must never be dereferenced on the CPU. Reach the contents
// with CopyIn/CopyOut, Memset and CopyDtoD. Host memory pinned with PinHost MUST be
// unpinned with UnpinHost, and every Stream closed, before the Backing is closed; the
// host buffer of an async copy MUST stay valid and untouched until the stream is
// synchronized (the Stream keeps a reference to it until then).
//
// # Concurrency
//
// A Backing is safe for concurrent use, and so is a Stream (its copies are queued in
// call order; Synchronize waits for all of them). Operations on one reservation are serialized
// by its lock (distinct ranges may be used from several goroutines); the pool's lock
// is never held across a driver call, and comes before the governor's (the pool puts
// its idle handles' bytes idle on its authority under it); CommitCtx waits for budget
// in the governor's queue without holding the reservation or any handle. The CUDA context is per OS thread: every operation locks its
// goroutine to the thread (runtime.LockOSThread), makes the device's primary context
// current, calls the driver and unlocks in a defer. Nothing is locked in init. With
// Options.Background one goroutine refills the pool; Close stops it. The pool charges
// its authority before it creates a handle, so while the refill (or a reclaim the
// governor started) works, the ledger runs ahead of PoolStats; Quiesce waits that
// out, so that a caller with nothing else in flight reads books that agree.
package cuda
