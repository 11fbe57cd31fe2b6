package tiertest_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/tiertest"
)

func TestRunMap(t *testing.T) {
	tiertest.Run(t, func(t *testing.T) kv.Tier {
		m := tiertest.NewMap(0)
		t.Cleanup(func() {
			assert.Zero(t, m.Len(), "values left behind")
			assert.Zero(t, m.Bytes(), "bytes left behind")
		})
		return m
	})
}

// TestRunMapShared runs every property on one Map, as a suite over one shared server
// does: each property's keys are its own.
func TestRunMapShared(t *testing.T) {
	m := tiertest.NewMap(tiertest.MinValueSize)
	tiertest.Run(t, func(*testing.T) kv.Tier { return m })
	assert.Zero(t, m.Len(), "values left behind")
}

func TestMapCounts(t *testing.T) {
	ctx := context.Background()
	m := tiertest.NewMap(100)
	assert.Equal(t, 100, m.MaxValueSize())
	k := tierval.Key{Namespace: 1, Hash: 2}
	fill := func(dst []byte) error { return nil }
	require.NoError(t, m.Store(ctx, k, 60, fill))
	require.NoError(t, m.Store(ctx, tierval.Key{Namespace: 1, Hash: 3}, 40, fill))
	assert.Equal(t, 2, m.Len())
	assert.Equal(t, 100, m.Bytes())
	require.NoError(t, m.Store(ctx, k, 10, fill))
	assert.Equal(t, 50, m.Bytes(), "a replacement counts its own size only")
	require.NoError(t, m.Delete(ctx, k))
	require.NoError(t, m.Delete(ctx, k))
	assert.Equal(t, 1, m.Len())
	assert.Equal(t, 40, m.Bytes())
}

func TestMapBadInputs(t *testing.T) {
	ctx := context.Background()
	m := tiertest.NewMap(-5)
	assert.Equal(t, tiertest.MinValueSize, m.MaxValueSize(), "a bound below 1 means MinValueSize")
	k := tierval.Key{Hash: 1}
	for _, size := range []int{-1, -1 << 40, tiertest.MinValueSize + 1} {
		err := m.Store(ctx, k, size, func([]byte) error { t.Fatal("fill called"); return nil })
		assert.ErrorIs(t, err, tierval.ErrSize, "size %d", size)
	}
	assert.Zero(t, m.Len())
}

func ExampleMap() {
	ctx := context.Background()
	m := tiertest.NewMap(0)
	k := tierval.Key{Namespace: 7, Hash: 42}
	_ = m.Store(ctx, k, 5, func(dst []byte) error {
		copy(dst, "block")
		return nil
	})
	_ = m.Load(ctx, k, func(src []byte) error {
		fmt.Printf("%s\n", src)
		return nil
	})
	n, _ := m.Contains(ctx, []tierval.Key{k, {Namespace: 7, Hash: 43}})
	fmt.Println("run:", n)
	err := m.Load(ctx, tierval.Key{Namespace: 8, Hash: 42}, func([]byte) error { return nil })
	fmt.Println(errors.Is(err, kv.ErrTierMiss))
	// Output:
	// block
	// run: 1
	// true
}
