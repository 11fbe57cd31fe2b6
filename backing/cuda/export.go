package cuda

import (
	"fmt"
	"runtime"

	"github.com/vmarena/vmarena/backing"
)

// Granules between processes: the owner of a granule exports its allocation as a
// POSIX file descriptor, which travels to another process by SCM_RIGHTS; that
// process imports it and maps the same device memory into a reservation of its own,
// with no copy (the CUDA half of a node pool, docs/node.md).
//
// A handle's life across processes:
//
//	owned (pool) --Export--> owned, exported: its last unmapping in the exporter
//	                         releases it (cuMemRelease) instead of pooling it
//	descriptor --Import--> imported: mapped, never owned; its last unmapping in the
//	                       importer releases it
//
// The physical memory lives until every process has unmapped it and released its
// handle, whoever the ledgers charge (the driver counts the references).

// Export returns a new file descriptor for each granule of the committed range
// [off, off+size) of r, in order: a POSIX shareable handle of the granule's physical
// allocation (cuMemExportToShareableHandle). Another process that receives one (by
// SCM_RIGHTS) maps the same device memory with Import. The descriptors are the
// caller's: it MUST close each once it has passed it on.
//
// The Backing must have been made with Options.Exportable, else Export fails with
// ErrNotExportable, as it does for a granule r imported (only its exporter exports
// it). On error no descriptor is left open and nothing changed.
//
// An exported handle never goes back to the pool: when its last mapping in b goes
// (Decommit, Unreserve) it is released, for an importer may map it still and a pooled
// handle would be handed to the next commit under that mapping. Its bytes stay
// charged to b's authority until then, and no longer: the authority does not see
// other processes' mappings, so whoever exports a granule keeps it committed until
// its importers have unmapped it (a node pool's owner counts them). A descriptor
// carries no protection: the importer chooses it (Import's prot), so export only to
// processes trusted to keep what they are lent read-only.
func (b *Backing) Export(r *Reservation, off, size int) ([]int, error) {
	const op = "export"
	if err := b.check(op, r, off, size); err != nil {
		return nil, err
	}
	if !b.export {
		return nil, &backing.OpError{Op: op, Offset: off, Size: size,
			Err: fmt.Errorf("%w: the Backing was made without Options.Exportable", ErrNotExportable)}
	}
	if size == 0 {
		return nil, nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.dead.Load() {
		panic(backing.PanicUseAfterUnreserve)
	}
	if err := r.state(op, off, size, true); err != nil {
		return nil, err
	}
	g := b.gran
	first, n := off/g, size/g
	hs := make([]*handle, 0, n)
	for i := first; i < first+n; {
		s, next := r.slots.run(i, first+n) // committed: never nil
		for k := range s {
			if s[k].h.imported {
				return nil, &backing.OpError{Op: op, Offset: off, Size: size,
					Err: fmt.Errorf("%w: granule at %#x was imported from another process", ErrNotExportable, (i+k)*g)}
			}
			hs = append(hs, s[k].h)
		}
		i = next
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := b.setCurrent(); err != nil {
		return nil, opError(op, off, size, err)
	}
	fds := make([]int, 0, n)
	for i, h := range hs {
		fd := int32(-1)
		if err := b.drv.call("cuMemExportToShareableHandle",
			b.drv.MemExportToShareableHandle(int32Ptr(&fd), h.h, HandleTypePosixFD, 0)); err != nil {
			closeFDs(fds)
			return nil, opError(op, off, size, fmt.Errorf("granule at %#x: %w", off+i*g, err))
		}
		fds = append(fds, int(fd))
	}
	b.mu.Lock()
	for _, h := range hs {
		h.exported = true
	}
	b.mu.Unlock()
	return fds, nil
}

// Import moves [off, off+len(fds)*Granularity()) of r from Reserved to Committed by
// mapping there, one granule each and in order, the allocations another process
// exported (Export) as the descriptors fds: cuMemImportFromShareableHandle, cuMemMap,
// and one cuMemSetAccess over the run (PROT_READ for backing.ReadOnly, which Protect
// then never makes writable, as for a read-only Share). The descriptors stay the
// caller's to close; the mappings do not need them.
//
// An imported granule is mapped, not owned: it counts in the authority's mapped bytes
// (Authority.Map) as a share does and never in its owned bytes, which are the
// exporter's. Share maps it again within b. When its last mapping in b goes its
// handle is released (cuMemRelease), never pooled; the memory lives on while its
// exporter or another importer maps it. It can not be exported onward
// (ErrNotExportable).
//
// Both processes must use the same physical device and granule size. A negative
// descriptor, or one the driver does not take as an exported allocation, fails with
// ErrBadDescriptor; a range outside r, misaligned or not Reserved fails as Commit's
// does. On error nothing changed.
//
// NB: import each descriptor once per Backing and map the granule again with Share:
// the driver does not promise a distinct handle for a second import of one
// allocation, and each import is released once.
func (b *Backing) Import(r *Reservation, off int, fds []int, prot backing.Protection) error {
	const op = "import"
	size := len(fds) * b.gran
	if err := b.check(op, r, off, size); err != nil {
		return err
	}
	if prot != backing.ReadWrite && prot != backing.ReadOnly {
		return &backing.OpError{Op: op, Offset: off, Size: size, Err: fmt.Errorf("cuda: unknown protection %d", prot)}
	}
	if len(fds) == 0 {
		return nil
	}
	for i, fd := range fds {
		if fd < 0 {
			return &backing.OpError{Op: op, Offset: off, Size: size,
				Err: fmt.Errorf("%w: descriptor %d for granule at %#x", ErrBadDescriptor, fd, off+i*b.gran)}
		}
	}
	if !posixFDs {
		return &backing.OpError{Op: op, Offset: off, Size: size, Kind: backing.ErrUnsupported, Err: ErrNoExport}
	}
	if err := b.drv.checkExport(); err != nil {
		return &backing.OpError{Op: op, Offset: off, Size: size, Err: err}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.dead.Load() {
		panic(backing.PanicUseAfterUnreserve)
	}
	if err := r.state(op, off, size, false); err != nil {
		return err
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := b.setCurrent(); err != nil {
		return opError(op, off, size, err)
	}
	hs := make([]*handle, 0, len(fds))
	var err error
	for i, fd := range fds {
		var h uint64
		c := b.drv.MemImportFromShareableHandle(&h, uintptr(fd), HandleTypePosixFD)
		if c != Success {
			err = b.drv.call("cuMemImportFromShareableHandle", c)
			if c == CodeInvalidValue || c == CodeInvalidHandle {
				err = fmt.Errorf("%w: descriptor %d for granule at %#x: %w", ErrBadDescriptor, fd, off+i*b.gran, err)
			}
			break
		}
		hs = append(hs, &handle{h: h, imported: true})
	}
	b.mu.Lock()
	b.imports += len(hs)
	b.mu.Unlock()
	if err == nil {
		err = b.mapRun(r, off, hs, prot == backing.ReadOnly)
	}
	if err != nil {
		b.releaseImported(b.unmapped(hs))
		return opError(op, off, size, err)
	}
	return nil
}

// releaseImported releases imported handles mapped nowhere. They are not owned, so
// the authority is not told. Handles the driver refuses stay counted, in b.stuckIn,
// and are retried with the stuck pooled ones (Trim, Close). The thread must be bound.
func (b *Backing) releaseImported(hs []*handle) {
	if len(hs) == 0 {
		return
	}
	var stuck []*handle
	for _, h := range hs {
		if b.drv.MemRelease(h.h) != Success {
			stuck = append(stuck, h)
		}
	}
	b.mu.Lock()
	b.imports -= len(hs) - len(stuck)
	b.stuckIn = append(b.stuckIn, stuck...)
	b.mu.Unlock()
}

// closeFDs closes descriptors Export made and will not hand out. A descriptor just
// made closes; there is nothing to report.
func closeFDs(fds []int) {
	for _, fd := range fds {
		_ = closeFD(fd)
	}
}
