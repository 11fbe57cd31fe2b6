package kvevents_test

import (
	"encoding/binary"
	"fmt"
	"math"
)

// A msgpack decoder written from the specification
// (https://github.com/msgpack/msgpack/blob/master/spec.md) for these tests alone, so
// that the publisher's frames are read by code that shares nothing with the
// encoder. It keeps a map's keys in wire order and each value's wire form.

// mpMap is a decoded map, its entries in wire order.
type mpMap []mpEntry

type mpEntry struct {
	Key   string
	Value any
}

// get returns the value under key and whether it is there.
func (m mpMap) get(key string) (any, bool) {
	for _, e := range m {
		if e.Key == key {
			return e.Value, true
		}
	}
	return nil, false
}

// keys returns the map's keys in wire order.
func (m mpMap) keys() []string {
	ks := make([]string, len(m))
	for i, e := range m {
		ks[i] = e.Key
	}
	return ks
}

// mpFloat64 is a float written as msgpack's float 64 (0xcb), as msgspec writes a
// Python float.
type mpFloat64 float64

// mpDecode decodes exactly one value from b; bytes after it are an error.
func mpDecode(b []byte) (any, error) {
	d := &mpDecoder{b: b}
	v, err := d.value()
	if err != nil {
		return nil, err
	}
	if d.i != len(b) {
		return nil, fmt.Errorf("msgpack: %d bytes after the value", len(b)-d.i)
	}
	return v, nil
}

type mpDecoder struct {
	b []byte
	i int
}

func (d *mpDecoder) take(n int) ([]byte, error) {
	if n < 0 || d.i+n > len(d.b) {
		return nil, fmt.Errorf("msgpack: truncated at %d", d.i)
	}
	s := d.b[d.i : d.i+n]
	d.i += n
	return s, nil
}

func (d *mpDecoder) uint(n int) (uint64, error) {
	s, err := d.take(n)
	if err != nil {
		return 0, err
	}
	var v uint64
	for _, c := range s {
		v = v<<8 | uint64(c)
	}
	return v, nil
}

// value decodes one value: nil, bool, int64 (every integer that fits), uint64 (the
// rest), mpFloat64 or float32, string, []byte, []any or mpMap.
func (d *mpDecoder) value() (any, error) {
	s, err := d.take(1)
	if err != nil {
		return nil, err
	}
	c := s[0]
	switch {
	case c <= 0x7f:
		return int64(c), nil
	case c >= 0xe0:
		return int64(int8(c)), nil
	case c&0xf0 == 0x80:
		return d.mapOf(int(c & 0x0f))
	case c&0xf0 == 0x90:
		return d.arrayOf(int(c & 0x0f))
	case c&0xe0 == 0xa0:
		return d.str(int(c & 0x1f))
	}
	switch c {
	case 0xc0:
		return nil, nil
	case 0xc2:
		return false, nil
	case 0xc3:
		return true, nil
	case 0xc4, 0xc5, 0xc6:
		n, err := d.uint(1 << (c - 0xc4))
		if err != nil {
			return nil, err
		}
		b, err := d.take(int(n))
		return append([]byte{}, b...), err
	case 0xca:
		v, err := d.uint(4)
		return math.Float32frombits(uint32(v)), err
	case 0xcb:
		v, err := d.uint(8)
		return mpFloat64(math.Float64frombits(v)), err
	case 0xcc, 0xcd, 0xce, 0xcf:
		v, err := d.uint(1 << (c - 0xcc))
		if err != nil {
			return nil, err
		}
		if v <= math.MaxInt64 {
			return int64(v), nil
		}
		return v, nil
	case 0xd0, 0xd1, 0xd2, 0xd3:
		n := 1 << (c - 0xd0)
		v, err := d.uint(n)
		if err != nil {
			return nil, err
		}
		shift := 64 - 8*n
		return int64(v<<shift) >> shift, nil
	case 0xd9, 0xda, 0xdb:
		n, err := d.uint(1 << (c - 0xd9))
		if err != nil {
			return nil, err
		}
		return d.str(int(n))
	case 0xdc, 0xdd:
		n, err := d.uint(2 << (c - 0xdc))
		if err != nil {
			return nil, err
		}
		return d.arrayOf(int(n))
	case 0xde, 0xdf:
		n, err := d.uint(2 << (c - 0xde))
		if err != nil {
			return nil, err
		}
		return d.mapOf(int(n))
	}
	return nil, fmt.Errorf("msgpack: type byte %#x at %d not handled", c, d.i-1)
}

func (d *mpDecoder) str(n int) (any, error) {
	b, err := d.take(n)
	return string(b), err
}

func (d *mpDecoder) arrayOf(n int) (any, error) {
	a := make([]any, 0, min(n, 1<<16))
	for range n {
		v, err := d.value()
		if err != nil {
			return nil, err
		}
		a = append(a, v)
	}
	return a, nil
}

func (d *mpDecoder) mapOf(n int) (any, error) {
	m := make(mpMap, 0, min(n, 1<<10))
	for range n {
		k, err := d.value()
		if err != nil {
			return nil, err
		}
		ks, ok := k.(string)
		if !ok {
			return nil, fmt.Errorf("msgpack: a map key of type %T", k)
		}
		v, err := d.value()
		if err != nil {
			return nil, err
		}
		m = append(m, mpEntry{ks, v})
	}
	return m, nil
}

// beUint64 reads an 8-byte big-endian frame.
func beUint64(b []byte) uint64 { return binary.BigEndian.Uint64(b) }
