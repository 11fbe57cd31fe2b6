package kv_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
)

// TestGroupExactCount128K: one 128K-token sequence of each preset commits at most one
// partly filled block per group beyond its exact need (the full groups' tokens, each
// window group's live window, each recurrent state), plus, in a window group, the
// dead front of the block its window starts in: Committed is exactly Config.Size's
// group figures for the window the last decode step read, and the ledger owns
// exactly that. host.Private reserves and commits address space without touching
// it, so the 9 to 34 GB of a full cache never become resident.
func TestGroupExactCount128K(t *testing.T) {
	const n = 128 << 10
	for _, granule := range []int{64 << 10, 2 << 20} {
		for _, m := range kv.ModelPresets() {
			t.Run(fmt.Sprintf("%s/granule=%d", m.Name, granule), func(t *testing.T) {
				e, err := openEnv(t, envSpec{kind: onPrivate, noCache: true, granule: granule, limit: 1 << 40,
					private: host.PrivateOptions{NoHugePages: true}})
				require.NoError(t, err)
				cfg := kv.Config{Model: m, MaxTokens: n}
				c := e.cache(t, cfg)
				s, err := c.NewSequence()
				require.NoError(t, err)
				defer s.Close()
				// Prefill in chunks, then one decode step: the window groups then hold
				// what the step read, from FirstLive(n-1).
				for s.Len() < n-1 {
					require.NoError(t, s.Append(min(8192, n-1-s.Len())))
				}
				require.NoError(t, s.Append(1))

				before, err := cfg.Size(granule, n-1) // the windows as the last step read them
				require.NoError(t, err)
				at, err := cfg.Size(granule, n)
				require.NoError(t, err)
				var want, need int64
				for i, g := range at.Groups {
					need += g.Need
					if g.Kind == kv.Recurrent {
						assert.Less(t, g.Committed-g.Need, int64(granule), "a state rounds up to one granule at most")
						want += g.Committed
						continue
					}
					// The blocks from the one that holds the first token the last step
					// read (FirstLive(n-1); 0 in a full group) to the one of token n-1.
					bt, read := g.BlockTokens, before.Groups[i].FirstLive
					blocks := (n+bt-1)/bt - read/bt
					fewest := (n - read + bt - 1) / bt
					if g.Kind == kv.SlidingWindow || g.Kind == kv.ChunkedLocal {
						assert.LessOrEqual(t, blocks, fewest+1, "group %d: a window straddles one block more at most", i)
					} else {
						assert.Equal(t, fewest, blocks, "group %d: one partly filled block at most", i)
						assert.Equal(t, g.Committed, int64(blocks)*int64(g.BlockBytes), "group %d: Size says so", i)
					}
					want += int64(blocks) * int64(g.BlockBytes)
				}
				st := c.Stats()
				assert.Equal(t, want, st.Committed, "committed: exactly those blocks")
				assert.Equal(t, want, e.auth.Stats().Owned, "the ledger owns exactly that")
				assert.Equal(t, at.Used, need)
				t.Logf("%s at %d tokens, %d-byte granules: need %d, committed %d (%.2f%% over), a full cache's need %d",
					m.Name, n, granule, need, st.Committed, 100*float64(st.Committed-need)/float64(need), int64(n)*int64(m.Uniform().BytesPerToken()))
			})
		}
	}
}
