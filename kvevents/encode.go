package kvevents

import (
	"bytes"
	"fmt"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/vmarena/vmarena/kv"
)

// The wire format, as vLLM's ZmqEventPublisher sends it
// (vllm/distributed/kv_events.py). The form of the payload changed between vLLM
// releases; each decision below names the release it follows (docs/events.md lists
// them, with the routers that read each):
//
//   - Each message is three frames: the topic (Options.Topic, UTF-8), the sequence
//     number as 8 bytes big-endian (0, 1, 2, ... one per message), and the payload.
//   - The payload is an EventBatch, a msgspec Struct with array_like=True in every
//     release from the file's first (vLLM's PR 16750) to v0.26.0, so a
//     positional array: [ts (float64 seconds since the Unix epoch), events,
//     data_parallel_rank]. The rank's default is None, which omit_defaults would leave
//     out, but vLLM's publisher always sets it, and so does this one: the array always
//     has 3 elements.
//   - Each event is a KVCacheEvent Struct with tag=True and omit_defaults=True. In
//     v0.26.0 (after vLLM's change to map-encoded events) it is not array_like: a map
//     whose first key is "type", the class name, followed by the fields in their
//     declared order, a field with a default omitted while it holds it. In v0.23.0 and
//     before it is array_like too: an array whose first element is the class name,
//     followed by the fields in their declared order, the defaulted ones that trail
//     omitted. Options.VLLM023Events picks the older form; the default is v0.26.0's.
//     A field without a default is always present (None as nil). So:
//   - BlockStored: type, block_hashes ([uint64]), parent_block_hash (uint64, or nil
//     for a chain's first block), token_ids ([int], len(block_hashes)*block_size of
//     them), block_size, lora_id (deprecated by vLLM: always nil here), medium ("GPU"
//     or "CPU"), lora_name (nil for none), then extra_keys (one entry per block, nil
//     or an array; omitted from a map when no block has any, nil in an array),
//     group_idx (always sent: the group's index in the kv.Model), kv_cache_spec_kind
//     and kv_cache_spec_sliding_window. The kind is named from
//     kv.BlocksStored.Attention as vLLM's get_kv_cache_spec_kind names a spec
//     (vllm/v1/kv_cache_interface.py): "full_attention", "mla_attention",
//     "sliding_window", "chunked_local_attention"; omitted when the event has none.
//     The window is sent for a sliding window alone, as
//     get_kv_cache_spec_sliding_window gives it (a chunked-local group's chunk is no
//     window): omitted otherwise. vLLM sets both on every BlockStored
//     (KVCacheManager.take_events, vllm/v1/core/kv_cache_manager.py), and a prefix
//     cache's events carry them for every group, one-group models included.
//   - BlockRemoved: type, block_hashes, medium, group_idx (no spec: vLLM's carries
//     none).
//   - AllBlocksCleared: type alone.
//
// Integers take msgpack's shortest form, as msgspec writes them; a hash of 2^63 or
// more is a uint64.

// event is one queued kv.BlockEvents call. A BlocksRemoved is kept in the fields of
// stored it shares (Hashes, Group, Medium): the queue's events stay 152 bytes, since
// the caller pays for each cache line of the one it writes.
type event struct {
	kind   eventKind
	stored kv.BlocksStored
}

type eventKind uint8

const (
	kindStored eventKind = iota + 1
	kindRemoved
	kindCleared
)

// encoder writes batches in vLLM's payload form (see the top of this file).
type encoder struct {
	buf    bytes.Buffer
	enc    *msgpack.Encoder
	arrays bool // each event a positional array, as vLLM v0.23.0 and before (Options.VLLM023Events)
}

func newEncoder(arrays bool) *encoder {
	e := &encoder{arrays: arrays}
	e.enc = msgpack.NewEncoder(&e.buf)
	return e
}

// batch returns the payload of one EventBatch: a new slice, the encoder's own
// buffer being reused.
func (e *encoder) batch(ts float64, events []event, rank int) ([]byte, error) {
	e.buf.Reset()
	w := e.enc
	// EventBatch is array_like in every vLLM release (vllm/distributed/kv_events.py,
	// from its first, PR 16750, through v0.26.0): [ts, events, data_parallel_rank]. The rank's default is
	// None, but vLLM's ZmqEventPublisher.publish always sets it, so it is always sent.
	err := firstErr(w.EncodeArrayLen(3), w.EncodeFloat64(ts), w.EncodeArrayLen(len(events)))
	if err != nil {
		return nil, err
	}
	for i := range events {
		if err := e.event(&events[i]); err != nil {
			return nil, err
		}
	}
	if err := w.EncodeInt(int64(rank)); err != nil {
		return nil, err
	}
	return bytes.Clone(e.buf.Bytes()), nil
}

// head starts an event of n fields besides its tag: a map led by "type" (vLLM
// v0.26.0: KVCacheEvent has tag=True and is not array_like), or an array led by the
// tag (vLLM v0.23.0 and before: array_like=True as well).
func (e *encoder) head(tag string, n int) error {
	if e.arrays {
		return firstErr(e.enc.EncodeArrayLen(n+1), e.enc.EncodeString(tag))
	}
	return firstErr(e.enc.EncodeMapLen(n+1), e.enc.EncodeString("type"), e.enc.EncodeString(tag))
}

// key writes a field's name, in the map form only.
func (e *encoder) key(k string) error {
	if e.arrays {
		return nil
	}
	return e.enc.EncodeString(k)
}

func (e *encoder) event(ev *event) error {
	w := e.enc
	switch ev.kind {
	case kindStored:
		s := &ev.stored
		kind, window := specOf(s)
		// The 7 fields without a default, then group_idx (always sent), then the
		// defaulted ones that do not hold their default (omit_defaults). A positional
		// array omits only trailing defaults: extra_keys, before group_idx, is nil there.
		n := 8
		if s.ExtraKeys != nil || e.arrays {
			n++
		}
		if kind != "" {
			n++
		}
		if window > 0 {
			n++
		}
		err := e.head("BlockStored", n)
		err = firstErr(err, e.key("block_hashes"), e.hashes(s.Hashes))
		err = firstErr(err, e.key("parent_block_hash"))
		if s.HasParent {
			err = firstErr(err, w.EncodeUint(s.Parent))
		} else {
			err = firstErr(err, w.EncodeNil())
		}
		err = firstErr(err, e.key("token_ids"), w.EncodeArrayLen(len(s.Tokens)))
		for _, t := range s.Tokens {
			err = firstErr(err, w.EncodeInt(int64(t)))
		}
		err = firstErr(err, e.key("block_size"), w.EncodeInt(int64(s.BlockSize)))
		err = firstErr(err, e.key("lora_id"), w.EncodeNil()) // deprecated: lora_name replaces it
		err = firstErr(err, e.key("medium"), e.optString(s.Medium))
		err = firstErr(err, e.key("lora_name"), e.optString(s.LoRA))
		switch {
		case s.ExtraKeys != nil:
			err = firstErr(err, e.key("extra_keys"), w.EncodeArrayLen(len(s.ExtraKeys)))
			for _, keys := range s.ExtraKeys {
				if keys == nil {
					err = firstErr(err, w.EncodeNil())
					continue
				}
				err = firstErr(err, w.EncodeArrayLen(len(keys)))
				for _, k := range keys {
					err = firstErr(err, w.Encode(k))
				}
			}
		case e.arrays:
			err = firstErr(err, w.EncodeNil())
		}
		err = firstErr(err, e.key("group_idx"), w.EncodeInt(int64(s.Group)))
		if kind != "" {
			err = firstErr(err, e.key("kv_cache_spec_kind"), w.EncodeString(kind))
		}
		if window > 0 {
			err = firstErr(err, e.key("kv_cache_spec_sliding_window"), w.EncodeInt(int64(window)))
		}
		return err
	case kindRemoved:
		r := &ev.stored
		err := e.head("BlockRemoved", 3)
		err = firstErr(err, e.key("block_hashes"), e.hashes(r.Hashes))
		err = firstErr(err, e.key("medium"), e.optString(r.Medium))
		return firstErr(err, e.key("group_idx"), w.EncodeInt(int64(r.Group)))
	case kindCleared:
		return e.head("AllBlocksCleared", 0)
	}
	panic(fmt.Sprintf("kvevents: event of kind %d", ev.kind))
}

// specOf returns s's kv_cache_spec_kind and kv_cache_spec_sliding_window, "" and 0
// for None, as vLLM's get_kv_cache_spec_kind and get_kv_cache_spec_sliding_window
// (vllm/v1/kv_cache_interface.py) name its group's spec: the window only for a
// sliding window (a chunked-local group's chunk is none).
func specOf(s *kv.BlocksStored) (string, int) {
	switch s.Attention {
	case kv.FullAttention:
		return "full_attention", 0
	case kv.MLALatent:
		return "mla_attention", 0
	case kv.SlidingWindow:
		return "sliding_window", s.Window
	case kv.ChunkedLocal:
		return "chunked_local_attention", 0
	case kv.Recurrent:
		return "mamba", 0 // vLLM's MambaSpec covers its linear-attention and SSM layers
	case 0:
		return "", 0
	}
	return "unknown", 0
}

func (e *encoder) hashes(hs []uint64) error {
	err := e.enc.EncodeArrayLen(len(hs))
	for _, h := range hs {
		err = firstErr(err, e.enc.EncodeUint(h))
	}
	return err
}

// optString encodes "" as nil (Python's None), anything else as itself.
func (e *encoder) optString(s string) error {
	if s == "" {
		return e.enc.EncodeNil()
	}
	return e.enc.EncodeString(s)
}

func firstErr(errs ...error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}
