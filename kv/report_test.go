package kv_test

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/internal/testutil"
	"github.com/vmarena/vmarena/kv"
)

// ledger returns the ledger's two axes as the calls that map granules move them: the
// bytes in use (owned, less a pool's idle granules, which a commit may take without
// owning anything new) and the bytes mapped. A pool's snapshot is read in one piece,
// after its background work stopped.
func (e *env) ledger() (inUse, mapped int64) {
	e.quiet()
	if e.pool != nil {
		ps := e.pool.PoolStats()
		return ps.Owned - ps.Idle, ps.Mapped
	}
	as := e.auth.Stats()
	return as.Owned, as.Mapped
}

// TestStartedReportsMatchLedger drives random Append, Freeze, NewSequenceFrom, Fork,
// ForkAt, prefix cache Insert and Lookup, Close and Release on each sharing backing
// and layout, and checks every call that maps granules into a new sequence against
// the ledger: the ledger moves by exactly what the new sequence's Started reports (a
// hit's, a fork's, a prefix's), one call at a time and summed over the run.
func TestStartedReportsMatchLedger(t *testing.T) {
	for kind := range sharingBackings {
		for _, layout := range layouts {
			t.Run(fmt.Sprintf("%s/%v", sharingNames[kind], layout), func(t *testing.T) {
				g := envGranuleOf(kind)
				// NB: sequences as long as three granules of a PerLayer tensor (tiny8's
				// TokenBytes), so that there are full granules to share on any granule.
				maxTokens := max(48, 3*g/tiny8.Groups[0].TokenBytes())
				e := openEnv(t, kind, pooled, withConfig(kv.Config{MaxTokens: maxTokens, Layout: layout, BlockTokens: blockTokensFor(layout)}))
				pc, err := kv.NewPrefixCache(e.c, kv.PrefixCacheOptions{})
				require.NoError(t, err)
				e.onFail(func() { _ = pc.Close() })
				r := rand.New(rand.NewPCG(uint64(kind), uint64(layout)))
				var (
					seqs     []*kv.Sequence
					prefixes []*kv.Prefix
					reported backing.MapReport // the sum of the reports
					moved    backing.MapReport // the sum of the ledger's moves around them
					calls    = map[string]int{}
				)
				e.onFail(func() {
					for _, s := range seqs {
						s.Close()
					}
					for _, p := range prefixes {
						p.Release()
					}
				})
				prompt := func(n int) []int32 { // the token IDs of a prompt; all share a start
					ids := make([]int32, n)
					for i := range ids {
						ids[i] = int32(7 + i)
					}
					return ids
				}
				// check runs call, which makes a sequence, and compares its report with
				// the ledger's move.
				check := func(what string, call func() (*kv.Sequence, error)) {
					inUse, mapped := e.ledger()
					s, err := call()
					require.NoError(t, err, what)
					nowInUse, nowMapped := e.ledger()
					rep := s.Started()
					move := backing.MapReport{Owned: nowInUse - inUse, Mapped: nowMapped - mapped, Granules: int((nowMapped - mapped) / int64(g))}
					assert.Equal(t, move, rep, "%s: the report against the ledger's move", what)
					reported, moved = reported.Add(rep), moved.Add(move)
					if rep.Mapped > 0 {
						calls[what]++
					}
					seqs = append(seqs, s)
				}
				for range 160 {
					switch op := r.IntN(9); {
					case op == 0 || len(seqs) == 0:
						s, err := e.c.NewSequence()
						require.NoError(t, err)
						assert.Equal(t, backing.MapReport{}, s.Started(), "a new sequence took on nothing")
						require.NoError(t, s.Append(1+r.IntN(maxTokens)))
						writeTokens(t, s, uint64(len(seqs)+1), 0, s.Len())
						seqs = append(seqs, s)
					case op == 1:
						s := seqs[r.IntN(len(seqs))]
						if n := min(r.IntN(8), maxTokens-s.Len()); n > 0 {
							require.NoError(t, s.Append(n))
						}
					case op == 2:
						s := seqs[r.IntN(len(seqs))]
						p, err := s.Freeze(r.IntN(s.Len() + 1))
						require.NoError(t, err)
						prefixes = append(prefixes, p)
					case op == 3 && len(prefixes) > 0:
						p := prefixes[r.IntN(len(prefixes))]
						check("NewSequenceFrom", func() (*kv.Sequence, error) { return e.c.NewSequenceFrom(p) })
					case op == 4:
						s := seqs[r.IntN(len(seqs))]
						check("Fork", s.Fork)
					case op == 5:
						s := seqs[r.IntN(len(seqs))]
						n := r.IntN(s.Len() + 1)
						check("ForkAt", func() (*kv.Sequence, error) { return s.ForkAt(n) })
					case op == 6:
						s := seqs[r.IntN(len(seqs))]
						require.NoError(t, pc.Insert(s, prompt(s.Len())))
					case op == 7:
						n := 1 + r.IntN(maxTokens)
						check("Lookup", func() (*kv.Sequence, error) {
							s, cached, err := pc.Lookup(prompt(n))
							if err == nil && cached == 0 {
								assert.Equal(t, backing.MapReport{}, s.Started(), "a miss took on nothing")
							}
							return s, err
						})
					case op == 8:
						i := r.IntN(len(seqs))
						assert.True(t, seqs[i].Close().OK())
						seqs = append(seqs[:i], seqs[i+1:]...)
						if len(prefixes) > 0 && r.IntN(2) == 0 {
							j := r.IntN(len(prefixes))
							prefixes[j].Release()
							prefixes = append(prefixes[:j], prefixes[j+1:]...)
						}
					}
					if t.Failed() {
						t.FailNow()
					}
				}
				t.Logf("calls that mapped granules: %v; reported %+v", calls, reported)
				assert.Equal(t, moved, reported, "the sum of the reports against the ledger's move")
				assert.NotZero(t, calls["NewSequenceFrom"]+calls["Fork"]+calls["ForkAt"], "the run mapped no prefix or fork")
				assert.NotZero(t, reported.Owned, "the run copied no tail")
				assert.Greater(t, reported.Mapped, reported.Owned, "the run shared no granule")
				for _, s := range seqs {
					assert.True(t, s.Close().OK())
				}
				for _, p := range prefixes {
					p.Release()
				}
				seqs, prefixes = nil, nil
				require.NoError(t, pc.Close())
				e.finish(t)
			})
		}
	}
}

// TestPrefixAccessors checks the seed's SharedDevicePrefix readings on each sharing
// backing and layout: Requested is the tokens' bytes, Mapped their span in whole
// granules (blocks) per range, Committed what the ledger holds for the prefix once
// its maker is gone, whatever maps it, and Base the address of each tensor's token 0
// in the prefix's own ranges, where the tokens are.
func TestPrefixAccessors(t *testing.T) {
	for kind := range sharingBackings {
		for _, layout := range layouts {
			t.Run(fmt.Sprintf("%s/%v", sharingNames[kind], layout), func(t *testing.T) {
				e := openEnv(t, kind, pooled, withConfig(kv.Config{MaxTokens: 64, Layout: layout, BlockTokens: blockTokensFor(layout)}))
				g := envGranuleOf(kind)
				cfg := kv.Config{Model: tiny8, MaxTokens: 64, Layout: layout, BlockTokens: blockTokensFor(layout)}
				ml := modelOf(cfg, g)
				if ml.blk > 0 {
					// The env's cache chose its block on its own granule: read it back.
					s, err := e.c.NewSequence()
					require.NoError(t, err)
					ml.tpb, ml.blk = s.BlockTokens(), s.BlockStride()
					require.True(t, s.Close().OK())
				}
				start, _ := e.ledger()
				root, err := e.c.NewSequence()
				require.NoError(t, err)
				e.onFail(func() { root.Close() })
				const n = 21
				require.NoError(t, root.Append(n))
				writeTokens(t, root, 5, 0, n)
				p, err := root.Freeze(n)
				require.NoError(t, err)
				e.onFail(func() { p.Release() })
				assert.Equal(t, int64(n*tiny8.BytesPerToken()), p.Requested())
				assert.Equal(t, ml.committed(n), p.Mapped(), "the tokens' span in whole granules")
				assert.Equal(t, p.Mapped(), p.Committed(), "a prefix commits what it spans")
				assert.Zero(t, p.Mapped()%int64(g))
				assert.GreaterOrEqual(t, p.Mapped(), p.Requested())

				// On its own the prefix holds Committed, however many sequences mapped it.
				require.True(t, root.Close().OK())
				before, _ := e.ledger()
				assert.Equal(t, p.Committed(), before-start, "the ledger holds the prefix alone")
				var kids []*kv.Sequence
				for range 3 {
					s, err := e.c.NewSequenceFrom(p)
					require.NoError(t, err)
					kids = append(kids, s)
				}
				for _, s := range kids {
					require.True(t, s.Close().OK())
				}
				after, _ := e.ledger()
				assert.Equal(t, p.Committed(), after-start, "the ledger holds the prefix once, after sequences mapped it")

				seen := map[uintptr]bool{}
				for layer := range tiny8.Layers {
					for _, k := range kv.KindsOf(tiny8) {
						base := p.Base(layer, k)
						assert.NotZero(t, base)
						assert.False(t, seen[base], "layer %d %v: a base of its own", layer, k)
						seen[base] = true
						if kind == onShared {
							// Safety: base is the host address of token 0 of a live prefix's
							// tensor, TokenBytes long; the bits are read as a pointer.
							got := unsafe.Slice((*byte)(*(*unsafe.Pointer)(unsafe.Pointer(&base))), tiny8.Groups[0].TokenBytes())
							for i, b := range got {
								if b != testutil.TokenByte(5, layer, k, 0, i) {
									t.Fatalf("layer %d %v byte %d at Base: %#x, want %#x", layer, k, i, b, testutil.TokenByte(5, layer, k, 0, i))
								}
							}
						}
					}
				}
				assert.PanicsWithValue(t, kv.PanicLayerRange, func() { p.Base(tiny8.Layers, kv.K) })
				p.Release()
				for name, f := range map[string]func(){
					"Base":      func() { p.Base(0, kv.K) },
					"Committed": func() { p.Committed() },
					"Mapped":    func() { p.Mapped() },
					"Requested": func() { p.Requested() },
				} {
					assert.PanicsWithValue(t, kv.PanicPrefixReleased, f, "%s after Release", name)
				}
				e.finish(t)
			})
		}
	}
}

// TestPrefixRequestedOnModel: a prefix of a cache of a one-group model counts the
// model's bytes per token.
func TestPrefixRequestedOnModel(t *testing.T) {
	e := openEnv(t, onFake, withConfig(kv.Config{Model: tiny8, MaxTokens: 64}))
	s, err := e.c.NewSequence()
	require.NoError(t, err)
	defer s.Close()
	const n = 13
	require.NoError(t, s.Append(n))
	p, err := s.Freeze(n)
	require.NoError(t, err)
	defer p.Release()
	assert.Equal(t, int64(n*tiny8.BytesPerToken()), p.Requested())
}
