package kv_test

import (
	"testing"

	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kvtier/hosttier"
)

// BenchmarkPrefixCacheTierLoad is a lookup that loads a prompt's 16 whole blocks of 2
// MiB (Llama-3.2-1B, 2 MiB granules, 1,025 tokens) from the host tier after eviction
// took them off the cache: the Contains, the sequence's growth, each value's check
// (CRC-32C and the tokens) and its copy into the fresh block, then the sequence's
// Close. memcpy is a copy of the same bytes between two buffers of the Go heap, in
// the same run: the target is a load at most 1.2× its time. B/s is the
// blocks' bytes.
func BenchmarkPrefixCacheTierLoad(b *testing.B) {
	g := kv.Llama32_1B()
	c := openEnv(b, onShared, withGranule(2<<20), withShared(host.SharedOptions{Populate: true}), withName("kv-bench-tier"),
		withConfig(kv.Config{Model: g, MaxTokens: 4096})).c
	tier, err := hosttier.New(hosttier.Options{Budget: 256 << 20})
	if err != nil {
		b.Fatal(err)
	}
	defer tier.Close()
	pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{Tiers: []kv.Tier{tier}})
	if err != nil {
		b.Fatal(err)
	}
	defer pc.Close()
	s, err := c.NewSequence()
	if err != nil {
		b.Fatal(err)
	}
	const blocks = 16
	tpb, blk := s.BlockTokens(), s.BlockStride()
	ids := promptIDs(1, blocks*tpb+1)
	if err := s.Append(len(ids)); err != nil {
		b.Fatal(err)
	}
	if err := pc.Insert(s, ids); err != nil {
		b.Fatal(err)
	}
	s.Close()
	if _, err := pc.Evict(1 << 40); err != nil {
		b.Fatal(err)
	}
	b.Run("lookup", func(b *testing.B) {
		b.SetBytes(int64(blocks * blk))
		for b.Loop() {
			q, m, err := pc.Lookup(ids)
			if err != nil || m != blocks*tpb {
				b.Fatalf("lookup: %d tokens, %v", m, err)
			}
			q.Close()
		}
	})
	b.Run("memcpy", func(b *testing.B) {
		src, dst := make([]byte, blocks*blk), make([]byte, blocks*blk)
		for i := range src {
			src[i] = byte(i)
		}
		b.SetBytes(int64(len(src)))
		for b.Loop() {
			copy(dst, src)
		}
	})
}
