package kv_test

import (
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/internal/testutil"
	"github.com/vmarena/vmarena/kv"
)

// The namespaces of a prefix cache (kv.Namespace): no hit crosses one, a sequence of
// one is never inserted into another, Match, Need and Pin see their own only, and the
// books stay exact across them. The events' hashes are in namespace_events_test.go,
// the tiers' refusal in namespace_tier_test.go.

// nsModel is the model the namespace tests cache: 2 layers of 128-byte K and V, so a
// 4 KiB granule holds a Blocked block of 8 tokens.
var nsModel = kv.Uniform("ns-tiny", 2, 1, 64, arena.Float16)

// nsGranule is the fake backing's granule.
const nsGranule = 4 << 10

// nsSpaces are the namespaces the tests drive: the default, an adapter, a salt, both,
// and another adapter.
var nsSpaces = []kv.Namespace{{}, {Adapter: "a"}, {Salt: "t1"}, {Adapter: "a", Salt: "t1"}, {Adapter: "b"}}

// newNSCache returns the test's env: a prefix cache with opts over a cache of cfg
// (nsModel, Blocked, when cfg.Model is unset) on a Fake of nsGranule granules under
// limit bytes (0: no limit). The env's cleanup closes both and checks the books. It
// is the file's one constructor.
func newNSCache(t testing.TB, cfg kv.Config, limit int64, opts kv.PrefixCacheOptions) *env {
	t.Helper()
	if cfg.Model.Name == "" {
		cfg.Model = nsModel
	}
	return openEnv(t, onFake, withGranule(nsGranule), withLimit(limit), withConfig(cfg), withPrefixCache(opts))
}

// nsIDs returns n token IDs from first on.
func nsIDs(first, n int) []int32 {
	ids := make([]int32, n)
	for i := range ids {
		ids[i] = int32(first + i)
	}
	return ids
}

// nsWriter returns the writer (testutil.FillToken) of token len(ids)-1 of a prompt
// ids in namespace ns: a function of the namespace and every token up to it, as K/V
// is of the adapter and the prefix, so that a hit across namespaces or prefixes reads
// bytes of another writer.
func nsWriter(ns int, ids []int32) uint64 {
	w := uint64(ns+1) * 0x9e3779b97f4a7c15
	for _, id := range ids {
		w = (w ^ uint64(uint32(id))) * 1099511628211
	}
	return w | 1
}

// nsWrite writes tokens [from, to) of s as namespace ns's K/V of ids.
func nsWrite(s *kv.Sequence, ns int, ids []int32, from, to int) error {
	return nsEach(s, from, to, func(layer int, kind kv.Kind, tok int, buf []byte) error {
		testutil.FillToken(buf, nsWriter(ns, ids[:tok+1]), layer, kind, tok)
		return s.WriteToken(layer, kind, tok, buf)
	})
}

// nsCheck checks that tokens [from, to) of s are namespace ns's K/V of ids.
func nsCheck(s *kv.Sequence, ns int, ids []int32, from, to int) error {
	return nsEach(s, from, to, func(layer int, kind kv.Kind, tok int, buf []byte) error {
		if err := s.ReadToken(layer, kind, tok, buf); err != nil {
			return err
		}
		if i := testutil.TokenAt(buf, nsWriter(ns, ids[:tok+1]), layer, kind, tok); i >= 0 {
			return fmt.Errorf("token %d layer %d %v byte %d is not namespace %v's", tok, layer, kind, i, nsSpaces[ns])
		}
		return nil
	})
}

// nsEach calls f on tokens [from, to) of every tensor of s, a uniform model's.
func nsEach(s *kv.Sequence, from, to int, f func(layer int, kind kv.Kind, tok int, buf []byte) error) error {
	m := s.Cache().Config().Model
	buf := make([]byte, m.Groups[0].TokenBytes())
	for layer := range m.Layers {
		for _, kind := range kv.KindsOf(m) {
			for tok := from; tok < to; tok++ {
				if err := f(layer, kind, tok, buf); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// nsServe is one request of namespace ns: look ids up there, check what came from the
// cache, prefill the rest, insert. It returns the open sequence and the hit.
func nsServe(pc *kv.PrefixCache, ns int, ids []int32) (*kv.Sequence, int, error) {
	s, m, err := pc.LookupIn(nsSpaces[ns], ids)
	if err != nil {
		return nil, 0, err
	}
	err = nsCheck(s, ns, ids, 0, m)
	if err == nil {
		err = s.Append(len(ids) - m)
	}
	if err == nil {
		err = nsWrite(s, ns, ids, m, len(ids))
	}
	if err == nil {
		err = pc.InsertIn(nsSpaces[ns], s, ids)
	}
	if err != nil {
		s.Close()
		return nil, m, err
	}
	return s, m, nil
}

// TestNamespacesShareNothing serves one prompt in each namespace in turn: each first
// request misses (another namespace's entry of the same tokens is not a hit), each
// second hits its own, and Match, Need and Pin answer per namespace. On a model of
// window groups beside a full one, the same.
func TestNamespacesShareNothing(t *testing.T) {
	hybrid := kv.Model{Name: "ns-hybrid", Layers: 2, Groups: []kv.Group{
		{Kind: kv.FullAttention, Layers: []int{0}, KVHeads: 1, HeadDim: 64, DType: arena.Float16},
		{Kind: kv.SlidingWindow, Layers: []int{1}, Window: 8, KVHeads: 1, HeadDim: 64, DType: arena.Float16},
	}}
	for _, tt := range []struct {
		name string
		cfg  kv.Config
	}{
		{"blocked", kv.Config{MaxTokens: 64}},
		{"perlayer", kv.Config{MaxTokens: 64, Layout: kv.PerLayer}},
		{"window", kv.Config{MaxTokens: 64, Model: hybrid}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			e := newNSCache(t, tt.cfg, 0, kv.PrefixCacheOptions{})
			ids := nsIDs(100, 40)
			uniform := tt.cfg.Model.Name == ""
			for ns, space := range nsSpaces {
				assert.Zero(t, e.pc.MatchIn(space, ids), "%v: nothing of its own is cached", space)
				s, m, err := e.pc.LookupIn(space, ids)
				require.NoError(t, err)
				assert.Zero(t, m, "%v: a hit in another namespace's entry", space)
				require.NoError(t, s.Append(len(ids)))
				if uniform {
					require.NoError(t, nsWrite(s, ns, ids, 0, len(ids)))
				}
				require.NoError(t, e.pc.InsertIn(space, s, ids))
				require.True(t, s.Close().OK())
				assert.Equal(t, len(ids)-1, e.pc.MatchIn(space, ids), "%v: its own entry", space)
			}
			assert.Equal(t, len(ids)-1, e.pc.Match(ids), "Match is the default namespace's")
			for ns, space := range nsSpaces {
				s, m, err := e.pc.LookupIn(space, ids)
				require.NoError(t, err)
				assert.Equal(t, len(ids)-1, m, "%v", space)
				if uniform {
					assert.NoError(t, nsCheck(s, ns, ids, 0, m), "%v reads its own K/V", space)
				}
				require.True(t, s.Close().OK())
				need, err := e.pc.NeedIn(space, ids)
				require.NoError(t, err)
				other, err := e.pc.NeedIn(kv.Namespace{Adapter: "never"}, ids)
				require.NoError(t, err)
				assert.Less(t, need, other, "%v: a hit needs less than a miss", space)
			}
			pin, err := e.pc.PinIn(kv.Namespace{Adapter: "never"}, ids)
			require.NoError(t, err)
			assert.Zero(t, pin.Len(), "a namespace holds nothing of another's")
			pin.Release()
			pin, err = e.pc.PinIn(nsSpaces[1], ids)
			require.NoError(t, err)
			assert.Equal(t, len(ids), pin.Len())
			pin.Release()
			st := e.pc.Stats()
			assert.Equal(t, len(nsSpaces), st.Entries, "one entry per namespace")
			assert.Equal(t, int64(len(nsSpaces)*len(ids)), st.CachedTokens, "each namespace holds its tokens apart")
		})
	}
}

// TestNamespaceBindsSequence: a sequence that hit in a namespace, or was inserted
// into one, is refused by an Insert into another with ErrConfig, changing nothing;
// into its own it is taken.
func TestNamespaceBindsSequence(t *testing.T) {
	e := newNSCache(t, kv.Config{MaxTokens: 64}, 0, kv.PrefixCacheOptions{})
	ids := nsIDs(7, 30)
	s, _, err := nsServe(e.pc, 1, ids)
	require.NoError(t, err)
	defer s.Close()
	before := e.pc.Stats()
	err = e.pc.InsertIn(nsSpaces[2], s, ids[:20])
	require.ErrorIs(t, err, kv.ErrConfig, "inserted into adapter a, then into salt t1")
	assert.Equal(t, before.Entries, e.pc.Stats().Entries)
	assert.Zero(t, e.pc.MatchIn(nsSpaces[2], ids))
	require.NoError(t, e.pc.InsertIn(nsSpaces[1], s, ids[:20]), "its own namespace")

	h, m, err := e.pc.LookupIn(nsSpaces[1], ids)
	require.NoError(t, err)
	defer h.Close()
	require.Equal(t, len(ids)-1, m)
	require.ErrorIs(t, e.pc.Insert(h, ids[:m]), kv.ErrConfig, "a hit of adapter a inserted into the default")
	require.NoError(t, e.pc.InsertIn(nsSpaces[1], h, ids[:m]))

	miss, m, err := e.pc.LookupIn(nsSpaces[3], ids)
	require.NoError(t, err)
	defer miss.Close()
	require.Zero(t, m)
	require.NoError(t, miss.Append(len(ids)))
	require.NoError(t, nsWrite(miss, 4, ids, 0, len(ids)))
	require.NoError(t, e.pc.InsertIn(nsSpaces[4], miss, ids), "a miss maps nothing: the first Insert binds it")
}

// The operations FuzzPrefixCacheNamespaces decodes, one per two input bytes (op,
// argument).
const (
	nsOpServe = iota
	nsOpClose
	nsOpEvict
	nsOpPin
	nsOpUnpin
	nsOpCross
	nsOpMatch
	nsOpCount
)

const (
	nsFuzzMaxTokens = 32
	nsFuzzMaxLive   = 4
	nsFuzzMaxPins   = 3
	nsFuzzOps       = 48
	// nsFuzzBudget is the governor's limit: 28 granules, where a request of
	// nsFuzzMaxTokens takes 4 and every namespace caches, so that eviction, and a
	// miss that takes over an evicted entry's ranges, come often.
	nsFuzzBudget = 28 * nsGranule
)

// nsLive is a live sequence of the fuzz model: its namespace and prompt, every token
// of it written as that namespace's.
type nsLive struct {
	s   *kv.Sequence
	ns  int
	ids []int32
}

// nsFuzz drives a prefix cache across namespaces and keeps the model: the prompts
// inserted into each namespace, the live sequences and the pins.
type nsFuzz struct {
	t        *testing.T
	e        *env
	bases    [3][]int32
	inserted [][][]int32 // per namespace
	live     []nsLive
	pins     []*kv.PrefixPin
	steps    []string
}

// prompt returns a prompt of arg's choosing: a prefix of one of three token strings
// that share their first tokens, so that namespaces see the same prompts.
func (m *nsFuzz) prompt(arg int) []int32 {
	b := m.bases[arg%3]
	return b[:2+(arg/3)%(nsFuzzMaxTokens-1)]
}

// own returns the longest prefix of ids, at most all but its last token, that ns's
// inserted prompts share: what a lookup there may hit at most.
func (m *nsFuzz) own(ns int, ids []int32) int {
	best := 0
	for _, p := range m.inserted[ns] {
		n := 0
		for n < len(p) && n < len(ids) && p[n] == ids[n] {
			n++
		}
		best = max(best, n)
	}
	return min(best, len(ids)-1)
}

func (m *nsFuzz) run(op, arg int) {
	t := m.t
	ns := arg % len(nsSpaces)
	switch op {
	case nsOpServe:
		ids := m.prompt(arg >> 1)
		ns = (arg >> 5) % len(nsSpaces)
		m.steps = append(m.steps, fmt.Sprintf("serve %v %d", nsSpaces[ns], len(ids)))
		s, hit, err := nsServe(m.e.pc, ns, ids)
		require.LessOrEqual(t, hit, m.own(ns, ids), "a hit beyond what namespace %v holds: another namespace's, after %v", nsSpaces[ns], m.steps)
		if errors.Is(err, accounting.ErrBudgetExceeded) {
			return
		}
		require.NoError(t, err, "after %v", m.steps)
		m.inserted[ns] = append(m.inserted[ns], ids)
		if arg&1 == 0 {
			require.True(t, s.Close().OK())
			return
		}
		if len(m.live) == nsFuzzMaxLive {
			m.closeLive(0)
		}
		m.live = append(m.live, nsLive{s: s, ns: ns, ids: ids})
	case nsOpClose:
		if len(m.live) > 0 {
			m.steps = append(m.steps, "close")
			m.closeLive(arg % len(m.live))
		}
	case nsOpEvict:
		m.steps = append(m.steps, fmt.Sprintf("evict %d", arg))
		_, err := m.e.pc.Evict(int64(arg) * nsGranule / 8)
		require.NoError(t, err)
	case nsOpPin:
		ids := m.prompt(arg >> 3)
		m.steps = append(m.steps, fmt.Sprintf("pin %v %d", nsSpaces[ns], len(ids)))
		if len(m.pins) == nsFuzzMaxPins {
			m.pins[0].Release()
			m.pins = m.pins[1:]
		}
		p, err := m.e.pc.PinIn(nsSpaces[ns], ids)
		require.NoError(t, err)
		require.LessOrEqual(t, p.Len(), min(len(ids), m.own(ns, ids)+1), "a pin of another namespace's tokens")
		m.pins = append(m.pins, p)
	case nsOpUnpin:
		if len(m.pins) > 0 {
			m.steps = append(m.steps, "unpin")
			k := arg % len(m.pins)
			m.pins[k].Release()
			m.pins = slices.Delete(m.pins, k, k+1)
		}
	case nsOpCross:
		if len(m.live) == 0 {
			return
		}
		l := m.live[arg%len(m.live)]
		other := (l.ns + 1 + (arg>>3)%(len(nsSpaces)-1)) % len(nsSpaces)
		m.steps = append(m.steps, fmt.Sprintf("cross %v into %v", nsSpaces[l.ns], nsSpaces[other]))
		require.ErrorIs(t, m.e.pc.InsertIn(nsSpaces[other], l.s, l.ids), kv.ErrConfig, "a sequence of %v inserted into %v", nsSpaces[l.ns], nsSpaces[other])
	case nsOpMatch:
		ids := m.prompt(arg >> 3)
		for ns := range nsSpaces {
			require.LessOrEqual(t, m.e.pc.MatchIn(nsSpaces[ns], ids), m.own(ns, ids), "Match in %v beyond its own, after %v", nsSpaces[ns], m.steps)
		}
	}
}

// closeLive closes live sequence i.
func (m *nsFuzz) closeLive(i int) {
	require.True(m.t, m.live[i].s.Close().OK())
	m.live = slices.Delete(m.live, i, i+1)
}

// check reads back every token of every live sequence against its namespace's K/V,
// and checks the books: the ledger owns exactly the granules the backing holds, and
// with no sequence live, exactly what the prefix cache holds.
func (m *nsFuzz) check() {
	t := m.t
	for _, l := range m.live {
		require.Equal(t, len(l.ids), l.s.Len())
		require.NoError(t, nsCheck(l.s, l.ns, l.ids, 0, len(l.ids)), "after %v", m.steps)
	}
	owned := m.e.auth.Stats().Owned
	require.Equal(t, int64(m.e.fake.LiveGranules())*nsGranule, owned, "the ledger owns what the backing holds, after %v", m.steps)
	if len(m.live) == 0 {
		require.Equal(t, owned, m.e.pc.Stats().CachedBytes, "with no sequence live, the prefix cache holds all that is owned, after %v", m.steps)
	}
}

// finish closes everything and checks that the prefix cache gave every granule back.
func (m *nsFuzz) finish() {
	for len(m.live) > 0 {
		m.closeLive(0)
	}
	for _, p := range m.pins {
		p.Release()
	}
	m.check()
	require.NoError(m.t, m.e.pc.Close())
	assert.Zero(m.t, m.e.auth.Stats().Owned, "owned after Close")
}

// FuzzPrefixCacheNamespaces drives requests in five namespaces (the default, two
// adapters, a salt, an adapter with a salt) over three prompts that share their
// first tokens, with closes, evictions, pins and inserts into the wrong namespace,
// under a budget that evicts often; on some inputs (the first byte's top bits 01) with
// a tier below the device that is blind to namespaces (nsTier). After every step: no lookup, Match or Pin saw
// more of a prompt than its own namespace's inserted prompts hold (a hit across
// namespaces fails at once), every token of every live sequence is its namespace's
// K/V, and the ledger is exact; at the end everything comes back. The first input
// byte picks the layout (top bit), the tier, and the prompts' tokens (the low 3 bits),
// then two bytes per operation (op, argument).
func FuzzPrefixCacheNamespaces(f *testing.F) {
	f.Add([]byte{0, nsOpServe, 0x21, nsOpServe, 0x41, nsOpServe, 0x01, nsOpCross, 0, nsOpMatch, 9, nsOpServe, 0x60})
	f.Add([]byte{0x41, nsOpServe, 0x3f, nsOpServe, 0x7f, nsOpEvict, 0xff, nsOpServe, 0x5f, nsOpServe, 0x3e})
	f.Add([]byte{1, nsOpServe, 0x3f, nsOpPin, 0x11, nsOpServe, 0x5f, nsOpEvict, 0xff, nsOpServe, 0x7e, nsOpUnpin, 0, nsOpServe, 0x1e})
	f.Fuzz(func(t *testing.T, in []byte) {
		if len(in) == 0 {
			return
		}
		var opts kv.PrefixCacheOptions
		if in[0]&0xc0 == 0x40 {
			// A tier under the device, blind to namespaces: each lookup that
			// asks it for another namespace's blocks gets them, and must refuse.
			opts.Tiers = []kv.Tier{&nsTier{blind: true}}
		}
		e := newNSCache(t, kv.Config{MaxTokens: nsFuzzMaxTokens, Layout: []kv.Layout{kv.Blocked, kv.PerLayer}[in[0]>>7]}, nsFuzzBudget, opts)
		m := &nsFuzz{t: t, e: e, inserted: make([][][]int32, len(nsSpaces))}
		// Three prompts: the first 4+in[0]%8 tokens shared, then each its own.
		shared := 4 + int(in[0]%8)
		for b := range m.bases {
			m.bases[b] = make([]int32, nsFuzzMaxTokens)
			for i := range m.bases[b] {
				m.bases[b][i] = int32(i % 5)
				if i >= shared {
					m.bases[b][i] = int32(10*(b+1) + i%3)
				}
			}
		}
		in = in[1:]
		for i := 0; i+1 < len(in) && i < 2*nsFuzzOps; i += 2 {
			m.run(int(in[i])%nsOpCount, int(in[i+1]))
			m.check()
		}
		m.finish()
	})
}
