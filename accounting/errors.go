package accounting

import (
	"errors"
	"fmt"
)

var (
	// ErrBudgetExceeded is matched by a *BudgetError: the device's budget cannot
	// cover the request now.
	ErrBudgetExceeded = errors.New("accounting: budget exceeded")
	// ErrExceedsLimit is matched by a *BudgetError whose request is larger than the
	// device's whole limit: waiting will never help.
	ErrExceedsLimit = errors.New("accounting: request exceeds the device limit")
	// ErrInvalidRequest is matched by an *InvalidRequestError.
	ErrInvalidRequest = errors.New("accounting: invalid request")
	// ErrAllocationFailed is matched by an *AllocationError.
	ErrAllocationFailed = errors.New("accounting: allocation failed")
	// ErrAuthorityBusy: Authority.Close was called on a ledger that still owns or
	// maps bytes, or waits for some.
	ErrAuthorityBusy = errors.New("accounting: authority still holds or waits for bytes")
	// ErrAuthorityClosed: Authority.Close was called on a ledger closed already.
	ErrAuthorityClosed = errors.New("accounting: authority closed")
)

// BudgetError reports a request the device's budget cannot cover.
type BudgetError struct {
	Device    DeviceKey
	Requested int64 // bytes asked for
	Available int64 // bytes free under the limit when the request was refused
	Limit     int64 // the device's limit then
	// Held is the part of the request its taker owns already and would use for it
	// (a pool's idle granules): it takes no budget, so it is not in Requested, but it
	// counts under the limit, so the request can never fit when Requested + Held
	// exceeds Limit.
	Held int64
}

func (e *BudgetError) Error() string {
	switch {
	case e.Held > 0 && e.exceeds():
		return fmt.Sprintf("accounting: %v: request of %d bytes (and %d held) exceeds the limit of %d bytes", e.Device, e.Requested, e.Held, e.Limit)
	case e.exceeds():
		return fmt.Sprintf("accounting: %v: request of %d bytes exceeds the limit of %d bytes", e.Device, e.Requested, e.Limit)
	}
	return fmt.Sprintf("accounting: %v: budget exceeded: requested %d bytes, %d of %d available", e.Device, e.Requested, e.Available, e.Limit)
}

// exceeds reports whether the request can never fit under the limit.
func (e *BudgetError) exceeds() bool {
	return e.Requested > e.Limit || e.Held > e.Limit-e.Requested
}

// Is reports whether target is ErrBudgetExceeded, or ErrExceedsLimit when the request
// can never fit (Requested + Held exceeds Limit).
func (e *BudgetError) Is(target error) bool {
	return target == ErrBudgetExceeded || (target == ErrExceedsLimit && e.exceeds())
}

// CanWait reports whether waiting for memory can cure err: it is a budget refusal
// (ErrBudgetExceeded) of a request that fits under the device's limit, so that bytes
// released by others can let it through. It is false for nil, for a request larger
// than the whole limit (ErrExceedsLimit), and for every other error.
func CanWait(err error) bool {
	return err != nil && errors.Is(err, ErrBudgetExceeded) && !errors.Is(err, ErrExceedsLimit)
}

// InvalidRequestError reports a request that is wrong in itself (a negative size, say).
type InvalidRequestError struct {
	Reason string
}

func (e *InvalidRequestError) Error() string { return "accounting: invalid request: " + e.Reason }

// Is reports whether target is ErrInvalidRequest.
func (e *InvalidRequestError) Is(target error) bool { return target == ErrInvalidRequest }

// AllocationError reports that the memory itself could not be had although the
// budget allowed it: the OS or driver said no. It unwraps to the cause.
type AllocationError struct {
	Device DeviceKey
	Bytes  int64
	Cause  error
}

func (e *AllocationError) Error() string {
	return fmt.Sprintf("accounting: %v: allocation of %d bytes failed: %v", e.Device, e.Bytes, e.Cause)
}

// Is reports whether target is ErrAllocationFailed.
func (e *AllocationError) Is(target error) bool { return target == ErrAllocationFailed }

// Unwrap returns the cause.
func (e *AllocationError) Unwrap() error { return e.Cause }
