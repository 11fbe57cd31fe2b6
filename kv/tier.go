package kv

import (
	"context"
	"errors"

	"github.com/vmarena/vmarena/kv/tierval"
)

// ErrTierMiss: a tier does not hold the key asked of it. A Tier's Load returns it
// (wrapped or not) for such a key. Every other failure of a tier (a timeout, a server
// gone, a value that fails its check) is reported by the cache as a miss too, never as
// an error on the token path.
var ErrTierMiss = errors.New("kv: tier does not hold the block")

// Tier is a store of whole blocks below the device's memory: pinned host memory, a
// shared Redis or Valkey, or one a user writes. Implement it to give a PrefixCache a
// store of your own (PrefixCacheOptions.Tiers); kvtier has the ones this module
// offers. The cache calls it off the token path, from its own goroutines, with
// bounded concurrency, and never under its locks.
//
// A value is opaque to the tier: the cache writes a self-checking value (a header, the
// tokens it was made for, the block's bytes: package kv/tierval) under its key
// (tierval.Key) and checks it again on load before it maps anything, so a tier needs
// no checksum of its own. A tier may be called from
// several goroutines at once.
//
// Every method honours its context: one already done is refused with an error wrapping
// ctx.Err() that changes nothing, and a tier that waits (on a network, say) stops
// waiting when it is done. Keys differing in Namespace alone are different keys.
// Package kvtier/tiertest is the conformance suite a Tier passes.
type Tier interface {
	// Name returns a short, stable name for metrics and logs ("host", "redis").
	Name() string
	// Store keeps a value of size bytes under key, replacing any value it held. It
	// calls fill once with size bytes of the tier's own memory (pinned host memory
	// for a device cache, so that the device copies straight into it) and keeps them
	// only if fill returns nil; fill's error is Store's. A failed Store never leaves
	// a partial value: the key then holds its old value or nothing. A size below 0 or
	// above what the tier holds is refused with an error wrapping tierval.ErrSize
	// before fill is called. A tier that is full may evict what it likes, or refuse
	// with an error; either way it stays consistent. dst must not be used after fill
	// returns.
	Store(ctx context.Context, key tierval.Key, size int, fill func(dst []byte) error) error
	// Load calls use once with the value stored under key; src is valid only during
	// the call and must not be written. A key the tier does not hold is ErrTierMiss
	// (use is not called); use's error is Load's, and the value stays stored.
	Load(ctx context.Context, key tierval.Key, use func(src []byte) error) error
	// Contains returns how many of keys, from the first, the tier holds: the length
	// of the longest run it could load.
	Contains(ctx context.Context, keys []tierval.Key) (int, error)
	// Delete forgets key; a key not held is not an error.
	Delete(ctx context.Context, key tierval.Key) error
}

// TierPeeker is implemented by tiers that read the start of a value without reading
// it whole: a few hundred bytes from host memory, one aligned read of a file, a Redis
// GETRANGE. On a model with window or recurrent groups, a Probe peeks at the values
// of a tier's run to find the last block a Lookup would serve a hit at (where every
// window group holds what the step reads, and the value carries the states), and so
// counts exactly what the Lookup serves. Without it, Probe counts the whole run, an
// upper bound. (A Lookup's load does not peek: it reads the run.)
type TierPeeker interface {
	Tier
	// Peek calls use once with the first min(n, size) bytes of the value stored under
	// key (n >= 1; less panics); head is valid only during the call and must not be
	// written. A key the tier does not hold is ErrTierMiss (use is not called); use's
	// error is Peek's. It marks no value used and counts no load; a tier may forget a
	// value whose head it finds damaged, as its Load would.
	Peek(ctx context.Context, key tierval.Key, n int, use func(head []byte) error) error
}

// PanicPeekLength is the panic value of a TierPeeker's Peek asked for fewer than one
// byte, named so that a test (and a tier written elsewhere) can match it.
const PanicPeekLength = "kv: Tier.Peek of fewer than one byte"

// InProcessTier is implemented by tiers that keep their values in this process's own
// memory (kvtier/hosttier); implement it only for such a tier, returning true: nothing outside the process can damage a value there, so
// the cache leaves the block's bytes out of its checksum when it writes one (summing
// 2 MiB costs about what copying it does) and checks only the header and the tokens
// when it reads one back. A value with the payload left out is accepted only from a
// tier that says InProcess; any other tier's is refused as a bad format.
type InProcessTier interface {
	Tier
	InProcess() bool
}

// inProcess reports whether t keeps its values in this process's memory.
func inProcess(t Tier) bool {
	p, ok := t.(InProcessTier)
	return ok && p.InProcess()
}
