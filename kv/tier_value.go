package kv

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"math"
)

// The tier value format: what the cache writes into a tier for one block, so that a
// value read back is checked before any of its bytes is mapped. All integers are
// little-endian.
//
//	offset  size  field
//	0       4     magic "VMKV"
//	4       2     format version (TierValueVersion)
//	6       2     flags: 0, or tierPayloadUnsummed for an in-process tier's value
//	8       8     namespace (TierNamespace)
//	16      8     the block's chained hash
//	24      4     token count n
//	28      4     reserved, 0
//	32      8     payload length p
//	40      4     CRC-32C (Castagnoli) of bytes [0, 40), then [48, 48+4n+p)
//	              ([48, 48+4n) only, with tierPayloadUnsummed)
//	44      4     reserved, 0
//	48      4n    the tokens the block was made for, int32 each
//	48+4n   p     the block's bytes
//
// CRC-32C is hardware-accelerated by Go on amd64 and arm64 (BENCHMARKS.md has it
// against a copy of 2 MiB). Every single-byte change, and every burst of up to 32 bits,
// changes it; a value that an adversary forges is not its concern: the tokens are
// compared in full, so a forged value can only claim its own tokens.
const (
	// TierValueVersion is the format version this build writes and reads.
	TierValueVersion = 1
	// TierHeaderSize is the bytes of a value's header, before its tokens.
	TierHeaderSize = 48

	tierMagic     = "VMKV"
	tierCRCOffset = 40

	// tierPayloadUnsummed marks a value whose checksum leaves out the payload: one
	// the cache writes into a tier that keeps it in this process's memory
	// (InProcessTier), where no network, disk or other process can damage it and
	// summing 2 MiB would cost about what copying it does. Its header and tokens are
	// summed and checked as ever. Only the cache's reads from such a tier accept it:
	// DecodeTierValue refuses it (ErrTierFormat), so that a value from anywhere else
	// can never skip its checksum by setting the flag.
	tierPayloadUnsummed = 1
)

var tierCRC = crc32.MakeTable(crc32.Castagnoli)

// TierNamespace returns the namespace of a cache's blocks in a tier: a fingerprint of
// everything that gives a block's bytes their meaning. That is the model's shape,
// the layout, the granule size and the block it makes (tokens and bytes a block), and
// prefix, which the user chooses to tell apart what the shape can not: the model's
// weights or revision, an adapter, a tenant. Caches whose namespaces agree may read
// each other's blocks. A configuration the cache can not be built from is refused
// with ErrGeometry or ErrConfig.
//
// A uniform model (Uniform: one full-attention group of every layer in order) is
// fingerprinted by its name, layers, KV heads, head dim, element type and scale mode,
// as it has been since the first version (v1), so that its stored blocks stay
// readable. Any other model's fingerprint, under a header of its own, covers each of
// its groups in order: its attention kind, window, layers (their indices), KV heads,
// head dim, element type, scale mode, state bytes and the block it makes. Two models
// that differ in any of these never share a namespace.
//
// Config's other fields (MaxTokens, the authority, map-ahead) do not change a block's
// bytes and are not part of it.
func TierNamespace(cfg Config, granule int, prefix string) (uint64, error) {
	m, err := cfg.model()
	if err != nil {
		return 0, err
	}
	if !m.uniform() {
		return modelNamespace(m, cfg, granule, prefix)
	}
	g := m.Groups[0]
	sh, err := newGroupShape(g, cfg.Layout, granule, cfg.BlockTokens, 0)
	if err != nil {
		return 0, err
	}
	b := make([]byte, 0, 128+len(m.Name)+len(prefix))
	b = append(b, "vmarena kv tier namespace v1\x00"...)
	b = appendString(b, m.Name)
	for _, v := range []int{m.Layers, g.KVHeads, g.HeadDim, int(g.DType), int(g.Scales), int(cfg.Layout), granule, sh.tpb, sh.unit} {
		b = binary.LittleEndian.AppendUint64(b, uint64(v))
	}
	return namespaceSum(b, prefix), nil
}

// modelNamespace is TierNamespace on m, a valid model that is not uniform: under a
// header of its own, so that no such model's fingerprint is a uniform one's, and with
// the count of each list before it, so that no two models encode alike.
func modelNamespace(m Model, cfg Config, granule int, prefix string) (uint64, error) {
	groups, _, err := newGroups(m, cfg.Layout, granule, cfg.BlockTokens, 0)
	if err != nil {
		return 0, err
	}
	b := make([]byte, 0, 128+len(m.Name)+len(prefix)+len(groups)*96+m.Layers*8)
	b = append(b, "vmarena kv tier namespace model v1\x00"...)
	b = appendString(b, m.Name)
	for _, v := range []int{m.Layers, len(groups), int(cfg.Layout), granule} {
		b = binary.LittleEndian.AppendUint64(b, uint64(v))
	}
	for i := range groups {
		g := &groups[i]
		s := g.spec
		for _, v := range []int{int(s.Kind), s.Window, s.KVHeads, s.HeadDim, int(s.DType), int(s.Scales),
			s.TensorsPerLayer(), s.StateBytes, g.tpb, g.unit, len(s.Layers)} {
			b = binary.LittleEndian.AppendUint64(b, uint64(v))
		}
		for _, l := range s.Layers {
			b = binary.LittleEndian.AppendUint64(b, uint64(l))
		}
	}
	return namespaceSum(b, prefix), nil
}

// namespaceSum appends prefix to the fingerprint b and returns its namespace.
func namespaceSum(b []byte, prefix string) uint64 {
	b = appendString(b, prefix)
	sum := sha256.Sum256(b)
	return binary.LittleEndian.Uint64(sum[:8])
}

// appendString appends s with its length first, so that no two lists of strings
// encode alike.
func appendString(b []byte, s string) []byte {
	b = binary.LittleEndian.AppendUint64(b, uint64(len(s)))
	return append(b, s...)
}

// TierValueSize returns the bytes of the value of a block of tokens tokens and
// payload bytes, or -1 when either is negative or the value would not fit an int.
func TierValueSize(tokens, payload int) int {
	if tokens < 0 || payload < 0 || tokens > math.MaxUint32 || tokens > (math.MaxInt-TierHeaderSize)/4 {
		return -1
	}
	if payload > math.MaxInt-TierHeaderSize-4*tokens {
		return -1
	}
	return TierHeaderSize + 4*tokens + payload
}

// EncodeTierValue writes into dst the value of the block key names, made for tokens,
// with payload bytes of K/V. It calls fill once with the payload's part of dst, where
// the caller makes its one copy of the block's bytes, then writes the header and the
// tokens and seals the value with its checksum. dst must be exactly
// TierValueSize(len(tokens), payload) bytes (a tier's Store hands over such a slice);
// another length is refused with ErrTierValueSize before fill is called. fill's error
// is EncodeTierValue's, and dst is then no value.
func EncodeTierValue(dst []byte, key TierKey, tokens []int32, payload int, fill func(payload []byte) error) error {
	return encodeTierValue(dst, key, tokens, payload, fill, 0)
}

// encodeTierValue is EncodeTierValue with the header's flags: 0, or
// tierPayloadUnsummed.
func encodeTierValue(dst []byte, key TierKey, tokens []int32, payload int, fill func(payload []byte) error, flags uint16) error {
	if fill == nil {
		panic(PanicNilTierFill)
	}
	size := TierValueSize(len(tokens), payload)
	if size < 0 || len(dst) != size {
		return fmt.Errorf("%w: a value of %d tokens and %d payload bytes is %d bytes, dst is %d",
			ErrTierValueSize, len(tokens), payload, size, len(dst))
	}
	body := TierHeaderSize + 4*len(tokens)
	if err := fill(dst[body:]); err != nil {
		return err
	}
	h := dst[:TierHeaderSize]
	copy(h, tierMagic)
	binary.LittleEndian.PutUint16(h[4:], TierValueVersion)
	binary.LittleEndian.PutUint16(h[6:], flags)
	binary.LittleEndian.PutUint64(h[8:], key.Namespace)
	binary.LittleEndian.PutUint64(h[16:], key.Hash)
	binary.LittleEndian.PutUint32(h[24:], uint32(len(tokens)))
	binary.LittleEndian.PutUint32(h[28:], 0)
	binary.LittleEndian.PutUint64(h[32:], uint64(payload))
	binary.LittleEndian.PutUint32(h[44:], 0)
	for i, tok := range tokens {
		binary.LittleEndian.PutUint32(dst[TierHeaderSize+4*i:], uint32(tok))
	}
	binary.LittleEndian.PutUint32(h[tierCRCOffset:], tierChecksum(dst, flags, len(tokens)))
	return nil
}

// tierChecksum returns the CRC-32C of a value of n tokens, all but its checksum field
// and the reserved word after it; with tierPayloadUnsummed, not its payload either.
func tierChecksum(v []byte, flags uint16, n int) uint32 {
	c := crc32.Update(0, tierCRC, v[:tierCRCOffset])
	if flags&tierPayloadUnsummed != 0 {
		return crc32.Update(c, tierCRC, v[TierHeaderSize:TierHeaderSize+4*n])
	}
	return crc32.Update(c, tierCRC, v[TierHeaderSize:])
}

// DecodeTierValue checks that src is the value of the block key names, made for
// tokens, with payload bytes of K/V, and returns those bytes: a sub-slice of src, so
// valid only as long as src is. A value that fails any check is refused with an error
// wrapping ErrTierValue and one kind: ErrTierTruncated (shorter or longer than its
// header says), ErrTierFormat (no magic, another version, flags this version does not
// know), ErrTierChecksum, ErrTierNamespace (written under another namespace) or
// ErrTierBlock (another hash, token count, payload length or tokens). The checks run in
// that order, so a value damaged in transit is a checksum failure, not a claim about
// its contents.
func DecodeTierValue(src []byte, key TierKey, tokens []int32, payload int) ([]byte, error) {
	return decodeTierValue(src, key, tokens, payload, false)
}

// decodeTierValue is DecodeTierValue that, with inProcess set (the value comes from
// an InProcessTier), also accepts a value whose payload is not summed.
func decodeTierValue(src []byte, key TierKey, tokens []int32, payload int, inProcess bool) ([]byte, error) {
	if len(src) < TierHeaderSize {
		return nil, tierRefused(ErrTierTruncated, "%d bytes, a header is %d", len(src), TierHeaderSize)
	}
	h := src[:TierHeaderSize]
	if string(h[:4]) != tierMagic {
		return nil, tierRefused(ErrTierFormat, "magic % x", h[:4])
	}
	f := binary.LittleEndian.Uint16(h[6:])
	if v := binary.LittleEndian.Uint16(h[4:]); v != TierValueVersion || (f != 0 && (!inProcess || f != tierPayloadUnsummed)) {
		return nil, tierRefused(ErrTierFormat, "version %d flags %#x, this build reads version %d", v, f, TierValueVersion)
	}
	if r1, r2 := binary.LittleEndian.Uint32(h[28:]), binary.LittleEndian.Uint32(h[44:]); r1 != 0 || r2 != 0 {
		return nil, tierRefused(ErrTierFormat, "reserved words %#x %#x", r1, r2)
	}
	n := binary.LittleEndian.Uint32(h[24:])
	p := binary.LittleEndian.Uint64(h[32:])
	rest := uint64(len(src) - TierHeaderSize)
	if uint64(n)*4 > rest || p != rest-uint64(n)*4 {
		return nil, tierRefused(ErrTierTruncated, "%d bytes for %d tokens and %d payload bytes", len(src), n, p)
	}
	if got, want := tierChecksum(src, f, int(n)), binary.LittleEndian.Uint32(h[tierCRCOffset:]); got != want {
		return nil, tierRefused(ErrTierChecksum, "CRC-32C %#08x, header says %#08x", got, want)
	}
	if ns := binary.LittleEndian.Uint64(h[8:]); ns != key.Namespace {
		return nil, tierRefused(ErrTierNamespace, "namespace %#016x, want %#016x", ns, key.Namespace)
	}
	if hash := binary.LittleEndian.Uint64(h[16:]); hash != key.Hash {
		return nil, tierRefused(ErrTierBlock, "hash %#016x, want %#016x", hash, key.Hash)
	}
	if int(n) != len(tokens) || payload < 0 || p != uint64(payload) {
		return nil, tierRefused(ErrTierBlock, "%d tokens and %d payload bytes, want %d and %d", n, p, len(tokens), payload)
	}
	stored := src[TierHeaderSize : TierHeaderSize+4*len(tokens)]
	for i, tok := range tokens {
		if got := int32(binary.LittleEndian.Uint32(stored[4*i:])); got != tok {
			return nil, tierRefused(ErrTierBlock, "token %d is %d, want %d", i, got, tok)
		}
	}
	return src[TierHeaderSize+4*len(tokens):], nil
}

// tierRefused returns an error wrapping ErrTierValue and kind.
func tierRefused(kind error, format string, args ...any) error {
	return fmt.Errorf("%w: %w: %s", ErrTierValue, kind, fmt.Sprintf(format, args...))
}
