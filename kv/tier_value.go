package kv

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"

	"github.com/vmarena/vmarena/kv/tierval"
)

// TierNamespace returns the namespace of a cache's blocks in a tier: a fingerprint of
// everything that gives a block's bytes their meaning. That is the model's shape,
// the layout, the granule size and the block it makes (tokens and bytes a block), and
// prefix, which the user chooses to tell apart what the shape can not: the model's
// weights or revision, an adapter, a tenant. Caches whose namespaces agree may read
// each other's blocks. A configuration the cache can not be built from is refused
// with ErrModel or ErrConfig. The cache computes its own, with
// PrefixCacheOptions.TierPrefix as prefix; a server calls it to tell a tier that
// keeps blocks across restarts (kvtier/filetier) which namespace is its.
//
// A uniform model (Uniform: one full-attention group of every layer in order) is
// fingerprinted by its name, layers, KV heads, head dim, element type and scale mode,
// as it has been since the first version (v1), so that its stored blocks stay
// readable. Any other model's fingerprint, under a header of its own, covers each of
// its groups in order: its attention kind, window, layers (their indices), KV heads,
// head dim, element type, scale mode, state bytes and the block it makes. Two models
// that differ in any of these never share a namespace.
//
// Config's other fields (MaxTokens, the authority, map-ahead) do not change a block's
// bytes and are not part of it.
func TierNamespace(cfg Config, granule int, prefix string) (uint64, error) {
	m, err := cfg.model()
	if err != nil {
		return 0, err
	}
	if !m.uniform() {
		return modelNamespace(m, cfg, granule, prefix)
	}
	g := m.Groups[0]
	sh, err := newGroupShape(g, cfg.Layout, granule, cfg.BlockTokens, cfg.RunTokens, 0)
	if err != nil {
		return 0, err
	}
	b := make([]byte, 0, 128+len(m.Name)+len(prefix))
	b = append(b, "vmarena kv tier namespace v1\x00"...)
	b = appendString(b, m.Name)
	for _, v := range []int{m.Layers, g.KVHeads, g.HeadDim, int(g.DType), int(g.Scales), int(cfg.Layout), granule, sh.tpb, sh.unit} {
		b = binary.LittleEndian.AppendUint64(b, uint64(v))
	}
	b = sh.appendRuns(b)
	return namespaceSum(b, prefix), nil
}

// modelNamespace is TierNamespace on m, a valid model that is not uniform: under a
// header of its own, so that no such model's fingerprint is a uniform one's, and with
// the count of each list before it, so that no two models encode alike.
func modelNamespace(m Model, cfg Config, granule int, prefix string) (uint64, error) {
	groups, _, err := newGroups(m, cfg.Layout, granule, cfg.BlockTokens, cfg.RunTokens, 0)
	if err != nil {
		return 0, err
	}
	b := make([]byte, 0, 128+len(m.Name)+len(prefix)+len(groups)*96+m.Layers*8)
	b = append(b, "vmarena kv tier namespace model v1\x00"...)
	b = appendString(b, m.Name)
	for _, v := range []int{m.Layers, len(groups), int(cfg.Layout), granule} {
		b = binary.LittleEndian.AppendUint64(b, uint64(v))
	}
	for i := range groups {
		g := &groups[i]
		s := g.spec
		for _, v := range []int{int(s.Kind), s.Window, s.KVHeads, s.HeadDim, int(s.DType), int(s.Scales),
			s.tensorsPerLayer(), s.StateBytes, g.tpb, g.unit, len(s.Layers)} {
			b = binary.LittleEndian.AppendUint64(b, uint64(v))
		}
		b = g.appendRuns(b)
		for _, l := range s.Layers {
			b = binary.LittleEndian.AppendUint64(b, uint64(l))
		}
	}
	return namespaceSum(b, prefix), nil
}

// appendRuns appends to a namespace's fingerprint b the runs a block of sh is cut
// into, where it is cut (a block of one run appends nothing, so that a namespace of
// blocks laid out as before runs were made stays what it was): a block's bytes are
// laid out by its runs, and a value of other runs must not load.
func (sh *shape) appendRuns(b []byte) []byte {
	if sh.layout != Blocked || sh.rt == sh.tpb {
		return b
	}
	b = append(b, "runs"...)
	return binary.LittleEndian.AppendUint64(b, uint64(sh.rt))
}

// namespaceSum appends prefix to the fingerprint b and returns its namespace.
func namespaceSum(b []byte, prefix string) uint64 {
	b = appendString(b, prefix)
	sum := sha256.Sum256(b)
	return binary.LittleEndian.Uint64(sum[:8])
}

// appendString appends s with its length first, so that no two lists of strings
// encode alike.
func appendString(b []byte, s string) []byte {
	b = binary.LittleEndian.AppendUint64(b, uint64(len(s)))
	return append(b, s...)
}

// TierValueSize returns the bytes of the largest value a cache of cfg on granules of
// granule bytes may store into its tiers (PrefixCacheOptions.Tiers): a tier block's
// bytes of every group (a window group's units all there, as an entry inserted right
// after its prefill holds them), a recurrent group's states where a checkpoint ends
// the block, and the value's header and tokens. A tier that bounds its values
// (kvtier/redistier's and kvtier/filetier's MaxValueSize) must take at least that
// many, or every store of such a value is a counted drop (TierStats.Drops): a server
// sizes its tiers with it before it makes the cache. On 2 MiB granules a value of
// Qwen3-Next-80B-A3B is 43.7 MiB (6 MiB of K/V, 37.7 MiB of states), of
// gemma-3-27b 62 MiB and of gpt-oss-20b 14 MiB (a tier block of each group's blocks),
// all above redistier's default 8 MiB.
// A configuration the cache can not be built from is refused with ErrModel or
// ErrConfig, as is one whose prefix cache would refuse tiers (a layout other than
// Blocked, a tier block past MaxTokens).
func TierValueSize(cfg Config, granule int) (int, error) {
	m, err := cfg.model()
	if err != nil {
		return 0, err
	}
	groups, _, err := newGroups(m, cfg.Layout, granule, cfg.BlockTokens, cfg.RunTokens, cfg.MaxTokens)
	if err != nil {
		return 0, err
	}
	if len(groups) == 1 && groups[0].fullLike() {
		g := &groups[0]
		if cfg.Layout != Blocked || g.nbuf != 1 || g.tpb <= 0 {
			return 0, fmt.Errorf("%w: tiers store whole blocks, and only the Blocked layout lays a block out as one contiguous unit (layout %v)", ErrConfig, cfg.Layout)
		}
		return tierval.Size(g.tpb, g.unit), nil
	}
	tg, bt, err := newTierGroups(m, cfg.Layout, cfg.MaxTokens, groups)
	if err != nil {
		return 0, err
	}
	return tg.layout.Size(bt, tg.parts), nil
}
