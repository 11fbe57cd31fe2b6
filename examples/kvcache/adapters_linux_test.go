package main

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/assert"
)

// TestReplayPrefixAdapters replays the small trace under two adapters, interleaved:
// A, C and E under lora-0, B and D under lora-1. No hit crosses adapters, so the ideal
// is each adapter's own: lora-0's C finds A's 1,100 tokens and E C's 1,299; lora-1's
// D finds B's first block (512); B finds nothing of A. vmarena's prefix cache finds
// exactly that, every hit read back as its adapter's K/V (Verify), and the paged one
// at most that.
func TestReplayPrefixAdapters(t *testing.T) {
	w := prefixWorkload(t)
	w.Adapters, w.Verify = 2, true
	s := testSetup(0)
	s.maxTokens = w.MaxTokens
	for _, name := range []string{namePrefixOn, namePagedPC} {
		t.Run(name, func(t *testing.T) {
			r := replayWhole(t, name, s, w)
			assert.Equal(t, len(w.Requests), r.Completed)
			assert.Equal(t, []int64{1100 + 1299, 512}, r.AdapterIdeal)
			assert.Equal(t, int64(1100+1299+512), r.IdealHits, "the ideal is the adapters' own")
			assert.Equal(t, int64(1024+1100+512+1299), r.SharedIdeal, "one cache for all: B and C find A's, D B's, E C's")
			assert.Equal(t, []int64{1100 + 1300 + 1300, 1500 + 700}, r.AdapterQueries)
			assert.Equal(t, r.Hits, r.AdapterHits[0]+r.AdapterHits[1])
			if name == namePrefixOn {
				assert.Equal(t, r.AdapterIdeal, r.AdapterHits, "token-exact matching within each adapter")
				assert.Equal(t, r.Hits, r.Verified, "every hit read back")
			} else {
				for a := range 2 {
					assert.LessOrEqual(t, r.AdapterHits[a], r.AdapterIdeal[a])
				}
			}
			var out bytes.Buffer
			printAdapterTable(&out, []PrefixResult{r}, 2)
			assert.Contains(t, out.String(), "lora-1")
			assert.Contains(t, out.String(), name)
			assert.Contains(t, out.String(), "one unbounded cache shared by every adapter would find")
		})
	}
}

func TestRunAdaptersFlags(t *testing.T) {
	checkUsage(t, []usageCase{
		{"negative adapters", []string{"-trace", "mooncake", "-adapters", "-1"}, "-adapters -1: want 0 to 1024"},
		{"too many adapters", []string{"-trace", "mooncake", "-adapters", "5000"}, "-adapters 5000: want 0 to 1024"},
		{"adapters without token IDs", []string{"-adapters", "2"}, "-adapters needs a trace with token IDs (-trace mooncake)"},
	})
}
