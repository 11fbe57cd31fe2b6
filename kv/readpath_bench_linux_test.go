package kv_test

import (
	"math/rand/v2"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
)

// BenchmarkReadLayer measures what a decode step's attention reads: one layer's K of
// 8 sequences of 1,024 tokens each (Llama-3-8B: 2 KiB per token, 16 MiB in all),
// copied out through every byte, the layer changing every iteration in a scattered
// order (13 apart) so that no layer's bytes stay in cache. Memory is a Private
// backing of 2 MiB granules, populated, with 4 KiB pages or transparent huge pages.
//
//   - layout=plain: the 16 MiB contiguous, one copy: the floor;
//   - layout=per-layer: kv.PerLayer, Sequence.Bytes of each sequence (2 MiB runs);
//   - layout=per-sequence: kv.PerSequence, the token rows of View (2 KiB runs
//     128 KiB apart), the default layout;
//   - layout=blocked: a granule-blocked layout kv does not have: each 2 MiB granule
//     holds 16 tokens of every layer, layer-major inside ([layer][K|V][16 tokens]
//     [heads][dim]), so a layer reads 32 KiB runs 2 MiB apart;
//   - layout=paged: the paged baseline's gather: 16-token blocks of 32 KiB in a
//     per-layer pool, in the order of each sequence's block table (shuffled, as a
//     pool hands blocks out after some churn).
func BenchmarkReadLayer(b *testing.B) {
	const (
		seqs    = 8
		tokens  = 1024
		granule = 2 << 20
		block   = 16 // tokens per block (blocked and paged)
	)
	g := kv.Llama3_8B
	tb := g.TokenBytes()
	layerBytes := seqs * tokens * tb
	layer := func(i int) int { return i * 13 % g.Layers }
	for _, huge := range []bool{false, true} {
		pages := "4KiB"
		if huge {
			pages = "huge"
		}
		newMem := func(b *testing.B) *host.Private {
			p, err := host.NewPrivate(host.PrivateOptions{Granularity: granule, Populate: true, NoHugePages: !huge, AlwaysHugePages: huge})
			require.NoError(b, err)
			return p
		}
		// region maps n bytes of populated anonymous memory, 2 MiB-aligned, with the
		// same pages as the backing (the layouts kv does not have, and the floor).
		region := func(b *testing.B, n int) []byte {
			raw, err := unix.Mmap(-1, 0, n+granule, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
			require.NoError(b, err)
			b.Cleanup(func() { require.NoError(b, unix.Munmap(raw)) })
			pad := (granule - int(uintptr(unsafe.Pointer(&raw[0]))%granule)) % granule
			mem := raw[pad : pad+n]
			advice := unix.MADV_NOHUGEPAGE
			if huge {
				advice = unix.MADV_HUGEPAGE
			}
			require.NoError(b, unix.Madvise(mem, advice))
			require.NoError(b, unix.Madvise(mem, unix.MADV_POPULATE_WRITE))
			return mem
		}
		cache := func(b *testing.B, layout kv.Layout) []*kv.Sequence {
			gov := accounting.NewGovernor()
			c, err := kv.New(newMem(b), kv.Config{Geometry: g, MaxTokens: tokens, Layout: layout,
				Authority: gov.Authority("kv", accounting.HostKey)})
			require.NoError(b, err)
			qs := make([]*kv.Sequence, 0, seqs)
			b.Cleanup(func() {
				for _, q := range qs {
					require.True(b, q.Close().OK())
				}
				require.NoError(b, c.Close())
				require.Zero(b, gov.Stats(accounting.HostKey).Used, "the cache gave its memory back")
			})
			for range seqs {
				q, err := c.NewSequence()
				require.NoError(b, err)
				qs = append(qs, q)
				require.NoError(b, q.Append(tokens))
			}
			return qs
		}
		dst := make([]byte, layerBytes)
		b.Run("layout=plain/pages="+pages, func(b *testing.B) {
			mem := region(b, g.Layers*layerBytes)
			b.SetBytes(int64(layerBytes))
			i := 0
			for b.Loop() {
				l := layer(i)
				copy(dst, mem[l*layerBytes:(l+1)*layerBytes])
				i++
			}
		})
		b.Run("layout=per-layer/pages="+pages, func(b *testing.B) {
			qs := cache(b, kv.PerLayer)
			b.SetBytes(int64(layerBytes))
			i := 0
			for b.Loop() {
				l := layer(i)
				for k, q := range qs {
					src, err := q.Bytes(l, kv.K)
					if err != nil {
						b.Fatal(err)
					}
					copy(dst[k*tokens*tb:], src)
				}
				i++
			}
		})
		b.Run("layout=per-sequence/pages="+pages, func(b *testing.B) {
			qs := cache(b, kv.PerSequence)
			// The token rows of every layer's view, as a kernel walks them by
			// base and stride.
			rows := make([][][]arena.F16, g.Layers)
			for l := range rows {
				for _, q := range qs {
					v, err := kv.View[arena.F16](q, l, kv.K)
					require.NoError(b, err)
					for t := range tokens {
						row, err := v.Sub(t, t+1).Slice()
						require.NoError(b, err)
						rows[l] = append(rows[l], row)
					}
				}
			}
			out := make([]arena.F16, layerBytes/2)
			b.SetBytes(int64(layerBytes))
			i := 0
			for b.Loop() {
				at := 0
				for _, row := range rows[layer(i)] {
					at += copy(out[at:], row)
				}
				i++
			}
		})
		b.Run("layout=blocked/pages="+pages, func(b *testing.B) {
			blocks := tokens / block // granules per sequence
			mem := region(b, seqs*blocks*granule)
			run := block * tb // 32 KiB of one layer's K in a granule
			b.SetBytes(int64(layerBytes))
			i := 0
			for b.Loop() {
				l := layer(i)
				at := 0
				for k := range seqs * blocks {
					off := k*granule + l*2*run
					at += copy(dst[at:], mem[off:off+run])
				}
				i++
			}
		})
		b.Run("layout=paged/pages="+pages, func(b *testing.B) {
			n := seqs * tokens / block // blocks per layer's K pool
			run := block * tb
			mem := region(b, g.Layers*n*run)
			table := rand.New(rand.NewPCG(1, 2)).Perm(n) // the sequences' block tables, one after another
			b.SetBytes(int64(layerBytes))
			i := 0
			for b.Loop() {
				pool := layer(i) * n * run
				at := 0
				for _, blk := range table {
					off := pool + blk*run
					at += copy(dst[at:], mem[off:off+run])
				}
				i++
			}
		})
	}
}
