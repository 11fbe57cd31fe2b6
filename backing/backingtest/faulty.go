package backingtest

import (
	"context"
	"fmt"
	"sync"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
)

// Op names an operation of a backing that Faulty can make fail.
type Op uint8

const (
	OpReserve Op = iota
	OpCommit
	OpDecommit
	OpUnreserve
	OpShare
	OpCommitCtx
	OpCopyIn
	OpCopyOut
	OpPopulate
	OpProtect
	numOps
)

var opNames = [numOps]string{"reserve", "commit", "decommit", "unreserve", "share", "commit ctx", "copy in", "copy out", "populate", "protect"}

func (o Op) String() string {
	if o < numOps {
		return opNames[o]
	}
	return fmt.Sprintf("Op(%d)", uint8(o))
}

// Faulty wraps a backing and makes chosen calls fail, for fault injection. A failing
// call does not reach the inner backing, so it changes nothing: Reserve, Commit,
// Decommit, Share, CommitCtx, CopyIn, CopyOut, Populate and Protect return an
// [*backing.OpError] wrapping the armed error; Unreserve returns a Failed outcome
// (accounting.FailedRelease, with Residual 0 since Faulty does not know what the
// reservation holds) whose Err wraps it.
//
// Faulty implements [backing.Backing][R] and every capability: [backing.Sharer],
// [backing.Copier], [backing.Populator], [backing.Protector], [backing.Waiter], [backing.Zeroer],
// [backing.HostAccessible] and [backing.Pool]. Each forwards to the inner backing when
// it has the capability.
//
// NB: discovery by type assertion on a Faulty therefore always succeeds; the answer
// is in the call. When the inner backing lacks a capability the method returns an
// error wrapping [backing.ErrUnsupported] (Prefill, Trim too), CommitZeroes reports
// false, HostAccessible reports the inner's answer (false when it has none) and
// PoolStats returns the zero value.
//
// Only the ten operations of [Op] are counted and can fail; Base, Size and the Pool
// methods are forwarded untouched. A Faulty is safe for concurrent use.
type Faulty[R any] struct {
	inner backing.Backing[R]

	mu     sync.Mutex
	calls  int
	counts [numOps]int
	faults []fault
}

// fault is one armed failure: the call whose counter reaches at fails with err.
type fault struct {
	any bool // counted over all ops; otherwise over op only
	op  Op
	at  int
	err error
}

var (
	_ backing.Backing[int]   = (*Faulty[int])(nil)
	_ backing.Copier[int]    = (*Faulty[int])(nil)
	_ backing.Sharer[int]    = (*Faulty[int])(nil)
	_ backing.Populator[int] = (*Faulty[int])(nil)
	_ backing.Protector[int] = (*Faulty[int])(nil)
	_ backing.Waiter[int]    = (*Faulty[int])(nil)
	_ backing.Zeroer         = (*Faulty[int])(nil)
	_ backing.HostAccessible = (*Faulty[int])(nil)
	_ backing.Pool           = (*Faulty[int])(nil)
)

// NewFaulty returns a Faulty over inner with no faults armed.
func NewFaulty[R any](inner backing.Backing[R]) *Faulty[R] {
	return &Faulty[R]{inner: inner}
}

// Inner returns the wrapped backing.
func (f *Faulty[R]) Inner() backing.Backing[R] { return f.inner }

// FailAt arms a fault: the n-th call (1-based, counted from now) of any operation
// fails with err. n must be positive.
func (f *Faulty[R]) FailAt(n int, err error) {
	if n < 1 {
		panic(fmt.Sprintf("backingtest: FailAt(%d): n must be positive", n))
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.faults = append(f.faults, fault{any: true, at: f.calls + n, err: err})
}

// FailOp arms a fault: the n-th call (1-based, counted from now) of op fails with
// err. n must be positive.
func (f *Faulty[R]) FailOp(op Op, n int, err error) {
	if n < 1 || op >= numOps {
		panic(fmt.Sprintf("backingtest: FailOp(%v, %d): bad op or n", op, n))
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.faults = append(f.faults, fault{op: op, at: f.counts[op] + n, err: err})
}

// Calls returns how many counted calls were made since NewFaulty or Reset, failed
// ones included.
func (f *Faulty[R]) Calls() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls
}

// Reset disarms every fault and zeroes the counters.
func (f *Faulty[R]) Reset() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = 0
	f.counts = [numOps]int{}
	f.faults = nil
}

// call counts one call of op and returns the armed error it must fail with, or nil.
// A fault fires once.
func (f *Faulty[R]) call(op Op) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	f.counts[op]++
	for i, ft := range f.faults {
		if (ft.any && ft.at == f.calls) || (!ft.any && ft.op == op && ft.at == f.counts[op]) {
			f.faults = append(f.faults[:i], f.faults[i+1:]...)
			return ft.err
		}
	}
	return nil
}

func injected(op Op, off, size int, err error) error {
	return &backing.OpError{Op: op.String(), Offset: off, Size: size, Err: err}
}

func unsupported(op string, off, size int, capability string) error {
	return &backing.OpError{Op: op, Offset: off, Size: size, Kind: backing.ErrUnsupported,
		Err: fmt.Errorf("backingtest: the wrapped backing is not a %s", capability)}
}

// Granularity forwards to the inner backing.
func (f *Faulty[R]) Granularity() int { return f.inner.Granularity() }

// Device forwards to the inner backing.
func (f *Faulty[R]) Device() accounting.DeviceKey { return f.inner.Device() }

// Accounting forwards to the inner backing.
func (f *Faulty[R]) Accounting() backing.PhysicalAccounting { return f.inner.Accounting() }

// Reserve forwards unless a fault is armed for this call.
func (f *Faulty[R]) Reserve(size int) (R, error) {
	if err := f.call(OpReserve); err != nil {
		var zero R
		return zero, injected(OpReserve, 0, size, err)
	}
	return f.inner.Reserve(size)
}

// Base forwards to the inner backing.
func (f *Faulty[R]) Base(r R) uintptr { return f.inner.Base(r) }

// Size forwards to the inner backing.
func (f *Faulty[R]) Size(r R) int { return f.inner.Size(r) }

// Commit forwards unless a fault is armed for this call.
func (f *Faulty[R]) Commit(r R, off, size int) error {
	if err := f.call(OpCommit); err != nil {
		return injected(OpCommit, off, size, err)
	}
	return f.inner.Commit(r, off, size)
}

// Decommit forwards unless a fault is armed for this call.
func (f *Faulty[R]) Decommit(r R, off, size int) error {
	if err := f.call(OpDecommit); err != nil {
		return injected(OpDecommit, off, size, err)
	}
	return f.inner.Decommit(r, off, size)
}

// Unreserve forwards unless a fault is armed for this call, when it is Failed and
// nothing changed.
func (f *Faulty[R]) Unreserve(r R) accounting.ReleaseOutcome {
	if err := f.call(OpUnreserve); err != nil {
		return accounting.FailedRelease(0, injected(OpUnreserve, 0, 0, err))
	}
	return f.inner.Unreserve(r)
}

// Share forwards unless a fault is armed for this call or the inner backing is not a
// Sharer.
func (f *Faulty[R]) Share(dst R, dstOff int, src R, srcOff, size int, prot backing.Protection) error {
	if err := f.call(OpShare); err != nil {
		return injected(OpShare, dstOff, size, err)
	}
	s, ok := f.inner.(backing.Sharer[R])
	if !ok {
		return unsupported(OpShare.String(), dstOff, size, "Sharer")
	}
	return s.Share(dst, dstOff, src, srcOff, size, prot)
}

// CommitCtx forwards unless a fault is armed for this call or the inner backing is
// not a Waiter.
func (f *Faulty[R]) CommitCtx(ctx context.Context, r R, off, size int) error {
	if err := f.call(OpCommitCtx); err != nil {
		return injected(OpCommitCtx, off, size, err)
	}
	w, ok := f.inner.(backing.Waiter[R])
	if !ok {
		return unsupported(OpCommitCtx.String(), off, size, "Waiter")
	}
	return w.CommitCtx(ctx, r, off, size)
}

// CopyIn forwards unless a fault is armed for this call or the inner backing is not a
// Copier.
func (f *Faulty[R]) CopyIn(r R, off int, src []byte) error {
	if err := f.call(OpCopyIn); err != nil {
		return injected(OpCopyIn, off, len(src), err)
	}
	c, ok := f.inner.(backing.Copier[R])
	if !ok {
		return unsupported(OpCopyIn.String(), off, len(src), "Copier")
	}
	return c.CopyIn(r, off, src)
}

// CopyOut forwards unless a fault is armed for this call or the inner backing is not
// a Copier.
func (f *Faulty[R]) CopyOut(dst []byte, r R, off int) error {
	if err := f.call(OpCopyOut); err != nil {
		return injected(OpCopyOut, off, len(dst), err)
	}
	c, ok := f.inner.(backing.Copier[R])
	if !ok {
		return unsupported(OpCopyOut.String(), off, len(dst), "Copier")
	}
	return c.CopyOut(dst, r, off)
}

// Populate forwards unless a fault is armed for this call or the inner backing is not
// a Populator.
func (f *Faulty[R]) Populate(r R, off, size int) error {
	if err := f.call(OpPopulate); err != nil {
		return injected(OpPopulate, off, size, err)
	}
	p, ok := f.inner.(backing.Populator[R])
	if !ok {
		return unsupported(OpPopulate.String(), off, size, "Populator")
	}
	return p.Populate(r, off, size)
}

// Protect forwards unless a fault is armed for this call or the inner backing is not
// a Protector.
func (f *Faulty[R]) Protect(r R, off, size int, prot backing.Protection) error {
	if err := f.call(OpProtect); err != nil {
		return injected(OpProtect, off, size, err)
	}
	p, ok := f.inner.(backing.Protector[R])
	if !ok {
		return unsupported(OpProtect.String(), off, size, "Protector")
	}
	return p.Protect(r, off, size, prot)
}

// CommitZeroes reports the inner backing's answer, or false when it is not a Zeroer.
func (f *Faulty[R]) CommitZeroes() bool {
	z, ok := f.inner.(backing.Zeroer)
	return ok && z.CommitZeroes()
}

// HostAccessible reports the inner backing's answer, or false when it has none.
func (f *Faulty[R]) HostAccessible() bool { return backing.IsHostAccessible(f.inner) }

// Prefill forwards, or returns an error wrapping ErrUnsupported when the inner backing
// is not a Pool.
func (f *Faulty[R]) Prefill(n int) error {
	p, ok := f.inner.(backing.Pool)
	if !ok {
		return unsupported("prefill", 0, 0, "Pool")
	}
	return p.Prefill(n)
}

// Trim forwards, or returns an error wrapping ErrUnsupported when the inner backing is
// not a Pool.
func (f *Faulty[R]) Trim(keep int) (int64, error) {
	p, ok := f.inner.(backing.Pool)
	if !ok {
		return 0, unsupported("trim", 0, 0, "Pool")
	}
	return p.Trim(keep)
}

// PoolStats forwards, or returns the zero value when the inner backing is not a Pool.
func (f *Faulty[R]) PoolStats() backing.PoolStats {
	if p, ok := f.inner.(backing.Pool); ok {
		return p.PoolStats()
	}
	return backing.PoolStats{}
}
