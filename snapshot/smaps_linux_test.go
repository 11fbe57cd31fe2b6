package snapshot_test

import (
	"bufio"
	"context"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/snapshot"
)

// rssIn returns the resident bytes of the mappings inside [lo, hi), from
// /proc/self/smaps. A mapping that straddles a bound counts whole, so the range
// must be one the caller reserved alone.
func rssIn(t *testing.T, lo, hi uintptr) int64 {
	t.Helper()
	f, err := os.Open("/proc/self/smaps")
	require.NoError(t, err)
	defer f.Close()
	var rss int64
	in := false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) == 0 {
			continue
		}
		if start, end, ok := strings.Cut(fields[0], "-"); ok && !strings.HasSuffix(fields[0], ":") {
			s, err1 := strconv.ParseUint(start, 16, 64)
			e, err2 := strconv.ParseUint(end, 16, 64)
			if err1 == nil && err2 == nil {
				in = uintptr(s) < hi && uintptr(e) > lo
				continue
			}
		}
		if in && len(fields) == 3 && fields[0] == "Rss:" {
			kb, err := strconv.ParseInt(fields[1], 10, 64)
			require.NoError(t, err)
			rss += kb << 10
		}
	}
	require.NoError(t, sc.Err())
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
