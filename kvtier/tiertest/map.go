package tiertest

import (
	"context"
	"fmt"
	"sync"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
)

// Map is a [kv.Tier] on Go-heap memory, for tests of code above the tiers. Its zero
// value is not usable; make one with [NewMap]. A Map is safe for concurrent use.
type Map struct {
	max int

	mu     sync.Mutex
	values map[tierval.Key][]byte
	bytes  int
}

// NewMap returns an empty Map that holds values of up to maxValue bytes; maxValue 0
// means [MinValueSize].
func NewMap(maxValue int) *Map {
	if maxValue <= 0 {
		maxValue = MinValueSize
	}
	return &Map{max: maxValue, values: map[tierval.Key][]byte{}}
}

// Name returns "map".
func (m *Map) Name() string { return "map" }

// MaxValueSize returns the largest value Store accepts.
func (m *Map) MaxValueSize() int { return m.max }

// Store keeps the size bytes fill writes under key, replacing any value held there.
// fill writes into a fresh slice, so a failed fill leaves the old value untouched.
func (m *Map) Store(ctx context.Context, key tierval.Key, size int, fill func(dst []byte) error) error {
	if size < 0 || size > m.max {
		return fmt.Errorf("%w: %d bytes (at most %d)", tierval.ErrSize, size, m.max)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	v := make([]byte, size)
	if err := fill(v); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.bytes += size - len(m.values[key])
	m.values[key] = v
	return nil
}

// Load calls use with the value under key. Values are never written after Store, so
// use reads it without the lock held, and may call the Map itself.
func (m *Map) Load(ctx context.Context, key tierval.Key, use func(src []byte) error) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	m.mu.Lock()
	v, ok := m.values[key]
	m.mu.Unlock()
	if !ok {
		return kv.ErrTierMiss
	}
	return use(v)
}

// Peek calls use with the first min(n, len) bytes of the value under key.
func (m *Map) Peek(ctx context.Context, key tierval.Key, n int, use func(head []byte) error) error {
	if n < 1 {
		panic(kv.PanicPeekLength)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	m.mu.Lock()
	v, ok := m.values[key]
	m.mu.Unlock()
	if !ok {
		return kv.ErrTierMiss
	}
	return use(v[:min(n, len(v))])
}

// Contains returns how many of keys, from the first, the Map holds.
func (m *Map) Contains(ctx context.Context, keys []tierval.Key) (int, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for i, k := range keys {
		if _, ok := m.values[k]; !ok {
			return i, nil
		}
	}
	return len(keys), nil
}

// Delete forgets key.
func (m *Map) Delete(ctx context.Context, key tierval.Key) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.bytes -= len(m.values[key])
	delete(m.values, key)
	return nil
}

// Len returns the number of values held.
func (m *Map) Len() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.values)
}

// Bytes returns the bytes of the values held.
func (m *Map) Bytes() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.bytes
}
