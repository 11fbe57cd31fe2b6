package kvevents

import (
	"testing"

	"github.com/vmarena/vmarena/kv"
)

// BenchmarkEncodeBatch is the publisher goroutine's encoding for one request of
// BenchmarkPublishCost: a batch of a BlockStored of 256 blocks (4,096 tokens of a
// 152k-token vocabulary) and a BlockRemoved of 256.
func BenchmarkEncodeBatch(b *testing.B) {
	s := kv.BlocksStored{Hashes: make([]uint64, 256), Tokens: make([]int32, 4096), BlockSize: 16, Medium: "CPU"}
	for i := range s.Tokens {
		s.Tokens[i] = int32(100_000 + i)
	}
	for i := range s.Hashes {
		s.Hashes[i] = 0x9e3779b97f4a7c15 * uint64(i+1)
	}
	events := []event{{kind: kindStored, stored: s}, {kind: kindRemoved, stored: kv.BlocksStored{Hashes: s.Hashes, Medium: "CPU"}}}
	enc := newEncoder(false)
	var n int
	for b.Loop() {
		payload, err := enc.batch(1.7e9, events, 0)
		if err != nil {
			b.Fatal(err)
		}
		n = len(payload)
	}
	b.SetBytes(int64(n))
	b.ReportMetric(float64(n), "wire-bytes/op")
}
