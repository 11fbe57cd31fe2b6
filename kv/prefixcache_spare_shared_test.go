//go:build linux || windows

package kv_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
)

// TestPrefixCacheMissTakesOverHost is TestPrefixCacheMissTakesOverLRUEntry on a
// host.Shared pool, where read-only memory faults: the new sequence writes the
// taken-over granules in place, and an entry that a hit protected while its sequence
// lived (a real mprotect) is left to the growth's eviction rather than handed over.
func TestPrefixCacheMissTakesOverHost(t *testing.T) {
	const p = 300
	for _, layout := range layouts {
		for _, guarded := range []bool{false, true} {
			name := layout.String() + map[bool]string{false: "/plain", true: "/guarded"}[guarded]
			t.Run(name, func(t *testing.T) {
				c, pc, hp := newHostPrefixCache(t, "kv-pc-spare", layout)
				gov, auth, b := hp.auth.Governor(), hp.auth, hp.b
				a, bb, cc := promptIDs(0, p), promptIDs(1000, p), promptIDs(2000, p)
				s, _, err := serve(pc, a)
				require.NoError(t, err)
				if guarded {
					q, m, err := pc.Lookup(append(a[:p:p], -1))
					require.NoError(t, err)
					require.Equal(t, p, m)
					require.True(t, q.Close().OK())
				}
				require.True(t, s.Close().OK())
				x := pc.Stats().CachedBytes
				s, _, err = serve(pc, bb)
				require.NoError(t, err)
				require.True(t, s.Close().OK())
				_, err = b.Trim(0) // idle granules would cover the miss's growth
				require.NoError(t, err)
				require.Equal(t, 2*x, held(&hostPool{auth, b}))
				require.NoError(t, gov.SetLimit(accounting.HostKey, auth.Stats().Owned+x/2))

				s, m, err := pc.Lookup(cc)
				require.NoError(t, err)
				require.Zero(t, m)
				if guarded {
					assert.Zero(t, committedOf(t, c, s), "a's ranges are read-only in part: not taken over")
				} else {
					assert.Equal(t, x, committedOf(t, c, s), "the new sequence holds a's granules")
				}
				require.NoError(t, s.Append(p))
				require.NoError(t, writeIDs(s, cc, 0, p), "the granules are writable")
				require.NoError(t, checkIDs(s, cc, 0, p))
				require.NoError(t, pc.Insert(s, cc))
				require.True(t, s.Close().OK())
				st := pc.Stats()
				if guarded {
					assert.Equal(t, 3, st.Entries, "the growth took only the shortfall, from a's tail")
				} else {
					assert.Equal(t, 2, st.Entries, "a went whole")
				}
				assert.Equal(t, st.CachedBytes, held(&hostPool{auth, b}), "with no live sequence, the pool holds just the cache")
				// A hit may need budget of its own (a granule of small private pages
				// moves into the memfd when first shared): lift the limit.
				require.NoError(t, gov.SetLimit(accounting.HostKey, accounting.Unlimited))
				q, m, err := pc.Lookup(append(bb[:p:p], -1))
				require.NoError(t, err)
				assert.Equal(t, p, m)
				require.NoError(t, checkIDs(q, bb, 0, p))
				require.True(t, q.Close().OK())
			})
		}
	}
}
