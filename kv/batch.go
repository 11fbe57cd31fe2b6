package kv

import (
	"context"
	"errors"
	"fmt"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
)

// Growth is one sequence's part of a batch step: Seq grows by Tokens. A server
// passes one per sequence of a step to Cache.Need, AppendBatch or AppendBatchCtx.
type Growth struct {
	Seq    *Sequence
	Tokens int
}

// Need returns the bytes of budget that growing s by n tokens would take now: the
// granules it must commit, less those the backing's pool holds idle (they are owned
// already). Zero means the growth fits in granules the sequence or the pool holds.
// It fails as Append would for a bad n. On a Model it counts what the growth commits
// before a window group gives any granule back (those go idle in a pooling backing,
// where the next growth finds them). A scheduler compares it with Headroom before it
// grows one sequence (a prefill chunk); Cache.Need does a whole step.
func (s *Sequence) Need(n int) (int64, error) {
	g := [1]Growth{{s, n}}
	return s.c.Need(g[:])
}

// Need returns the bytes of budget that the batch step would take now (see
// Sequence.Need): what AppendBatch compares with the governor's available bytes. It
// fails as AppendBatch would for a bad batch. A scheduler compares it with Headroom
// to choose a step that fits before it calls AppendBatch.
func (c *Cache) Need(batch []Growth) (int64, error) {
	need, err := c.check(batch)
	if err != nil {
		return 0, err
	}
	return max(need-c.own(), 0), nil
}

// AppendBatch grows every sequence of the batch by its own count, all or nothing:
// every sequence grows, or none does and the step holds nothing afterwards. When the
// memory can not be had now it fails at once with an *accounting.BudgetError whose
// Requested, Available and Limit say what the step needs (Need), what the device has
// free and its limit: a scheduler frees Requested - Available bytes (preempts a
// sequence) and steps again. A batch that names a sequence twice, a nil sequence or
// one of another cache fails with ErrBatch; a count past MaxTokens with ErrTooLong.
// The batch's sequences MUST all be owned by the calling goroutine. A server calls it
// once per decode step, for every sequence the step grows, when it would rather
// preempt than wait; AppendBatchCtx waits.
func (c *Cache) AppendBatch(batch []Growth) error { return c.appendBatch(batch, 0) }

// AppendBatchCtx is AppendBatch that, when the memory can not be had now, waits for
// the whole step's bytes in the governor's FIFO queue of the device, behind every
// request (of this cache or any other user of the device) that queued before it, until
// ctx ends; the queue serves it from the pool's idle granules as from free budget. It
// holds nothing while it waits, so waiting steps can not deadlock each other. A step
// larger than the device's whole limit fails at once (ErrExceedsLimit); a cancelled
// wait returns ctx.Err() and changes nothing. A server uses it when it would rather
// wait for other requests to finish and free memory than preempt; ctx bounds the
// wait.
func (c *Cache) AppendBatchCtx(ctx context.Context, batch []Growth) error {
	if ctx == nil {
		panic(panicNilContext)
	}
	err := c.appendBatch(batch, 0)
	if !accounting.CanWait(err) {
		return err
	}
	return c.wait(ctx, batch, err)
}

// check validates a batch and returns the bytes of the granules it must commit.
func (c *Cache) check(batch []Growth) (int64, error) {
	mark := c.batch.Add(1)
	var need int64
	for i, g := range batch {
		s := g.Seq
		switch {
		case s == nil:
			return 0, fmt.Errorf("%w: entry %d has no sequence", ErrBatch, i)
		case s.c != c:
			return 0, fmt.Errorf("%w: entry %d: sequence %d belongs to another cache", ErrBatch, i, s.id)
		}
		if err := s.usable(); err != nil {
			return 0, err
		}
		switch {
		case s.mark == mark:
			return 0, fmt.Errorf("%w: sequence %d appears twice", ErrBatch, s.id)
		case g.Tokens < 0:
			return 0, fmt.Errorf("%w: append of %d tokens", ErrRange, g.Tokens)
		case g.Tokens > c.cfg.MaxTokens-s.n:
			return 0, fmt.Errorf("%w: %d + %d tokens, MaxTokens %d", ErrTooLong, s.n, g.Tokens, c.cfg.MaxTokens)
		}
		s.mark = mark
		need += s.need(s.n + g.Tokens)
	}
	return need, nil
}

// appendBatch is AppendBatch with credit bytes already waited for (see wait).
func (c *Cache) appendBatch(batch []Growth, credit int64) error {
	need, err := c.check(batch)
	if err != nil {
		return err
	}
	crossed := false
	if need > 0 && c.ahead != nil {
		if need, crossed, err = c.ahead.step(batch, need); err != nil {
			return err
		}
	}
	if need == 0 && !crossed {
		// NB: a decode step's common case, kept one call short of commitStep: no
		// granule to commit, no run adopted, nothing to hold the worker off for.
		err = c.refused(c.grow(batch, false))
	} else {
		err = c.commitStep(batch, need, credit, crossed)
	}
	if err != nil {
		return err
	}
	if c.ahead != nil {
		// NB: after the step's hold ended, so that the runs it asks are not held
		// off by its own reservation (see ahead.go: hold).
		c.ahead.after(batch, crossed)
	}
	return nil
}

// commitStep commits what a batch step needs beyond the runs it adopted (crossed),
// need bytes of new granules, keeping the map-ahead worker from the budget it counts
// on meanwhile; a step refused or failed gives back what it adopted.
func (c *Cache) commitStep(batch []Growth, need, credit int64, crossed bool) error {
	if need > 0 && c.ahead != nil {
		defer c.ahead.hold(need, credit)()
	}
	if need > 0 {
		// Refuse what can not fit before committing any of it: a commit rolled back
		// would leave fresh granules idle in a pool, holding budget.
		if be := c.budgetOrEvict(need, credit); be != nil {
			err := c.refuse(be)
			if crossed {
				err = joinNonNil(err, c.ahead.unadopt(batch))
			}
			return err
		}
	}
	if err := c.grow(batch, need > 0); err != nil {
		if crossed {
			err = joinNonNil(err, c.ahead.unadopt(batch))
		}
		return c.refused(err)
	}
	return nil
}

// grow resizes the ranges of the batch's sequences that need new granules, all or
// nothing, and counts every sequence's new tokens; commits says whether any needs new
// granules (else no range is touched).
func (c *Cache) grow(batch []Growth, commits bool) error {
	var idle int64
	if commits {
		idle = c.idle()
	}
	for i, g := range batch {
		s := g.Seq
		if !commits || s.need(s.n+g.Tokens) == 0 {
			continue // the granules it holds cover the tokens: nothing to resize
		}
		for gi := range c.groups {
			if !s.adopted { // NB: else pre is what they held before adopting
				// the ranges of a group are alike (see refreshStats)
				*s.preOf(gi) = rangeEnd(s.bufs[c.groups[gi].first])
			}
		}
		j, err := s.resizeRanges(s.n + g.Tokens)
		if err != nil {
			return c.rollback(batch[:i], s, j, idle, commits, err)
		}
		s.grew = true
	}
	// NB: the windows give back what no step from the sequence's length on reads
	// (see the states of a window group's bytes) only once every growth is committed, so
	// that a refused step changes nothing; a give-back the backing fails damages its
	// sequence (see dropDead), the others' steps stand.
	var errs []error
	for _, g := range batch {
		g.Seq.grew, g.Seq.adopted = false, false
		if c.windows {
			if err := g.Seq.dropDead(g.Seq.n); err != nil {
				errs = append(errs, fmt.Errorf("sequence %d: %w", g.Seq.id, err))
			}
		}
		g.Seq.n += g.Tokens
		if commits || c.multi {
			g.Seq.refreshStats()
		} else {
			g.Seq.tokens.Store(int64(g.Seq.n)) // nothing else moved
		}
	}
	return errors.Join(errs...)
}

// resizeRanges resizes each of s's ranges to hold tokens tokens, in order, under the
// lock that a lookup mapping from them holds (lockRanges). It returns the error of
// the first that failed and how many were resized before it.
func (s *Sequence) resizeRanges(tokens int) (int, error) {
	s.lockRanges()
	defer s.unlockRanges()
	j := 0
	for gi := range s.c.groups {
		g := &s.c.groups[gi]
		size := g.extent(tokens)
		for _, b := range g.ranges(s.bufs) {
			if err := b.Resize(size); err != nil {
				return j, err
			}
			j++
		}
	}
	return j, nil
}

// rollback undoes a failed grow: the first k ranges of s and every range of the
// sequences of done that it resized (grew) go back to what they committed before the
// step (pre), which may be more than their tokens take (a sequence that took over an
// entry's ranges holds granules past its tokens), so that a sequence's ranges stay
// alike. A range that can not go back damages its sequence (it must be closed). The
// granules the undone part took went idle in the pool: what the pool did not hold
// before is given back, so the refusal holds no budget; if the pool can not give them
// back, the error says so too (they stay idle in the pool, where the next commit or a
// Trim finds them).
func (c *Cache) rollback(done []Growth, s *Sequence, k int, idle int64, commits bool, err error) error {
	errs := []error{err}
	// undo gives q's first k ranges back what they held before the step.
	undo := func(q *Sequence, k int) {
		var qerrs []error
		q.lockRanges()
		for gi := range c.groups {
			g := &c.groups[gi]
			for i, b := range g.ranges(q.bufs) {
				if g.first+i >= k {
					break
				}
				if err := b.Resize(*q.preOf(gi)); err != nil {
					qerrs = append(qerrs, err)
				}
			}
		}
		q.unlockRanges()
		if rerr := errors.Join(qerrs...); rerr != nil {
			q.err = rerr
			errs = append(errs, fmt.Errorf("%w: sequence %d: rolling back: %w", ErrDamaged, q.id, rerr))
		}
		q.refreshStats()
	}
	undo(s, k)
	for _, g := range done {
		if g.Seq.grew {
			g.Seq.grew = false
			undo(g.Seq, len(g.Seq.bufs))
		}
	}
	if commits && c.pool != nil {
		if _, terr := c.pool.Trim(int(idle / int64(c.gran))); terr != nil && !errors.Is(terr, backing.ErrUnsupported) {
			errs = append(errs, fmt.Errorf("kv: giving back the granules of the undone step: %w", terr))
		}
	}
	return errors.Join(errs...)
}

// wait is AppendBatchCtx after a refusal err: it waits in the governor's FIFO queue
// for the bytes the step needs beyond the runs map-ahead holds, which the queue
// serves from the pool's idle granules as from free budget, then steps with them (the
// governor hands them over as credit: see accounting.Authority.AcquireFor; the pool's
// commit takes the idle granules waited for first). On a pool whose budget is not
// only this governor's (backing.PoolWaiter: a node pool's client), a step the queue
// granted and the backing still refused waits in the backing for its granules, which
// it keeps idle for the next grant.
func (c *Cache) wait(ctx context.Context, batch []Growth, err error) error {
	c.mu.Lock()
	c.waits++
	c.mu.Unlock()
	for {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		var be *accounting.BudgetError
		if !errors.As(err, &be) {
			return err
		}
		// The idle granules the refused step counted as held are the queue's to hand
		// out: wait for them with the rest. NB: a refusal may race a concurrent user
		// of the pool that took the idle granules counted; wait for a granule at
		// least so that the loop makes progress only as memory moves.
		want := max(be.Requested+min(be.Held, c.idle()), int64(c.gran))
		var stepErr error
		err = c.auth.AcquireFor(ctx, want, func(idle int64) error {
			stepErr = c.appendBatch(batch, want-idle)
			return nil
		})
		switch {
		case err == nil:
			err = stepErr
		case ctx.Err() != nil:
			return ctx.Err()
		default:
			return err // the limit shrank below the request, say
		}
		if err == nil || !accounting.CanWait(err) {
			return err
		}
		if werr := c.waitBacking(ctx, err); werr != nil {
			return werr
		}
	}
}

// waitBacking, after the governor's queue granted a step that the backing refused
// with refusal, waits in the backing for the granules the step needs where the
// backing is a backing.PoolWaiter (a node pool's client: the node's owner refused
// it, and this governor's queue would grant it again at once), and returns the
// refusal where the backing can not wait (a client that keeps no pool): waiting in
// this governor again would only ask the backing again and again. Elsewhere the
// refusal raced another user of the pool, and the queue waits for the next grant: it
// returns nil.
func (c *Cache) waitBacking(ctx context.Context, refusal error) error {
	pw, ok := c.pool.(backing.PoolWaiter)
	if !ok {
		return nil
	}
	var be *accounting.BudgetError
	if !errors.As(refusal, &be) {
		return refusal
	}
	gran := int64(c.gran)
	n := int((be.Requested+gran-1)/gran + c.pool.PoolStats().Idle/gran)
	switch err := pw.PrefillCtx(ctx, n); {
	case err == nil:
		return nil
	case ctx.Err() != nil:
		return ctx.Err()
	case errors.Is(err, backing.ErrUnsupported):
		return refusal
	case accounting.CanWait(err):
		return nil // this governor refused the prefill: its queue waits next
	default:
		return err
	}
}

// Append grows every K and V tensor of the sequence by n tokens, committing whole
// granules only where a tensor crosses a granule boundary (in the Blocked layout, a
// block's granules when its first token arrives). When the memory can not be
// had now it fails at once with an *accounting.BudgetError (it matches
// accounting.ErrBudgetExceeded; see AppendBatch for what it carries) and changes
// nothing; past MaxTokens it fails with ErrTooLong. On a Model, each window group
// then gives back the whole units below the one that holds its FirstLive of the
// length it grew from (see the states of a window group's bytes). A server calls it
// for one sequence's growth (a prompt's prefill); a step of many is AppendBatch.
func (s *Sequence) Append(n int) error {
	g := [1]Growth{{s, n}}
	return s.c.appendBatch(g[:], 0)
}

// AppendCtx is Append that, when memory can not be had now, waits for it in the
// governor's FIFO queue of the device until ctx ends (see AppendBatchCtx). A
// cancelled wait changes nothing. A server uses it for one sequence's growth when it
// would rather wait than fail.
func (s *Sequence) AppendCtx(ctx context.Context, n int) error {
	return s.c.AppendBatchCtx(ctx, []Growth{{s, n}})
}
