package snapshot_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/internal/testutil"
	"github.com/vmarena/vmarena/snapshot"
)

// rssIn returns the resident bytes of the mappings inside [lo, hi), from
// /proc/self/smaps. A mapping that straddles a bound counts whole, so the range
// must be one the caller reserved alone.
func rssIn(t *testing.T, lo, hi uintptr) int64 {
	t.Helper()
	var rss int64
	for _, m := range testutil.Overlapping(testutil.Smaps(t), lo, hi) {
		rss += m.Sizes["Rss"]
	}
	return rss
}

// TestResetReturnsMemoryBySmaps shows on the kernel's own count what the ledger
// says: a snapshot is resident in its store's range while committed (populated
// at commit, whole granules), and nothing of it is after Reset.
func TestResetReturnsMemoryBySmaps(t *testing.T) {
	for _, kind := range backings {
		t.Run(kind.String(), func(t *testing.T) {
			opts := snapshot.Options{Backing: kind, MaxSize: 64 * gran}
			if kind == snapshot.Shared {
				opts.Pool.High = -1 // no idle granules: a Reset gives them to the OS
			}
			f, _ := newFactory(t, accounting.Unlimited, opts)
			s := newStore(t, f)
			snap(t, s, 20*gran+100, 6)
			lo := s.Base()
			hi := lo + uintptr(f.MaxSize())
			assert.Equal(t, int64(21*gran), rssIn(t, lo, hi), "resident: the granules that cover the snapshot")
			assert.Equal(t, int64(21*gran), f.Authority().Stats().Owned)

			require.NoError(t, s.Reset(context.Background()))
			assert.Zero(t, rssIn(t, lo, hi), "Reset left pages resident in the store's range")
			assert.Zero(t, f.Authority().Stats().Owned)
			assert.Zero(t, f.Stats().Idle)
		})
	}
}
