//go:build linux || windows

package kv_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
)

// TestPrefixCacheInsertAfterForkHost is TestPrefixCacheInsertAfterFork on a
// host.Shared pool, whose granules are reference-counted by their mappings: a granule
// the holder maps stays owned when the entry unmaps it.
func TestPrefixCacheInsertAfterForkHost(t *testing.T) {
	const p = 300
	for _, layout := range layouts {
		for _, how := range []string{"fork", "forkat", "freeze", "child"} {
			t.Run(layout.String()+"/"+how, func(t *testing.T) {
				c, pc, hp := newHostPrefixCache(t, "kv-pc-forkins", layout)
				gov, auth, b := hp.auth.Governor(), hp.auth, hp.b
				pool := forkInsertPool{
					held: func() int64 { return held(hp) },
					limit: func(t *testing.T) {
						_, err := b.Trim(0) // idle granules would cover the growth
						require.NoError(t, err)
						require.NoError(t, gov.SetLimit(accounting.HostKey, auth.Stats().Owned))
					},
				}
				forkThenInsert(t, c, pc, pool, how, p)
			})
		}
	}
}
