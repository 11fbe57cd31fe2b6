package kronk_test

import (
	"context"
	"errors"
	"io/fs"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/ardanlabs/kronk/sdk/kronk/kvstorage"
	"github.com/ardanlabs/kronk/sdk/kronk/model"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/examples/kronk"
	"github.com/vmarena/vmarena/snapshot"
)

// newFactory returns a factory of 64 KiB granules under a host budget of limit
// (accounting.Unlimited for none), closed when the test ends.
func newFactory(t testing.TB, limit int64) *snapshot.Factory {
	t.Helper()
	g := accounting.NewGovernor()
	if limit != accounting.Unlimited {
		require.NoError(t, g.SetLimit(accounting.HostKey, limit))
	}
	f, err := snapshot.NewFactory(g, snapshot.Options{Granularity: gran, MaxSize: 1 << 30})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, f.Close()) })
	return f
}

// TestFactoryIsKronks: Factory's result is a kvstorage.Factory (and Kronk's
// model.SessionStoreFactory) whose stores are snapshot stores of f.
func TestFactoryIsKronks(t *testing.T) {
	f := newFactory(t, accounting.Unlimited)
	var factory model.SessionStoreFactory = kronk.Factory(f)
	store, err := factory(context.Background())
	require.NoError(t, err)
	_, ok := store.(*snapshot.Store)
	assert.True(t, ok, "a %T", store)
	assert.Equal(t, 1, f.Stats().Stores)
	require.NoError(t, store.Close())
}

// TestFactoryCanceledContext: like Kronk's ram.NewFactory, the factory returns a
// done context's error and makes no store.
func TestFactoryCanceledContext(t *testing.T) {
	f := newFactory(t, accounting.Unlimited)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	store, err := kronk.Factory(f)(ctx)
	require.ErrorIs(t, err, context.Canceled)
	assert.Nil(t, store)
	assert.Zero(t, f.Stats().Stores)
}

// countingFactory wraps Factory(f) and counts the stores Kronk asks for.
func countingFactory(f *snapshot.Factory, n *atomic.Int64) kvstorage.Factory {
	inner := kronk.Factory(f)
	return func(ctx context.Context) (kvstorage.Store, error) {
		n.Add(1)
		return inner(ctx)
	}
}

// TestConfigAccepted builds Kronk's model configuration with our factory and loads
// it as far as it goes without a model file: NewModel's validation accepts it and
// the load stops at the missing file, before any session store is made. A config
// that validation refuses, the same but for a negative IMC session capacity,
// shows that the check is real.
func TestConfigAccepted(t *testing.T) {
	f := newFactory(t, accounting.Unlimited)
	var made atomic.Int64
	missing := filepath.Join(t.TempDir(), "no-such-model.gguf")
	opts := []model.Option{
		model.WithModelFiles([]string{missing}),
		model.WithIncrementalCache(true),
		model.WithSessionStoreFactory(countingFactory(f, &made)),
	}

	cfg := kronk.Config(f, opts[:2]...)
	require.NotNil(t, cfg.SessionStoreFactory)
	assert.True(t, cfg.IncrementalCache())
	assert.Contains(t, cfg.String(), "SessionStoreFactory[true]")

	ctx := context.Background()
	m, err := model.NewModel(ctx, model.NewConfig(opts...))
	require.Error(t, err)
	assert.Nil(t, m)
	assert.NotContains(t, err.Error(), "validate-config", "the config passed validation")
	assert.True(t, errors.Is(err, fs.ErrNotExist) || strings.Contains(err.Error(), missing), "the load stopped at the model file: %v", err)
	assert.Zero(t, made.Load(), "no store is made before a model loads")

	bad := model.NewConfig(append(opts, model.WithIMCSessionCapacity(-1))...)
	_, err = model.NewModel(ctx, bad)
	require.ErrorContains(t, err, "validate-config")
}
