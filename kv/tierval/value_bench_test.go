package tierval_test

import (
	"hash/crc32"
	"testing"

	"github.com/vmarena/vmarena/kv/tierval"
)

// BenchmarkTierValue measures the tier value format on a 2 MiB block of 1,024 tokens
// against a plain copy of the same bytes: op=copy is the cache's one copy alone,
// op=encode is that copy plus the header, tokens and CRC-32C, op=decode is the check
// of a value read back (no copy), op=crc32c the checksum alone.
func BenchmarkTierValue(b *testing.B) {
	const payload = 2 << 20
	key := tierval.Key{Namespace: 1, Hash: 2}
	toks := tierTokens(1024, 1)
	block := tierPayload(payload, 1)
	value := make([]byte, tierval.Size(len(toks), payload))
	fill := func(p []byte) error { copy(p, block); return nil }
	if err := tierval.Encode(value, key, toks, payload, fill); err != nil {
		b.Fatal(err)
	}
	dst := make([]byte, payload)
	table := crc32.MakeTable(crc32.Castagnoli)
	b.Run("op=copy", func(b *testing.B) {
		b.SetBytes(payload)
		for b.Loop() {
			copy(dst, block)
		}
	})
	b.Run("op=crc32c", func(b *testing.B) {
		b.SetBytes(payload)
		for b.Loop() {
			_ = crc32.Checksum(block, table)
		}
	})
	b.Run("op=encode", func(b *testing.B) {
		b.SetBytes(payload)
		for b.Loop() {
			if err := tierval.Encode(value, key, toks, payload, fill); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("op=decode", func(b *testing.B) {
		b.SetBytes(payload)
		for b.Loop() {
			if _, err := tierval.Decode(value, key, toks, payload); err != nil {
				b.Fatal(err)
			}
		}
	})
}
