package kv

import "github.com/vmarena/vmarena/internal/radix"

// PrefixPin holds a cached prefix against eviction (a system prompt): take one
// (PrefixCache.Pin) for a prefix every request shares and eviction must not take. It
// MUST be released.
type PrefixPin struct {
	pc   *PrefixCache
	node *radix.Node[*pcEntry]
	n    int
	done bool
}

// Len returns the pinned tokens: a server checks it after Pin, since a prefix the
// cache holds only in part pins fewer tokens than asked, or none (0).
func (p *PrefixPin) Len() int { return p.n }

// Pin pins the longest prefix of tokens the cache holds (at most all of it): eviction
// never takes those tokens' granules until the pin is released. A server pins a
// prefix every request shares (its system prompt) once it is inserted, so that a
// burst of other prompts can not evict it. On a Model of window
// groups it takes no entry that holds them (which of them holds a window group's
// units is each one's own). Len says how many
// tokens that is (0 when none is cached: insert them first).
func (pc *PrefixCache) Pin(tokens []int32) (*PrefixPin, error) { return pc.PinIn(Namespace{}, tokens) }

// PinIn is Pin in namespace ns: it holds ns's tokens only.
func (pc *PrefixCache) PinIn(ns Namespace, tokens []int32) (*PrefixPin, error) {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	if pc.closed {
		return nil, ErrClosed
	}
	n := pc.tree.PinFrom(pc.space(ns, true), tokens)
	return &PrefixPin{pc: pc, node: n, n: n.Depth()}, nil
}

// Release drops the pin, when the prefix stops being shared by every request (the
// system prompt changed) or at shutdown; a cache over MaxBytes then evicts down to
// it. Releasing twice panics ("kv: PrefixPin released twice").
func (p *PrefixPin) Release() {
	pc := p.pc
	pc.mu.Lock()
	if p.done {
		pc.mu.Unlock()
		panic(panicPinReleased)
	}
	p.done = true
	var drop []*pcEntry
	if !pc.closed {
		pc.tree.Unpin(p.node)
		drop = pc.capLocked()
	}
	pc.mu.Unlock()
	for _, d := range drop {
		d.close()
	}
}

// pinnedLocked returns the physical bytes of the cached granuleRefs that eviction can
// not take now: mapped by a live sequence or under a pin. pc.mu is held.
func (pc *PrefixCache) pinnedLocked() int64 {
	pinned := map[*granuleRef]struct{}{}
	var cks map[*checkpoint]struct{}
	pc.tree.EachLeaf(func(leaf *radix.Node[*pcEntry]) bool {
		for _, g := range leaf.Value().grefs {
			if g.live > 0 {
				pinned[g] = struct{}{}
			}
		}
		under := pinnedAbove(leaf) // several groups: eviction takes no unit of it
		for _, ck := range leaf.Value().ckpts {
			if ck.live > 0 || under {
				if cks == nil {
					cks = map[*checkpoint]struct{}{}
				}
				cks[ck] = struct{}{}
			}
		}
		for _, sg := range leaf.Value().segs {
			for _, g := range sg.refs {
				if g.live > 0 || under {
					pinned[g] = struct{}{}
				}
			}
		}
		// Each pinned node on the leaf's path pins its tokens' granules.
		for n := leaf; n != nil && n.Parent() != nil; n = n.Parent() {
			if n.Pinned() {
				for _, g := range leaf.Value().grefs[:min(len(leaf.Value().grefs), pc.c.unitsFor(n.Depth()))] {
					pinned[g] = struct{}{}
				}
				for gi, sg := range leaf.Value().segs {
					for u := sg.from; u < min(sg.end(), pc.c.groups[gi].unitsFor(n.Depth())); u++ {
						pinned[sg.refs[u-sg.from]] = struct{}{}
					}
				}
				break
			}
		}
		return true
	})
	var bytes int64
	for g := range pinned {
		bytes += pc.ubytes[g.grp]
	}
	for ck := range cks {
		bytes += ck.bytes
	}
	return bytes
}
