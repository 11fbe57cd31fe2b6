package kv_test

import (
	"encoding/binary"
	"errors"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/blockhash"
	"github.com/vmarena/vmarena/kvtier/tiertest"
)

// configInput is what FuzzConfig decodes: every field of a Config, its Model (a
// uniform one from its shape, kv.Uniform, or any other from bytes, groupsOf), what Size and TierNamespace are asked, and
// a PrefixCacheOptions.
type configInput struct {
	cfg     kv.Config
	granule int // for Config.Size, Model.Size and TierNamespace
	tokens  int // for Config.Size and Model.Size
	prefix  string
	opts    kv.PrefixCacheOptions
	tiers   int // tiers to give the prefix cache (tiertest.Map), 0 to 3
	events  bool
}

// configLimit is the budget a fuzzed cache runs under: a valid config that needs more
// than this must be refused with the governor's error, never allocate it.
const configLimit = 1 << 20

// varintReader reads a fuzzer's bytes as bytes and signed varints; past the end it
// reads zeros.
type varintReader struct{ b []byte }

func (r *varintReader) byte() byte {
	if len(r.b) == 0 {
		return 0
	}
	c := r.b[0]
	r.b = r.b[1:]
	return c
}

func (r *varintReader) int() int {
	v, n := binary.Varint(r.b)
	if n <= 0 {
		r.b = nil
		return 0
	}
	r.b = r.b[n:]
	return int(v)
}

// groupsOf decodes a Model's groups from b, each as: kind, dtype, scales (bytes);
// window, KV heads, head dim, tensors, state bytes (varints); a count of layers
// (a byte) and the layers (varints). At most 8 groups of 64 layers each.
func groupsOf(b []byte) []kv.Group {
	r := &varintReader{b}
	var gs []kv.Group
	for len(r.b) > 0 && len(gs) < 8 {
		g := kv.Group{Kind: kv.Attention(r.byte()), DType: arena.DType(r.byte()), Scales: kv.ScaleMode(r.byte())}
		g.Window, g.KVHeads, g.HeadDim, g.Tensors, g.StateBytes = r.int(), r.int(), r.int(), r.int(), r.int()
		n := int(r.byte()) % 65
		for range n {
			g.Layers = append(g.Layers, r.int())
		}
		gs = append(gs, g)
	}
	return gs
}

// isUniform reports whether m is what kv.Uniform makes (with its group's Scales set):
// one full-attention group of layers 0 to Layers-1 (none when Layers is out of range)
// and nothing else.
func isUniform(m kv.Model) bool {
	if len(m.Groups) != 1 {
		return false
	}
	g := m.Groups[0]
	return reflect.DeepEqual(withScales(kv.Uniform(m.Name, m.Layers, g.KVHeads, g.HeadDim, g.DType), g.Scales), m)
}

// groupBytes is groupsOf's inverse, for the seeds.
func groupBytes(gs []kv.Group) []byte {
	var b []byte
	for _, g := range gs {
		b = append(b, byte(g.Kind), byte(g.DType), byte(g.Scales))
		for _, v := range []int{g.Window, g.KVHeads, g.HeadDim, g.Tensors, g.StateBytes} {
			b = binary.AppendVarint(b, int64(v))
		}
		b = append(b, byte(len(g.Layers)))
		for _, l := range g.Layers {
			b = binary.AppendVarint(b, int64(l))
		}
	}
	return b
}

// isConfigError reports whether err is one of kv's refusals of a bad configuration.
func isConfigError(err error) bool {
	return errors.Is(err, kv.ErrConfig) || errors.Is(err, kv.ErrModel) || errors.Is(err, kv.ErrNoSharing)
}

// isShortage reports whether err is a refusal for memory: what a valid config that
// needs more than the budget, or more address space than there is, must get.
func isShortage(err error) bool {
	return errors.Is(err, accounting.ErrBudgetExceeded) || errors.Is(err, backing.ErrOutOfMemory)
}

// FuzzConfig feeds every field of Config (its Model: a uniform one's shape, or every
// field of every Group), the arguments of Config.Size, Model.Size and TierNamespace,
// and every field of PrefixCacheOptions (and of its EventOptions) to the public
// calls that take them. Each call either refuses with an error matching ErrConfig or
// ErrModel (ErrNoSharing never, on backings that share), or works: a cache is made
// under a budget of configLimit bytes on a backingtest.Fake (with MapAhead, on cuda's
// fake driver, a pool that maps ahead), a sequence of it appends, writes and reads
// back a token (or a recurrent state), and a prefix cache over it looks a prompt up,
// inserts it, evicts and closes; a call may then fail only for the
// budget (or the address space), never otherwise. Nothing may panic, and nothing may
// allocate what the budget would not allow.
func FuzzConfig(f *testing.F) {
	add := func(in configInput) {
		c := in.cfg
		// A uniform model goes in as its shape (the first six arguments), any other
		// as its groups.
		var u kv.Group
		name, layers, m := "", 0, c.Model
		if isUniform(m) {
			u, name, layers, m = m.Groups[0], m.Name, m.Layers, kv.Model{}
		}
		f.Add(name, layers, u.KVHeads, u.HeadDim, byte(u.DType), byte(u.Scales),
			m.Name, m.Layers, groupBytes(m.Groups),
			c.MaxTokens, byte(c.Layout), c.BlockTokens, c.MapAhead, in.granule, in.tokens, in.prefix,
			in.opts.MaxBytes, in.opts.TierStores, in.opts.TierLoads, int64(in.opts.TierWait), in.opts.TierWriteThrough, in.opts.TierMinHits,
			byte(in.tiers), in.events, in.opts.Events.Hash.BlockSize, byte(in.opts.Events.Hash.Algorithm), in.opts.Events.Medium)
	}
	add(configInput{cfg: kv.Config{Model: tiny8, MaxTokens: 64}, granule: fakeGranule, tokens: 10})
	add(configInput{cfg: kv.Config{Model: kv.Tiny(), MaxTokens: 32, Layout: kv.PerLayer, MapAhead: true}, granule: fakeGranule, tokens: 3, events: true})
	add(configInput{cfg: kv.Config{Model: kv.Tiny(), MaxTokens: 40, BlockTokens: 4}, granule: fakeGranule, tokens: 40, tiers: 2,
		opts: kv.PrefixCacheOptions{MaxBytes: 1 << 16, TierWriteThrough: true, TierMinHits: 1, TierStores: 2, TierLoads: 1, TierWait: time.Second}})
	// Map-ahead on cuda's fake driver, each sequence reserving from a few mebibytes to
	// past the driver's address space (2^45 tokens of Tiny is 2^53 bytes).
	for _, maxTokens := range []int{1 << 16, 1 << 30, 1 << 36, 1 << 45} {
		add(configInput{cfg: kv.Config{Model: kv.Tiny(), MaxTokens: maxTokens, MapAhead: true}, granule: fakeGranule, tokens: 5})
	}
	add(configInput{cfg: kv.Config{Model: kv.Uniform("", 1<<62, 1, 1, arena.Float8E4M3), MaxTokens: 8}, granule: fakeGranule})
	add(configInput{cfg: kv.Config{Model: withScales(kv.Uniform("", 2, 1<<20, 32, arena.Float8E4M3), kv.ScalePerHead), MaxTokens: 8}, granule: fakeGranule, tokens: 1})
	small := func(m kv.Model) kv.Model { // the preset's groups on its first 6 layers
		out := kv.Model{Name: m.Name, Layers: 6}
		for _, g := range m.Groups {
			g.Layers = slices.DeleteFunc(slices.Clone(g.Layers), func(l int) bool { return l >= 6 })
			if len(g.Layers) > 0 {
				g.KVHeads = min(g.KVHeads, 2)
				g.Window = min(g.Window, 6)
				g.StateBytes = min(g.StateBytes, 1000)
				out.Groups = append(out.Groups, g)
			}
		}
		return out
	}
	for _, m := range kv.Presets() {
		add(configInput{cfg: kv.Config{Model: small(m), MaxTokens: 24}, granule: fakeGranule, tokens: 13, events: true})
		add(configInput{cfg: kv.Config{Model: small(m), MaxTokens: 24, Layout: kv.PerLayer, MapAhead: true}, granule: fakeGranule, tokens: 7})
	}
	f.Fuzz(func(t *testing.T, gName string, gLayers, gHeads, gDim int, gDType, gScales byte,
		mName string, mLayers int, groups []byte,
		maxTokens int, layout byte, blockTokens int, mapAhead bool, granule, tokens int, prefix string,
		maxBytes int64, tierStores, tierLoads int, tierWait int64, writeThrough bool, minHits int,
		tiers byte, events bool, evBlock int, evAlg byte, medium string) {
		m := kv.Model{Name: mName, Layers: mLayers, Groups: groupsOf(groups)}
		if mName == "" && mLayers == 0 && len(m.Groups) == 0 {
			m = withScales(kv.Uniform(gName, gLayers, gHeads, gDim, arena.DType(gDType)), kv.ScaleMode(gScales))
		}
		in := configInput{
			cfg: kv.Config{
				Model:     m,
				MaxTokens: maxTokens, Layout: kv.Layout(layout), BlockTokens: blockTokens, MapAhead: mapAhead,
				// NB: RunTokens from the high bits of tokens, so that the corpus keeps
				// its form (small token counts, every entry before runs, take 0).
				RunTokens: fuzzRuns[uint(tokens>>20)%uint(len(fuzzRuns))],
			},
			granule: granule, tokens: tokens, prefix: prefix, tiers: int(tiers % 4), events: events,
			opts: kv.PrefixCacheOptions{MaxBytes: maxBytes, TierPrefix: prefix, TierStores: tierStores, TierLoads: tierLoads,
				TierWait: time.Duration(tierWait), TierWriteThrough: writeThrough, TierMinHits: minHits,
				Events: kv.EventOptions{Hash: blockhash.Options{BlockSize: evBlock, Algorithm: blockhash.Algorithm(evAlg), Seed: prefix,
					LoRA: medium, CacheSalt: gName}, Medium: medium}},
		}
		checkConfig(t, in)
	})
}

// fuzzRuns are the Config.RunTokens FuzzConfig tries: the default, powers of two
// that do and do not divide a block, one that is no power of two, a negative one and
// one past any block.
var fuzzRuns = []int{0, 1, 2, 8, 16, 64, 3, -1, 1 << 62}

// checkConfig runs FuzzConfig's checks on one input.
func checkConfig(t *testing.T, in configInput) {
	cfg := in.cfg
	// The pure calls: each refuses with kv's sentinel or answers.
	if err := cfg.Model.Validate(0); err != nil && !isConfigError(err) {
		t.Fatalf("Model.Validate(0): %v", err)
	}
	if err := cfg.Model.Validate(cfg.MaxTokens); err != nil && !isConfigError(err) {
		t.Fatalf("Model.Validate: %v", err)
	}
	_ = cfg.Model.Uniform()
	if ms, err := cfg.Model.Size(in.granule, cfg.BlockTokens, in.tokens); err != nil {
		if !isConfigError(err) {
			t.Fatalf("Model.Size: %v", err)
		}
	} else if ms.Need < 0 || ms.Committed < ms.Need || ms.Packed < 0 {
		t.Fatalf("Model.Size(%d, %d, %d) = %+v", in.granule, cfg.BlockTokens, in.tokens, ms)
	}
	checkSize(t, cfg, in.granule, in.tokens)
	if _, err := kv.TierNamespace(cfg, in.granule, in.prefix); err != nil && !isConfigError(err) {
		t.Fatalf("TierNamespace: %v", err)
	}

	// A sequence's address space may be 2^55 bytes (valid, and free on the Fake):
	// cuda's fake driver refuses a reservation past its 128 TiB as the driver does,
	// with backing.ErrOutOfMemory, a shortage.
	kind := onFake
	if cfg.MapAhead {
		kind = onCUDA // MapAhead needs a pool: cuda on its fake driver
	}
	e := openEnv(t, kind, noCache, withLimit(configLimit))
	defer func() {
		e.finish(t)
		if err := e.auth.Close(); err != nil {
			t.Fatalf("ledger: %v", err)
		}
	}()
	c, err := e.mk(cfg) // NB: not tryCache, which would give a zero Model tiny8
	switch {
	case err == nil:
	case isConfigError(err), isShortage(err):
		return
	default:
		t.Fatalf("New: %v", err)
	}
	defer func() {
		if err := c.Close(); err != nil {
			t.Fatalf("Cache.Close: %v", err)
		}
	}()
	// What New accepts, Size and TierNamespace accept on its granule.
	if _, err := cfg.Size(fakeGranule, min(in.tokens&0xff, cfg.MaxTokens)); err != nil {
		t.Fatalf("New accepted what Size(%d) refuses: %v", fakeGranule, err)
	}
	if _, err := kv.TierNamespace(cfg, fakeGranule, in.prefix); err != nil {
		t.Fatalf("New accepted what TierNamespace refuses: %v", err)
	}
	n := 1 + (in.tokens&0xff)%min(cfg.MaxTokens, 8)
	useSequence(t, c, n)
	usePrefixCache(t, c, in, n)
}

// checkSize checks Config.Size's answer on one input: a refusal with kv's sentinel,
// or figures that add up.
func checkSize(t *testing.T, cfg kv.Config, granule, tokens int) {
	s, err := cfg.Size(granule, tokens)
	if err != nil {
		if !isConfigError(err) {
			t.Fatalf("Config.Size: %v", err)
		}
		return
	}
	if s.Used < 0 || s.Committed < s.Used || s.Reserved < s.Committed || s.Waste != s.Committed-s.Used || s.BytesPerToken <= 0 {
		t.Fatalf("Config.Size(%d, %d) = %+v", granule, tokens, s)
	}
}

// useSequence makes a sequence of c, appends n tokens and writes and reads back its
// last token of each layer (a recurrent layer's state), and closes it. Only the
// budget may refuse.
func useSequence(t *testing.T, c *kv.Cache, n int) {
	s, err := c.NewSequence()
	if err != nil {
		if isShortage(err) {
			return
		}
		t.Fatalf("NewSequence: %v", err)
	}
	defer func() {
		if out := s.Close(); !out.OK() {
			t.Fatalf("Sequence.Close: %v", out.Err)
		}
	}()
	if err := s.Append(n); err != nil {
		if isShortage(err) {
			return
		}
		t.Fatalf("Append(%d): %v", n, err)
	}
	m := c.Config().Model
	for gi, g := range m.Groups {
		l := g.Layers[len(g.Layers)-1]
		size := g.TokenBytes()
		if g.Kind == kv.Recurrent {
			size = g.StateBytes
		}
		src := make([]byte, size)
		for i := range src {
			src[i] = byte(i*7 + gi + 1)
		}
		dst := make([]byte, size)
		if g.Kind == kv.Recurrent {
			if err := s.WriteState(l, src); err != nil {
				t.Fatalf("WriteState(%d): %v", l, err)
			}
			if err := s.ReadState(l, dst); err != nil {
				t.Fatalf("ReadState(%d): %v", l, err)
			}
		} else {
			if err := s.WriteToken(l, kv.K, n-1, src); err != nil {
				t.Fatalf("WriteToken(%d, K, %d): %v", l, n-1, err)
			}
			if err := s.ReadToken(l, kv.K, n-1, dst); err != nil {
				t.Fatalf("ReadToken(%d, K, %d): %v", l, n-1, err)
			}
		}
		if !slices.Equal(src, dst) {
			t.Fatalf("group %d layer %d: read back other bytes", gi, l)
		}
	}
}

// nopEvents is an observer that drops what it is told.
type nopEvents struct{}

func (nopEvents) BlocksStored(kv.BlocksStored)   {}
func (nopEvents) BlocksRemoved(kv.BlocksRemoved) {}
func (nopEvents) AllBlocksCleared()              {}

// usePrefixCache makes a prefix cache over c with in's options, serves a prompt of
// n tokens, inserts it, evicts everything and closes it. Only the budget may refuse
// what it serves.
func usePrefixCache(t *testing.T, c *kv.Cache, in configInput, n int) {
	opts := in.opts
	for i := range in.tiers {
		opts.Tiers = append(opts.Tiers, namedTier{tiertest.NewMap(64 << 10), string(rune('a' + i))})
	}
	if in.events {
		opts.Events.Observer = nopEvents{}
	}
	// NB: a wait of the fuzzer's is bounded, so that a Close that waits for stores
	// into a tier does not wait for hours; the tiers here answer at once anyway.
	opts.TierWait = min(opts.TierWait, time.Second)
	pc, err := kv.NewPrefixCache(c, opts)
	if err != nil {
		if !isConfigError(err) || errors.Is(err, kv.ErrNoSharing) {
			t.Fatalf("NewPrefixCache: %v", err)
		}
		return
	}
	defer func() {
		if err := pc.Close(); err != nil {
			t.Fatalf("PrefixCache.Close: %v", err)
		}
	}()
	prompt := make([]int32, n)
	for i := range prompt {
		prompt[i] = int32(i + 1)
	}
	s, _, err := pc.Lookup(prompt)
	if err != nil {
		if isShortage(err) {
			return
		}
		t.Fatalf("Lookup: %v", err)
	}
	defer func() {
		if out := s.Close(); !out.OK() {
			t.Fatalf("Sequence.Close: %v", out.Err)
		}
	}()
	if err := s.Append(n - s.Len()); err != nil {
		if isShortage(err) {
			return
		}
		t.Fatalf("Append: %v", err)
	}
	if err := pc.Insert(s, prompt); err != nil && !isShortage(err) {
		t.Fatalf("Insert: %v", err)
	}
	if _, err := pc.Evict(1 << 40); err != nil {
		t.Fatalf("Evict: %v", err)
	}
	pc.FlushEvents()
}

// namedTier is a tier under a name of the test's, so that several are told apart.
type namedTier struct {
	*tiertest.Map
	name string
}

func (t namedTier) Name() string { return t.name }
