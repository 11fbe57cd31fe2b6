package kv

import (
	"fmt"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing"
)

// buffer is one address range of a sequence or a prefix: an arena.Buffer with its
// backing's reservation and type erased, so that Cache, Sequence and Prefix name no
// backing type. Only New, which sees the backing's type, makes them (through a store).
type buffer interface {
	arena.Memory // Base, Len, HostAccessible

	Start() int
	Committed() int
	Shared() int
	Resize(n int) error
	// DecommitBelow and StartAt are arena.Buffer's: a window group gives back the
	// granules below its first live token, and a fork of one starts there.
	DecommitBelow(off int) error
	StartAt(off int) error
	// LeaveBehind and DecommitBehind are arena.Buffer's: with map-ahead a window
	// group leaves those granules behind and the worker gives them back (see
	// ahead_behind.go); DecommitBehind may run on the worker, concurrently with the
	// owner's calls.
	LeaveBehind(off int) (bool, error)
	DecommitBehind() (int, error)
	Bytes() []byte
	Close() accounting.ReleaseOutcome

	// shareRange maps the granules behind src's bytes [off, off+size) into this
	// buffer at off with access prot (see arena.Buffer.ShareRange). src must come
	// from the same store.
	shareRange(src buffer, off, size int, prot backing.Protection) error

	// The run committed ahead (see arena.Buffer.CommitAhead and ahead.go):
	// CommitAhead, DecommitAhead and Ahead may run on the map-ahead worker,
	// concurrently with the owner's calls.
	CommitAhead(off, size int) error
	AdoptAhead(n int) error
	DecommitAhead() (int, error)
	Ahead() (off, size int)

	// readAt copies len(p) bytes at off into p: directly on the host, through the
	// backing's Copier elsewhere.
	readAt(off int, p []byte) error
	// writeAt copies p into the buffer at off.
	writeAt(off int, p []byte) error
	// protect sets the access of the committed, granule-aligned [off, off+size) in
	// place (see arena.Buffer.Protect).
	protect(off, size int, prot backing.Protection) error
}

// store makes a cache's buffers on its backing.
type store interface {
	newBuffer(capacity int, auth *accounting.Authority) (buffer, error)
}

// storeOf is the store of a backing of type B.
type storeOf[R any, B backing.Backing[R]] struct{ b B }

func (st storeOf[R, B]) newBuffer(capacity int, auth *accounting.Authority) (buffer, error) {
	buf, err := arena.NewBuffer(st.b, capacity, auth)
	if err != nil {
		return nil, err
	}
	return bufferOf[R, B]{buf}, nil
}

// bufferOf is the buffer of a backing of type B. NB: it is one pointer wide, so
// storing it in an interface allocates nothing.
type bufferOf[R any, B backing.Backing[R]] struct{ *arena.Buffer[R, B] }

// Resize makes the range hold n bytes, committing or decommitting whole granules. NB:
// the buffer's length is always what it commits (n rounded up to the granule): kv
// counts its tokens itself, so growth inside a granule needs no call here at all.
func (b bufferOf[R, B]) Resize(n int) error {
	size, ok := backing.AlignUp(n, b.Granularity())
	if !ok {
		return fmt.Errorf("%w: %d bytes", ErrTooLong, n)
	}
	return b.Buffer.Resize(size)
}

func (b bufferOf[R, B]) shareRange(src buffer, off, size int, prot backing.Protection) error {
	s, ok := src.(bufferOf[R, B])
	if !ok {
		return fmt.Errorf("%w: a %T shares from a %T", ErrConfig, b, src)
	}
	return b.ShareRange(s.Buffer, off, off, size, prot)
}

func (b bufferOf[R, B]) protect(off, size int, prot backing.Protection) error {
	return b.Protect(off, size, prot)
}

func (b bufferOf[R, B]) readAt(off int, p []byte) error {
	if b.HostAccessible() {
		copy(p, b.Bytes()[off:])
		return nil
	}
	cp, ok := any(b.Backing()).(backing.Copier[R])
	if !ok {
		return fmt.Errorf("%w: the backing can neither be read by the CPU nor copy", backing.ErrUnsupported)
	}
	return cp.CopyOut(p, b.Reservation(), off)
}

func (b bufferOf[R, B]) writeAt(off int, p []byte) error {
	if b.HostAccessible() {
		copy(b.Bytes()[off:], p)
		return nil
	}
	cp, ok := any(b.Backing()).(backing.Copier[R])
	if !ok {
		return fmt.Errorf("%w: the backing can neither be written by the CPU nor copy", backing.ErrUnsupported)
	}
	return cp.CopyIn(b.Reservation(), off, p)
}

// copyRange copies n bytes at off from src to dst: directly on the host, through a
// bounce buffer and the backing's Copier elsewhere.
func copyRange(dst, src buffer, off, n int) error {
	if dst.HostAccessible() && src.HostAccessible() {
		copy(dst.Bytes()[off:off+n], src.Bytes()[off:off+n])
		return nil
	}
	tmp := make([]byte, n)
	if err := src.readAt(off, tmp); err != nil {
		return err
	}
	return dst.writeAt(off, tmp)
}

// layerMemory is the memory of one layer's K or V tensor inside a Blocked range: it
// starts off bytes into the range, so that an empty sequence still has a view at the
// tensor's base address.
type layerMemory struct {
	buf buffer
	off int
}

func (m layerMemory) Base() uintptr        { return m.buf.Base() + uintptr(m.off) }
func (m layerMemory) Len() int             { return max(m.buf.Len()-m.off, 0) }
func (m layerMemory) HostAccessible() bool { return m.buf.HostAccessible() }
