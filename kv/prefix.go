package kv

import (
	"errors"
	"fmt"

	"github.com/vmarena/vmarena/internal/nocopy"
)

// Prefix is the immutable K and V of a sequence's first tokens (a system prompt, a
// few-shot header), shared by mapping its physical granules into every sequence that
// starts on it. It is reference-counted: its creator holds one reference, each
// sequence started on it another; it is freed with the last.
type Prefix struct {
	_ nocopy.NoCopy

	c      *Cache
	bufs   []buffer
	tokens int
	pcl    *pcLive // what it maps of a PrefixCache's granules, or nil

	// guarded by c.mu
	refs    int
	creator bool // the creator's reference is still held
}

// Len returns the prefix's tokens.
func (p *Prefix) Len() int { return p.tokens }

// Release drops the creator's reference. The prefix's memory is freed now if no
// sequence started on it is still live, else with the last of them. Releasing twice
// panics with PanicPrefixReleased.
func (p *Prefix) Release() {
	p.c.mu.Lock()
	if !p.creator {
		p.c.mu.Unlock()
		panic(PanicPrefixReleased)
	}
	p.creator = false
	p.c.mu.Unlock()
	p.unref()
}

// ref takes a reference for a new sequence; it fails once the creator released it
// and so no new sequence may start on it.
func (p *Prefix) ref() bool {
	p.c.mu.Lock()
	defer p.c.mu.Unlock()
	if !p.creator {
		return false
	}
	p.refs++
	return true
}

func (p *Prefix) unref() {
	p.c.mu.Lock()
	p.refs--
	last := p.refs == 0
	p.c.mu.Unlock()
	if last {
		// NB: what can not be given back now is kept by the cache and retried by
		// Cache.Close. The prefix leaves the cache only after, so Close can not slip
		// in between.
		p.c.release(p.bufs)
		if p.pcl != nil {
			p.pcl.drop()
		}
		p.c.mu.Lock()
		delete(p.c.prefixes, p)
		p.c.notifyLocked()
		p.c.mu.Unlock()
	}
}

// NewSequenceFrom returns a sequence that starts on prefix p: p's full granules (full
// blocks in the Blocked layout) are mapped read-only into it (owned once, whatever
// maps them), and the tokens past them are copied into the sequence's own granule
// (block). The sequence holds a reference to p until it is closed. It MUST be closed.
// When the copied tail's granules can not be had, it evicts cached prefixes before it
// refuses with an *accounting.BudgetError, as ForkAt does.
func (c *Cache) NewSequenceFrom(p *Prefix) (*Sequence, error) {
	if p == nil {
		panic(PanicNilPrefix)
	}
	if p.c != c {
		return nil, fmt.Errorf("%w: the prefix belongs to another cache", ErrConfig)
	}
	if !p.ref() {
		panic(PanicPrefixReleased)
	}
	if err := c.shareBudget(p.tokens); err != nil {
		p.unref()
		return nil, err
	}
	var full int
	s, err := evicting(c, func() (*Sequence, error) {
		s, err := c.newSequence()
		if err != nil {
			return nil, err
		}
		full, err = c.shareInto(s.bufs, p.bufs, p.tokens)
		if err != nil {
			return nil, errors.Join(err, c.abandon(s))
		}
		return s, nil
	})
	if err != nil {
		p.unref()
		return nil, err
	}
	s.n = p.tokens
	s.frozen = full
	s.prefix = p
	if p.pcl != nil {
		s.pcl = p.pcl.inherit(nil, full/c.unit)
	}
	s.publish()
	c.register(s)
	return s, nil
}
