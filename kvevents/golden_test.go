package kvevents_test

import (
	"encoding/hex"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kvevents"
	"github.com/vmarena/vmarena/kvevents/internal/golden"
)

// goldenEvents queues the events of testdata/golden/vllm-*.hex on p.
func goldenEvents(p *kvevents.Publisher) {
	first := stored(7, 2, 0, false)
	first.Hashes[1] = math.MaxUint64 - 1
	first.Medium, first.LoRA = "GPU", "adapter-a"
	first.ExtraKeys = [][]any{{"adapter-a", "salt"}, nil}
	first.Attention, first.Window = kv.SlidingWindow, 128
	p.BlocksStored(first)
	p.BlocksRemoved(kv.BlocksRemoved{Hashes: []uint64{7}, Medium: "GPU", Group: 1})
	p.AllBlocksCleared()
	plain := stored(9, 1, 8, true)
	plain.Group = 2
	p.BlocksStored(plain)
}

// TestGolden: the publisher's payload is, byte for byte, the one written by hand
// from vLLM's definitions in testdata/golden, in each release's form. An encoder
// that drifts (a map for the batch, a batch of another length, a field out of
// place or of another msgpack type) fails here.
func TestGolden(t *testing.T) {
	for _, tt := range []struct {
		file   string
		arrays bool
	}{
		{"vllm-0.26.0.hex", false},
		{"vllm-0.23.0.hex", true},
	} {
		t.Run(tt.file, func(t *testing.T) {
			want, err := golden.Read(tt.file)
			require.NoError(t, err)
			release := make(chan struct{})
			calls := 0
			p := newPublisher(t, kvevents.Options{
				DataParallelRank: 3,
				VLLM023Events:    tt.arrays,
				Now: func() time.Time {
					calls++
					if calls == 1 {
						<-release // hold the publisher while the golden events queue up
					}
					return time.Unix(1_700_000_000, 250_000_000)
				},
			})
			sub := subscribe(t, p, "", 1)
			p.AllBlocksCleared() // taken alone, held in Now
			require.Eventually(t, func() bool { return p.Stats().QueueDepth == 0 }, 5*time.Second, time.Millisecond)
			goldenEvents(p)
			close(release)
			recv(t, sub)
			m := recv(t, sub)
			assert.Equal(t, hex.Dump(want), hex.Dump(m.payload))
		})
	}
}

// TestGoldenParse: the golden files' syntax is read as documented.
func TestGoldenParse(t *testing.T) {
	b, err := golden.Parse("93 cb 00 # a comment \"x\"\n a2 \"ts\"\t0a0b")
	require.NoError(t, err)
	assert.Equal(t, []byte{0x93, 0xcb, 0x00, 0xa2, 't', 's', 0x0a, 0x0b}, b)
	for _, bad := range []string{"9", "zz", "a1 \"x"} {
		_, err := golden.Parse(bad)
		assert.Error(t, err, bad)
	}
}
