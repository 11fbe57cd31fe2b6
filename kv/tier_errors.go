package kv

import "errors"

// Errors of the tier contract and of the tier value format (tier_value.go). A value
// that fails any check of DecodeTierValue is refused with an error wrapping
// ErrTierValue and exactly one of the more precise kinds below, so that the cache can
// count each kind; all of them are misses to the cache.
var (
	// ErrTierValueSize: a Store whose size is negative or above what the tier holds.
	ErrTierValueSize = errors.New("kv: tier value size out of range")

	// ErrTierValue: a value read from a tier that is not a block this cache may use.
	ErrTierValue = errors.New("kv: tier value refused")
	// ErrTierTruncated: the value is shorter (or longer) than its header says.
	ErrTierTruncated = errors.New("kv: tier value truncated")
	// ErrTierFormat: the value does not start with the format's magic, or is of a
	// format version this build does not read.
	ErrTierFormat = errors.New("kv: tier value of unknown format")
	// ErrTierChecksum: the value's checksum does not match its bytes.
	ErrTierChecksum = errors.New("kv: tier value checksum mismatch")
	// ErrTierNamespace: the value was written under another namespace (another model
	// geometry, layout, block size or user prefix).
	ErrTierNamespace = errors.New("kv: tier value of another namespace")
	// ErrTierBlock: the value was written for another block: another hash, another
	// token count or payload length, or other tokens.
	ErrTierBlock = errors.New("kv: tier value of another block")
)

// PanicNilTierFill is the panic value for EncodeTierValue with a nil fill.
const PanicNilTierFill = "kv: EncodeTierValue with a nil fill"
