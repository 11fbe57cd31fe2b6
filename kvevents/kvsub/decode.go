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

// Decode returns the EventBatch payload holds, in the map form vLLM sends now or the
// positional array form ([ts, events, rank], each event [type, fields...]) it sent
// before. It fails with ErrPayload, naming what it could not read.
func Decode(payload []byte) (Batch, error) {
	d := msgpack.NewDecoder(bytes.NewReader(payload))
	b, err := decodeBatch(d)
	if err != nil {
		return Batch{}, fmt.Errorf("%w: %w", ErrPayload, err)
	}
	return b, nil
}

func decodeBatch(d *msgpack.Decoder) (Batch, error) {
	var b Batch
	if isArray(d) {
		n, err := d.DecodeArrayLen()
		if err != nil || n < 2 || n > 3 {
			return b, fmt.Errorf("batch array of %d: %v", n, err)
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
	n, err := d.DecodeMapLen()
	if err != nil {
		return b, fmt.Errorf("batch: %w", err)
	}
	for range n {
		k, err := d.DecodeString()
		if err != nil {
			return b, fmt.Errorf("batch key: %w", err)
		}
		switch k {
		case "ts":
			b.TS, err = d.DecodeFloat64()
		case "events":
			b.Events, err = decodeEvents(d)
		case "data_parallel_rank":
			b.Rank, err = optInt(d)
		default:
			err = d.Skip()
		}
		if err != nil {
			return b, fmt.Errorf("%s: %w", k, err)
		}
	}
	return b, nil
}

func decodeEvents(d *msgpack.Decoder) ([]Event, error) {
	n, err := d.DecodeArrayLen()
	if err != nil {
		return nil, fmt.Errorf("events: %w", err)
	}
	out := make([]Event, 0, max(n, 0))
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
// kv_events.py declares them.
var arrayFields = map[Kind][]string{
	Stored: {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
		"extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"},
	Removed: {"block_hashes", "medium", "group_idx"},
	Cleared: {},
}

func decodeEvent(d *msgpack.Decoder) (Event, error) {
	var e Event
	if isArray(d) {
		n, err := d.DecodeArrayLen()
		if err != nil || n < 1 {
			return e, fmt.Errorf("event array of %d: %v", n, err)
		}
		tag, err := d.DecodeString()
		if err != nil {
			return e, fmt.Errorf("type: %w", err)
		}
		e.Kind = Kind(tag)
		fields, ok := arrayFields[e.Kind]
		if !ok || n-1 > len(fields) {
			return e, fmt.Errorf("event %q of %d fields", tag, n-1)
		}
		for _, f := range fields[:n-1] {
			if err := e.field(d, f); err != nil {
				return e, fmt.Errorf("%s: %w", f, err)
			}
		}
		return e, nil
	}
	n, err := d.DecodeMapLen()
	if err != nil {
		return e, err
	}
	for range n {
		k, err := d.DecodeString()
		if err != nil {
			return e, fmt.Errorf("key: %w", err)
		}
		if k == "type" {
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
	if _, ok := arrayFields[e.Kind]; !ok {
		return e, fmt.Errorf("event type %q", e.Kind)
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
	n, err := d.DecodeArrayLen()
	if err != nil {
		return nil, err
	}
	out := make([]uint64, 0, max(n, 0))
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
	n, err := d.DecodeArrayLen()
	if err != nil {
		return nil, err
	}
	out := make([]int32, 0, max(n, 0))
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
	out := make([][]any, n)
	for i := range out {
		if isNil(d) {
			if err := d.DecodeNil(); err != nil {
				return nil, err
			}
			continue
		}
		v, err := d.DecodeInterfaceLoose()
		if err != nil {
			return nil, err
		}
		keys, ok := v.([]any)
		if !ok {
			return nil, fmt.Errorf("extra keys of block %d: %T", i, v)
		}
		out[i] = keys
	}
	return out, nil
}
