package arena

import (
	"errors"
	"fmt"
	"sync"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
)

// Eager is the plain eager allocator of the [Allocator] contract over one backing:
// each Allocate reserves an address range of its own and commits all of it at once,
// as cudaMalloc does; Release gives all of it back, as cudaFree does. On
// host.Private its memory lies outside the Go heap, so the garbage collector never
// scans or moves it. It has none of the optional capabilities: an allocation never
// grows and is never shared (IsVirtual and CanShare report false).
//
// Eager is what a caller uses for memory whose size is known up front and that lives
// as long as it does (weights, a fixed scratch area); it is also the floor the
// benchmarks measure a growing [Buffer] against. Its zero value is not usable; call
// NewEager. It is safe for concurrent use.
//
// # Memory management
//
// Every Allocation MUST be given back with Release. Under ByBuffer accounting each
// allocation charges its committed granules to the authority passed to NewEager;
// under ByBacking the backing charges them.
type Eager[R any, B backing.Backing[R]] struct {
	b    B
	auth *accounting.Authority

	mu   sync.Mutex
	live map[uint64]*Buffer[R, B]
	next uint64
}

// NewEager returns an eager allocator over b. auth follows NewBuffer's rule: required
// under ByBuffer accounting (on b's device), nil under ByBacking.
func NewEager[R any, B backing.Backing[R]](b B, auth *accounting.Authority) (*Eager[R, B], error) {
	if err := checkAuthority(b, auth); err != nil {
		return nil, err
	}
	return &Eager[R, B]{b: b, auth: auth, live: make(map[uint64]*Buffer[R, B])}, nil
}

// Allocate reserves and commits size bytes, rounded up to the backing's granule, at an
// address that is a multiple of align. size must not be negative (ErrInvalidSize);
// align a power of two no larger than the granule (ErrInvalidAlignment), since a
// reservation starts on a granule. A zero-byte allocation is not a failure: it has an
// address of its own (one granule reserved, nothing committed), so that a caller never
// mistakes it for no allocation, and it MUST be released as any other. On error
// nothing is held and nothing stays charged.
func (e *Eager[R, B]) Allocate(size, align int) (Allocation, error) {
	if size < 0 {
		return Allocation{}, fmt.Errorf("%w: %d bytes", ErrInvalidSize, size)
	}
	if g := e.b.Granularity(); !backing.IsPowerOfTwo(align) || align > g {
		return Allocation{}, fmt.Errorf("%w: %d (granule %d)", ErrInvalidAlignment, align, g)
	}
	buf, err := NewBuffer(e.b, max(size, 1), e.auth)
	if err != nil {
		return Allocation{}, err
	}
	if err := buf.Resize(size); err != nil {
		if out := buf.Close(); !out.OK() {
			err = errors.Join(err, fmt.Errorf("arena: eager: %d bytes could not be given back: %w", out.Residual, out.Err))
		}
		return Allocation{}, err
	}
	if buf.Base()%uintptr(align) != 0 {
		// NB: a backing whose reservations do not start on a granule breaks its
		// contract; say so rather than hand out a misaligned block.
		_ = buf.Close()
		return Allocation{}, fmt.Errorf("%w: the backing reserved at %#x", ErrInvalidAlignment, buf.Base())
	}
	e.mu.Lock()
	e.next++
	id := e.next
	e.live[id] = buf
	e.mu.Unlock()
	return Allocation{Ptr: buf.Base(), Size: size, owner: e, id: id}, nil
}

// Release decommits a and gives back its address range. The outcome is the backing's,
// honest as Buffer.Close's: Complete with the bytes unmapped; Failed when nothing
// changed (a stays allocated and Release may be called again); Quarantined when the
// backing failed midway (a is gone; the residual stays charged). It panics with
// PanicForeignAllocation for an allocation another allocator made and with
// PanicReleased for one already given back.
func (e *Eager[R, B]) Release(a Allocation) accounting.ReleaseOutcome {
	if a.owner != any(e) {
		panic(PanicForeignAllocation)
	}
	e.mu.Lock()
	buf, ok := e.live[a.id]
	delete(e.live, a.id)
	e.mu.Unlock()
	if !ok {
		panic(PanicReleased)
	}
	out := buf.Close()
	if out.Status == accounting.Failed {
		e.mu.Lock()
		e.live[a.id] = buf
		e.mu.Unlock()
	}
	return out
}

// Bytes returns a's memory as a slice, valid until a is released. It panics with
// PanicDeviceBytes when the CPU must not touch the backing's memory, with
// PanicForeignAllocation for another allocator's allocation and with PanicReleased
// for one already given back.
func (e *Eager[R, B]) Bytes(a Allocation) []byte {
	if a.owner != any(e) {
		panic(PanicForeignAllocation)
	}
	e.mu.Lock()
	buf, ok := e.live[a.id]
	e.mu.Unlock()
	if !ok {
		panic(PanicReleased)
	}
	return buf.Bytes()[:a.Size]
}

// Device returns the memory the allocations live in: the backing's device.
func (e *Eager[R, B]) Device() accounting.DeviceKey { return e.b.Device() }

// CommitsOnDemand reports false: Eager commits every byte of an allocation when it is
// made, though its backing could commit granule by granule (see [OnDemand]).
func (e *Eager[R, B]) CommitsOnDemand() bool { return false }

// Live returns how many allocations have not been released.
func (e *Eager[R, B]) Live() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.live)
}
