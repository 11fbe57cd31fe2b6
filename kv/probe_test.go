package kv_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/hosttier"
	"github.com/vmarena/vmarena/kvtier/tiertest"
)

// probeEnv returns the test's env: a prefix cache with opts over a cache of tiny8 in
// layout, of MaxTokens probeMax and 4-token blocks (Blocked), tiers waited for up
// to a minute, on a Fake without a limit, whose ledger then changes only by what the cache commits and gives back. It
// is the file's one constructor.
func probeEnv(t testing.TB, layout kv.Layout, opts kv.PrefixCacheOptions) *env {
	t.Helper()
	return probeEnvOf(t, tiny8, layout, opts)
}

// probeEnvOf is probeEnv of model m.
func probeEnvOf(t testing.TB, m kv.Model, layout kv.Layout, opts kv.PrefixCacheOptions) *env {
	t.Helper()
	cfg := kv.Config{Model: m, Layout: layout, MaxTokens: probeMax}
	if layout == kv.Blocked {
		cfg.BlockTokens = testBlockTokens
	}
	if len(opts.Tiers) > 0 {
		// A wait no loaded machine reaches, so that a Lookup loads what the tiers
		// hold (TestPrefixCacheTierWait tests the wait).
		opts.TierPrefix, opts.TierWait = t.Name(), time.Minute
	}
	return openEnv(t, onFake, withConfig(cfg), withPrefixCache(opts))
}

// probeMax is the MaxTokens of probeEnv's caches.
const probeMax = 96

// probeHostTier returns an in-process host tier closed by the test's cleanup.
func probeHostTier(t testing.TB) kv.Tier {
	t.Helper()
	ht, err := hosttier.New(hosttier.Options{Budget: 64 << 20})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, ht.Close()) })
	return ht
}

// probePrompt returns a prompt of 1 to probeMax tokens that shares a random start
// with others: each token is one of a few, so that prompts branch after a few
// tokens, and a few prompts repeat one another.
func probePrompt(r *rand.Rand) []int32 {
	n := 1 + r.IntN(probeMax)
	ids := make([]int32, n)
	for i := range ids {
		ids[i] = int32(1 + r.IntN(2))
		if i > 6 {
			ids[i] = int32(1 + r.IntN(40))
		}
	}
	return ids
}

// TestProbeIsLookup: over random prompts in two namespaces, some served, some
// evicted (down into the tiers, where the cache has one), a Probe changes none of
// the prefix cache's stats, its Device is what Match says, its Total what the Lookup
// made next returns, its Tiers[i] what the Lookup then loaded from tier i, and its
// Commit what the ledger then shows the Lookup committed.
func TestProbeIsLookup(t *testing.T) {
	cases := []struct {
		name   string
		model  kv.Model
		layout kv.Layout
		tiers  func(t *testing.T) []kv.Tier
	}{
		{"Blocked", tiny8, kv.Blocked, nil},
		{"PerLayer", tiny8, kv.PerLayer, nil},
		{"Blocked/host", tiny8, kv.Blocked, func(t *testing.T) []kv.Tier { return []kv.Tier{probeHostTier(t)} }},
		{"Blocked/map+host", tiny8, kv.Blocked, func(t *testing.T) []kv.Tier {
			return []kv.Tier{tiertest.NewMap(4 << 20), probeHostTier(t)}
		}},
		{"MLA/PerLayer", tinyMLA, kv.PerLayer, nil},
		// A window group beside a full one: the hit rule's match, each group's
		// copied tail.
		{"tiny-oss/Blocked", tinyOSS, kv.Blocked, nil},
		{"tiny-oss/PerLayer", tinyOSS, kv.PerLayer, nil},
		// Window hybrids with tiers: a value may lack a window group's units, and a
		// lookup loads up to the last block where every window group holds what the
		// step reads, which Probe finds from the values' heads.
		{"tiny-oss/Blocked/host", tinyOSS, kv.Blocked, func(t *testing.T) []kv.Tier { return []kv.Tier{probeHostTier(t)} }},
		{"tiny-gemma/Blocked/map+host", tinyGemma, kv.Blocked, func(t *testing.T) []kv.Tier {
			return []kv.Tier{tiertest.NewMap(4 << 20), probeHostTier(t)}
		}},
	}
	spaces := []kv.Namespace{{}, {Adapter: "a", Salt: "t1"}}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var opts kv.PrefixCacheOptions
			if tc.tiers != nil {
				opts.Tiers = tc.tiers(t)
			}
			e := probeEnvOf(t, tc.model, tc.layout, opts)
			windowed := len(tc.model.Groups) > 1 // its window gives back tokens below it
			r := rand.New(rand.NewPCG(43, 5))
			var loaded, device int
			var made [][]int32
			for op := range 300 {
				ns := spaces[r.IntN(len(spaces))]
				ids := probePrompt(r)
				if windowed && tc.tiers != nil {
					// Conversations: a window hybrid's tier blocks serve where a later
					// prompt continues an earlier one past them.
					ids = stream(r, made, probeMax)
					made = append(made, ids)
				}
				where := fmt.Sprintf("op %d, %v, %d tokens", op, ns, len(ids))
				before := e.pc.Stats()
				p, err := e.pc.ProbeIn(ns, ids)
				require.NoError(t, err, where)
				require.Equal(t, before, e.pc.Stats(), "%s: a Probe counts nothing", where)
				require.Equal(t, e.pc.MatchIn(ns, ids), p.Device, where)
				sum := p.Device
				for i, n := range p.Tiers {
					require.GreaterOrEqual(t, n, 0, where)
					if i >= len(opts.Tiers) {
						require.Zero(t, n, "%s: tier %d is not the cache's", where, i)
					}
					sum += n
				}
				require.Equal(t, sum, p.Total, where)
				require.Equal(t, p.Total-p.Device, p.Tiered(), where)

				owned := e.auth.Stats().Owned
				s, m, err := e.pc.LookupIn(ns, ids)
				require.NoError(t, err, where)
				require.Equal(t, p.Total, m, "%s: the Lookup starts on what the Probe said", where)
				require.Equal(t, m, s.Len(), where)
				require.Equal(t, p.Commit, e.auth.Stats().Owned-owned, "%s: the Lookup committed what the Probe said", where)
				after := e.pc.Stats()
				for i := range opts.Tiers {
					require.Equal(t, int64(p.Tiers[i]), after.Tiers[i].Hits-before.Tiers[i].Hits, "%s: tier %d", where, i)
				}
				if !windowed {
					require.NoError(t, nsCheckIDs(s, ns, ids, 0, m), where)
				}
				loaded += p.Tiered()
				device += p.Device

				require.NoError(t, s.Append(len(ids)-m), where)
				require.NoError(t, nsWriteIDs(s, ns, ids, m, len(ids)), where)
				require.NoError(t, e.pc.InsertIn(ns, s, ids), where)
				require.True(t, s.Close().OK(), where)
				if r.IntN(8) == 0 {
					_, err := e.pc.Evict(1 << 30) // down into the tiers
					require.NoError(t, err, where)
				}
			}
			assert.Positive(t, device, "some prompts hit the device")
			if len(opts.Tiers) > 0 {
				assert.Positive(t, loaded, "some prompts loaded from the tiers")
			}
		})
	}
}

// nsWriteIDs writes tokens [from, to) of s with patterns of their IDs and of ns, so
// that another namespace's K/V of the same tokens differ.
func nsWriteIDs(s *kv.Sequence, ns kv.Namespace, ids []int32, from, to int) error {
	for p := from; p < to; p++ {
		if err := tryWrite(s, probeWriter(ns, ids[p]), p, p+1); err != nil {
			return err
		}
	}
	return nil
}

// nsCheckIDs checks tokens [from, to) of s against nsWriteIDs's patterns.
func nsCheckIDs(s *kv.Sequence, ns kv.Namespace, ids []int32, from, to int) error {
	for p := from; p < to; p++ {
		if err := tryCheck(s, probeWriter(ns, ids[p]), p, p+1); err != nil {
			return fmt.Errorf("token %d: %w", p, err)
		}
	}
	return nil
}

// probeWriter is the writer of a token of ID id in namespace ns.
func probeWriter(ns kv.Namespace, id int32) uint64 {
	w := uint64(id)
	if ns != (kv.Namespace{}) {
		w |= uint64(len(ns.Adapter)+1)<<40 | uint64(len(ns.Salt)+1)<<48
	}
	return w
}

// TestProbeNamespaces: a prompt served in one namespace and then evicted down into
// a tier is held, on the device and then in the tier, for that namespace only: a
// Probe in another counts none of it.
func TestProbeNamespaces(t *testing.T) {
	e := probeEnv(t, kv.Blocked, kv.PrefixCacheOptions{Tiers: []kv.Tier{probeHostTier(t)}})
	own, other := kv.Namespace{Adapter: "a"}, kv.Namespace{Salt: "t1"}
	ids := nsIDs(500, 41)
	s, m, err := e.pc.LookupIn(own, ids)
	require.NoError(t, err)
	require.Zero(t, m)
	require.NoError(t, s.Append(len(ids)))
	require.NoError(t, nsWriteIDs(s, own, ids, 0, len(ids)))
	require.NoError(t, e.pc.InsertIn(own, s, ids))
	require.True(t, s.Close().OK())

	for _, evicted := range []bool{false, true} {
		if evicted {
			_, err := e.pc.Evict(1 << 30)
			require.NoError(t, err)
			require.Zero(t, e.pc.Stats().Entries)
		}
		p, err := e.pc.ProbeIn(own, ids)
		require.NoError(t, err)
		assert.Equal(t, len(ids)-1, p.Total, "evicted %v", evicted)
		if evicted {
			assert.Zero(t, p.Device)
			assert.Equal(t, len(ids)-1, p.Tiers[0], "every whole block below the last token, from the tier")
			assert.Positive(t, p.Commit)
		} else {
			assert.Equal(t, len(ids)-1, p.Device)
			assert.Zero(t, p.Tiers[0])
		}
		for _, ns := range []kv.Namespace{other, {}, {Adapter: "a", Salt: "t1"}} {
			p, err := e.pc.ProbeIn(ns, ids)
			require.NoError(t, err)
			assert.Equal(t, kv.Probe{}, p, "%v holds nothing of %v's prompt (evicted %v)", ns, own, evicted)
		}
		p, err = e.pc.Probe(ids)
		require.NoError(t, err)
		assert.Equal(t, kv.Probe{}, p, "the default namespace holds nothing of it")
	}
}

// TestProbeRefuses: a prompt longer than MaxTokens, and any prompt once the prefix
// cache is closed, are refused with the package's errors; a prefix cache of more
// tiers than a Probe counts is refused at its making.
func TestProbeRefuses(t *testing.T) {
	e := probeEnv(t, kv.Blocked, kv.PrefixCacheOptions{})
	p, err := e.pc.Probe(nsIDs(1, probeMax+1))
	assert.ErrorIs(t, err, kv.ErrTooLong)
	assert.Equal(t, kv.Probe{}, p)
	for _, ids := range [][]int32{nil, {7}, nsIDs(1, probeMax)} {
		p, err := e.pc.Probe(ids)
		require.NoError(t, err, "%d tokens", len(ids))
		assert.Equal(t, kv.Probe{}, p, "an empty cache holds nothing of %d tokens", len(ids))
	}
	require.NoError(t, e.pc.Close())
	_, err = e.pc.Probe(nsIDs(1, 8))
	assert.ErrorIs(t, err, kv.ErrClosed)
	_, err = e.pc.ProbeIn(kv.Namespace{Adapter: "a"}, nsIDs(1, 8))
	assert.ErrorIs(t, err, kv.ErrClosed)

	tiers := make([]kv.Tier, kv.MaxTiers+1)
	for i := range tiers {
		tiers[i] = namedTier{tiertest.NewMap(1 << 20), fmt.Sprint("t", i)}
	}
	_, err = kv.NewPrefixCache(e.cache(t, kv.Config{MaxTokens: probeMax, BlockTokens: testBlockTokens}), kv.PrefixCacheOptions{Tiers: tiers})
	assert.ErrorIs(t, err, kv.ErrConfig)
	pc, err := kv.NewPrefixCache(e.cache(t, kv.Config{MaxTokens: probeMax, BlockTokens: testBlockTokens}), kv.PrefixCacheOptions{Tiers: tiers[:kv.MaxTiers]})
	require.NoError(t, err, "MaxTiers tiers")
	require.NoError(t, pc.Close())
}

// TestProbeAllocatesNothing: a Probe allocates nothing, on a miss, a device hit, a
// partial hit and a hit in an in-process tier, in the default namespace and another.
func TestProbeAllocatesNothing(t *testing.T) {
	if probeRace {
		t.Skip("the race detector's sync.Pool drops what is put back: its allocations are not the Probe's")
	}
	e := probeEnv(t, kv.Blocked, kv.PrefixCacheOptions{Tiers: []kv.Tier{probeHostTier(t)}})
	ns := kv.Namespace{Adapter: "a", Salt: "t1"}
	for _, first := range []int{100, 300} {
		for _, space := range []kv.Namespace{{}, ns} {
			ids := nsIDs(first, 60)
			s, _, err := e.pc.LookupIn(space, ids)
			require.NoError(t, err)
			require.NoError(t, s.Append(len(ids)-s.Len()))
			require.NoError(t, e.pc.InsertIn(space, s, ids))
			require.True(t, s.Close().OK())
		}
	}
	// The older prompts (from 100) down into the tier, least recently used first.
	_, err := e.pc.Evict(e.pc.Stats().CachedBytes / 2)
	require.NoError(t, err)
	prompts := map[string][]int32{
		"miss":    nsIDs(900, 60),
		"tier":    nsIDs(100, 60),
		"device":  nsIDs(300, 60),
		"partial": append(nsIDs(300, 30), nsIDs(700, 30)...),
	}
	for _, space := range []kv.Namespace{{}, ns} {
		for name, ids := range prompts {
			p, err := e.pc.ProbeIn(space, ids)
			require.NoError(t, err)
			switch name {
			case "tier":
				require.Positive(t, p.Tiered(), "%v %s: %+v", space, name, p)
			case "device", "partial":
				require.Positive(t, p.Device, "%v %s: %+v", space, name, p)
			}
			assert.Zero(t, testing.AllocsPerRun(50, func() {
				_, _ = e.pc.ProbeIn(space, ids)
			}), "%v %s", space, name)
		}
	}
}

// failingTier is a tier whose Load fails from its failAt-th call on (0: never), as a
// tier that lost its values or its server would.
type failingTier struct {
	kv.Tier
	calls, failAt int
}

func (t *failingTier) Load(ctx context.Context, key tierval.Key, use func(src []byte) error) error {
	t.calls++
	if t.failAt > 0 && t.calls >= t.failAt {
		return errors.New("tier gone")
	}
	return t.Tier.Load(ctx, key, use)
}

// TestProbePartialLoad: a tier whose loads fail past some block, after a Probe said
// it held them all: the Lookup reports exactly the blocks it loaded (its sequence
// holds them and no more, each token the prompt's), and the rest is prefilled; the
// Probe had counted what the tier held, not what it would hand back.
func TestProbePartialLoad(t *testing.T) {
	for _, failAt := range []int{1, 2, 5} {
		t.Run(fmt.Sprint("fail at load ", failAt), func(t *testing.T) {
			tier := &failingTier{Tier: tiertest.NewMap(4 << 20)}
			e := probeEnv(t, kv.Blocked, kv.PrefixCacheOptions{Tiers: []kv.Tier{tier}})
			ids := nsIDs(40, 37)
			s, _, err := serve(e.pc, ids)
			require.NoError(t, err)
			require.True(t, s.Close().OK())
			_, err = e.pc.Evict(1 << 30)
			require.NoError(t, err)

			p, err := e.pc.Probe(ids)
			require.NoError(t, err)
			require.Equal(t, (len(ids)-1)/testBlockTokens*testBlockTokens, p.Tiers[0])
			tier.failAt = failAt
			s, m, err := e.pc.Lookup(ids)
			require.NoError(t, err)
			defer s.Close()
			assert.Equal(t, (failAt-1)*testBlockTokens, m, "the blocks before the failed load")
			assert.Equal(t, m, s.Len())
			assert.Equal(t, int64(m), e.pc.Stats().Tiers[0].Hits)
			require.NoError(t, checkIDs(s, ids, 0, m))
			require.NoError(t, s.Append(len(ids)-m), "the rest is prefilled")
			require.NoError(t, writeIDs(s, ids, m, len(ids)))
			require.NoError(t, checkIDs(s, ids, 0, len(ids)))
		})
	}
}

// BenchmarkProbe is the admission question against Match on the same prompts, in
// one loop: rounds of probeRound Probes and as many Matches alternate (which goes
// first alternating too), each timed, so that a loaded machine's drift falls on
// both alike. It reports ns/probe, ns/match and their ratio probe/match, and the
// ratio of the fastest rounds of each (probe/match-fastest), on a device
// hit of the whole prompt, a partial one and a miss, without tiers and with an
// in-process one holding the rest (the Probe then hashes the prompt and asks it).
func BenchmarkProbe(b *testing.B) {
	for _, tiered := range []bool{false, true} {
		var opts kv.PrefixCacheOptions
		if tiered {
			opts.Tiers = []kv.Tier{probeHostTier(b)}
		}
		e := probeEnv(b, kv.Blocked, opts)
		hit := nsIDs(1000, probeMax)
		s, _, err := e.pc.Lookup(hit)
		require.NoError(b, err)
		require.NoError(b, s.Append(len(hit)))
		require.NoError(b, e.pc.Insert(s, hit))
		require.True(b, s.Close().OK())
		if tiered {
			_, err := e.pc.Evict(1 << 30)
			require.NoError(b, err)
			s, _, err := e.pc.Lookup(hit[:probeMax/2+1]) // the first half back on the device
			require.NoError(b, err)
			require.NoError(b, e.pc.Insert(s, hit[:s.Len()]))
			require.True(b, s.Close().OK())
		}
		prompts := []struct {
			name string
			ids  []int32
		}{
			{"hit", hit},
			{"partial", append(slices.Clone(hit[:probeMax/2]), nsIDs(5000, probeMax/2)...)},
			{"miss", nsIDs(9000, probeMax)},
		}
		for _, pr := range prompts {
			b.Run(fmt.Sprintf("tiers=%v/%s", tiered, pr.name), func(b *testing.B) {
				probe := func() {
					for range probeRound {
						_, _ = e.pc.Probe(pr.ids)
					}
				}
				match := func() {
					for range probeRound {
						_ = e.pc.Match(pr.ids)
					}
				}
				var tp, tm time.Duration
				lp, lm := time.Duration(math.MaxInt64), time.Duration(math.MaxInt64)
				rounds := 0
				for b.Loop() {
					first, second, t1, t2, l1, l2 := probe, match, &tp, &tm, &lp, &lm
					if rounds%2 == 1 {
						first, second, t1, t2, l1, l2 = match, probe, &tm, &tp, &lm, &lp
					}
					start := time.Now()
					first()
					mid := time.Now()
					second()
					d1, d2 := mid.Sub(start), time.Since(mid)
					*t1, *t2 = *t1+d1, *t2+d2
					*l1, *l2 = min(*l1, d1), min(*l2, d2)
					rounds++
				}
				n := float64(rounds * probeRound)
				b.ReportMetric(float64(tp.Nanoseconds())/n, "ns/probe")
				b.ReportMetric(float64(tm.Nanoseconds())/n, "ns/match")
				b.ReportMetric(float64(tp)/float64(tm), "probe/match")
				// The fastest round of each: what a loaded machine's other work
				// added least to.
				b.ReportMetric(float64(lp)/float64(lm), "probe/match-fastest")
			})
		}
	}
}

// probeRound is the Probes (and Matches) one round of BenchmarkProbe times at once.
const probeRound = 64
