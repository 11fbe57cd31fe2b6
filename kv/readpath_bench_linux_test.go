package kv_test

import (
	"fmt"
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
// tile: a sequence's K then V, or a block's), loaded through every byte as attention
// loads a tile (no stores: see load), the layer changing every iteration in a
// scattered order (13 apart) so that no layer's bytes stay in cache, run after run.
// Memory is a Private backing of 2 MiB granules, populated, with 4 KiB pages or
// transparent huge pages. (BenchmarkReadRuns prices run patterns in plain memory,
// and a kernel that reads several runs at once.)
//
//   - layout=plain: the layer's bytes contiguous ([layer][K|V]), read in 2 MiB runs
//     one after another: the floor;
//   - layout=copy: the same bytes copied out (copy, which takes non-temporal stores
//     from 1 MiB up): a user's other way to read them;
//   - layout=runs: plain memory read in Blocked's pattern without kv (32 KiB runs
//     2 MiB apart): what the default's runs cost the memory itself;
//   - layout=per-layer: kv.PerLayer, Sequence.Bytes of each sequence (2 MiB runs);
//   - layout=blocked: kv.Blocked, the default: the blocks of View (16 tokens of every
//     layer per 2 MiB block, layer-major inside: a block's K is a 32 KiB run, its K
//     and V one 64 KiB run);
//   - layout=blockedN: kv.Blocked with BlockTokens N (N/16 granules a block) and
//     RunTokens N (each block one run: runs of K N/16 times as long);
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
	g := kv.Llama3_8B()
	tb := g.Groups[0].TokenBytes()
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
			e := openEnv(b, onPrivate, withGranule(granule), withPrivate(host.PrivateOptions{Populate: true, NoHugePages: !huge, AlwaysHugePages: huge}),
				withConfig(kv.Config{Model: g, MaxTokens: tokens, Layout: layout, BlockTokens: blockTokens, RunTokens: blockTokens}))
			c, gov := e.c, e.gov
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
		// each runs a layout for both reads. setup returns the runs of layer l's
		// tensors of the kinds asked for, in the order a kernel reads them; they are
		// found before the clock starts, as a kernel gets them from its arguments.
		each := func(b *testing.B, name string, setup func(b *testing.B) func(l int, kinds []kv.Kind) [][]byte) {
			b.Run("layout="+name+"/pages="+pages, func(b *testing.B) {
				runsOf := setup(b)
				for _, r := range reads {
					runs := make([][][]byte, g.Layers)
					for l := range runs {
						runs[l] = runsOf(l, r.kinds)
						n := 0
						for _, run := range runs[l] {
							n += len(run)
						}
						require.Equal(b, len(r.kinds)*layerBytes, n, "layer %d: the runs hold the layer's bytes", l)
					}
					b.Run("read="+r.name, func(b *testing.B) {
						b.SetBytes(int64(len(r.kinds) * layerBytes))
						i := 0
						for b.Loop() {
							for _, run := range runs[layer(i)] {
								load(run)
							}
							i++
						}
					})
				}
			})
		}
		// chunks cuts mem into runs of n bytes.
		chunks := func(mem []byte, n int) [][]byte {
			var out [][]byte
			for at := 0; at < len(mem); at += n {
				out = append(out, mem[at:min(at+n, len(mem))])
			}
			return out
		}
		each(b, "plain", func(b *testing.B) func(int, []kv.Kind) [][]byte {
			mem := region(b, 2*g.Layers*layerBytes)
			return func(l int, kinds []kv.Kind) [][]byte {
				at := 2 * l * layerBytes
				return chunks(mem[at:at+len(kinds)*layerBytes], granule)
			}
		})
		b.Run("layout=copy/pages="+pages, func(b *testing.B) {
			mem := region(b, 2*g.Layers*layerBytes)
			dst := make([]byte, 2*layerBytes)
			for _, r := range reads {
				b.Run("read="+r.name, func(b *testing.B) {
					b.SetBytes(int64(len(r.kinds) * layerBytes))
					i := 0
					for b.Loop() {
						at := 2 * layer(i) * layerBytes
						copy(dst, mem[at:at+len(r.kinds)*layerBytes])
						i++
					}
				})
			}
		})
		// runs is plain memory in Blocked's pattern, without kv.
		each(b, "runs", func(b *testing.B) func(int, []kv.Kind) [][]byte {
			mem := region(b, 2*g.Layers*layerBytes)
			bt := granule / (2 * g.Layers * tb) // tokens per 2 MiB block
			run := bt * tb
			return func(l int, kinds []kv.Kind) [][]byte {
				var out [][]byte
				for blk := range seqs * tokens / bt {
					for _, k := range kinds {
						off := blk*granule + (2*l+int(k))*run
						out = append(out, mem[off:off+run])
					}
				}
				return out
			}
		})
		each(b, "per-layer", func(b *testing.B) func(int, []kv.Kind) [][]byte {
			qs := cache(b, kv.PerLayer, 0)
			return func(l int, kinds []kv.Kind) [][]byte {
				var out [][]byte
				for _, q := range qs {
					for _, k := range kinds {
						src, err := q.Bytes(l, k)
						require.NoError(b, err)
						out = append(out, src)
					}
				}
				return out
			}
		})
		// viewed reads a layout through the runs of its views, as a kernel walks them
		// by base and strides: a sequence's or a block's K run, then its V run.
		viewed := func(layout kv.Layout, blockTokens int) func(b *testing.B) func(int, []kv.Kind) [][]byte {
			return func(b *testing.B) func(int, []kv.Kind) [][]byte {
				qs := cache(b, layout, blockTokens)
				return func(l int, kinds []kv.Kind) [][]byte {
					var out [][]byte
					for _, q := range qs {
						var rs [2][][]arena.F16
						for _, k := range kinds {
							rs[k] = viewRuns(b, q, l, k, 0)
						}
						for j := range rs[kv.K] {
							for _, k := range kinds {
								out = append(out, asBytes(rs[k][j]))
							}
						}
					}
					return out
				}
			}
		}
		each(b, "blocked", viewed(kv.Blocked, 0))
		each(b, "blocked32", viewed(kv.Blocked, 32))
		each(b, "blocked64", viewed(kv.Blocked, 64))
		each(b, "blocked128", viewed(kv.Blocked, 128))
		each(b, "paged", func(b *testing.B) func(int, []kv.Kind) [][]byte {
			n := seqs * tokens / block // blocks per (layer, K|V) pool
			run := block * tb
			mem := region(b, 2*g.Layers*n*run)
			table := rand.New(rand.NewPCG(1, 2)).Perm(n) // the sequences' block tables, one after another
			return func(l int, kinds []kv.Kind) [][]byte {
				var out [][]byte
				for _, blk := range table {
					for _, k := range kinds {
						off := ((2*l+int(k))*n + blk) * run
						out = append(out, mem[off:off+run])
					}
				}
				return out
			}
		})
	}
}

// BenchmarkReadRuns measures what the memory alone charges for reading in runs: 16 MiB
// loaded as BenchmarkReadLayer loads it, in runs of run bytes whose starts are stride
// apart (stride=run is one contiguous stream), out of 1 GiB of populated anonymous
// memory with 4 KiB pages, so that no two iterations in a row read the same bytes
// (64 disjoint slots, visited 13 apart). It is the floor under every layout's read:
// a layer of kv.Blocked's default block is runs of 32 KiB 2 MiB apart. streams=4
// reads four runs at once (loadStreams), as a kernel working on four blocks would.
func BenchmarkReadRuns(b *testing.B) {
	const (
		total = 1 << 30
		read  = 16 << 20
		slots = total / read
	)
	raw, err := unix.Mmap(-1, 0, total, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(b, err)
	defer func() { require.NoError(b, unix.Munmap(raw)) }()
	require.NoError(b, unix.Madvise(raw, unix.MADV_NOHUGEPAGE))
	require.NoError(b, unix.Madvise(raw, unix.MADV_POPULATE_WRITE))
	for _, c := range []struct{ run, stride, streams int }{
		{32 << 10, 32 << 10, 1}, {32 << 10, 64 << 10, 1}, {32 << 10, 2 << 20, 1}, {32 << 10, 2 << 20, 4},
		{128 << 10, 256 << 10, 1}, {128 << 10, 2 << 20, 1}, {2 << 20, 2 << 20, 1}, {2 << 20, 2 << 20, 4},
	} {
		b.Run(fmt.Sprintf("run=%dKiB/stride=%dKiB/streams=%d", c.run>>10, c.stride>>10, c.streams), func(b *testing.B) {
			n := read / c.run          // runs an iteration reads
			phases := c.stride / c.run // slots interleaved in a group of n strides
			runs := make([][]byte, c.streams)
			b.SetBytes(read)
			i := 0
			for b.Loop() {
				k := i * 13 % slots
				at := k/phases*n*c.stride + k%phases*c.run
				for j := 0; j < n; j += c.streams {
					for r := range runs {
						off := at + (j+r)*c.stride
						runs[r] = raw[off : off+c.run]
					}
					loadStreams(runs)
				}
				i++
			}
		})
	}
}

// sink keeps the benchmarks' reads from being optimized away.
var sink uint64

// load reads every byte of run, as attention reads a tile of K or V (eight 8-byte
// words a cache line, eight sums so that the loads do not wait on each other), and
// returns how many bytes it read. Only the memory is measured: no stores.
func load[T any](run []T) int {
	if len(run) == 0 {
		return 0
	}
	n := len(run) * int(unsafe.Sizeof(run[0]))
	w := unsafe.Slice((*uint64)(unsafe.Pointer(&run[0])), n/8)
	var s0, s1, s2, s3, s4, s5, s6, s7 uint64
	i := 0
	for ; i+8 <= len(w); i += 8 {
		l := w[i : i+8 : i+8]
		s0 += l[0]
		s1 += l[1]
		s2 += l[2]
		s3 += l[3]
		s4 += l[4]
		s5 += l[5]
		s6 += l[6]
		s7 += l[7]
	}
	for ; i < len(w); i++ {
		s0 += w[i]
	}
	sink += s0 + s1 + s2 + s3 + s4 + s5 + s6 + s7
	return n
}

// loadStreams loads runs together, a cache line of each in turn, as a kernel that
// works on several blocks at once reads them; what is left of the longer ones is
// loaded after.
func loadStreams(runs [][]byte) {
	if len(runs) == 1 {
		load(runs[0])
		return
	}
	n := len(runs[0])
	for _, r := range runs {
		n = min(n, len(r))
	}
	n &^= 63
	var s0, s1, s2, s3, s4, s5, s6, s7 uint64
	for i := 0; i < n; i += 64 {
		for _, r := range runs {
			l := unsafe.Slice((*uint64)(unsafe.Pointer(&r[i])), 8)
			s0 += l[0]
			s1 += l[1]
			s2 += l[2]
			s3 += l[3]
			s4 += l[4]
			s5 += l[5]
			s6 += l[6]
			s7 += l[7]
		}
	}
	sink += s0 + s1 + s2 + s3 + s4 + s5 + s6 + s7
	for _, r := range runs {
		if n < len(r) {
			load(r[n:])
		}
	}
}

// asBytes returns the bytes of s.
func asBytes[T any](s []T) []byte {
	if len(s) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&s[0])), len(s)*int(unsafe.Sizeof(s[0])))
}

// viewRuns returns the contiguous runs of tokens [from, Len) of layer's K or V tensor
// of q, as a kernel walks its view by base and strides: one a run of a block in Blocked (its tokens below Len; from must start a run), the whole
// tensor in PerLayer.
func viewRuns(b *testing.B, q *kv.Sequence, layer int, kind kv.Kind, from int) [][]arena.F16 {
	v, err := kv.View[arena.F16](q, layer, kind)
	if err != nil {
		b.Fatal(err)
	}
	n, bt := q.Len(), q.BlockTokens()
	var out [][]arena.F16
	if q.Cache().Config().Layout == kv.PerLayer {
		r, err := v.Slice()
		if err != nil {
			b.Fatal(err)
		}
		return append(out, r)
	}
	if rt := stridesOf(q, layer).RunTokens; rt < bt {
		// A block of runs is no contiguous view: its runs are Run's.
		for t := from; t < n; t += rt {
			r, err := kv.Run[arena.F16](q, layer, kind, t)
			if err != nil {
				b.Fatal(err)
			}
			out = append(out, r)
		}
		return out
	}
	per := v.NumElems() / max(v.Dim(0)*bt, 1) // elements per token
	for t := from; t < n; t += bt {
		r, err := v.Sub(t/bt, t/bt+1).Slice()
		if err != nil {
			b.Fatal(err)
		}
		out = append(out, r[:min(bt, n-t)*per])
	}
	return out
}
