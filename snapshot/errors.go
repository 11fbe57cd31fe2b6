package snapshot

import "errors"

// Errors of a Factory.
var (
	// ErrOptions: NewFactory was given options it can not honour (a nil governor, a
	// negative size or wait, an unknown backing, pool options the factory sets itself,
	// a granule or name the backing refuses).
	ErrOptions = errors.New("snapshot: invalid factory options")
	// ErrFactoryClosed: New or Close was called on a closed Factory.
	ErrFactoryClosed = errors.New("snapshot: factory is closed")
	// ErrFactoryBusy: Close was called on a Factory whose stores are not all closed.
	ErrFactoryBusy = errors.New("snapshot: factory still has open stores")
)

// Errors of a Store. A refusal of the budget is the governor's own
// *accounting.BudgetError (errors.Is(err, accounting.ErrBudgetExceeded)).
var (
	// ErrInvalidSize: a negative size for Prepare.
	ErrInvalidSize = errors.New("snapshot: invalid size")
	// ErrTooLarge: a Prepare larger than the factory's MaxSize, the address space
	// each store reserves.
	ErrTooLarge = errors.New("snapshot: size exceeds the store's maximum")
	// ErrCommitRange: Commit of a length outside the slice the last Prepare returned.
	ErrCommitRange = errors.New("snapshot: commit length outside the prepared slice")
	// ErrClosed: a Store used after Close (Close again included).
	ErrClosed = errors.New("snapshot: store is closed")
	// ErrRelease: the backing could not give the memory back whole; the error also
	// wraps the backing's cause.
	ErrRelease = errors.New("snapshot: release failed")
)

// Misuse panics with these messages.
const (
	// PanicNilContext is the panic value for a nil context.
	PanicNilContext = "snapshot: nil context"
	// PanicNotStore is the panic value of FactoryFunc instantiated with a type that
	// *Store does not implement.
	PanicNotStore = "snapshot: FactoryFunc's type parameter is not implemented by *Store"
)
