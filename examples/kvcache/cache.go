package main

import (
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/internal/baseline"
	"github.com/vmarena/vmarena/kv"
)

// cacheStrategy drives a kv.Cache through baseline.Strategy, so that the replay
// treats vmarena's cache and the baselines alike. Physical is the governor's reading:
// the bytes the cache's ledger owns (under ByBacking the backing's whole pool, idle
// granules included, every shared granule once).
type cacheStrategy struct {
	name  string
	c     *kv.Cache
	pool  backing.Pool          // the backing's pool, or nil
	auth  *accounting.Authority // owns the cache's physical bytes
	close func() error          // closes the backing, after the cache
	model kv.Model              // the cache's groups
	// groups measures each layer group of a cache on a model of groups; nil for a
	// uniform model.
	groups *groupMeter

	mu      sync.Mutex
	drained *backing.PoolStats         // the pool after the cache closed, before the backing did
	copies  map[*copiedPrefix]struct{} // live copied prefixes (backings that can not share)
	closed  bool
}

func newCacheStrategy(name string, c *kv.Cache, pool backing.Pool, auth *accounting.Authority, closeBacking func() error) *cacheStrategy {
	m := c.Config().Model
	return &cacheStrategy{name: name, c: c, pool: pool, auth: auth, close: closeBacking, model: m,
		copies: make(map[*copiedPrefix]struct{})}
}

func (s *cacheStrategy) Name() string { return s.name }

func (s *cacheStrategy) NewSequence() (baseline.Sequence, error) {
	q, err := s.c.NewSequence()
	if err != nil {
		return nil, err
	}
	return s.track(&cacheSeq{s: s, q: q}), nil
}

// track has the group meter, where there is one, follow q until it closes.
func (s *cacheStrategy) track(q *cacheSeq) *cacheSeq {
	if s.groups != nil {
		s.groups.add(q.q)
	}
	return q
}

func (s *cacheStrategy) NewSequenceFrom(p baseline.Prefix) (baseline.Sequence, error) {
	switch p := p.(type) {
	case *cachePrefix:
		if p.s != s {
			break
		}
		q, err := s.c.NewSequenceFrom(p.p)
		if err != nil {
			return nil, err
		}
		return s.track(&cacheSeq{s: s, q: q}), nil
	case *copiedPrefix:
		if p.s != s {
			break
		}
		if p.released {
			panic(baseline.PanicPrefixReleased)
		}
		if p.forked {
			q, err := p.q.ForkAt(p.q.Len())
			if err != nil {
				return nil, err
			}
			return s.track(&cacheSeq{s: s, q: q}), nil
		}
		q, err := s.c.NewSequence()
		if err != nil {
			return nil, err
		}
		if err := copyTokens(s.model, q, p.q, p.q.Len()); err != nil {
			q.Close()
			return nil, err
		}
		return s.track(&cacheSeq{s: s, q: q}), nil
	}
	return nil, fmt.Errorf("%w: %T", baseline.ErrForeign, p)
}

// copyTokens grows dst by n tokens and copies src's first n tokens into them, group
// by group in m's shapes: each layer's tensors from the first token src still holds
// (a window group's tokens below it are gone, and no later step reads them), and,
// where src has them, its recurrent states.
func copyTokens(m kv.Model, dst, src *kv.Sequence, n int) error {
	from := dst.Len()
	if err := dst.Append(n); err != nil {
		return err
	}
	var buf []byte
	// Layer by layer, as the replay writes (writeLayerMajor).
	for _, g := range m.Groups {
		for _, l := range g.Layers {
			if g.Kind == kv.Recurrent {
				if src.Len() == 0 || from > 0 {
					continue // no state yet, or dst's own
				}
				buf = slices.Grow(buf[:0], g.StateBytes)[:g.StateBytes]
				if err := src.ReadState(l, buf); err != nil {
					return err
				}
				if err := dst.WriteState(l, buf); err != nil {
					return err
				}
				continue
			}
			tb := g.TokenBytes()
			buf = slices.Grow(buf[:0], tb)[:tb]
			kinds := []kv.Kind{kv.K, kv.V}
			if g.Kind == kv.MLALatent {
				kinds = kinds[:1]
			}
			for t := src.FirstHeld(l); t < n; t++ {
				for _, k := range kinds {
					if err := src.ReadToken(l, k, t, buf); err != nil {
						return err
					}
					if err := dst.WriteToken(l, k, from+t, buf); err != nil {
						return err
					}
				}
			}
		}
	}
	return nil
}

func (s *cacheStrategy) Stats() baseline.Stats {
	s.mu.Lock()
	st := s.c.Stats()
	// A copied prefix is held in a sequence of its own: count it as a prefix.
	copies, copied := len(s.copies), int64(0)
	for p := range s.copies {
		copied += int64(p.q.Len())
	}
	s.mu.Unlock()
	return baseline.Stats{
		Sequences:    st.Sequences - copies,
		Prefixes:     st.Prefixes + copies,
		Tokens:       st.Tokens - copied,
		Physical:     st.Owned,
		PeakPhysical: s.auth.Stats().OwnedPeak,
		Saved:        st.Shared,
	}
}

// readGroups measures the layer groups of a cache on a model of groups (groupReader).
func (s *cacheStrategy) readGroups() (groupUse, bool, error) {
	if s.groups == nil {
		return groupUse{}, false, nil
	}
	u, err := s.groups.read()
	return u, true, err
}

// poolAfterClose returns the backing's pool as the cache's Close left it (every
// granule idle, none mapped, when nothing leaked), or nil for a backing without a
// pool or before Close.
func (s *cacheStrategy) poolAfterClose() *backing.PoolStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.drained
}

// Close closes the cache, then the backing.
func (s *cacheStrategy) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return baseline.ErrClosed
	}
	if len(s.copies) > 0 {
		return fmt.Errorf("%w: %d prefixes", baseline.ErrBusy, len(s.copies))
	}
	if err := s.c.Close(); err != nil {
		return err
	}
	s.closed = true
	if s.pool != nil {
		ps := s.pool.PoolStats()
		s.drained = &ps
	}
	if s.close != nil {
		return s.close()
	}
	return nil
}

type cacheSeq struct {
	s *cacheStrategy
	q *kv.Sequence
}

func (q *cacheSeq) Append(n int) error { return q.q.Append(n) }
func (q *cacheSeq) Len() int           { return q.q.Len() }

func (q *cacheSeq) WriteToken(layer int, v baseline.Kind, token int, src []byte) error {
	return q.q.WriteToken(layer, kv.Kind(v), token, src)
}

func (q *cacheSeq) ReadToken(layer int, v baseline.Kind, token int, dst []byte) error {
	return q.q.ReadToken(layer, kv.Kind(v), token, dst)
}

// writeState and readState reach a recurrent layer's state (stateHolder).
func (q *cacheSeq) writeState(layer int, src []byte) error { return q.q.WriteState(layer, src) }
func (q *cacheSeq) readState(layer int, dst []byte) error  { return q.q.ReadState(layer, dst) }

// Freeze shares the first n tokens where the backing can (host.Shared, cuda); where
// it can not (host.Private) it copies them into a sequence of their own, which every
// new sequence copies again: what a server without sharing does.
func (q *cacheSeq) Freeze(n int) (baseline.Prefix, error) {
	if q.s.groups != nil {
		return q.holdPrefix(n)
	}
	p, err := q.q.Freeze(n)
	if err == nil {
		return &cachePrefix{s: q.s, p: p}, nil
	}
	if !errors.Is(err, kv.ErrNoSharing) {
		return nil, err
	}
	if n < 0 || n > q.q.Len() {
		return nil, fmt.Errorf("%w: freeze %d of %d tokens", kv.ErrRange, n, q.q.Len())
	}
	held, err := q.s.c.NewSequence()
	if err != nil {
		return nil, err
	}
	if err := copyTokens(q.s.model, held, q.q, n); err != nil {
		held.Close()
		return nil, err
	}
	cp := &copiedPrefix{s: q.s, q: held}
	q.s.mu.Lock()
	q.s.copies[cp] = struct{}{}
	q.s.mu.Unlock()
	return cp, nil
}

// holdPrefix is Freeze on a cache of layer groups, which kv's Freeze refuses: the
// prefix is a sequence of its own, forked from q at n where the backing can share
// (each group forks on its own: a window group keeps the units from its FirstLive(n)
// on, mapped) and copied where it can not. Every sequence started on it is forked
// from it, or copied.
func (q *cacheSeq) holdPrefix(n int) (baseline.Prefix, error) {
	if n < 0 || n > q.q.Len() {
		return nil, fmt.Errorf("%w: freeze %d of %d tokens", kv.ErrRange, n, q.q.Len())
	}
	held, err := q.q.ForkAt(n)
	forked := err == nil
	if errors.Is(err, kv.ErrNoSharing) {
		if held, err = q.s.c.NewSequence(); err == nil {
			if err = copyTokens(q.s.model, held, q.q, n); err != nil {
				held.Close()
			}
		}
	}
	if err != nil {
		return nil, err
	}
	cp := &copiedPrefix{s: q.s, q: held, forked: forked}
	q.s.groups.setPrefix(held)
	q.s.mu.Lock()
	q.s.copies[cp] = struct{}{}
	q.s.mu.Unlock()
	return cp, nil
}

func (q *cacheSeq) Close() error {
	if q.s.groups != nil {
		q.s.groups.remove(q.q)
	}
	if out := q.q.Close(); !out.OK() {
		if errors.Is(out.Err, kv.ErrClosed) {
			return fmt.Errorf("%w: %v", baseline.ErrClosed, out)
		}
		return fmt.Errorf("kv: sequence close: %v", out)
	}
	return nil
}

type cachePrefix struct {
	s *cacheStrategy
	p *kv.Prefix
}

func (p *cachePrefix) Len() int { return p.p.Len() }
func (p *cachePrefix) Release() { p.p.Release() }

// copiedPrefix is a prefix on a backing that can not share: a sequence of its own.
type copiedPrefix struct {
	s        *cacheStrategy
	q        *kv.Sequence
	released bool
	forked   bool // every sequence on it forks from q (a cache of layer groups that shares)
}

func (p *copiedPrefix) Len() int { return p.q.Len() }

func (p *copiedPrefix) Release() {
	if p.released {
		panic(baseline.PanicPrefixReleased)
	}
	p.released = true
	if p.s.groups != nil {
		p.s.groups.setPrefix(nil)
	}
	p.q.Close()
	p.s.mu.Lock()
	delete(p.s.copies, p)
	p.s.mu.Unlock()
}
