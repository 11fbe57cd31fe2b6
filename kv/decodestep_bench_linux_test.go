package kv_test

import (
	"math/rand/v2"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
)

// BenchmarkDecodeStep measures a whole decode step of a batch, what a KV layout
// costs a server: append one token to each of 8 sequences of about 1,024 tokens
// (Llama-3-8B), writing its K and V in every layer, then read every layer's K and V
// of every sequence (attention's read: 1 GiB, loaded through every byte as in
// BenchmarkReadLayer, layer after layer, and within a layer tile by tile as attention
// reads them: a sequence's K then its V, or a block's). Memory is populated on commit
// (2 MiB granules), with 4 KiB pages or transparent huge pages.
//
// The sequences start at 1,025 to 1,039 tokens (odd, so that their granule
// boundaries are spread over the steps) and grow by one a step: a layout that
// commits a granule per 16 tokens of a sequence (blocked) pays its
// commits in proportion. PerLayer commits the same bytes as 64 granules per 1,024
// tokens of a sequence, all at once, which no short run meets in proportion: its
// commits fall outside the steps measured (the granule benchmarks of backing/host
// price them; BENCHMARKS.md adds them). -benchtime must stay at most 200x.
//
//   - layout=plain: the same bytes contiguous, read: the floor; no append;
//   - layout=per-layer: kv.PerLayer (WriteToken; Sequence.Bytes);
//   - layout=blocked: kv.Blocked, the default (WriteToken; the blocks of View: a
//     2 MiB block of 16 tokens committed as its first token arrives);
//   - layout=blockedN: kv.Blocked with BlockTokens N (N/16 granules a block), each
//     block one run (RunTokens N);
//   - layout=paged: the paged baseline: 16-token blocks in a per-(layer, K|V) pool
//     that is all populated up front and never shrinks, found through each
//     sequence's block table (shuffled).
//
// ns/token is the step's time per token it appends (8 a step).
func BenchmarkDecodeStep(b *testing.B) {
	const (
		seqs    = 8
		tokens  = 1024
		room    = 256 // tokens a sequence may grow by
		granule = 2 << 20
		block   = 16 // tokens per block (paged)
	)
	g := kv.Llama3_8B()
	tb := g.Groups[0].TokenBytes()
	kinds := 2 * g.Layers                                // (layer, K|V) tensors
	start := func(k int) int { return tokens + 1 + 2*k } // sequence k's first length
	total := 0                                           // tokens of the batch at the start
	for k := range seqs {
		total += start(k)
	}
	layerBytes := total * tb          // one tensor of every sequence
	step := int64(kinds * layerBytes) // bytes read a step (at the start)
	token := make([]byte, tb)         // the new token's K or V of one layer
	for i := range token {
		token[i] = byte(i)
	}
	sum := func(qs []*kv.Sequence) int { // tokens of the batch
		n := 0
		for _, q := range qs {
			n += q.Len()
		}
		return n
	}
	report := func(b *testing.B) {
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*seqs), "ns/token")
	}
	for _, huge := range []bool{false, true} {
		pages := "4KiB"
		if huge {
			pages = "huge"
		}
		advice := unix.MADV_NOHUGEPAGE
		if huge {
			advice = unix.MADV_HUGEPAGE
		}
		// region reserves n bytes of anonymous memory, 2 MiB-aligned, inaccessible;
		// commit makes a range of it readable and writable and populates it, as
		// host.Private does with Populate.
		region := func(b *testing.B, n int) []byte {
			raw, err := unix.Mmap(-1, 0, n+granule, unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
			require.NoError(b, err)
			b.Cleanup(func() { require.NoError(b, unix.Munmap(raw)) })
			pad := (granule - int(uintptr(unsafe.Pointer(&raw[0]))%granule)) % granule
			return raw[pad : pad+n]
		}
		commit := func(b *testing.B, mem []byte) {
			require.NoError(b, unix.Mprotect(mem, unix.PROT_READ|unix.PROT_WRITE))
			require.NoError(b, unix.Madvise(mem, advice))
			require.NoError(b, unix.Madvise(mem, unix.MADV_POPULATE_WRITE))
		}
		cache := func(b *testing.B, layout kv.Layout, blockTokens int) []*kv.Sequence {
			e := openEnv(b, onPrivate, withGranule(granule), withPrivate(host.PrivateOptions{Populate: true, NoHugePages: !huge, AlwaysHugePages: huge}),
				withConfig(kv.Config{Model: g, MaxTokens: tokens + room, Layout: layout, BlockTokens: blockTokens, RunTokens: blockTokens}))
			return benchSequences(b, e.c, seqs, start)
		}
		appendAll := func(b *testing.B, qs []*kv.Sequence) { decodeAppend(b, qs, g, tokens+room, token) }
		// check fails b unless a layer's read loaded the K and V of every token.
		check := func(b *testing.B, read, tokens int) {
			if read != 2*tokens*tb {
				b.Fatalf("a layer's read loaded %d bytes, want %d", read, 2*tokens*tb)
			}
		}
		b.Run("layout=plain/pages="+pages, func(b *testing.B) {
			mem := region(b, kinds*layerBytes)
			commit(b, mem)
			b.SetBytes(step)
			for b.Loop() {
				for i := range kinds {
					load(mem[i*layerBytes : (i+1)*layerBytes])
				}
			}
			report(b)
		})
		b.Run("layout=per-layer/pages="+pages, func(b *testing.B) {
			qs := cache(b, kv.PerLayer, 0)
			b.SetBytes(step)
			for b.Loop() {
				appendAll(b, qs)
				for l := range g.Layers {
					at := 0
					for _, q := range qs {
						for _, k := range kv.KindsOf(g) {
							src, err := q.Bytes(l, k)
							if err != nil {
								b.Fatal(err)
							}
							at += load(src)
						}
					}
					check(b, at, sum(qs))
				}
			}
			report(b)
		})
		// viewed steps a layout whose tensors a kernel walks through the runs of their
		// views (a token's row, a block's tokens) by base and strides; a step redoes
		// the runs of the block it appended to.
		viewed := func(layout kv.Layout, blockTokens int) func(b *testing.B) {
			return func(b *testing.B) {
				qs := cache(b, layout, blockTokens)
				runs := make([][][2][][]arena.F16, g.Layers) // [layer][sequence][kind][run]
				for l := range runs {
					runs[l] = make([][2][][]arena.F16, seqs)
					for k, q := range qs {
						for _, kind := range kv.KindsOf(g) {
							runs[l][k][kind] = viewRuns(b, q, l, kind, 0)
						}
					}
				}
				b.SetBytes(step)
				for b.Loop() {
					appendAll(b, qs)
					for l := range runs {
						at := 0
						for k, q := range qs {
							unit := max(stridesOf(q, l).RunTokens, 1) // a block's run
							from := (q.Len() - 1) / unit * unit       // the run of the new token
							r := &runs[l][k]
							for _, kind := range kv.KindsOf(g) {
								r[kind] = append(r[kind][:from/unit], viewRuns(b, q, l, kind, from)...)
							}
							for j := range r[kv.K] {
								at += load(r[kv.K][j])
								at += load(r[kv.V][j])
							}
						}
						check(b, at, sum(qs))
					}
				}
				report(b)
			}
		}
		b.Run("layout=blocked/pages="+pages, viewed(kv.Blocked, 0))
		b.Run("layout=blocked32/pages="+pages, viewed(kv.Blocked, 32))
		b.Run("layout=blocked64/pages="+pages, viewed(kv.Blocked, 64))
		b.Run("layout=blocked128/pages="+pages, viewed(kv.Blocked, 128))
		b.Run("layout=paged/pages="+pages, func(b *testing.B) {
			n := seqs * (tokens + room) / block // blocks in each tensor's pool
			run := block * tb
			mem := region(b, kinds*n*run)
			commit(b, mem)
			free := rand.New(rand.NewPCG(1, 2)).Perm(n) // handed out in a shuffled order
			tables := make([][]int, seqs)
			lens := make([]int, seqs)
			for k := range tables {
				lens[k] = start(k)
				nb := (lens[k] + block - 1) / block
				tables[k], free = free[:nb:nb], free[nb:]
			}
			b.SetBytes(step)
			for b.Loop() {
				for k := range tables {
					t := lens[k]
					if t == tokens+room {
						b.Fatalf("more steps than the %d tokens of room", room)
					}
					if t%block == 0 {
						tables[k] = append(tables[k], free[len(free)-1])
						free = free[:len(free)-1]
					}
					lens[k]++
					blk := tables[k][t/block]
					for i := range kinds {
						off := (i*n+blk)*run + t%block*tb
						copy(mem[off:off+tb], token)
					}
				}
				for l := range g.Layers {
					at := 0
					for k, table := range tables {
						for j, blk := range table {
							for i := 2 * l; i < 2*l+2; i++ { // K, then V
								off := (i*n + blk) * run
								at += load(mem[off : off+min(block, lens[k]-j*block)*tb])
							}
						}
					}
					n := 0
					for _, t := range lens {
						n += t
					}
					check(b, at, n)
				}
			}
			report(b)
		})
	}
}

// benchSequences opens n sequences on c, sequence k with start(k) tokens, and closes
// them and c when b ends.
func benchSequences(b *testing.B, c *kv.Cache, n int, start func(k int) int) []*kv.Sequence {
	qs := make([]*kv.Sequence, 0, n)
	b.Cleanup(func() {
		for _, q := range qs {
			require.True(b, q.Close().OK())
		}
		require.NoError(b, c.Close())
	})
	for k := range n {
		q, err := c.NewSequence()
		require.NoError(b, err)
		qs = append(qs, q)
		require.NoError(b, q.Append(start(k)))
	}
	return qs
}

// decodeAppend appends one token to each of qs and writes its K and V in every layer
// of g, as a decode step does; it fails b when a sequence would pass limit tokens.
func decodeAppend(b *testing.B, qs []*kv.Sequence, g kv.Model, limit int, token []byte) {
	for _, q := range qs {
		t := q.Len()
		if t == limit {
			b.Fatalf("a sequence reached its %d tokens: more steps than it has room for", limit)
		}
		if err := q.Append(1); err != nil {
			b.Fatal(err)
		}
		for l := range g.Layers {
			for _, k := range kv.KindsOf(g) {
				if err := q.WriteToken(l, k, t, token); err != nil {
					b.Fatal(err)
				}
			}
		}
	}
}
