package kv

import (
	"fmt"

	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/internal/radix"
)

// What a scheduler asks the prefix cache before it admits a request, all without
// side effects (Match, Need, and Probe in prefixcache_probe.go: where the prompt's
// tokens are held and what a Lookup would commit), and the eviction it may ask for
// (Evict).

// Match returns the tokens of the prompt tokens that a Lookup now would start on
// (at most len(tokens)-1: see Lookup), and changes nothing: it makes no sequence,
// counts no query, copies nothing, takes no entry over and marks no entry used. A
// scheduler calls it (with Need and Cache.Headroom) to decide whether to admit a
// request, and Lookup once it does. A closed prefix cache matches nothing.
func (pc *PrefixCache) Match(tokens []int32) int { return pc.MatchIn(Namespace{}, tokens) }

// MatchIn is Match in namespace ns.
func (pc *PrefixCache) MatchIn(ns Namespace, tokens []int32) int {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	if pc.closed {
		return 0
	}
	return pc.peekLocked(pc.space(ns, false), tokens[:pc.matchable(tokens)])
}

// peekLocked returns how many of tokens a lookup under root would start on now,
// marking nothing used. pc.mu is held.
func (pc *PrefixCache) peekLocked(root *radix.Node[*pcEntry], tokens []int32) int {
	if pc.c.multi {
		m, _ := pc.hitLocked(root, tokens)
		return m
	}
	m, _ := pc.tree.PeekFrom(root, tokens)
	return m
}

// matchable returns how many of tokens a lookup may match: all but the last, at most
// MaxTokens.
func (pc *PrefixCache) matchable(tokens []int32) int {
	return min(max(len(tokens)-1, 0), pc.c.cfg.MaxTokens)
}

// Need returns the bytes of budget that serving the prompt tokens would take now:
// Lookup(tokens), then the Append of the tokens past the match, less the pool's idle
// granules: what a scheduler compares with Cache.Headroom before it admits a
// request. The whole units of the match are mapped from the cache and take nothing;
// a miss that takes over an evicted entry's ranges may take less. It changes nothing
// (as Match), and fails with ErrTooLong for a prompt longer than MaxTokens and
// ErrClosed once the prefix cache is closed.
func (pc *PrefixCache) Need(tokens []int32) (int64, error) { return pc.NeedIn(Namespace{}, tokens) }

// NeedIn is Need for a prompt of namespace ns.
func (pc *PrefixCache) NeedIn(ns Namespace, tokens []int32) (int64, error) {
	c := pc.c
	if len(tokens) > c.cfg.MaxTokens {
		return 0, fmt.Errorf("%w: a prompt of %d tokens, MaxTokens %d", ErrTooLong, len(tokens), c.cfg.MaxTokens)
	}
	pc.mu.Lock()
	closed := pc.closed
	var m int
	if !closed {
		m = pc.peekLocked(pc.space(ns, false), tokens[:pc.matchable(tokens)])
	}
	pc.mu.Unlock()
	if closed {
		return 0, ErrClosed
	}
	if c.multi {
		return max(c.needGroups(len(tokens), m)-c.own(), 0), nil
	}
	size, _ := backing.AlignUp(c.extent(len(tokens)), c.gran)
	need := int64(c.nbuf) * int64(size-c.shareable(m))
	return max(need-c.own(), 0), nil
}

// Evict evicts cached prefixes that no live sequence maps and no pin holds, least
// recently used first, until bytes of physical memory came back (to the backing's
// pool) or none is left to take, and returns the bytes that came back: what a
// scheduler asks for before an operation that Cache.Headroom says needs it, or to
// give memory to another user of the device; the cache evicts without it where the
// package doc's memory rules say. A negative bytes fails with ErrRange; a closed
// prefix cache with ErrClosed.
func (pc *PrefixCache) Evict(bytes int64) (int64, error) {
	if bytes < 0 {
		return 0, fmt.Errorf("%w: evict %d bytes", ErrRange, bytes)
	}
	pc.mu.Lock()
	if pc.closed {
		pc.mu.Unlock()
		return 0, ErrClosed
	}
	pc.working.Add(1)
	pc.mu.Unlock()
	defer pc.working.Done()
	return pc.evictFor(bytes, evictForCaller), nil
}

// evictable returns the physical bytes eviction could give back now: the cached
// granules that no live sequence maps and no pin holds.
func (pc *PrefixCache) evictable() int64 {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	return pc.cachedBytes - pc.pinnedLocked()
}
