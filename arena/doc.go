// Package arena turns a backing's reserved address range into memory a program uses:
// a [Buffer] that grows and shrinks in granule steps on a base address that never
// moves, typed views ([Tensor]) over it, and a bump [Arena] for tensors that live one
// step. Code written against the plain eager-allocator contract, [Allocator] (the
// cudaMalloc shape), runs on an Arena or on [Eager], which commits each allocation
// whole outside the Go heap and is the floor a growing Buffer is measured against.
// Whether an allocator commits on demand and charges the governor as it does (the
// seed's commits_on_demand: an Arena does, Eager does not) is its promise,
// [CommitsOnDemand], apart from what its backing could do.
//
// # Element types
//
// A view holds one of the closed set [Elem]: Go's fixed-size numbers, the 16-bit floats
// [F16] and [BF16], the OCP 8-bit floats [F8E4M3] and [F8E5M2], and the blocks of
// llama.cpp's Q8_0 format ([BlockQ8_0]: 32 values in 34 bytes). Each has a [DType],
// which says how many bytes n values take ([DType.Bytes]); for a block type a view's
// element is a whole block. The conversions from float32 round to nearest, ties to
// even, and are tested exhaustively against references written from each format's
// definition.
//
// # Memory management
//
// A Buffer owns one reservation of its backing. It MUST be released with
// [Buffer.Close], which gives back every committed granule and the address range and
// returns an honest [accounting.ReleaseOutcome]. Shrinking with [Buffer.Resize]
// decommits the granules wholly past the new length: their contents are forfeit and
// any slice or view over them becomes invalid (a host access faults).
// [Buffer.DecommitBelow] gives back the granules below an offset the same way (a
// sliding window that moves on): the committed granules are always one run [Start,
// Start+Committed), the base stays, and the bytes below Start are Reserved.
// [Buffer.ShareRange] maps another buffer's committed granules into this one's run,
// at any granule offset; the physical granules live while any buffer maps them.
//
// Every allocation of an [Eager] MUST be given back with [Eager.Release].
// An [Arena] owns its Buffer: [Arena.Close] closes it. A [Tensor] is a view and owns
// nothing: it is valid only while the bytes under it stay committed, so a Resize
// below it or an Arena Reset or Rewind past it INVALIDATES it (a host access then
// panics with PanicStaleView or faults).
//
// When the backing's accounting is [backing.ByBuffer], the Buffer charges each granule
// it commits to its authority before committing it and releases the charge after
// decommitting it, so the governor's ledger matches committed memory exactly. When it
// is [backing.ByBacking], the backing's pool owns the bytes and the Buffer charges
// nothing.
//
// # Concurrency
//
// A Buffer is used by one goroutine at a time: Resize, DecommitBelow, ShareFrom,
// ShareRange, Protect and Close must not run concurrently with each other or with
// readings. Several goroutines may read and
// write the committed bytes at once, as with any memory, provided none of them
// resizes the buffer meanwhile. An Eager is safe for concurrent use.
package arena
