package blockhash

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
)

// Algorithm says how a block's hash is computed (see the package doc): every replica
// and router of a cluster must use the same one.
type Algorithm uint8

const (
	// FNV64CBOR is FNV-1a 64 over canonical CBOR of [parent, tokens, extra]: the
	// default, for a cluster of vmarena replicas and their router.
	FNV64CBOR Algorithm = iota
	// SHA256CBOR is vLLM's sha256_cbor chain: for a router that also reads vLLM
	// engines' events, whose hashes it must equal.
	SHA256CBOR
)

// String returns the algorithm's name as flags and logs spell it ("sha256_cbor").
func (a Algorithm) String() string {
	switch a {
	case FNV64CBOR:
		return "fnv64_cbor"
	case SHA256CBOR:
		return "sha256_cbor"
	}
	return fmt.Sprintf("Algorithm(%d)", uint8(a))
}

// DefaultBlockSize is the tokens of a block when Options.BlockSize is 0: vLLM's.
const DefaultBlockSize = 16

// VLLMSeed is the seed vLLM derives NONE_HASH from for a cryptographic hash when
// PYTHONHASHSEED is not set (DEFAULT_NONE_HASH_SEED in kv_cache_utils.py); SHA256CBOR
// uses it when Options.Seed is empty, so a caller names it only to log or compare it.
const VLLMSeed = "vllm-none-hash"

// Options configures a Hasher. Its zero value is FNV64CBOR over 16-token blocks with an
// empty seed and no extra keys. A router and the caches whose events it reads
// (kv.EventOptions.Hash) must use equal Options, or their hashes never meet.
type Options struct {
	BlockSize int // tokens a block; 0 means DefaultBlockSize
	Algorithm Algorithm
	// Seed is what the root hash is derived from. Replicas whose hashes must agree
	// share it; for SHA256CBOR it is vLLM's PYTHONHASHSEED, VLLMSeed when empty.
	Seed string
	// LoRA is the adapter's name, an extra key of every block (vLLM's lora_name); ""
	// for none.
	LoRA string
	// CacheSalt is an extra key of block 0 only, as vLLM's cache_salt; "" for none.
	CacheSalt string
}

// Hash is a block's chained hash: the whole SHA-256 digest for SHA256CBOR, or the
// 64-bit value in the last 8 bytes (big-endian) for FNV64CBOR. The zero Hash is no
// block's.
type Hash [32]byte

// Uint64 returns the 64-bit hash a KV event publishes: the last 8 bytes, big-endian
// (vLLM's maybe_convert_block_hash): what a router compares with the events' hashes.
func (h Hash) Uint64() uint64 { return binary.BigEndian.Uint64(h[24:]) }

// Hasher computes block hashes under one Options: a router makes one to hash a
// prompt as the caches' events hash it. Its zero value is not usable; call New.
type Hasher struct {
	opts Options
	root Hash
}

// New returns a Hasher for o, or an error matching ErrConfig for a negative block size
// or an unknown algorithm.
func New(o Options) (*Hasher, error) {
	if o.BlockSize < 0 {
		return nil, fmt.Errorf("%w: BlockSize %d", ErrConfig, o.BlockSize)
	}
	if o.BlockSize == 0 {
		o.BlockSize = DefaultBlockSize
	}
	h := &Hasher{opts: o}
	switch o.Algorithm {
	case FNV64CBOR:
		h.root = fnvHash(fnv1a([]byte(o.Seed)))
	case SHA256CBOR:
		seed := o.Seed
		if seed == "" {
			seed = VLLMSeed
		}
		h.root = sha256.Sum256(appendItem(nil, seed))
	default:
		return nil, fmt.Errorf("%w: %v", ErrConfig, o.Algorithm)
	}
	return h, nil
}

// Options returns the options the Hasher was made with, BlockSize filled in: for
// logs, or to make a matching Hasher elsewhere.
func (h *Hasher) Options() Options { return h.opts }

// BlockSize returns the tokens of a block: a prompt shorter than it has no hash.
func (h *Hasher) BlockSize() int { return h.opts.BlockSize }

// Root returns the parent of a sequence's first block (vLLM's NONE_HASH): the parent
// to pass to Chain for a whole prompt.
func (h *Hasher) Root() Hash { return h.root }

// ExtraKeys returns the extra keys of a sequence's block i, in vLLM's order (the LoRA
// name, then the cache salt on block 0), or nil when it has none: the extra argument
// of Block for a caller that hashes block by block as Chain does.
func (h *Hasher) ExtraKeys(i int) []any {
	var keys []any
	if h.opts.LoRA != "" {
		keys = append(keys, h.opts.LoRA)
	}
	if i == 0 && h.opts.CacheSalt != "" {
		keys = append(keys, h.opts.CacheSalt)
	}
	return keys
}

// Block returns the hash of a block of tokens after parent, with extra keys extra (nil
// for none). tokens must hold BlockSize tokens, else it panics with PanicBlockLength;
// an extra key of another type than nil, bool, string, []byte, an integer or []any of
// them panics with PanicExtraKey. Chain is the usual call; Block is for a caller that
// hashes blocks as they fill (a decode stream).
func (h *Hasher) Block(parent Hash, tokens []int32, extra []any) Hash {
	if len(tokens) != h.opts.BlockSize {
		panic(PanicBlockLength)
	}
	var buf [256]byte
	b := h.payload(buf[:0], parent, tokens, extra)
	if h.opts.Algorithm == SHA256CBOR {
		return sha256.Sum256(b)
	}
	return fnvHash(fnv1a(b))
}

// Chain appends to dst the hashes of the full blocks of tokens, which start at block
// index first of their sequence (0 for a whole sequence), after parent (Root for
// block 0), and returns the extended slice. A last block that is not full has no hash.
// A router calls it on a prompt to get the hashes it looks up.
func (h *Hasher) Chain(dst []Hash, parent Hash, first int, tokens []int32) []Hash {
	bs := h.opts.BlockSize
	for i := 0; (i+1)*bs <= len(tokens); i++ {
		parent = h.Block(parent, tokens[i*bs:(i+1)*bs], h.ExtraKeys(first+i))
		dst = append(dst, parent)
	}
	return dst
}

// payload appends what a block's hash is taken over: the CBOR array of its parent,
// tokens and extra keys (null when extra is nil).
func (h *Hasher) payload(b []byte, parent Hash, tokens []int32, extra []any) []byte {
	b = appendHead(b, majorArray, 3)
	if h.opts.Algorithm == SHA256CBOR {
		b = appendItem(b, parent[:])
	} else {
		b = appendHead(b, majorUint, parent.Uint64())
	}
	b = appendTokens(b, tokens)
	if extra == nil {
		return append(b, simpleNull)
	}
	return appendItem(b, extra)
}

// fnv1a returns FNV-1a 64 of b (hash/fnv's New64a, without the allocation).
func fnv1a(b []byte) uint64 {
	const (
		offset = 14695981039346656037
		prime  = 1099511628211
	)
	h := uint64(offset)
	for _, c := range b {
		h ^= uint64(c)
		h *= prime
	}
	return h
}

// fnvHash returns v as a Hash: in the last 8 bytes, big-endian.
func fnvHash(v uint64) Hash {
	var h Hash
	binary.BigEndian.PutUint64(h[24:], v)
	return h
}
