package kvsub

import (
	"bytes"
	"encoding/binary"
	"fmt"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// Kind is an event's type, vLLM's class name.
type Kind string

const (
	Stored  Kind = "BlockStored"
	Removed Kind = "BlockRemoved"
	Cleared Kind = "AllBlocksCleared"
)

// Event is one event of a batch: the fields of vLLM's BlockStored, BlockRemoved or
// AllBlocksCleared (vllm/distributed/kv_events.py). A field the event left out, or
// sent as null, is its zero value here: HasParent, HasGroup say which.
type Event struct {
	Kind      Kind
	Hashes    []uint64 // block_hashes: ints, or the last 8 bytes (big-endian) of byte hashes
	Parent    uint64   // parent_block_hash
	HasParent bool
	Tokens    []int32 // token_ids
	BlockSize int
	LoRAName  string
	Medium    string
	ExtraKeys [][]any // one entry per block, nil where null; nil when omitted
	Group     int     // group_idx
	HasGroup  bool
	SpecKind  string // kv_cache_spec_kind
	Window    int    // kv_cache_spec_sliding_window
}

// Batch is one message: its sequence number and its EventBatch.
type Batch struct {
	Seq    uint64
	TS     float64 // seconds since the Unix epoch
	Rank   int     // data_parallel_rank (0 when null)
	Events []Event
}

// Decode returns the EventBatch payload holds. The batch must be vLLM's positional
// array [ts, events] or [ts, events, data_parallel_rank] (EventBatch is array_like
// in every release); each event may be a map led by "type" (vLLM v0.26.0) or an
// array led by its type (v0.23.0 and before), in one batch alike. Anything else,
// a batch sent as a map included, fails with ErrPayload, naming what it could not
// read: a malformed batch is never read as an empty one.
func Decode(payload []byte) (Batch, error) {
	r := bytes.NewReader(payload)
	d := msgpack.NewDecoder(r)
	b, err := decodeBatch(d)
	if err == nil && r.Len() > 0 {
		err = fmt.Errorf("%d bytes after the batch", r.Len())
	}
	if err != nil {
		return Batch{}, fmt.Errorf("%w: %w", ErrPayload, err)
	}
	return b, nil
}

func decodeBatch(d *msgpack.Decoder) (Batch, error) {
	var b Batch
	if !isArray(d) {
		return b, fmt.Errorf("the batch is a %s, not the array [ts, events, data_parallel_rank] vLLM sends", kindOf(d))
	}
	n, err := d.DecodeArrayLen()
	if err != nil {
		return b, fmt.Errorf("batch: %w", err)
	}
	if n < 2 || n > 3 {
		return b, fmt.Errorf("a batch array of %d elements, not 2 or 3 [ts, events, data_parallel_rank]", n)
	}
	if !isNumber(d) {
		return b, fmt.Errorf("ts is a %s, not a number", kindOf(d))
	}
	if b.TS, err = d.DecodeFloat64(); err != nil {
		return b, fmt.Errorf("ts: %w", err)
	}
	if b.Events, err = decodeEvents(d); err != nil {
		return b, err
	}
	if n == 3 {
		if b.Rank, err = optInt(d); err != nil {
			return b, fmt.Errorf("data_parallel_rank: %w", err)
		}
	}
	return b, nil
}

func decodeEvents(d *msgpack.Decoder) ([]Event, error) {
	if !isArray(d) {
		return nil, fmt.Errorf("events is a %s, not an array", kindOf(d))
	}
	n, err := d.DecodeArrayLen()
	if err != nil {
		return nil, fmt.Errorf("events: %w", err)
	}
	out := make([]Event, 0, min(max(n, 0), 1<<16))
	for i := range n {
		e, err := decodeEvent(d)
		if err != nil {
			return nil, fmt.Errorf("event %d: %w", i, err)
		}
		out = append(out, e)
	}
	return out, nil
}

// arrayFields are the fields of an event in the positional form, in the order
// kv_events.py declares them (vLLM v0.23.0).
var arrayFields = map[Kind][]string{
	Stored: {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
		"extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"},
	Removed: {"block_hashes", "medium", "group_idx"},
	Cleared: {},
}

// required are the fields each event has in every release (those without a default
// since kv_events.py first appeared, vLLM's PR 16750): an event without one is
// malformed.
var required = map[Kind][]string{
	Stored:  {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"},
	Removed: {"block_hashes"},
	Cleared: {},
}

func decodeEvent(d *msgpack.Decoder) (Event, error) {
	var e Event
	if isArray(d) {
		n, err := d.DecodeArrayLen()
		if err != nil {
			return e, err
		}
		if n < 1 || !isString(d) {
			return e, fmt.Errorf("an array event not led by its type")
		}
		tag, err := d.DecodeString()
		if err != nil {
			return e, fmt.Errorf("type: %w", err)
		}
		e.Kind = Kind(tag)
		fields, ok := arrayFields[e.Kind]
		if !ok {
			return e, fmt.Errorf("event type %q", tag)
		}
		if n-1 < len(required[e.Kind]) {
			return e, fmt.Errorf("%s of %d fields, fewer than the %d it always has", tag, n-1, len(required[e.Kind]))
		}
		for i := range n - 1 {
			if i >= len(fields) { // a field added after the last positional release
				if err := d.Skip(); err != nil {
					return e, err
				}
				continue
			}
			if err := e.field(d, fields[i]); err != nil {
				return e, fmt.Errorf("%s: %w", fields[i], err)
			}
		}
		return e, nil
	}
	if !isMap(d) {
		return e, fmt.Errorf("an event that is a %s, not a map or an array", kindOf(d))
	}
	n, err := d.DecodeMapLen()
	if err != nil {
		return e, err
	}
	// NB: n is the payload's claim, up to 2^32-1: the map grows as keys come,
	// from room for the fields an event has.
	seen := make(map[string]bool, min(max(n, 0), 16))
	for range n {
		if !isString(d) {
			return e, fmt.Errorf("a key that is a %s", kindOf(d))
		}
		k, err := d.DecodeString()
		if err != nil {
			return e, fmt.Errorf("key: %w", err)
		}
		if seen[k] {
			return e, fmt.Errorf("key %q twice", k)
		}
		seen[k] = true
		if k == "type" {
			if !isString(d) {
				return e, fmt.Errorf("type is a %s, not a string", kindOf(d))
			}
			tag, err := d.DecodeString()
			if err != nil {
				return e, fmt.Errorf("type: %w", err)
			}
			e.Kind = Kind(tag)
			continue
		}
		if err := e.field(d, k); err != nil {
			return e, fmt.Errorf("%s: %w", k, err)
		}
	}
	if !seen["type"] {
		return e, fmt.Errorf("a map event without a type")
	}
	req, ok := required[e.Kind]
	if !ok {
		return e, fmt.Errorf("event type %q", e.Kind)
	}
	for _, k := range req {
		if !seen[k] {
			return e, fmt.Errorf("%s without %s", e.Kind, k)
		}
	}
	return e, nil
}

// field reads the value of the event's field k; an unknown field is skipped.
func (e *Event) field(d *msgpack.Decoder, k string) error {
	var err error
	switch k {
	case "block_hashes":
		e.Hashes, err = hashes(d)
	case "parent_block_hash":
		var hs []uint64
		if hs, err = optHash(d); err == nil && hs != nil {
			e.Parent, e.HasParent = hs[0], true
		}
	case "token_ids":
		e.Tokens, err = tokens(d)
	case "block_size":
		if !isNumber(d) {
			return fmt.Errorf("a %s, not an integer", kindOf(d))
		}
		e.BlockSize, err = d.DecodeInt()
	case "lora_name":
		e.LoRAName, err = optString(d)
	case "medium":
		e.Medium, err = optString(d)
	case "kv_cache_spec_kind":
		e.SpecKind, err = optString(d)
	case "kv_cache_spec_sliding_window":
		e.Window, err = optInt(d)
	case "group_idx":
		if isNil(d) {
			err = d.DecodeNil()
		} else {
			e.Group, err = d.DecodeInt()
			e.HasGroup = err == nil
		}
	case "extra_keys":
		e.ExtraKeys, err = extraKeys(d)
	default: // lora_id (deprecated), and fields added later
		err = d.Skip()
	}
	return err
}

// isArray reports whether the next value is an array (the positional form).
func isArray(d *msgpack.Decoder) bool {
	c, err := d.PeekCode()
	return err == nil && (msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32)
}

func isMap(d *msgpack.Decoder) bool {
	c, err := d.PeekCode()
	return err == nil && (msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32)
}

func isString(d *msgpack.Decoder) bool {
	c, err := d.PeekCode()
	return err == nil && (msgpcode.IsFixedString(c) || c == msgpcode.Str8 || c == msgpcode.Str16 || c == msgpcode.Str32)
}

func isNumber(d *msgpack.Decoder) bool {
	c, err := d.PeekCode()
	return err == nil && (msgpcode.IsFixedNum(c) || c == msgpcode.Float || c == msgpcode.Double ||
		c >= msgpcode.Uint8 && c <= msgpcode.Uint64 || c >= msgpcode.Int8 && c <= msgpcode.Int64)
}

// kindOf names the next value's msgpack type, for an error.
func kindOf(d *msgpack.Decoder) string {
	switch {
	case isMap(d):
		return "map"
	case isArray(d):
		return "array"
	case isString(d):
		return "string"
	case isNil(d):
		return "nil"
	case isNumber(d):
		return "number"
	}
	if _, err := d.PeekCode(); err != nil {
		return "missing value"
	}
	return "value of another type"
}

func isNil(d *msgpack.Decoder) bool {
	c, err := d.PeekCode()
	return err == nil && c == msgpcode.Nil
}

func optString(d *msgpack.Decoder) (string, error) {
	if isNil(d) {
		return "", d.DecodeNil()
	}
	return d.DecodeString()
}

func optInt(d *msgpack.Decoder) (int, error) {
	if isNil(d) {
		return 0, d.DecodeNil()
	}
	return d.DecodeInt()
}

// hash reads one block hash: an integer, or bytes reduced to their last 8 as vLLM
// reduces a digest (int.from_bytes(digest, "big") & (2**64-1)).
func hash(d *msgpack.Decoder) (uint64, error) {
	if c, err := d.PeekCode(); err == nil && !isNumber(d) && !isString(d) && !msgpcode.IsBin(c) {
		// NB: not decoded to name its type: a map or array claims its length, up
		// to 2^32-1, and the decoder sizes what it makes by the claim.
		return 0, fmt.Errorf("a hash that is a %s", kindOf(d))
	}
	v, err := d.DecodeInterfaceLoose()
	if err != nil {
		return 0, err
	}
	switch v := v.(type) {
	case int64:
		return uint64(v), nil
	case uint64:
		return v, nil
	case []byte:
		return tail64(v), nil
	case string:
		return tail64([]byte(v)), nil
	}
	return 0, fmt.Errorf("a hash of type %T", v)
}

// tail64 returns the last 8 bytes of b (fewer: padded in front) as big-endian.
func tail64(b []byte) uint64 {
	var t [8]byte
	copy(t[8-min(8, len(b)):], b[max(0, len(b)-8):])
	return binary.BigEndian.Uint64(t[:])
}

func optHash(d *msgpack.Decoder) ([]uint64, error) {
	if isNil(d) {
		return nil, d.DecodeNil()
	}
	h, err := hash(d)
	return []uint64{h}, err
}

func hashes(d *msgpack.Decoder) ([]uint64, error) {
	if !isArray(d) {
		return nil, fmt.Errorf("a %s, not an array", kindOf(d))
	}
	n, err := d.DecodeArrayLen()
	if err != nil {
		return nil, err
	}
	out := make([]uint64, 0, min(n, 1<<16))
	for range n {
		h, err := hash(d)
		if err != nil {
			return nil, err
		}
		out = append(out, h)
	}
	return out, nil
}

func tokens(d *msgpack.Decoder) ([]int32, error) {
	if !isArray(d) {
		return nil, fmt.Errorf("a %s, not an array", kindOf(d))
	}
	n, err := d.DecodeArrayLen()
	if err != nil {
		return nil, err
	}
	out := make([]int32, 0, min(n, 1<<16))
	for range n {
		t, err := d.DecodeInt32()
		if err != nil {
			return nil, err
		}
		out = append(out, t)
	}
	return out, nil
}

func extraKeys(d *msgpack.Decoder) ([][]any, error) {
	if isNil(d) {
		return nil, d.DecodeNil()
	}
	n, err := d.DecodeArrayLen()
	if err != nil {
		return nil, err
	}
	out := make([][]any, 0, min(n, 1<<16))
	for i := range n {
		if isNil(d) {
			if err := d.DecodeNil(); err != nil {
				return nil, err
			}
			out = append(out, nil)
			continue
		}
		if !isArray(d) {
			return nil, fmt.Errorf("extra keys of block %d: a %s, not an array", i, kindOf(d))
		}
		v, err := extraKey(d, 0)
		if err != nil {
			return nil, fmt.Errorf("extra keys of block %d: %w", i, err)
		}
		out = append(out, v.([]any))
	}
	return out, nil
}

// maxExtraDepth is how deep extra keys' arrays may nest (vLLM's are a tuple of
// strings and bytes, whose entries may be tuples).
const maxExtraDepth = 8

// extraKey reads one value of extra keys: a scalar, or an array of them (nested at
// most maxExtraDepth deep). A map is refused. NB: not DecodeInterfaceLoose, which sizes
// each map and array by its claimed length, up to 2^32-1, before reading any of it:
// here an array grows as its values come, each at least a byte of the payload.
func extraKey(d *msgpack.Decoder, depth int) (any, error) {
	switch {
	case isMap(d):
		return nil, fmt.Errorf("a map")
	case !isArray(d):
		return d.DecodeInterfaceLoose()
	case depth == maxExtraDepth:
		return nil, fmt.Errorf("arrays nested deeper than %d", maxExtraDepth)
	}
	n, err := d.DecodeArrayLen()
	if err != nil {
		return nil, err
	}
	out := make([]any, 0, min(max(n, 0), 16))
	for range n {
		v, err := extraKey(d, depth+1)
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, nil
}
