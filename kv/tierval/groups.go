package tierval

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"math"
)

// The grouped value: what a cache on a model of several layer groups (window groups
// beside full or MLA ones: gpt-oss, Gemma-3, Llama-4) writes for one block. A block
// there is a run of tokens that every group's units tile (each group's units are of
// its own size); the value carries, per group, that group's part of the block, and the
// layout of the groups it was written under, so that a value of another model or
// layout is refused before any of its bytes is used. All integers are little-endian.
//
//	offset      size  field
//	0           4     magic "VMKV"
//	4           2     format version (GroupsVersion)
//	6           2     flags: 0, or payloadUnsummed for an in-process tier's value
//	8           8     namespace
//	16          8     the block's chained hash
//	24          4     token count n
//	28          4     group count g
//	32          8     payload length p: the sum of the parts' lengths
//	40          4     CRC-32C of bytes [0, 40), then [48, end)
//	                  ([48, 48+L+8g+4n) only, with payloadUnsummed)
//	44          4     layout length L, a multiple of 8
//	48          L     the layout (Layout): the model's name (4-byte length, the
//	                  bytes, zeros to a multiple of 8), then g group records of 40
//	                  bytes: part kind, attention kind, element type, scale mode (1
//	                  byte each), window, layers, KV heads, head dim, tensors per
//	                  layer, tokens per unit, reserved 0 (4 bytes each), unit bytes (8)
//	48+L        8g    each group's part length, in group order: the whole part,
//	                  or (PartUnits) a whole number of the group's last units of
//	                  the block, or 0 for none (a window group's older units given
//	                  back before the block was written)
//	48+L+8g     4n    the tokens the block was made for, int32 each
//	48+L+8g+4n  p     the parts present, in group order
//
// A part is of one of two kinds, named in the group's record. PartUnits is a group's
// units of the block's tokens (a full, MLA, sliding-window or chunked group); PartState
// is a recurrent group's state checkpointed after the block's last token: the whole
// state (the record's unit bytes) or none, where the cache held no checkpoint there.
//
// Version 1 (value.go) stays the value of a cache of one group, written and read as
// before: Encode and Decode read and write version 1 only, EncodeGroups and
// DecodeGroups GroupsVersion only, and each refuses the other's values with ErrFormat.

// GroupsVersion is the format version of a grouped value (EncodeGroups, DecodeGroups).
const GroupsVersion = 2

const (
	groupRecord   = 40 // bytes of a group's record in a layout
	maxGroups     = 1 << 16
	maxModelBytes = 1 << 16
)

// PartKind is what a group's part of a grouped value holds.
type PartKind uint8

const (
	// PartUnits is a group's units (blocks) over the value's tokens: full, MLA,
	// sliding-window and chunked groups.
	PartUnits PartKind = iota + 1
	// PartState is a recurrent group's state, checkpointed after the value's last
	// token: whole, or none.
	PartState
)

// GroupLayout describes one layer group of a grouped value: what its part holds
// and what gives the part's bytes their meaning. The fields are the cache's own
// (kv.Group's kind, window, layers, KV heads, head dim, element type, scale mode,
// tensors per layer; the group's unit): a value whose layout differs in any one is
// refused with ErrLayout.
type GroupLayout struct {
	Part    PartKind
	Kind    uint8 // the group's attention kind (kv.Attention)
	DType   uint8 // its element type (arena.DType)
	Scales  uint8 // its scale mode (kv.ScaleMode)
	Window  int
	Layers  int
	KVHeads int
	HeadDim int
	Tensors int
	// UnitTokens and UnitBytes are the group's sharing unit: the tokens it holds
	// and its bytes (PartState: 0, and the state's bytes).
	UnitTokens int
	UnitBytes  int
}

// Layout is the group layout of a cache's grouped values, encoded once (NewLayout),
// so that writing it into a value and checking it in one are a copy and a compare.
// Its zero value is no layout; a Layout is immutable and safe for concurrent use.
type Layout struct {
	enc    []byte // the layout's bytes in a value: L of them
	groups int
	units  []int // each group's UnitBytes where its part is PartUnits, else 0
}

// NewLayout returns the layout of a model named model whose groups are groups, in
// order. It fails with an error wrapping ErrSize for no group, more than 65,536 of
// them, a name longer than 65,536 bytes, a part kind it does not know, or a field
// that is negative or does not fit its record.
func NewLayout(model string, groups []GroupLayout) (*Layout, error) {
	if len(groups) == 0 || len(groups) > maxGroups || len(model) > maxModelBytes {
		return nil, fmt.Errorf("%w: a layout of %d groups and a name of %d bytes", ErrSize, len(groups), len(model))
	}
	name := (4 + len(model) + 7) / 8 * 8
	enc := make([]byte, name, name+groupRecord*len(groups))
	units := make([]int, len(groups))
	binary.LittleEndian.PutUint32(enc, uint32(len(model)))
	copy(enc[4:], model)
	for i, g := range groups {
		if g.Part != PartUnits && g.Part != PartState {
			return nil, fmt.Errorf("%w: group %d: part kind %d", ErrSize, i, g.Part)
		}
		fields := []int{g.Window, g.Layers, g.KVHeads, g.HeadDim, g.Tensors, g.UnitTokens}
		for _, v := range fields {
			if v < 0 || v > math.MaxUint32 {
				return nil, fmt.Errorf("%w: group %d: field %d out of range", ErrSize, i, v)
			}
		}
		if g.UnitBytes < 0 {
			return nil, fmt.Errorf("%w: group %d: unit of %d bytes", ErrSize, i, g.UnitBytes)
		}
		enc = append(enc, byte(g.Part), g.Kind, g.DType, g.Scales)
		for _, v := range fields {
			enc = binary.LittleEndian.AppendUint32(enc, uint32(v))
		}
		enc = binary.LittleEndian.AppendUint32(enc, 0)
		enc = binary.LittleEndian.AppendUint64(enc, uint64(g.UnitBytes))
		if g.Part == PartUnits {
			units[i] = g.UnitBytes
		}
	}
	return &Layout{enc: enc, groups: len(groups), units: units}, nil
}

// Groups returns the layout's group count: the length of the parts of its values.
func (l *Layout) Groups() int { return l.groups }

// Size returns the bytes of the grouped value of a block of tokens tokens whose
// group i has a part of parts[i] bytes (0: none), or -1 when a count is negative,
// parts is not one per group, or the value would not fit an int. Use it to size the
// destination of EncodeGroups.
func (l *Layout) Size(tokens int, parts []int) int {
	if len(parts) != l.groups || tokens < 0 || tokens > math.MaxUint32 {
		return -1
	}
	size := HeaderSize + len(l.enc) + 8*l.groups
	if tokens > (math.MaxInt-size)/4 {
		return -1
	}
	size += 4 * tokens
	for _, p := range parts {
		if p < 0 || p > math.MaxInt-size {
			return -1
		}
		size += p
	}
	return size
}

// EncodeGroups writes into dst the grouped value of the block key names, made for
// tokens, under layout l, whose group i has a part of parts[i] bytes (0: none). It
// calls fill once per group with a part, in group order, with that part of dst, where
// the caller makes its one copy of the group's bytes, then writes the header, the
// layout, the parts' lengths and the tokens and seals the value with its checksum.
// dst must be exactly l.Size(len(tokens), parts) bytes; another length is refused
// with ErrSize before fill is called. fill's error is EncodeGroups', and dst is then
// no value. DecodeGroups checks it.
func EncodeGroups(dst []byte, key Key, l *Layout, tokens []int32, parts []int, fill func(group int, part []byte) error) error {
	return encodeGroups(dst, key, l, tokens, parts, fill, 0)
}

// EncodeGroupsInProcess is EncodeGroups for a value that stays in this process's
// memory (a kv.InProcessTier's): its parts are left out of the checksum, and only
// DecodeGroupsInProcess accepts it.
func EncodeGroupsInProcess(dst []byte, key Key, l *Layout, tokens []int32, parts []int, fill func(group int, part []byte) error) error {
	return encodeGroups(dst, key, l, tokens, parts, fill, payloadUnsummed)
}

// encodeGroups is EncodeGroups with the header's flags: 0, or payloadUnsummed.
func encodeGroups(dst []byte, key Key, l *Layout, tokens []int32, parts []int, fill func(group int, part []byte) error, flags uint16) error {
	if fill == nil {
		panic(PanicNilFill)
	}
	size := l.Size(len(tokens), parts)
	if size < 0 || len(dst) != size {
		return fmt.Errorf("%w: a grouped value of %d tokens and parts %v is %d bytes, dst is %d",
			ErrSize, len(tokens), parts, size, len(dst))
	}
	dir := HeaderSize + len(l.enc)
	body := dir + 8*l.groups + 4*len(tokens)
	off, payload := body, 0
	for i, p := range parts {
		if p == 0 {
			continue
		}
		if err := fill(i, dst[off:off+p]); err != nil {
			return err
		}
		off += p
		payload += p
	}
	h := dst[:HeaderSize]
	copy(h, magic)
	binary.LittleEndian.PutUint16(h[4:], GroupsVersion)
	binary.LittleEndian.PutUint16(h[6:], flags)
	binary.LittleEndian.PutUint64(h[8:], key.Namespace)
	binary.LittleEndian.PutUint64(h[16:], key.Hash)
	binary.LittleEndian.PutUint32(h[24:], uint32(len(tokens)))
	binary.LittleEndian.PutUint32(h[28:], uint32(l.groups))
	binary.LittleEndian.PutUint64(h[32:], uint64(payload))
	binary.LittleEndian.PutUint32(h[44:], uint32(len(l.enc)))
	copy(dst[HeaderSize:], l.enc)
	for i, p := range parts {
		binary.LittleEndian.PutUint64(dst[dir+8*i:], uint64(p))
	}
	for i, tok := range tokens {
		binary.LittleEndian.PutUint32(dst[dir+8*l.groups+4*i:], uint32(tok))
	}
	binary.LittleEndian.PutUint32(h[crcOffset:], groupsChecksum(dst, flags, body))
	return nil
}

// groupsChecksum returns the CRC-32C of a grouped value whose parts start at body,
// all but its checksum field and the layout length after it; with payloadUnsummed,
// not its parts either.
func groupsChecksum(v []byte, flags uint16, body int) uint32 {
	c := crc32.Update(0, crcTable, v[:crcOffset])
	c = crc32.Update(c, crcTable, v[crcOffset+4:HeaderSize])
	if flags&payloadUnsummed != 0 {
		return crc32.Update(c, crcTable, v[HeaderSize:body])
	}
	return crc32.Update(c, crcTable, v[HeaderSize:])
}

// DecodeGroups checks that src is the grouped value of the block key names, made for
// tokens, under layout l, each of whose parts present is want[i] bytes (or, for a
// PartUnits group, a whole number of its units fewer: its last units of the block),
// and sets parts[i] to group i's part (a sub-slice of src, valid only as long as src
// is), or nil where the value has none. parts and want must have one element per group. A
// value that fails any check is refused with an error wrapping ErrValue and one kind,
// checked in this order: ErrTruncated (its lengths do not add up to its size),
// ErrFormat (no magic, not GroupsVersion, unknown flags), ErrChecksum, ErrNamespace,
// ErrLayout (written under another layout: another model or group shape), or ErrBlock
// (another hash, token count or tokens, or a part of another length); parts are then
// unset. Use it on a grouped value read from any tier.
func DecodeGroups(src []byte, key Key, l *Layout, tokens []int32, want []int, parts [][]byte) error {
	return decodeGroups(src, key, l, tokens, want, parts, false)
}

// DecodeGroupsInProcess is DecodeGroups for a value read from a tier in this
// process's memory (a kv.InProcessTier's): it also accepts a value
// EncodeGroupsInProcess wrote, whose parts are not summed.
func DecodeGroupsInProcess(src []byte, key Key, l *Layout, tokens []int32, want []int, parts [][]byte) error {
	return decodeGroups(src, key, l, tokens, want, parts, true)
}

// decodeGroups is DecodeGroups that, with inProcess set, also accepts a value whose
// parts are not summed.
func decodeGroups(src []byte, key Key, l *Layout, tokens []int32, want []int, parts [][]byte, inProcess bool) error {
	if len(want) != l.groups || len(parts) != l.groups {
		panic("tierval: DecodeGroups with want or parts not one per group")
	}
	if len(src) < HeaderSize {
		return refused(ErrTruncated, "%d bytes, a header is %d", len(src), HeaderSize)
	}
	h := src[:HeaderSize]
	f, err := groupsFormat(h, inProcess)
	if err != nil {
		return err
	}
	n := uint64(binary.LittleEndian.Uint32(h[24:]))
	g := uint64(binary.LittleEndian.Uint32(h[28:]))
	p := binary.LittleEndian.Uint64(h[32:])
	lay := uint64(binary.LittleEndian.Uint32(h[44:]))
	rest := uint64(len(src) - HeaderSize)
	if lay%8 != 0 || lay+8*g+4*n > rest || p != rest-lay-8*g-4*n {
		return refused(ErrTruncated, "%d bytes for a layout of %d, %d groups, %d tokens and %d payload bytes", len(src), lay, g, n, p)
	}
	dir := HeaderSize + int(lay)
	body := dir + 8*int(g) + 4*int(n)
	if got, sum := groupsChecksum(src, f, body), binary.LittleEndian.Uint32(h[crcOffset:]); got != sum {
		return refused(ErrChecksum, "CRC-32C %#08x, header says %#08x", got, sum)
	}
	if err := l.ident(src, key); err != nil {
		return err
	}
	if int(n) != len(tokens) {
		return refused(ErrBlock, "%d tokens, want %d", n, len(tokens))
	}
	if err := l.lengths(src, want, p); err != nil {
		return err
	}
	stored := src[dir+8*l.groups : body]
	for i, tok := range tokens {
		if got := int32(binary.LittleEndian.Uint32(stored[4*i:])); got != tok {
			return refused(ErrBlock, "token %d is %d, want %d", i, got, tok)
		}
	}
	off := body
	for i := range l.groups {
		q := int(binary.LittleEndian.Uint64(src[dir+8*i:]))
		if q == 0 {
			parts[i] = nil
			continue
		}
		parts[i] = src[off : off+q : off+q]
		off += q
	}
	return nil
}

// HeadSize returns the bytes at the start of a grouped value under l that PeekParts
// reads: the header, the layout and the parts' lengths.
func (l *Layout) HeadSize() int { return HeaderSize + len(l.enc) + 8*l.groups }

// PeekParts reads from head, the first bytes of a grouped value (at least
// l.HeadSize() of them, or the whole value), the length of each group's part into
// lens (0: none), for a value that DecodeGroups(value, key, l, tokens, want, parts)
// would be asked to decode; lens and want must have one element per group. It checks
// what a head holds, as DecodeGroups does: the magic, the version and flags (an
// in-process value's too), the namespace, the layout, the hash, and each part's length
// against want. It can not check the checksum, the tokens or the parts, which only
// the whole value holds, so a value it accepts may still be refused by DecodeGroups;
// it never accepts one DecodeGroups would accept with other lengths. A head it
// refuses gets an error wrapping ErrValue and ErrTruncated (fewer bytes than the
// head), ErrFormat, ErrNamespace, ErrLayout or ErrBlock; lens is then unset.
func PeekParts(head []byte, key Key, l *Layout, want, lens []int) error {
	if len(want) != l.groups || len(lens) != l.groups {
		panic("tierval: PeekParts with want or lens not one per group")
	}
	if len(head) < l.HeadSize() {
		return refused(ErrTruncated, "%d bytes, the head of a grouped value under this layout is %d", len(head), l.HeadSize())
	}
	h := head[:HeaderSize]
	if _, err := groupsFormat(h, true); err != nil {
		return err
	}
	if err := l.ident(head, key); err != nil {
		return err
	}
	if err := l.lengths(head, want, binary.LittleEndian.Uint64(h[32:])); err != nil {
		return err
	}
	dir := HeaderSize + len(l.enc)
	for i := range l.groups {
		lens[i] = int(binary.LittleEndian.Uint64(head[dir+8*i:]))
	}
	return nil
}

// groupsFormat checks a grouped value's header h for its magic, version and flags
// (payloadUnsummed only with inProcess) and returns the flags.
func groupsFormat(h []byte, inProcess bool) (uint16, error) {
	if string(h[:4]) != magic {
		return 0, refused(ErrFormat, "magic % x", h[:4])
	}
	f := binary.LittleEndian.Uint16(h[6:])
	if v := binary.LittleEndian.Uint16(h[4:]); v != GroupsVersion || (f != 0 && (!inProcess || f != payloadUnsummed)) {
		return 0, refused(ErrFormat, "version %d flags %#x, a grouped value is version %d", v, f, GroupsVersion)
	}
	return f, nil
}

// ident checks that v, a grouped value or its head (its header and at least its
// layout's bytes, where its header says they are l's length), is of key under l: its
// namespace (ErrNamespace), its layout (ErrLayout: the group count, the layout's
// length and bytes) and its hash (ErrBlock), in that order.
func (l *Layout) ident(v []byte, key Key) error {
	h := v[:HeaderSize]
	if ns := binary.LittleEndian.Uint64(h[8:]); ns != key.Namespace {
		return refused(ErrNamespace, "namespace %#016x, want %#016x", ns, key.Namespace)
	}
	g, lay := binary.LittleEndian.Uint32(h[28:]), int(binary.LittleEndian.Uint32(h[44:]))
	enc := v[HeaderSize:min(len(v), HeaderSize+lay)]
	if int(g) != l.groups || !bytes.Equal(enc, l.enc) {
		return refused(ErrLayout, "%d groups, layout %s; want %d groups, layout %s", g, layoutName(enc), l.groups, layoutName(l.enc))
	}
	if hash := binary.LittleEndian.Uint64(h[16:]); hash != key.Hash {
		return refused(ErrBlock, "hash %#016x, want %#016x", hash, key.Hash)
	}
	return nil
}

// lengths checks the parts' lengths of v, a grouped value under l (ident passed) or
// its head: each one a part of its group may have against want (partFits), and all
// of them together payload bytes; else ErrBlock.
func (l *Layout) lengths(v []byte, want []int, payload uint64) error {
	dir := HeaderSize + len(l.enc)
	var sum uint64
	for i := range l.groups {
		q := binary.LittleEndian.Uint64(v[dir+8*i:])
		if !partFits(q, want[i], l.units[i]) {
			return refused(ErrBlock, "group %d's part is %d bytes, want %d or its last units of %d bytes", i, q, want[i], l.units[i])
		}
		sum += q
	}
	if sum != payload {
		return refused(ErrBlock, "parts of %d bytes in all, payload %d", sum, payload)
	}
	return nil
}

// partFits reports whether a part of q bytes is one a value may hold of a group
// whose whole part is want bytes, of units of unit bytes (0: the part is whole or
// none): none, the whole part, or a whole number of its last units.
func partFits(q uint64, want, unit int) bool {
	return q == 0 || q <= uint64(want) && (q == uint64(want) || unit != 0 && q%uint64(unit) == 0)
}

// layoutName returns the model name a layout's bytes start with, for an error.
func layoutName(enc []byte) string {
	if len(enc) < 4 {
		return "(none)"
	}
	n := binary.LittleEndian.Uint32(enc)
	if uint64(n) > uint64(len(enc)-4) {
		return "(damaged)"
	}
	return fmt.Sprintf("of %q", enc[4:4+n])
}
