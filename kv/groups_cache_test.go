package kv_test

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kvtier/tiertest"
)

// TestGroupWindowGivesBack: as one sequence of a sliding-window model grows, its
// window's granules go back to the pool: the ledger owns the same bytes at 1,000
// tokens as at 100, and the dropped tokens can not be read.
func TestGroupWindowGivesBack(t *testing.T) {
	e := openEnv(t, noCache, withGranule(groupGranule), withLimit(1<<30))
	m := kv.Model{Name: "window", Layers: 1, Groups: []kv.Group{{Kind: kv.SlidingWindow, Window: 16, Layers: []int{0}, KVHeads: 1, HeadDim: 16, DType: arena.Float16}}}
	c := e.cache(t, kv.Config{Model: m, MaxTokens: 1000})
	s, err := c.NewSequence()
	require.NoError(t, err)
	defer s.Close()
	base := s.Base(0, kv.K)
	var owned []int64
	for n := 1; n <= 1000; n++ {
		require.NoError(t, s.Append(1))
		if n%100 == 0 {
			owned = append(owned, e.auth.Stats().Owned)
		}
		assert.Equal(t, base, s.Base(0, kv.K), "the base stays")
	}
	for _, o := range owned[1:] {
		assert.Equal(t, owned[0], o, "the window's memory stays flat")
	}
	// 64 bytes a token: a 256-byte block holds 4, so the 16 live tokens take 4 or 5.
	assert.Equal(t, int64(4*groupGranule), owned[0])
	assert.Equal(t, 984, s.FirstHeld(0), "token 985's block on is held")
	assert.ErrorIs(t, s.ReadToken(0, kv.V, 983, make([]byte, 32)), kv.ErrDropped)
	assert.NoError(t, s.ReadToken(0, kv.V, 984, make([]byte, 32)))
	v, err := kv.View[arena.F16](s, 0, kv.K)
	require.NoError(t, err)
	assert.Equal(t, []int{4, 4, 1, 16}, v.Shape(), "the view is the held window: 4 blocks of 4 tokens")
	assert.Equal(t, base+uintptr(246*groupGranule), v.DevicePtr(), "from the block of token 984, at its address")
	assert.ErrorIs(t, s.Truncate(900), kv.ErrDropped, "tokens the window dropped do not come back")
	assert.Equal(t, 1000, s.Len(), "a refused truncate changes nothing")
	require.NoError(t, s.Truncate(999), "a rollback within the held window works")
	require.NoError(t, s.Truncate(0), "an empty sequence needs nothing")
	assert.Zero(t, s.FirstHeld(0))
	assert.Zero(t, e.auth.Stats().Owned)
}

// TestGroupBadModels: New refuses a bad model, or one the cache can not serve, with
// a clear error and allocates nothing.
func TestGroupBadModels(t *testing.T) {
	window := func(w int) kv.Model {
		return kv.Model{Name: "w", Layers: 1, Groups: []kv.Group{{Kind: kv.SlidingWindow, Window: w, Layers: []int{0}, KVHeads: 1, HeadDim: 16, DType: arena.Float16}}}
	}
	mlaV := kv.DeepSeekV3()
	mlaV.Groups[0].Tensors = 2
	fp16Scaled := kv.Model{Name: "fp16", Layers: 1, Groups: []kv.Group{{Kind: kv.FullAttention, Layers: []int{0}, KVHeads: 1, HeadDim: 16, DType: arena.Float16, Scales: kv.ScalePerTensor}}}
	stateScaled := kv.Model{Name: "state", Layers: 1, Groups: []kv.Group{{Kind: kv.Recurrent, Layers: []int{0}, StateBytes: 64, Scales: kv.ScalePerHead}}}
	stateOnly := kv.Model{Name: "state-only", Layers: 1, Groups: []kv.Group{{Kind: kv.Recurrent, Layers: []int{0}, StateBytes: 64}}}
	badMode := kv.Model{Name: "mode", Layers: 1, Groups: []kv.Group{{Kind: kv.FullAttention, Layers: []int{0}, KVHeads: 1, HeadDim: 16, DType: arena.Float8E4M3, Scales: kv.ScaleMode(7)}}}
	for _, tt := range []struct {
		name string
		cfg  kv.Config
		want error
	}{
		{"window larger than MaxTokens", kv.Config{Model: window(101), MaxTokens: 100}, kv.ErrModel},
		{"no window", kv.Config{Model: window(0), MaxTokens: 100}, kv.ErrModel},
		{"MLA with V", kv.Config{Model: mlaV, MaxTokens: 100}, kv.ErrModel},
		{"zero layers", kv.Config{Model: kv.Model{Name: "empty"}, MaxTokens: 100}, kv.ErrModel},
		{"scales on an fp16 group", kv.Config{Model: fp16Scaled, MaxTokens: 100}, kv.ErrModel},
		{"scales on a recurrent group", kv.Config{Model: stateScaled, MaxTokens: 100}, kv.ErrModel},
		{"unknown scale mode", kv.Config{Model: badMode, MaxTokens: 100}, kv.ErrModel},
		{"map-ahead on states alone", kv.Config{Model: stateOnly, MaxTokens: 100, MapAhead: true}, kv.ErrConfig},
		{"no MaxTokens", kv.Config{Model: tinyHybrid}, kv.ErrConfig},
	} {
		t.Run(tt.name, func(t *testing.T) {
			e := openEnv(t, noCache, withGranule(groupGranule), withLimit(1<<30))
			c, err := kv.New(e.fake, tt.cfg)
			require.ErrorIs(t, err, tt.want)
			assert.Nil(t, c)
			assert.Zero(t, e.fake.LiveReservations(), "nothing reserved")
			assert.Zero(t, e.auth.Stats().Owned, "nothing committed")
			if tt.cfg.MaxTokens > 0 && !tt.cfg.MapAhead {
				_, err = tt.cfg.Size(groupGranule, 0)
				assert.ErrorIs(t, err, tt.want, "Size refuses the model too")
			}
		})
	}
}

// hybridSequence returns a cache of tinyHybrid on a Fake and a sequence of n tokens
// in it, both closed by the test's cleanup.
func hybridSequence(t *testing.T, n int) (*kv.Cache, *kv.Sequence) {
	e := openEnv(t, noCache, withGranule(groupGranule), withLimit(1<<30))
	c := e.cache(t, kv.Config{Model: tinyHybrid, MaxTokens: 100})
	s, err := c.NewSequence()
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	require.NoError(t, s.Append(n))
	return c, s
}

// TestGroupRefusals: on a model of groups, an MLA layer's V, a recurrent layer's
// tokens and a token layer's state are clear errors, and the operations a cache of
// groups does not have (Freeze with a recurrent group, tiers under its prefix cache)
// are refused.
func TestGroupRefusals(t *testing.T) {
	c, s := hybridSequence(t, 3)
	var err error

	err = s.ReadTokens(4, kv.V, 0, 1, make([]byte, 48))
	require.ErrorIs(t, err, kv.ErrRange)
	assert.Contains(t, err.Error(), "no V")
	_, err = kv.View[arena.F16](s, 4, kv.V)
	assert.ErrorIs(t, err, kv.ErrRange)
	require.NoError(t, s.ReadTokens(4, kv.K, 0, 3, make([]byte, 3*48)), "the latent is K")
	err = s.ReadToken(5, kv.K, 0, make([]byte, 64))
	require.ErrorIs(t, err, kv.ErrRange)
	assert.Contains(t, err.Error(), "recurrent")
	assert.ErrorIs(t, s.ReadState(1, make([]byte, 100)), kv.ErrRange, "a full layer has no state")
	assert.ErrorIs(t, s.ReadState(5, make([]byte, 99)), kv.ErrRange, "a state of another size")
	assert.ErrorIs(t, s.ReadState(6, make([]byte, 100)), kv.ErrRange, "no such layer")
	_, err = kv.View[arena.BF16](s, 1, kv.K)
	assert.ErrorIs(t, err, kv.ErrElemType)
	_, err = c.LayerStrides(6)
	assert.ErrorIs(t, err, kv.ErrRange)
	assert.Panics(t, func() { s.FirstHeld(-1) })

	_, err = s.Freeze(1)
	assert.ErrorIs(t, err, kv.ErrConfig)
	assert.ErrorContains(t, err, "5 groups (sliding-window, full, chunked-local, mla-latent, recurrent)")
	pcs, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{Tiers: []kv.Tier{tiertest.NewMap(1 << 20)}})
	require.NoError(t, err, "a recurrent group's checkpoints go down with the tier blocks they end")
	require.NoError(t, pcs.Close())
	require.NoError(t, s.Truncate(2))

	// A model of groups without one has a prefix cache, with tiers and events.
	e := openEnv(t, noCache, withGranule(groupGranule), withLimit(1<<30))
	w := e.cache(t, kv.Config{Model: tinyWindows, MaxTokens: 100})
	pc, err := kv.NewPrefixCache(w, kv.PrefixCacheOptions{Tiers: []kv.Tier{tiertest.NewMap(1 << 20)}})
	require.NoError(t, err)
	require.NoError(t, pc.Close())
	pc, err = kv.NewPrefixCache(w, kv.PrefixCacheOptions{Events: kv.EventOptions{Observer: &countingObserver{}}})
	require.NoError(t, err)
	require.NoError(t, pc.Close())
}

// TestGroupRecurrentForkCopies: a fork copies a recurrent state, so that a write to
// either one's state never reaches the other.
func TestGroupRecurrentForkCopies(t *testing.T) {
	_, s := hybridSequence(t, 40)
	a := bytes.Repeat([]byte{7}, 100)
	require.NoError(t, s.WriteState(5, a))
	f, err := s.Fork()
	require.NoError(t, err)
	defer f.Close()
	got := make([]byte, 100)
	require.NoError(t, f.ReadState(5, got))
	assert.Equal(t, a, got, "the fork starts with the parent's state")
	require.NoError(t, f.WriteState(5, bytes.Repeat([]byte{9}, 100)))
	require.NoError(t, s.ReadState(5, got))
	assert.Equal(t, a, got, "the parent's state is its own")
	require.NoError(t, f.Truncate(0))
	assert.ErrorIs(t, f.ReadState(5, got), kv.ErrRange, "emptied, the fork gave its state back")
	require.NoError(t, s.ReadState(5, got))
	assert.Equal(t, a, got)
}

// TestGroupConfigSize: on a Model, Config.Size reports each group, and in the
// Blocked layout its figures are Model.Size's (two computations of one layout).
func TestGroupConfigSize(t *testing.T) {
	for _, m := range append(kv.Presets(), tinyHybrid) {
		for _, granule := range []int{256, 64 << 10, 2 << 20} {
			for _, bt := range []int{0, 16} {
				for _, n := range []int{0, 1, 127, 128, 1025, 8192, 100_003} {
					cfg := kv.Config{Model: m, BlockTokens: bt, MaxTokens: 128 << 10}
					got, err := cfg.Size(granule, n)
					if m.Name == tinyHybrid.Name && n > 0 {
						cfg.MaxTokens = max(n, 200)
						got, err = cfg.Size(granule, n)
					}
					require.NoError(t, err)
					want, err := m.Size(granule, bt, n)
					require.NoError(t, err)
					require.Len(t, got.Groups, len(m.Groups))
					extra := int64(0)
					for i := range want.Groups {
						w, g := want.Groups[i], got.Groups[i]
						if w.Live == 0 && w.FirstLive > 0 && w.FirstLive%w.BlockTokens != 0 {
							// A chunk ended at n: no token is live, but the cache keeps the
							// block token n goes into, partly filled with dead tokens.
							assert.Equal(t, int64(w.BlockBytes), g.Committed, "%s group %d at %d", m.Name, i, n)
							extra += g.Committed
							g.Committed = 0
						}
						assert.Equal(t, w, g, "%s group %d at %d tokens, %d-byte granules, blocks of %d", m.Name, i, n, granule, bt)
					}
					assert.Equal(t, want.Committed+extra, got.Committed)
					assert.Equal(t, want.Need, got.Used)
					assert.Equal(t, got.Committed-got.Used, got.Waste)
					assert.Equal(t, m.BytesPerToken(), got.BytesPerToken)
				}
			}
		}
	}
	// PerLayer: a range per tensor, each window range from the granule of its first
	// live token.
	cfg := kv.Config{Model: tinyHybrid, Layout: kv.PerLayer, MaxTokens: 200}
	s, err := cfg.Size(groupGranule, 100)
	require.NoError(t, err)
	assert.Equal(t, 4+2+2+1+1, s.Buffers)
	// The window of layers 0 and 3 (32-byte tokens, 8 a granule) as the step that
	// appended token 99 read it: tokens 95..99 of 100 lie in granules 11 and 12, so
	// each of its 4 ranges commits two.
	assert.Equal(t, int64(4*2*groupGranule), s.Groups[0].Committed)
	assert.Zero(t, s.Groups[0].BlockBytes, "PerLayer has no blocks")
	assert.Equal(t, 5, s.Groups[0].Live)
}

// ExampleConfig_model lays gpt-oss-20b's sliding-window and full layers out in
// groups of their own: as the sequence grows, the window group's memory stays flat
// while the full group's grows.
func ExampleConfig_model() {
	gov := accounting.NewGovernor()
	if err := gov.SetLimit(accounting.HostKey, 64<<30); err != nil {
		panic(err)
	}
	// A fake backing (its memory is Go heap) of 2 MiB granules under one ledger.
	b := backingtest.NewFake(backingtest.FakeOptions{Granularity: 2 << 20, Authority: gov.Authority("kv", accounting.HostKey)})
	c, err := kv.New(b, kv.Config{Model: kv.GPTOSS20B(), MaxTokens: 4096})
	if err != nil {
		panic(err)
	}
	defer c.Close()
	s, err := c.NewSequence()
	if err != nil {
		panic(err)
	}
	defer s.Close()
	for _, n := range []int{256, 1024, 4096} {
		for s.Len() < n { // decode steps: each gives back what the window left
			if err := s.Append(1); err != nil {
				panic(err)
			}
		}
		sz, _ := c.Config().Size(c.Granularity(), n)
		fmt.Printf("%4d tokens: window group %2d MiB from token %4d, full group %2d MiB; committed %3d MiB\n",
			n, sz.Groups[0].Committed>>20, s.FirstHeld(0), sz.Groups[1].Committed>>20, c.Stats().Committed>>20)
	}
	// Output:
	//  256 tokens: window group  4 MiB from token  128, full group  6 MiB; committed  10 MiB
	// 1024 tokens: window group  4 MiB from token  896, full group 24 MiB; committed  28 MiB
	// 4096 tokens: window group  4 MiB from token 3968, full group 96 MiB; committed 100 MiB
}

// TestGroupFaults: a backing call that fails anywhere in a fork, truncate and window
// move of a model of groups fails the operation with the backing's error (or damages
// the sequence, which Close still gives back whole), and after every failure the
// ledger and the backing hold nothing once everything is closed.
func TestGroupFaults(t *testing.T) {
	boom := errors.New("injected")
	scenario := func(c *kv.Cache, open *[]*kv.Sequence) error {
		s, err := c.NewSequence()
		if err != nil {
			return err
		}
		*open = append(*open, s)
		if err := s.Append(20); err != nil {
			return err
		}
		if err := s.WriteTokens(1, kv.K, 0, 20, make([]byte, 20*64)); err != nil {
			return err
		}
		f, err := s.ForkAt(17)
		if err != nil {
			return err
		}
		*open = append(*open, f)
		for range 12 { // the windows move in both
			if err := c.AppendBatch([]kv.Growth{{Seq: s, Tokens: 1}, {Seq: f, Tokens: 1}}); err != nil {
				return err
			}
		}
		if err := f.Truncate(28); err != nil { // a rollback within its window
			return err
		}
		if err := s.Truncate(0); err != nil {
			return err
		}
		return s.Append(3)
	}
	failed, damaged := 0, 0
	for n := 1; ; n++ {
		e := openEnv(t, noCache, withGranule(groupGranule), withLimit(1<<30), withFaults)
		faulty := e.faults
		c, err := e.tryCache(kv.Config{Model: tinyHybrid, MaxTokens: 100})
		require.NoError(t, err)
		faulty.FailAt(n, boom)
		var open []*kv.Sequence
		err = scenario(c, &open)
		calls := faulty.Calls()
		faulty.Reset()
		if err != nil {
			failed++
			require.ErrorIs(t, err, boom, "call %d", n)
		}
		for _, s := range open {
			if s.Damaged() {
				damaged++
			}
			s.Close()
		}
		require.NoError(t, c.Close())
		assert.Zero(t, e.fake.LiveGranules(), "call %d: granules left", n)
		assert.Zero(t, e.fake.LiveReservations(), "call %d: reservations left", n)
		assert.Zero(t, e.auth.Stats().Owned, "call %d", n)
		if err == nil && calls < n {
			break // the fault was past the scenario's last call
		}
	}
	assert.Greater(t, failed, 100, "faults at every call of the scenario")
	assert.Positive(t, damaged, "some leave a sequence damaged (a window's give-back, a truncate midway)")
}

// TestGroupModelCopied: the cache keeps a copy of the Model it was made from, and
// Config answers a copy of its own, so that a caller changing either model's slices
// afterwards changes nothing of the cache's.
func TestGroupModelCopied(t *testing.T) {
	e := openEnv(t, noCache, withGranule(groupGranule), withLimit(1<<30))
	m := tinyHybrid.Uniform()
	m.Groups = slices.Clone(m.Groups)
	m.Groups[0].Layers = []int{0, 3}
	c := e.cache(t, kv.Config{Model: m, MaxTokens: 100})
	m.Groups[0].Layers[1] = 5
	m.Groups[0].KVHeads = 7
	assert.Equal(t, []int{0, 3}, c.Config().Model.Groups[0].Layers)
	assert.Equal(t, 1, c.Config().Model.Groups[0].KVHeads)
	got := c.Config().Model
	got.Groups[0].Layers[1], got.Groups[0].KVHeads = 5, 7
	assert.Equal(t, []int{0, 3}, c.Config().Model.Groups[0].Layers)
	assert.Equal(t, 1, c.Config().Model.Groups[0].KVHeads)
	_, err := c.Config().Size(groupGranule, 10)
	assert.NoError(t, err)
}

// TestGroupOneFullGroup: a model of one full-attention group whose layers are listed
// in another order than Uniform's commits what the uniform model does, and Freeze and
// a prefix cache work on it.
func TestGroupOneFullGroup(t *testing.T) {
	e := openEnv(t, noCache, withGranule(groupGranule), withLimit(1<<30))
	g := kv.Uniform("one", 2, 2, 16, arena.Float16)
	rev := cloned(g)
	slices.Reverse(rev.Groups[0].Layers)
	c := e.cache(t, kv.Config{Model: rev, MaxTokens: 100})
	s, err := c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, s.Append(37))
	want, err := kv.Config{Model: g, MaxTokens: 100}.Size(groupGranule, 37)
	require.NoError(t, err)
	assert.Equal(t, want.Committed, c.Stats().Committed)
	assert.Equal(t, want.Used, c.Stats().Used)
	p, err := s.Freeze(20)
	require.NoError(t, err)
	p.Release()
	pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{})
	require.NoError(t, err)
	require.True(t, s.Close().OK())
	require.NoError(t, pc.Close())
}

// TestGroupFreeze: on a model of window, full and MLA groups, Freeze shares each
// group's held units from the one that holds its FirstLive on; a freeze whose next
// step reads a dropped token is refused with ErrDropped, and one on a model with a
// recurrent group with ErrConfig, changing nothing; the frozen tokens are read-only
// in the sequence; everything goes back with the last holder.
func TestGroupFreeze(t *testing.T) {
	e := openEnv(t, noCache, withGranule(groupGranule), withLimit(1<<30))
	c := e.cache(t, kv.Config{Model: tinyWindows, MaxTokens: 100})
	s, err := c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, s.Append(30))
	require.NoError(t, s.Append(10))
	tok := bytes.Repeat([]byte{5}, 32)
	for i := 36; i < 40; i++ {
		require.NoError(t, s.WriteToken(0, kv.K, i, tok))
	}
	before := e.auth.Stats()

	_, err = s.Freeze(20)
	require.ErrorIs(t, err, kv.ErrDropped, "the window group reads from token 16, dropped at 30")
	assert.Equal(t, before, e.auth.Stats(), "a refused freeze changes nothing")

	p, err := s.Freeze(40)
	require.NoError(t, err)
	assert.Equal(t, p.Mapped(), p.Committed())
	// The next step reads from token 36 in the window group (5 tokens; 2 layers × K,V
	// of 32 bytes) and in the chunked group (chunk 36..44; K,V of 64 bytes), every
	// token of the full group (2 layers × K,V of 64 bytes) and of the latent (48).
	want := int64(4*2*2*32 + 4*2*64 + 40*(2*2*64+48))
	assert.Equal(t, want, p.Requested())
	assert.ErrorIs(t, s.WriteToken(0, kv.K, 37, tok), kv.ErrReadOnly, "the frozen tokens are shared")

	q, err := c.NewSequenceFrom(p)
	require.NoError(t, err)
	assert.Equal(t, 40, q.Len())
	got := make([]byte, 32)
	require.NoError(t, q.ReadToken(0, kv.K, 38, got))
	assert.Equal(t, tok, got)
	assert.LessOrEqual(t, q.FirstHeld(0), 36, "the new sequence holds the window the next step reads")
	assert.Greater(t, q.FirstHeld(0), s.FirstHeld(0), "and nothing the prefix did not keep")
	require.NoError(t, q.Append(20))
	require.NoError(t, q.Append(1))
	assert.Greater(t, q.FirstHeld(0), 40, "its window moves on")
	require.NoError(t, s.ReadToken(0, kv.K, 38, got), "and the prefix's holder keeps its own")
	assert.Equal(t, tok, got)

	p.Release()
	require.True(t, q.Close().OK())
	require.True(t, s.Close().OK())
	assert.Zero(t, e.auth.Stats().Owned, "everything went back with the last holder")

	_, h := hybridSequence(t, 3)
	_, err = h.Freeze(3)
	require.ErrorIs(t, err, kv.ErrConfig)
	assert.ErrorContains(t, err, "recurrent")
}
