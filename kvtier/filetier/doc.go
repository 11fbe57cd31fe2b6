// Package filetier is a [kv.Tier] on a local file system: a store of cold prefix
// blocks below host memory that survives a restart. A server opened again on the same
// directory finds the blocks its last run stored (a warm start) and its first prompts
// load them instead of prefilling them.
//
// Each block is a file of its own, <Dir>/<namespace>/<hash> in 16 hex digits each:
// a 64-byte header (the key, the value's length, the alignment unit and a CRC-32C of
// all of it; format.go), the value, and zeros up to whole 4 KiB units, written to a
// temporary file and renamed over the block's name, so that a reader or a later run
// finds the old file or the new one, never part of one. docs/filetier.md says why this
// layout and not segments with an index, and what runs on each system (O_DIRECT on
// Linux, F_NOCACHE on macOS, plain I/O elsewhere; io_*.go).
//
// A block whose file fails any check (length, magic, version, CRC-32C, or a key or
// namespace other than its name says) is refused with [ErrCorrupt], counted in
// Stats.Corrupt and removed; it is never handed to the use func. The namespace of a
// key (kv.TierNamespace) names the subdirectory, so a lookup under one namespace can
// never hit another's block; with Options.Namespace set, New never indexes, reads or
// removes another namespace's directory: it logs them and counts their blocks in
// Stats.Foreign. A directory holds one tier at a time: New takes a lock on <Dir>/LOCK
// ([ErrLocked]), which the kernel drops when the process dies.
//
// The budget (Options.Budget, or 90% of the file system's free space plus what the
// directory's blocks already hold, from statfs at New) bounds the files' bytes; a
// store that would pass it evicts the least recently stored or loaded blocks. New
// refuses a budget above that space ([ErrNoSpace]) and a directory that is missing,
// read-only or unwritable ([ErrDir]: it writes a probe file). A disk that fills or
// turns read-only later fails a store, which keeps nothing, returns [ErrWrite] and is
// counted (Stats.Drops, Stats.WriteErrors); the cache above keeps its device blocks.
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
