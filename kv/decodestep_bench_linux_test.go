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

// BenchmarkDecodeStep measures a whole decode step of a batch, what a KV layout
// costs a server: append one token to each of 8 sequences of about 1,024 tokens
// (Llama-3-8B), writing its K and V in every layer, then read every layer's K and V
// of every sequence (attention's read: 1 GiB, copied out through every byte, one
// tensor after another). Memory is populated on commit (2 MiB granules), with 4 KiB
// pages or transparent huge pages.
//
// The sequences start at 1,025 to 1,039 tokens (odd, so that their granule
// boundaries are spread over the steps) and grow by one a step: a layout that
// commits a granule per 16 tokens of a sequence (per-sequence, blocked) pays its
// commits in proportion. PerLayer commits the same bytes as 64 granules per 1,024
// tokens of a sequence, all at once, which no short run meets in proportion: its
// commits fall outside the steps measured (the granule benchmarks of backing/host
// price them; BENCHMARKS.md adds them). -benchtime must stay at most 200x.
//
//   - layout=plain: the same bytes contiguous, copied out: the floor; no append;
//   - layout=per-layer, layout=per-sequence: kv.PerLayer and kv.PerSequence
//     (WriteToken; Sequence.Bytes, or View rows);
//   - layout=blocked: each 2 MiB granule holds 16 tokens of every layer, layer-major
//     inside (as BenchmarkReadLayer), a granule committed per 16 tokens;
//   - layout=paged: the paged baseline: 16-token blocks in a per-layer pool that
//     is all populated up front and never shrinks, found through each sequence's
//     block table (shuffled).
//
// ns/token is the step's time per token it appends (8 a step).
func BenchmarkDecodeStep(b *testing.B) {
	const (
		seqs    = 8
		tokens  = 1024
		room    = 256 // tokens a sequence may grow by
		granule = 2 << 20
		block   = 16 // tokens per block (blocked and paged)
	)
	g := kv.Llama3_8B
	tb := g.TokenBytes()
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
		cache := func(b *testing.B, layout kv.Layout) []*kv.Sequence {
			p, err := host.NewPrivate(host.PrivateOptions{Granularity: granule, Populate: true, NoHugePages: !huge, AlwaysHugePages: huge})
			require.NoError(b, err)
			gov := accounting.NewGovernor()
			c, err := kv.New(p, kv.Config{Geometry: g, MaxTokens: tokens + room, Layout: layout,
				Authority: gov.Authority("kv", accounting.HostKey)})
			require.NoError(b, err)
			qs := make([]*kv.Sequence, 0, seqs)
			b.Cleanup(func() {
				for _, q := range qs {
					require.True(b, q.Close().OK())
				}
				require.NoError(b, c.Close())
			})
			for k := range seqs {
				q, err := c.NewSequence()
				require.NoError(b, err)
				qs = append(qs, q)
				require.NoError(b, q.Append(start(k)))
			}
			return qs
		}
		// appendAll appends one token to each sequence and writes its K and V in
		// every layer.
		appendAll := func(b *testing.B, qs []*kv.Sequence) {
			for _, q := range qs {
				t := q.Len()
				if t == tokens+room {
					b.Fatalf("more steps than the %d tokens of room", room)
				}
				if err := q.Append(1); err != nil {
					b.Fatal(err)
				}
				for l := range g.Layers {
					for _, k := range []kv.Kind{kv.K, kv.V} {
						if err := q.WriteToken(l, k, t, token); err != nil {
							b.Fatal(err)
						}
					}
				}
			}
		}
		dst := make([]byte, (tokens+room)*seqs*tb)
		b.Run("layout=plain/pages="+pages, func(b *testing.B) {
			mem := region(b, kinds*layerBytes)
			commit(b, mem)
			b.SetBytes(step)
			for b.Loop() {
				for i := range kinds {
					copy(dst, mem[i*layerBytes:(i+1)*layerBytes])
				}
			}
			report(b)
		})
		b.Run("layout=per-layer/pages="+pages, func(b *testing.B) {
			qs := cache(b, kv.PerLayer)
			b.SetBytes(step)
			for b.Loop() {
				appendAll(b, qs)
				for l := range g.Layers {
					for _, k := range []kv.Kind{kv.K, kv.V} {
						at := 0
						for _, q := range qs {
							src, err := q.Bytes(l, k)
							if err != nil {
								b.Fatal(err)
							}
							at += copy(dst[at:], src)
						}
					}
				}
			}
			report(b)
		})
		b.Run("layout=per-sequence/pages="+pages, func(b *testing.B) {
			qs := cache(b, kv.PerSequence)
			// The token rows of every (layer, kind) tensor, sequence after sequence,
			// as a kernel walks them by base and stride; a step adds the new rows.
			rows := make([][][][]arena.F16, kinds) // [tensor][sequence][token]
			view := func(q *kv.Sequence, i, from int) [][]arena.F16 {
				v, err := kv.View[arena.F16](q, i/2, kv.Kind(i%2))
				if err != nil {
					b.Fatal(err)
				}
				var out [][]arena.F16
				for t := from; t < q.Len(); t++ {
					row, err := v.Sub(t, t+1).Slice()
					if err != nil {
						b.Fatal(err)
					}
					out = append(out, row)
				}
				return out
			}
			for i := range rows {
				for _, q := range qs {
					rows[i] = append(rows[i], view(q, i, 0))
				}
			}
			out := make([]arena.F16, len(dst)/2)
			b.SetBytes(step)
			for b.Loop() {
				appendAll(b, qs)
				for i := range rows {
					at := 0
					for k, q := range qs {
						rows[i][k] = append(rows[i][k], view(q, i, q.Len()-1)...)
						for _, row := range rows[i][k] {
							at += copy(out[at:], row)
						}
					}
				}
			}
			report(b)
		})
		b.Run("layout=blocked/pages="+pages, func(b *testing.B) {
			per := (tokens + room) / block // granules a sequence may have
			run := block * tb              // one tensor's 16 tokens in a granule: 32 KiB
			mems := make([][]byte, seqs)
			lens := make([]int, seqs)
			for k := range mems {
				lens[k] = start(k)
				mems[k] = region(b, per*granule)
				commit(b, mems[k][:(lens[k]+block-1)/block*granule])
			}
			b.SetBytes(step)
			for b.Loop() {
				for k, mem := range mems {
					t := lens[k]
					if t == tokens+room {
						b.Fatalf("more steps than the %d tokens of room", room)
					}
					if t%block == 0 {
						commit(b, mem[t/block*granule:(t/block+1)*granule])
					}
					lens[k]++
					for i := range kinds {
						off := t/block*granule + (i*block+t%block)*tb
						copy(mem[off:off+tb], token)
					}
				}
				for i := range kinds {
					at := 0
					for k, mem := range mems {
						for blk := 0; blk*block < lens[k]; blk++ {
							off := blk*granule + i*run
							at += copy(dst[at:], mem[off:off+min(block, lens[k]-blk*block)*tb])
						}
					}
				}
			}
			report(b)
		})
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
				for i := range kinds {
					at := 0
					for k, table := range tables {
						for j, blk := range table {
							off := (i*n + blk) * run
							at += copy(dst[at:], mem[off:off+min(block, lens[k]-j*block)*tb])
						}
					}
				}
			}
			report(b)
		})
	}
}
