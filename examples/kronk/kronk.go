package kronk

import (
	"github.com/ardanlabs/kronk/sdk/kronk/kvstorage"
	"github.com/ardanlabs/kronk/sdk/kronk/model"

	"github.com/vmarena/vmarena/snapshot"
)

// Compile-time checks: a snapshot.Store is Kronk's session store.
var (
	_ kvstorage.Store    = (*snapshot.Store)(nil)
	_ model.SessionStore = (*snapshot.Store)(nil)
)

// Factory returns f as Kronk's store factory: each call makes a new snapshot.Store
// of f, so that every IMC session (target and draft) of a model draws from f's one
// budget.
func Factory(f *snapshot.Factory) kvstorage.Factory {
	return snapshot.FactoryFunc[kvstorage.Store](f)
}

// Config returns the Kronk model configuration that opts make, with its IMC
// session stores taken from f (model.WithSessionStoreFactory). Stores are used only
// where the incremental cache is on (model.WithIncrementalCache).
func Config(f *snapshot.Factory, opts ...model.Option) model.Config {
	opts = append(opts[:len(opts):len(opts)], model.WithSessionStoreFactory(Factory(f)))
	return model.NewConfig(opts...)
}
