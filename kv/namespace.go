package kv

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"

	"github.com/vmarena/vmarena/internal/radix"
)

// Namespace is a part of a PrefixCache whose entries share nothing with another's: the
// K/V one LoRA adapter computed, one tenant's, one model revision's. The same tokens
// give other K/V under another adapter, so a hit across namespaces would return wrong
// output silently; a tenant's hit in another's entries would tell it, by its timing,
// what the other asked (vLLM's cache_salt guards against that).
//
// Its zero value is the shared default namespace, the one Lookup, Match, Insert, Need
// and Pin use; LookupIn, MatchIn, InsertIn, NeedIn and PinIn take one. Two namespaces
// are the same when both fields are equal. A server builds one per request: the
// adapter the request runs under, and a salt of whatever must not share (a tenant's
// ID, the model's revision, the request's cache_salt, or several of them joined).
//
// What a namespace changes:
//   - Lookup and Match find only entries inserted in the same namespace, Insert
//     makes its entry there, and a Pin holds only that namespace's tokens.
//   - Entries of different namespaces hold no granule in common. A sequence is bound
//     to the namespace of its first Lookup hit or Insert (it maps or lends the
//     namespace's granules from then on); an Insert into another is refused with
//     ErrConfig.
//   - Eviction runs across all namespaces by one least-recently-used order, under
//     the cache's one MaxBytes and the governor's budget, as for one namespace: no
//     per-namespace cap. A cap per namespace would leave memory idle while another
//     namespace needs it, and a server that wants quotas has the governor's
//     authorities for them; a namespace that is not used ages out like any prefix.
//   - KV events (PrefixCacheOptions.Events) announce an entry's blocks with its
//     namespace's extra keys as vLLM does: Adapter as the lora_name of BlocksStored
//     and an extra key of every block's hash, Salt an extra key of block 0's only;
//     an empty field takes EventOptions.Hash's LoRA or CacheSalt. So a router that
//     hashes a request with its adapter and salt finds the blocks.
//   - Tiers (PrefixCacheOptions.Tiers) keep each namespace's blocks under a
//     tierval.Key Namespace of its own (TierNamespace's for the default, one derived
//     from it and the two fields for another: see spaceTierNS); a value of another
//     namespace that a tier hands back is refused by its header's check
//     (tierval.ErrNamespace, counted in TierStats.Invalid) and never mapped.
type Namespace struct {
	// Adapter is the LoRA adapter's name (vLLM's lora_name); "" for the base model.
	Adapter string
	// Salt is any other key that must not share: a tenant, a model revision,
	// vLLM's cache_salt; "" for none.
	Salt string
}

// String returns the namespace as a log shows it.
func (ns Namespace) String() string {
	if ns == (Namespace{}) {
		return "default"
	}
	return fmt.Sprintf("adapter=%q salt=%q", ns.Adapter, ns.Salt)
}

// appendKey appends the namespace's key in the index (radix.Tree.Space): nothing for
// the default, else the adapter's length, the adapter and the salt, so that no two
// namespaces have one key.
func (ns Namespace) appendKey(b []byte) []byte {
	if ns == (Namespace{}) {
		return b
	}
	b = binary.AppendUvarint(b, uint64(len(ns.Adapter)))
	return append(append(b, ns.Adapter...), ns.Salt...)
}

// space returns the root of ns's part of the index: an empty one, under which
// nothing can be inserted, when it holds nothing (make false), or one made for it
// (make true). pc.mu is held.
func (pc *PrefixCache) space(ns Namespace, make bool) *radix.Node[*pcEntry] {
	var buf [64]byte
	key := ns.appendKey(buf[:0])
	if make {
		return pc.tree.MakeSpace(key)
	}
	return pc.tree.Space(key)
}

// spaceTierNS returns the namespace of ns's blocks in the tiers, base being the
// default's (TierNamespace): base itself for the default, else the first 8 bytes of
// SHA-256 over a header of its own, base and ns's two fields, each with its length.
func spaceTierNS(base uint64, ns Namespace) uint64 {
	if ns == (Namespace{}) {
		return base
	}
	var buf [128]byte // NB: on the stack unless the fields are long (a Probe allocates nothing)
	b := append(buf[:0], "vmarena kv tier namespace space v1\x00"...)
	b = binary.LittleEndian.AppendUint64(b, base)
	b = appendString(b, ns.Adapter)
	b = appendString(b, ns.Salt)
	sum := sha256.Sum256(b)
	return binary.LittleEndian.Uint64(sum[:8])
}

// bind binds l, a sequence's holdings, to namespace ns, or returns an error matching
// ErrConfig when it is bound to another. pc.mu is held.
func (l *pcLive) bind(ns Namespace) error {
	switch {
	case !l.bound:
		l.ns, l.bound = ns, true
	case l.ns != ns:
		return fmt.Errorf("%w: the sequence holds K/V of namespace %v, not %v", ErrConfig, l.ns, ns)
	}
	return nil
}
