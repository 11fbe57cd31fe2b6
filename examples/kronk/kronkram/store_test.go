package kronkram

// The constructors that Kronk's cases call in place of its RAM store's, so that
// the cases run on a snapshot.Store (TestKronkRAMCases in kronk_test.go adds
// Kronk's file to this package when it runs them).

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/ardanlabs/kronk/sdk/kronk/kvstorage"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/examples/kronk"
	"github.com/vmarena/vmarena/snapshot"
)

// Store is the store Kronk's cases run on, under the name they give the RAM store.
type Store = snapshot.Store

// New returns a new, empty store of a factory of its own (NewFactory). It stands
// for Kronk's ram.New and for the RAM store's zero value (&Store{}), which is
// usable where a snapshot.Store's is not: a store belongs to a factory's budget.
func New(t testing.TB) *Store {
	t.Helper()
	s, err := NewFactory(t)(context.Background())
	require.NoError(t, err)
	return s.(*Store)
}

// NewFactory returns Kronk's store factory over a snapshot.Factory with the
// default options (2 MiB granules, host.Private), as a server would make it, with
// no budget limit. It stands for ram.NewFactory. When t ends the stores it made
// are closed and then the factory, which a RAM store's test need not do (the
// garbage collector takes its arrays) but a snapshot store's must (Factory.Close
// refuses while a store is open).
func NewFactory(t testing.TB) kvstorage.Factory {
	t.Helper()
	f, err := snapshot.NewFactory(accounting.NewGovernor(), snapshot.Options{})
	require.NoError(t, err)
	var (
		mu     sync.Mutex
		stores []kvstorage.Store
	)
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		for _, s := range stores {
			if err := s.Close(); !errors.Is(err, snapshot.ErrClosed) {
				assert.NoError(t, err, "closing a store")
			}
		}
		assert.NoError(t, f.Close())
	})
	factory := kronk.Factory(f)
	return func(ctx context.Context) (kvstorage.Store, error) {
		s, err := factory(ctx)
		if err == nil {
			mu.Lock()
			stores = append(stores, s)
			mu.Unlock()
		}
		return s, err
	}
}
