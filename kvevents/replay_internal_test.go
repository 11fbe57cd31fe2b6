package kvevents

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestReplayBufferModel drives the ring with random payload sizes and limits
// against a plain slice that keeps the same window.
func TestReplayBufferModel(t *testing.T) {
	for seed := range uint64(20) {
		rng := rand.New(rand.NewPCG(seed, 1))
		maxItems, maxBytes := 1+rng.IntN(100), 1+rng.IntN(4000)
		r := newReplayBuffer(maxItems, maxBytes)
		var model []replayItem
		modelBytes := 0
		for seq := range uint64(1000) {
			payload := make([]byte, rng.IntN(200))
			r.add(seq, payload)
			model = append(model, replayItem{seq, payload})
			modelBytes += len(payload)
			for len(model) > 1 && (len(model) > maxItems || modelBytes > maxBytes) {
				modelBytes -= len(model[0].payload)
				model = model[1:]
			}
			n, b, first := r.size()
			require.Equal(t, len(model), n, "seed %d seq %d", seed, seq)
			require.Equal(t, int64(modelBytes), b)
			require.Equal(t, model[0].seq, first)
			if rng.IntN(10) == 0 {
				from := seq - uint64(rng.IntN(len(model)+3))
				if from > seq {
					from = 0
				}
				var want []replayItem
				for _, it := range model {
					if it.seq >= from {
						want = append(want, it)
					}
				}
				require.Equal(t, want, r.from(from), "seed %d from %d", seed, from)
			}
		}
	}
}
