package tierval

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"math"
)

// The value format: what the cache writes into a tier for one block, so that a value
// read back is checked before any of its bytes is mapped. All integers are
// little-endian.
//
//	offset  size  field
//	0       4     magic "VMKV"
//	4       2     format version (Version)
//	6       2     flags: 0, or payloadUnsummed for an in-process tier's value
//	8       8     namespace (kv.TierNamespace)
//	16      8     the block's chained hash
//	24      4     token count n
//	28      4     reserved, 0
//	32      8     payload length p
//	40      4     CRC-32C (Castagnoli) of bytes [0, 40), then [48, 48+4n+p)
//	              ([48, 48+4n) only, with payloadUnsummed)
//	44      4     reserved, 0
//	48      4n    the tokens the block was made for, int32 each
//	48+4n   p     the block's bytes
//
// CRC-32C is hardware-accelerated by Go on amd64 and arm64 (BENCHMARKS.md has it
// against a copy of 2 MiB). Every single-byte change, and every burst of up to 32 bits,
// changes it; a value that an adversary forges is not its concern: the tokens are
// compared in full, so a forged value can only claim its own tokens.
const (
	// Version is the format version of a one-group value that this build writes
	// and reads: for a tool that reads values itself, which refuses another. A
	// value of several layer groups is GroupsVersion (groups.go).
	Version = 1
	// HeaderSize is the bytes of a value's header, before its tokens: for a tool
	// that reads values itself (Size is what a writer needs).
	HeaderSize = 48

	magic     = "VMKV"
	crcOffset = 40

	// payloadUnsummed marks a value whose checksum leaves out the payload: one the
	// cache writes into a tier that keeps it in this process's memory
	// (kv.InProcessTier), where no network, disk or other process can damage it and
	// summing 2 MiB would cost about what copying it does. Its header and tokens are
	// summed and checked as ever. Only DecodeInProcess accepts it: Decode refuses it
	// (ErrFormat), so that a value from anywhere else can never skip its checksum by
	// setting the flag.
	payloadUnsummed = 1
)

var crcTable = crc32.MakeTable(crc32.Castagnoli)

// Key names one block of a cached prefix in a tier below the device: the chained
// 64-bit hash of the block's tokens (package kv/blockhash), under a namespace that
// fingerprints what the block's bytes mean (kv.TierNamespace: the model, its layer
// groups, the element type, the layout, and a prefix the user chooses). Two caches
// that agree on all of them may read each other's blocks; any difference gives
// another Namespace. A tier keys its values by it; keys differing in Namespace alone
// are different keys.
type Key struct {
	Namespace uint64
	Hash      uint64
}

// Size returns the bytes of the value of a block of tokens tokens and payload bytes,
// or -1 when either is negative or the value would not fit an int. Use it to size the
// destination of Encode.
func Size(tokens, payload int) int {
	if tokens < 0 || payload < 0 || tokens > math.MaxUint32 || tokens > (math.MaxInt-HeaderSize)/4 {
		return -1
	}
	if payload > math.MaxInt-HeaderSize-4*tokens {
		return -1
	}
	return HeaderSize + 4*tokens + payload
}

// Encode writes into dst the value of the block key names, made for tokens, with
// payload bytes of K/V. It calls fill once with the payload's part of dst, where the
// caller makes its one copy of the block's bytes, then writes the header and the
// tokens and seals the value with its checksum. dst must be exactly
// Size(len(tokens), payload) bytes (a tier's Store hands over such a slice); another
// length is refused with ErrSize before fill is called. fill's error is Encode's, and
// dst is then no value. Use it for a value any tier may hold; Decode checks it. The
// cache calls it; a tier never needs to, only a tool or test that writes values.
func Encode(dst []byte, key Key, tokens []int32, payload int, fill func(payload []byte) error) error {
	return encode(dst, key, tokens, payload, fill, 0)
}

// EncodeInProcess is Encode for a value that stays in this process's memory (a
// kv.InProcessTier's): its payload is left out of the checksum, and only
// DecodeInProcess accepts it. The cache calls it for such a tier; nothing else needs
// to.
func EncodeInProcess(dst []byte, key Key, tokens []int32, payload int, fill func(payload []byte) error) error {
	return encode(dst, key, tokens, payload, fill, payloadUnsummed)
}

// encode is Encode with the header's flags: 0, or payloadUnsummed.
func encode(dst []byte, key Key, tokens []int32, payload int, fill func(payload []byte) error, flags uint16) error {
	if fill == nil {
		panic(PanicNilFill)
	}
	size := Size(len(tokens), payload)
	if size < 0 || len(dst) != size {
		return fmt.Errorf("%w: a value of %d tokens and %d payload bytes is %d bytes, dst is %d",
			ErrSize, len(tokens), payload, size, len(dst))
	}
	body := HeaderSize + 4*len(tokens)
	if err := fill(dst[body:]); err != nil {
		return err
	}
	h := dst[:HeaderSize]
	copy(h, magic)
	binary.LittleEndian.PutUint16(h[4:], Version)
	binary.LittleEndian.PutUint16(h[6:], flags)
	binary.LittleEndian.PutUint64(h[8:], key.Namespace)
	binary.LittleEndian.PutUint64(h[16:], key.Hash)
	binary.LittleEndian.PutUint32(h[24:], uint32(len(tokens)))
	binary.LittleEndian.PutUint32(h[28:], 0)
	binary.LittleEndian.PutUint64(h[32:], uint64(payload))
	binary.LittleEndian.PutUint32(h[44:], 0)
	for i, tok := range tokens {
		binary.LittleEndian.PutUint32(dst[HeaderSize+4*i:], uint32(tok))
	}
	binary.LittleEndian.PutUint32(h[crcOffset:], checksum(dst, flags, len(tokens)))
	return nil
}

// checksum returns the CRC-32C of a value of n tokens, all but its checksum field and
// the reserved word after it; with payloadUnsummed, not its payload either.
func checksum(v []byte, flags uint16, n int) uint32 {
	c := crc32.Update(0, crcTable, v[:crcOffset])
	if flags&payloadUnsummed != 0 {
		return crc32.Update(c, crcTable, v[HeaderSize:HeaderSize+4*n])
	}
	return crc32.Update(c, crcTable, v[HeaderSize:])
}

// Decode checks that src is the value of the block key names, made for tokens, with
// payload bytes of K/V, and returns those bytes: a sub-slice of src, so valid only as
// long as src is. A value that fails any check is refused with an error wrapping
// ErrValue and one kind: ErrTruncated (shorter or longer than its header says),
// ErrFormat (no magic, another version, flags this version does not know),
// ErrChecksum, ErrNamespace (written under another namespace) or ErrBlock (another
// hash, token count, payload length or tokens). The checks run in that order, so a
// value damaged in transit is a checksum failure, not a claim about its contents. Use
// it on a value read from any tier: the cache does, and so does a tool that checks
// what a tier holds.
func Decode(src []byte, key Key, tokens []int32, payload int) ([]byte, error) {
	return decode(src, key, tokens, payload, false)
}

// DecodeInProcess is Decode for a value read from a tier in this process's memory (a
// kv.InProcessTier's): it also accepts a value EncodeInProcess wrote, whose payload is
// not summed, and checks the rest of it as Decode does. The cache calls it for such a
// tier; a tool calls Decode.
func DecodeInProcess(src []byte, key Key, tokens []int32, payload int) ([]byte, error) {
	return decode(src, key, tokens, payload, true)
}

// decode is Decode that, with inProcess set, also accepts a value whose payload is not
// summed.
func decode(src []byte, key Key, tokens []int32, payload int, inProcess bool) ([]byte, error) {
	if len(src) < HeaderSize {
		return nil, refused(ErrTruncated, "%d bytes, a header is %d", len(src), HeaderSize)
	}
	h := src[:HeaderSize]
	if string(h[:4]) != magic {
		return nil, refused(ErrFormat, "magic % x", h[:4])
	}
	f := binary.LittleEndian.Uint16(h[6:])
	if v := binary.LittleEndian.Uint16(h[4:]); v != Version || (f != 0 && (!inProcess || f != payloadUnsummed)) {
		return nil, refused(ErrFormat, "version %d flags %#x, this build reads version %d", v, f, Version)
	}
	if r1, r2 := binary.LittleEndian.Uint32(h[28:]), binary.LittleEndian.Uint32(h[44:]); r1 != 0 || r2 != 0 {
		return nil, refused(ErrFormat, "reserved words %#x %#x", r1, r2)
	}
	n := binary.LittleEndian.Uint32(h[24:])
	p := binary.LittleEndian.Uint64(h[32:])
	rest := uint64(len(src) - HeaderSize)
	if uint64(n)*4 > rest || p != rest-uint64(n)*4 {
		return nil, refused(ErrTruncated, "%d bytes for %d tokens and %d payload bytes", len(src), n, p)
	}
	if got, want := checksum(src, f, int(n)), binary.LittleEndian.Uint32(h[crcOffset:]); got != want {
		return nil, refused(ErrChecksum, "CRC-32C %#08x, header says %#08x", got, want)
	}
	if ns := binary.LittleEndian.Uint64(h[8:]); ns != key.Namespace {
		return nil, refused(ErrNamespace, "namespace %#016x, want %#016x", ns, key.Namespace)
	}
	if hash := binary.LittleEndian.Uint64(h[16:]); hash != key.Hash {
		return nil, refused(ErrBlock, "hash %#016x, want %#016x", hash, key.Hash)
	}
	if int(n) != len(tokens) || payload < 0 || p != uint64(payload) {
		return nil, refused(ErrBlock, "%d tokens and %d payload bytes, want %d and %d", n, p, len(tokens), payload)
	}
	stored := src[HeaderSize : HeaderSize+4*len(tokens)]
	for i, tok := range tokens {
		if got := int32(binary.LittleEndian.Uint32(stored[4*i:])); got != tok {
			return nil, refused(ErrBlock, "token %d is %d, want %d", i, got, tok)
		}
	}
	return src[HeaderSize+4*len(tokens):], nil
}

// refused returns an error wrapping ErrValue and kind.
func refused(kind error, format string, args ...any) error {
	return fmt.Errorf("%w: %w: %s", ErrValue, kind, fmt.Sprintf(format, args...))
}
