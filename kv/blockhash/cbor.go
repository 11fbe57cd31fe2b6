package blockhash

import (
	"encoding/binary"
	"math"
)

// The few CBOR items a block's hash covers (RFC 8949), encoded canonically as Python's
// cbor2.dumps(canonical=True) does them: every head in its shortest form, arrays and
// strings of definite length.

const (
	majorUint  = 0 << 5
	majorNeg   = 1 << 5
	majorBytes = 2 << 5
	majorText  = 3 << 5
	majorArray = 4 << 5
	simpleNull = 0xf6
	simpleF    = 0xf4
	simpleT    = 0xf5
)

// appendHead appends an item's head: its major type and argument, shortest form.
func appendHead(b []byte, major byte, v uint64) []byte {
	switch {
	case v < 24:
		return append(b, major|byte(v))
	case v <= math.MaxUint8:
		return append(b, major|24, byte(v))
	case v <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, major|25), uint16(v))
	case v <= math.MaxUint32:
		return binary.BigEndian.AppendUint32(append(b, major|26), uint32(v))
	default:
		return binary.BigEndian.AppendUint64(append(b, major|27), v)
	}
}

// appendInt appends a signed integer: major type 0 from 0 up, 1 (as -1-v) below.
func appendInt(b []byte, v int64) []byte {
	if v >= 0 {
		return appendHead(b, majorUint, uint64(v))
	}
	return appendHead(b, majorNeg, uint64(-1-v))
}

// appendTokens appends tokens as an array of integers (a Python tuple of ints).
func appendTokens(b []byte, tokens []int32) []byte {
	b = appendHead(b, majorArray, uint64(len(tokens)))
	for _, t := range tokens {
		b = appendInt(b, int64(t))
	}
	return b
}

// appendItem appends one extra key; a type it does not know panics with PanicExtraKey.
func appendItem(b []byte, v any) []byte {
	switch v := v.(type) {
	case nil:
		return append(b, simpleNull)
	case bool:
		if v {
			return append(b, simpleT)
		}
		return append(b, simpleF)
	case string:
		return append(appendHead(b, majorText, uint64(len(v))), v...)
	case []byte:
		return append(appendHead(b, majorBytes, uint64(len(v))), v...)
	case int:
		return appendInt(b, int64(v))
	case int32:
		return appendInt(b, int64(v))
	case int64:
		return appendInt(b, v)
	case uint32:
		return appendHead(b, majorUint, uint64(v))
	case uint64:
		return appendHead(b, majorUint, v)
	case []any:
		b = appendHead(b, majorArray, uint64(len(v)))
		for _, x := range v {
			b = appendItem(b, x)
		}
		return b
	}
	panic(PanicExtraKey)
}
