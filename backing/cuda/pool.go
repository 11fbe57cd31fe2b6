package cuda

import (
	"context"
	"errors"
	"fmt"
	"runtime"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
)

// getHandles returns n handles mapped nowhere: idle ones from the pool first, then new
// ones, charged to the authority before they are created. Unless wait is set a
// budget refusal fails at once. Otherwise the caller waits in the governor's FIFO
// queue of the device, which serves it from the pool's idle handles as from free
// budget, until the budget and idle handles cover all n or ctx ends. On error it holds
// nothing new: taken handles are back in the pool. The thread must be bound.
func (b *Backing) getHandles(ctx context.Context, wait bool, n int) ([]*handle, error) {
	hs, charged, err := b.tryHandles(nil, n)
	if wait && accounting.CanWait(err) {
		b.putIdle(hs)
		hs, charged, err = b.waitHandles(ctx, n)
	}
	if err != nil {
		b.putIdle(hs)
		return nil, err
	}
	if charged > 0 {
		created, err := b.create(charged)
		hs = append(hs, created...)
		if err != nil {
			b.putIdle(hs)
			return nil, err
		}
	}
	return hs, nil
}

// tryHandles adds idle handles to hs up to n and charges the authority for the rest
// without waiting. It returns the handles and how many more to create.
func (b *Backing) tryHandles(hs []*handle, n int) ([]*handle, int, error) {
	b.mu.Lock()
	hs = b.takeIdle(hs, b.claim(min(n-len(hs), len(b.idle))))
	b.mu.Unlock()
	need := n - len(hs)
	if need == 0 {
		return hs, 0, nil
	}
	if err := b.auth.TryAcquire(int64(need) * int64(b.gran)); err != nil {
		return hs, 0, err
	}
	return hs, need, nil
}

// waitHandles is tryHandles that waits, holding nothing meanwhile: it waits for all n
// handles' bytes at once (Authority.AcquireIdle), so that waiting commits can not
// each hold part of what another needs. The governor serves it from the pool's idle
// handles first (they are this commit's then) and free budget for the rest, which it
// returns the count of to create.
func (b *Backing) waitHandles(ctx context.Context, n int) ([]*handle, int, error) {
	g := int64(b.gran)
	idle, err := b.auth.AcquireIdle(ctx, int64(n)*g)
	if err != nil {
		return nil, 0, err
	}
	b.mu.Lock()
	hs := b.takeIdle(nil, int(idle/g))
	b.mu.Unlock()
	return hs, n - len(hs), nil
}

// claim asks the governor for k of the pool's idle handles and returns how many the
// caller may take out of the pool (takeIdle): the idle handles that the governor
// served a waiting commit from are that commit's (see waitHandles). Every handle that
// goes idle is put idle on the authority (addIdle), and every one taken out but for a
// waiting commit's is claimed first, so that the pool holds at least the authority's
// idle bytes. b.mu must be held.
func (b *Backing) claim(k int) int {
	if k <= 0 {
		return 0
	}
	g := int64(b.gran)
	return int(b.auth.TakeIdle(int64(k)*g) / g)
}

// takeIdle appends k idle handles to hs (k <= len(b.idle)), the most recently used
// first. b.mu must be held.
func (b *Backing) takeIdle(hs []*handle, k int) []*handle {
	if k <= 0 {
		return hs
	}
	top := len(b.idle) - k
	for i := len(b.idle) - 1; i >= top; i-- {
		hs = append(hs, b.idle[i])
		b.idle[i] = nil
	}
	b.idle = b.idle[:top]
	return hs
}

// create makes n new handles whose bytes are already charged to the authority. On
// error it returns the handles it made and gives back the charge of the rest. The
// thread must be bound.
func (b *Backing) create(n int) ([]*handle, error) {
	hs := make([]*handle, 0, n)
	var err error
	for i := range n {
		var h uint64
		if cerr := b.drv.call("cuMemCreate", b.drv.MemCreate(&h, uintptr(b.gran), &b.prop, 0)); cerr != nil {
			b.auth.Release(int64(n-i) * int64(b.gran))
			err = &accounting.AllocationError{Device: b.Device(), Bytes: int64(b.gran), Cause: cerr}
			break
		}
		hs = append(hs, &handle{h: h})
	}
	b.mu.Lock()
	b.owned += len(hs)
	b.created += int64(len(hs))
	b.mu.Unlock()
	return hs, err
}

// putIdle returns handles mapped nowhere to the pool, puts their bytes idle on the
// authority, where they serve the next waiting commit, and releases the oldest idle
// handles beyond the High mark. The thread must be bound when a High mark is set.
func (b *Backing) putIdle(hs []*handle) { b.addIdle(hs, true) }

// addIdle is putIdle; trim false keeps every handle (Prefill asked for them).
func (b *Backing) addIdle(hs []*handle, trim bool) {
	if len(hs) == 0 {
		return
	}
	b.mu.Lock()
	b.idle = append(b.idle, hs...)
	b.auth.PutIdle(int64(len(hs)) * int64(b.gran))
	var extra []*handle
	if trim && b.high > 0 && len(b.idle) > b.high {
		k := b.claim(len(b.idle) - b.high)
		extra = append(extra, b.idle[:k]...)
		b.idle = append(b.idle[:0], b.idle[k:]...)
	}
	b.mu.Unlock()
	if len(extra) > 0 {
		// A handle the driver refuses to release stays owned (stuck) and is
		// retried by Trim and Close; the caller's own operation succeeded.
		_, _ = b.release(extra)
	}
}

// release gives handles mapped nowhere back to the driver and their bytes to the
// authority. Handles the driver refuses stay owned, in b.stuck. The thread must be
// bound.
func (b *Backing) release(hs []*handle) (int64, error) {
	var errs []error
	var freed int64
	var stuck []*handle
	for _, h := range hs {
		if err := b.drv.call("cuMemRelease", b.drv.MemRelease(h.h)); err != nil {
			errs = append(errs, err)
			stuck = append(stuck, h)
			continue
		}
		freed += int64(b.gran)
	}
	b.mu.Lock()
	b.owned -= int(freed / int64(b.gran))
	b.stuck = append(b.stuck, stuck...)
	b.mu.Unlock()
	if freed > 0 {
		b.auth.Release(freed)
	}
	return freed, errors.Join(errs...)
}

// releaseIdle releases idle handles until keep remain, and retries the stuck ones. The
// thread must be bound.
func (b *Backing) releaseIdle(keep int) (int64, error) {
	b.mu.Lock()
	var hs []*handle
	if k := b.claim(len(b.idle) - keep); k > 0 {
		hs = append(hs, b.idle[:k]...)
		b.idle = append(b.idle[:0], b.idle[k:]...)
	}
	hs = append(hs, b.stuck...)
	b.stuck = nil
	in := b.stuckIn
	b.stuckIn = nil
	b.mu.Unlock()
	b.releaseImported(in)
	return b.release(hs)
}

// fill creates handles until at least target are idle (or being created). It stops
// with the authority's error when the budget runs out; bg (the background refill)
// also stops when Close or Trim asks it to. The thread must be bound.
func (b *Backing) fill(target int, bg bool) error {
	for {
		select {
		case <-b.stop: // nil without Background: never ready
			return nil
		default:
		}
		b.mu.Lock()
		if len(b.idle)+b.creating >= target || (bg && b.held) {
			b.mu.Unlock()
			return nil
		}
		b.creating++
		b.mu.Unlock()
		err := b.auth.TryAcquire(int64(b.gran))
		var hs []*handle
		if err == nil {
			hs, err = b.create(1)
		}
		b.addIdle(hs, false)
		b.mu.Lock()
		b.creating--
		b.settled.Broadcast()
		b.mu.Unlock()
		if err != nil {
			return err
		}
	}
}

// refiller is the background goroutine: it refills the pool to Low when nudged.
func (b *Backing) refiller() {
	defer close(b.done)
	for {
		select {
		case <-b.stop:
			return
		case <-b.refill:
		}
		func() {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			if b.setCurrent() == nil {
				// Errors are not reported from here: a budget refusal means the
				// pool stays below Low for now, and a driver failure shows again in
				// the commit that needs the handle.
				_ = b.fill(b.low, true)
			}
		}()
	}
}

// nudge wakes the background refill without blocking.
func (b *Backing) nudge() {
	select {
	case b.refill <- struct{}{}:
	default:
	}
}

// nudgeIfLow wakes the background refill when the pool is below Low.
func (b *Backing) nudgeIfLow() {
	if b.refill == nil {
		return
	}
	b.mu.Lock()
	b.held = false // a commit drew on the pool: refill it again
	low := len(b.idle)+b.creating < b.low
	b.mu.Unlock()
	if low {
		b.nudge()
	}
}

// Prefill creates handles until at least n are idle in the pool, charging each to the
// authority first, so that later commits only map. It fails with the authority's
// budget error when the budget can not cover them (the handles made so far stay).
func (b *Backing) Prefill(n int) error {
	b.live()
	if n < 0 {
		return &backing.OpError{Op: "prefill", Size: n, Kind: backing.ErrInvalidRange, Err: fmt.Errorf("negative count")}
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := b.setCurrent(); err != nil {
		return opError("prefill", 0, n*b.gran, err)
	}
	if err := b.fill(n, false); err != nil {
		return opError("prefill", 0, n*b.gran, err)
	}
	return nil
}

// Trim releases idle handles (cuMemRelease) until at most keep remain, and returns the
// bytes given back to the authority. Mapped handles are never touched. The background
// refill pauses until the next commit, so that it does not undo the trim.
func (b *Backing) Trim(keep int) (int64, error) {
	b.live()
	if keep < 0 {
		return 0, &backing.OpError{Op: "trim", Size: keep, Kind: backing.ErrInvalidRange, Err: fmt.Errorf("negative count")}
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := b.setCurrent(); err != nil {
		return 0, opError("trim", 0, 0, err)
	}
	// The background refill must not undo the trim: hold it until the next commit,
	// and let a handle it is creating now land first, so the trim covers it.
	b.mu.Lock()
	b.held = true
	for b.creating > 0 {
		b.settled.Wait()
	}
	b.mu.Unlock()
	n, err := b.releaseIdle(keep)
	if b.log != nil && (n > 0 || err != nil) {
		b.log.Info("cuda: pool trim", "device", b.ordinal, "gave_back_bytes", n, "keep", keep, "err", err)
	}
	if err != nil {
		return n, opError("trim", 0, 0, err)
	}
	return n, nil
}

// Quiesce waits until no background work is changing the pool (a handle the
// background refill is creating, a reclaim the governor started) and holds the
// background refill until the next commit, as Trim does. When no other call on b, and
// no Acquire on its device, is in flight, PoolStats, the authority's Stats and the
// driver then agree, and go on agreeing until the next call. The pool may be below
// Low afterwards; the next commit resumes the refill.
//
// NB: the pool charges the authority before it creates a handle and releases the
// charge after the handle is gone, so while the refill works the ledger is ahead of
// PoolStats by the handle in flight; Quiesce is how a reader waits that out.
func (b *Backing) Quiesce() {
	b.live()
	b.mu.Lock()
	defer b.mu.Unlock()
	b.held = true
	for b.creating > 0 || b.reclaiming > 0 {
		b.settled.Wait()
	}
}

// reclaim releases every idle handle when a request on the device waits for memory
// (the governor calls it): idle handles hold budget that the waiter, perhaps another
// pool's user, can not otherwise have.
func (b *Backing) reclaim(need int64) {
	b.mu.Lock()
	if b.closed.Load() {
		b.mu.Unlock()
		return
	}
	b.reclaims.Add(1) // under mu: Close, having set closed, waits for it
	b.reclaiming++    // under mu: Quiesce waits for it
	b.mu.Unlock()
	defer func() {
		b.mu.Lock()
		b.reclaiming--
		b.settled.Broadcast()
		b.mu.Unlock()
		b.reclaims.Done()
	}()
	// The governor starts a reclaim on a goroutine of its own, which may run long
	// after the request that started it was served or gave up. With nobody waiting
	// there is nothing to reclaim for: keep the warm handles (and a quiesced pool
	// still, see Quiesce).
	if b.auth.Governor().Stats(b.auth.Device()).Waiters == 0 {
		return
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := b.setCurrent(); err != nil {
		return
	}
	n, err := b.releaseIdle(0)
	if b.log != nil && (n > 0 || err != nil) {
		b.log.Info("cuda: pool reclaim", "device", b.ordinal, "gave_back_bytes", n, "waiter_bytes", need, "err", err)
	}
}

// PoolStats returns a snapshot of the pool. Handles are physical device memory, so
// idle bytes are always resident.
func (b *Backing) PoolStats() backing.PoolStats {
	b.mu.Lock()
	defer b.mu.Unlock()
	g := int64(b.gran)
	idle := int64(len(b.idle)) * g
	return backing.PoolStats{
		Granule:  b.gran,
		Owned:    int64(b.owned) * g,
		Idle:     idle,
		Mapped:   b.mapped,
		Resident: idle,
		Low:      b.low,
		High:     b.high,

		Created:   b.created,
		GivenBack: b.created - int64(b.owned),
	}
}

// Close stops the background refill, releases every pooled handle and the primary
// context. It fails with ErrBusy, changing nothing, while reservations are live:
// Unreserve them first. Handles still mapped by quarantined reservations can not be
// released; they stay charged to the authority and Close reports them. Any use of b
// after Close panics with PanicClosed, but a second Close, which changes nothing and
// returns ErrClosed (docs/server.md, "A second Close").
func (b *Backing) Close() error {
	b.mu.Lock()
	if b.closed.Load() {
		b.mu.Unlock()
		return ErrClosed
	}
	if b.nres > 0 {
		n := b.nres
		b.mu.Unlock()
		return fmt.Errorf("%w: %d", ErrBusy, n)
	}
	// NB: closed is set under mu, where reclaim reads it: a reclaimer that saw it
	// false has counted itself in b.reclaims already, and a later one sees it true and
	// does nothing, so the Wait below misses none.
	b.closed.Store(true)
	b.mu.Unlock()
	b.auth.SetReclaimer(nil)
	b.reclaims.Wait()
	if b.stop != nil {
		close(b.stop)
		<-b.done
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var errs []error
	if err := b.setCurrent(); err != nil {
		return err
	}
	if _, err := b.releaseIdle(0); err != nil {
		errs = append(errs, err)
	}
	b.mu.Lock()
	if left := b.owned; left > 0 {
		errs = append(errs, fmt.Errorf("cuda: %d handles still mapped by quarantined reservations stay owned", left))
	}
	if left := b.imports; left > 0 {
		errs = append(errs, fmt.Errorf("cuda: %d imported handles still mapped by quarantined reservations or refused by cuMemRelease", left))
	}
	b.mu.Unlock()
	if err := b.drv.call("cuDevicePrimaryCtxRelease_v2", b.drv.DevicePrimaryCtxRelease(b.dev)); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}
