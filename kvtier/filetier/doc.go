// Package filetier is a [kv.Tier] on a local file system: a store of cold prefix
// blocks below host memory that survives a restart. A server opened again on the same
// directory finds the blocks its last run stored (a warm start) and its first prompts
// load them instead of prefilling them.
//
// # Layout: a file per block
//
// Each block is a file of its own, <Dir>/<namespace>/<hash> in 16 hex digits each,
// holding a 64-byte header (the key, the value's length, the alignment unit and a
// CRC-32C of all of it; format.go), the value, and zeros up to whole 4 KiB units. A
// store writes a temporary file and renames it over the block's name. This layout was
// chosen over segments with an index because every property the tier needs then
// comes from the file system and no index can disagree with the data:
//
//   - Crash safety without a log: a rename is atomic, so a reader, or a later run,
//     finds the old file or the new one, never part of one. A process killed mid-write
//     leaves only a "*.tmp" file, which the next New removes. Without Options.Sync no
//     fsync is paid: after a power loss a file renamed before its data reached the
//     disk may read back short or zeroed, and its length or checksum refuses it (a
//     miss, never a torn block served).
//   - The warm start is a directory listing (names and sizes), not a replay; the
//     blocks are checked when they are loaded, as every block always is.
//   - Eviction is an unlink that gives the space back at once: no compaction, no
//     segment half full of dead blocks, no second budget for garbage.
//   - A block is one 2 MiB unit, so the cost of a file (an inode, a rename, ~10 µs)
//     is small beside its transfer (~1 ms at 2 GB/s).
//
// A block whose file fails any check (length, magic, version, CRC-32C, or a key or
// namespace other than its name says: two files swapped, a block of another model
// copied in) is refused with [ErrCorrupt], counted in Stats.Corrupt and removed; it
// is never handed to the use func. The value inside is the cache's own self-checking
// format (tierval.Encode), which the cache checks again against its tokens.
//
// # Namespaces and warm start
//
// The namespace of a key (kv.TierNamespace: the model, its layer groups, element
// type, layout, block size and the user's prefix: an adapter, a salt, a revision)
// names the subdirectory, so a lookup under one namespace can never hit another's
// block. With Options.Namespace set to the cache's namespace, New also ignores the
// directories of every other namespace: it logs a line naming them, counts their
// blocks in Stats.Foreign, and never indexes, reads or removes them. A directory
// holds one tier at a time: New takes a lock on <Dir>/LOCK ([ErrLocked]), which the
// kernel drops when the process dies.
//
// # Budget, full and read-only disks
//
// The budget (Options.Budget, or 90% of the file system's free space plus what the
// directory's blocks already hold, from statfs at New) bounds the files' bytes; a
// store that would pass it evicts the least recently stored or loaded blocks. New
// refuses a budget above that space ([ErrNoSpace]) and a directory that is missing,
// read-only or unwritable ([ErrDir]: it writes a probe file). Later, a disk that fills
// or turns read-only fails a store's write: the store keeps nothing, returns
// [ErrWrite] and is counted (Stats.Drops, Stats.WriteErrors); the cache above counts a
// dropped store and keeps its device blocks. Nothing in the tier waits on the disk
// with a lock held, and the cache calls it off the token path.
//
// # Direct I/O, and what runs where
//
// Files are written and read whole, by one positioned write (pwrite) and one
// positioned read (pread) of buffers aligned to 4 KiB.
//
//   - Linux: O_DIRECT, so blocks do not fill the page cache twice (once in the tier's
//     files, once in the host memory the cache already holds them in). A file system
//     that refuses O_DIRECT (tmpfs answers EINVAL) is found by New's probe: the tier
//     logs it and goes through the page cache (Stats.IO "buffered").
//   - macOS: no O_DIRECT; files are opened with F_NOCACHE, the nearest it offers.
//   - Windows: plain I/O through the cache; the directory lock is LockFileEx. Every
//     handle shares delete, but Windows still refuses to rename over a file a reader
//     has open: a store of a key being read tries again for up to about 20 ms, then
//     is a counted drop.
//   - Other systems: plain I/O, no directory lock, and a Budget is required (the free
//     space is not asked).
//
// # Concurrency
//
// A Tier is safe for concurrent use. One lock guards the index, the LRU list, the
// budget's bytes and the counters; it is held across a rename or an unlink (so that a
// key's name and the index always agree) but never across a file's data I/O, a fill
// or a use. At most Options.Loads loads and Options.Stores stores run their I/O at
// once; a call past the bound waits for a slot within its context. A Load that opened
// a file keeps reading it whole if a Store replaces it or Delete removes it meanwhile.
// Calling Store, Load, Contains or Delete after Close panics.
//
// # Memory management
//
// The tier reads and writes through aligned buffers of its own, pooled by size: the
// dst of a fill func and the src of a use func are such a buffer, valid only during
// the call. A Tier MUST be closed with Close, which waits for the calls in progress
// and releases the directory's lock; the files stay for the next run.
package filetier
