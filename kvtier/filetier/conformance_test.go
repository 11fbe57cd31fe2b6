package filetier_test

import (
	"io"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kvtier/filetier"
	"github.com/vmarena/vmarena/kvtier/tiertest"
)

// quiet is a logger for tiers whose lines a test does not read.
var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// newTier opens a tier on dir (a fresh temporary directory when ""), closed when the
// test ends.
func newTier(t *testing.T, opts filetier.Options) *filetier.Tier {
	t.Helper()
	if opts.Dir == "" {
		opts.Dir = t.TempDir()
	}
	if opts.Logger == nil {
		opts.Logger = quiet
	}
	tr, err := filetier.New(opts)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tr.Close() })
	return tr
}

func TestConformance(t *testing.T) {
	tiertest.Run(t, func(t *testing.T) kv.Tier {
		return newTier(t, filetier.Options{Budget: 64 * tiertest.MinValueSize, MaxValueSize: tiertest.MinValueSize})
	})
}

// The suite through the page cache, as on a file system that refuses direct I/O,
// with every file synced.
func TestConformanceBuffered(t *testing.T) {
	tiertest.Run(t, func(t *testing.T) kv.Tier {
		return newTier(t, filetier.Options{Budget: 64 * tiertest.MinValueSize, Buffered: true, Sync: true})
	})
}

// The suite on a tier whose budget holds only a few values: it evicts as it goes.
func TestConformanceSmall(t *testing.T) {
	tiertest.Run(t, func(t *testing.T) kv.Tier {
		return newTier(t, filetier.Options{Budget: 4 * int64(filetier.FileSize(tiertest.MinValueSize)), MaxValueSize: tiertest.MinValueSize})
	})
}
