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

// BenchmarkReadLayer measures what a decode step's attention reads: one layer of 8
// sequences of 1,024 tokens each (Llama-3-8B: 2 KiB per token and tensor), its K alone
// (read=K, 16 MiB) or its K and V (read=KV, 32 MiB: what attention reads, tile by
// tile: a sequence's K then V, or a block's), copied out through every byte, the
// layer changing every iteration in a scattered order (13 apart) so that no layer's
// bytes stay in cache. Memory is a Private backing of 2 MiB granules, populated, with
// 4 KiB pages or transparent huge pages.
//
//   - layout=plain: the layer's bytes contiguous ([layer][K|V]), one copy: the floor;
//   - layout=per-layer: kv.PerLayer, Sequence.Bytes of each sequence (2 MiB runs);
//   - layout=per-sequence: kv.PerSequence, the token rows of View (2 KiB runs
//     128 KiB apart);
//   - layout=blocked: kv.Blocked, the default: the blocks of View (16 tokens of every
//     layer per 2 MiB block, layer-major inside: a block's K is a 32 KiB run, its K
//     and V one 64 KiB run);
//   - layout=blocked64: kv.Blocked with BlockTokens 64 (8 MiB blocks, 128 KiB runs of
//     K);
//   - layout=paged: the paged baseline's gather: 16-token blocks of 32 KiB in a
//     per-layer pool for K and one for V, in the order of each sequence's block table
//     (shuffled, as a pool hands blocks out after some churn).
func BenchmarkReadLayer(b *testing.B) {
	const (
		seqs    = 8
		tokens  = 1024
		granule = 2 << 20
		block   = 16 // tokens per block (paged)
	)
	g := kv.Llama3_8B
	tb := g.TokenBytes()
	layerBytes := seqs * tokens * tb // one tensor (K or V) of every sequence
	layer := func(i int) int { return i * 13 % g.Layers }
	reads := []struct {
		name  string
		kinds []kv.Kind
	}{{"K", []kv.Kind{kv.K}}, {"KV", []kv.Kind{kv.K, kv.V}}}
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
		cache := func(b *testing.B, layout kv.Layout, blockTokens int) []*kv.Sequence {
			gov := accounting.NewGovernor()
			c, err := kv.New(newMem(b), kv.Config{Geometry: g, MaxTokens: tokens, Layout: layout, BlockTokens: blockTokens,
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
		dst := make([]byte, 2*layerBytes)
		out := make([]arena.F16, layerBytes)
		// each runs read for both reads (K, KV) on the memory setup made: read(l,
		// kinds) copies layer l's tensors of those kinds out.
		each := func(b *testing.B, name string, setup func(b *testing.B) func(l int, kinds []kv.Kind)) {
			b.Run("layout="+name+"/pages="+pages, func(b *testing.B) {
				read := setup(b)
				for _, r := range reads {
					b.Run("read="+r.name, func(b *testing.B) {
						b.SetBytes(int64(len(r.kinds) * layerBytes))
						i := 0
						for b.Loop() {
							read(layer(i), r.kinds)
							i++
						}
					})
				}
			})
		}
		each(b, "plain", func(b *testing.B) func(int, []kv.Kind) {
			mem := region(b, 2*g.Layers*layerBytes)
			return func(l int, kinds []kv.Kind) {
				at := 2 * l * layerBytes
				copy(dst, mem[at:at+len(kinds)*layerBytes])
			}
		})
		each(b, "per-layer", func(b *testing.B) func(int, []kv.Kind) {
			qs := cache(b, kv.PerLayer, 0)
			return func(l int, kinds []kv.Kind) {
				at := 0
				for _, q := range qs {
					for _, k := range kinds {
						src, err := q.Bytes(l, k)
						if err != nil {
							b.Fatal(err)
						}
						at += copy(dst[at:], src)
					}
				}
			}
		})
		// viewed reads a layout through the runs of its views, as a kernel walks them
		// by base and strides: a sequence's or a block's K run, then its V run.
		viewed := func(layout kv.Layout, blockTokens int) func(b *testing.B) func(int, []kv.Kind) {
			return func(b *testing.B) func(int, []kv.Kind) {
				qs := cache(b, layout, blockTokens)
				rs := make([][2][][]arena.F16, g.Layers) // [layer][kind][run], sequence after sequence
				for l := range rs {
					for _, k := range []kv.Kind{kv.K, kv.V} {
						for _, q := range qs {
							rs[l][k] = append(rs[l][k], viewRuns(b, q, l, k, 0)...)
						}
					}
				}
				return func(l int, kinds []kv.Kind) {
					at := 0
					for j := range rs[l][kv.K] {
						for _, k := range kinds {
							at += copy(out[at:], rs[l][k][j])
						}
					}
				}
			}
		}
		each(b, "per-sequence", viewed(kv.PerSequence, 0))
		each(b, "blocked", viewed(kv.Blocked, 0))
		each(b, "blocked64", viewed(kv.Blocked, 64))
		each(b, "paged", func(b *testing.B) func(int, []kv.Kind) {
			n := seqs * tokens / block // blocks per (layer, K|V) pool
			run := block * tb
			mem := region(b, 2*g.Layers*n*run)
			table := rand.New(rand.NewPCG(1, 2)).Perm(n) // the sequences' block tables, one after another
			return func(l int, kinds []kv.Kind) {
				at := 0
				for _, blk := range table {
					for _, k := range kinds {
						off := ((2*l+int(k))*n + blk) * run
						at += copy(dst[at:], mem[off:off+run])
					}
				}
			}
		})
	}
}

// viewRuns returns the contiguous runs of tokens [from, Len) of layer's K or V tensor
// of q, as a kernel walks its view by base and strides: one a token in PerSequence,
// one a block in Blocked (its tokens below Len; from must start a block), the whole
// tensor in PerLayer.
func viewRuns(b *testing.B, q *kv.Sequence, layer int, kind kv.Kind, from int) [][]arena.F16 {
	v, err := kv.View[arena.F16](q, layer, kind)
	if err != nil {
		b.Fatal(err)
	}
	n, bt := q.Len(), q.BlockTokens()
	var out [][]arena.F16
	switch {
	case q.Cache().Config().Layout == kv.PerLayer:
		r, err := v.Slice()
		if err != nil {
			b.Fatal(err)
		}
		return append(out, r)
	case bt > 0:
		per := v.NumElems() / max(v.Dim(0)*bt, 1) // elements per token
		for t := from; t < n; t += bt {
			r, err := v.Sub(t/bt, t/bt+1).Slice()
			if err != nil {
				b.Fatal(err)
			}
			out = append(out, r[:min(bt, n-t)*per])
		}
	default:
		for t := from; t < n; t++ {
			r, err := v.Sub(t, t+1).Slice()
			if err != nil {
				b.Fatal(err)
			}
			out = append(out, r)
		}
	}
	return out
}
