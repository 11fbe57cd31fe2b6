package host

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"unsafe"

	"golang.org/x/sys/windows"
)

// The shared backing on Windows: the file is a pool of pagefile-backed sections,
// one per granule (CreateFileMapping of INVALID_HANDLE_VALUE): slot i of the pool is
// section i. A section can not be shrunk or have a hole punched in it, so one per
// granule is what lets a granule go back to the OS alone: closing its handle frees
// its pages once no view maps it. A reservation is a placeholder (VirtualAlloc2)
// that views replace granule by granule (MapViewOfFile3); shared_placeholder.go
// keeps the record of how it is split. There is no park: Windows has no mremap, so
// idle granules wait unmapped and a commit maps them afresh.
//
// Each owned granule costs a section handle and each mapping a view; Windows sets
// no count like vm.max_map_count, so mapCount reports none and an out-of-memory
// error is never blamed on a mapping limit. Granules are 64 KiB (the allocation
// granularity) or larger; giving one back closes its section. Otherwise the same
// capabilities, errors and accounting hold as on Linux.

const (
	sharedSupported = true
	// sharedPark says whether idle granules wait mapped in the park (Linux only).
	sharedPark = false
	// sharedMinGranularity is the least granule: views start on the 64 KiB
	// allocation granularity.
	sharedMinGranularity = placeholderGranularity
	// sharedCreateCall names what creates the pool, for errors.
	sharedCreateCall = "create the section pool"
	// sharedMapAllocates says whether mapping a new slot gives it memory: its
	// section, charged to the commit limit.
	sharedMapAllocates = true
	// sharedPrivate says whether new granules may be private anonymous memory
	// (Linux only: it moves with mremap).
	sharedPrivate = false
)

// sharedWin is the state of one pool's system calls: its sections and the
// placeholder records of its reservations.
type sharedWin struct {
	ph       *sharedPlaceholderCalls
	mu       sync.Mutex
	g        int
	sections []windows.Handle // per slot; 0: no section (a hole)
	resv     []*placeholders  // by base address
}

// sharedDefaultSys returns the system calls of a new pool.
func sharedDefaultSys() sharedSys {
	w := &sharedWin{ph: sharedPlaceholders}
	return sharedSys{
		memfd:    w.create,
		granule:  w.setGranule,
		truncate: w.truncate,
		allocate: w.allocate,
		punch:    w.punch,
		closeFd:  w.close,
		reserve:  w.reserve,
		mapFile:  w.mapFile,
		unmapTo:  w.unmapTo,
		move:     func(unsafe.Pointer, unsafe.Pointer, int) error { return errSharedNoMove },
		release:  w.release,
		protect:  w.protect,
		advise:   func(unsafe.Pointer, int, bool) error { return errors.ErrUnsupported },
		discard:  func(unsafe.Pointer, int) error { return errors.ErrUnsupported },
		populate: sharedPopulate,
		mapCount: func() (int, int, error) { return 0, 0, errSharedNoMapCount },
	}
}

var (
	errSharedNoMove      = fmt.Errorf("host: Windows can not move a view: %w", errors.ErrUnsupported)
	errSharedNoMapCount  = fmt.Errorf("host: Windows has no limit on the number of views: %w", errors.ErrUnsupported)
	sharedProbeOnce      sync.Once
	errSharedPlaceholder error
)

// sharedProbe checks once that the system honours placeholders: that it reserves
// one and splits it (Windows 10 1803 and later; Wine 8.0 refuses
// MEM_RESERVE_PLACEHOLDER).
func sharedProbe() error {
	sharedProbeOnce.Do(func() {
		if err := placeholderSupported(); err != nil {
			errSharedPlaceholder = err
			return
		}
		const g = placeholderGranularity
		base, err := placeholderReserve(2 * g)
		if err != nil {
			errSharedPlaceholder = fmt.Errorf("host: the system does not support placeholders (VirtualAlloc2 MEM_RESERVE_PLACEHOLDER: %v): %w", err, errors.ErrUnsupported)
			return
		}
		if err := placeholderSplit(base, g); err != nil {
			errSharedPlaceholder = fmt.Errorf("host: the system does not split placeholders (VirtualFree MEM_PRESERVE_PLACEHOLDER: %v): %w", err, errors.ErrUnsupported)
			_ = placeholderFree(base)
			return
		}
		_ = placeholderFree(base)
		_ = placeholderFree(uintptr(sharedAt(privatePtr(base), g)))
	})
	return errSharedPlaceholder
}

// sharedPools names the pools of the process by descriptor, as the file table names
// memfds: the descriptor of a pool is its key here until it is closed.
var sharedPools struct {
	mu   sync.Mutex
	next int
	m    map[int]*sharedWin
}

// create starts the pool and returns its descriptor. It fails with an error wrapping
// errors.ErrUnsupported where placeholders are not supported.
func (w *sharedWin) create(string) (int, error) {
	if err := w.ph.probe(); err != nil {
		return -1, err
	}
	sharedPools.mu.Lock()
	defer sharedPools.mu.Unlock()
	if sharedPools.m == nil {
		sharedPools.m = make(map[int]*sharedWin)
	}
	sharedPools.next++
	sharedPools.m[sharedPools.next] = w
	return sharedPools.next, nil
}

func (w *sharedWin) setGranule(_, g int) { w.g = g }

// truncate makes room for size bytes of slots; sections are created when used.
func (w *sharedWin) truncate(_ int, size int64) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if n := int(size / int64(w.g)); n > len(w.sections) {
		w.sections = append(w.sections, make([]windows.Handle, n-len(w.sections))...)
	}
	return nil
}

// section returns the section of slot i, creating it (zero-filled, charged to the
// commit limit) if there is none; created reports whether it did. w.mu must be held.
func (w *sharedWin) section(i int) (h windows.Handle, created bool, err error) {
	if h = w.sections[i]; h != 0 {
		return h, false, nil
	}
	if h, err = sectionCreate(w.g); err != nil {
		return 0, false, err
	}
	w.sections[i] = h
	return h, true, nil
}

// allocate creates the sections of the slots in [off, off+n) and makes their pages
// exist, writing each through a view of its own, as fallocate allocates the pages
// of a memfd.
func (w *sharedWin) allocate(_ int, off, n int64) error {
	page := os.Getpagesize()
	for i := int(off / int64(w.g)); i < int((off+n)/int64(w.g)); i++ {
		w.mu.Lock()
		h, _, err := w.section(i)
		w.mu.Unlock()
		if err != nil {
			return err
		}
		v, err := w.ph.view(h, w.g)
		if err != nil {
			return err
		}
		touch(v, w.g, page, true)
		if err := windows.UnmapViewOfFile(uintptr(v)); err != nil {
			return err
		}
	}
	return nil
}

// punch closes the sections of the slots in [off, off+n): their pages go once no
// view maps them, and the slots read as zero when next used.
func (w *sharedWin) punch(_ int, off, n int64) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	for i := int(off / int64(w.g)); i < int((off+n)/int64(w.g)); i++ {
		if h := w.sections[i]; h != 0 {
			if err := windows.CloseHandle(h); err != nil {
				return err
			}
			w.sections[i] = 0
		}
	}
	return nil
}

// close closes every section handle and forgets the descriptor.
func (w *sharedWin) close(fd int) error {
	sharedPools.mu.Lock()
	delete(sharedPools.m, fd)
	sharedPools.mu.Unlock()
	w.mu.Lock()
	defer w.mu.Unlock()
	var errs []error
	for i, h := range w.sections {
		if h != 0 {
			errs = append(errs, windows.CloseHandle(h))
			w.sections[i] = 0
		}
	}
	return errors.Join(errs...)
}

// sharedPlaceholderCalls are the calls a pool's reservations are made of.
type sharedPlaceholderCalls struct {
	placeholderOS
	probe   func() error                                             // whether the system honours placeholders
	reserve func(n int) (uintptr, error)                             // reserve one placeholder
	mapView func(h windows.Handle, at uintptr, n int, ro bool) error // map all of section h in place of a placeholder
	view    func(h windows.Handle, n int) (unsafe.Pointer, error)    // map all of section h anywhere, read-write
}

// sharedPlaceholders are the calls new pools use: the system's. NB: tests under a Wine
// that lacks placeholders (8.0) swap in an emulation (shared_emul_windows_test.go);
// Wine 10.0 has them.
var sharedPlaceholders = &sharedPlaceholderCalls{
	placeholderOS: placeholderOS{
		split:    placeholderSplit,
		coalesce: placeholderCoalesce,
		free:     placeholderFree,
		unmap:    placeholderUnmap,
	},
	probe:   sharedProbe,
	reserve: placeholderReserve,
	mapView: func(h windows.Handle, at uintptr, n int, ro bool) error { return placeholderMap(h, at, 0, n, ro) },
	view:    sectionView,
}

// reserve reserves n bytes as one placeholder and starts its record.
func (w *sharedWin) reserve(n int) (unsafe.Pointer, error) {
	base, err := w.ph.reserve(n)
	if err != nil {
		return nil, err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	p := newPlaceholders(base, w.g, n/w.g, w.ph.placeholderOS)
	k, _ := slices.BinarySearchFunc(w.resv, base, func(q *placeholders, b uintptr) int {
		return cmpUintptr(q.base, b)
	})
	w.resv = slices.Insert(w.resv, k, p)
	return privatePtr(base), nil
}

func cmpUintptr(a, b uintptr) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// find returns the index of the reservation that holds addr. w.mu must be held.
func (w *sharedWin) find(addr uintptr) int {
	k, found := slices.BinarySearchFunc(w.resv, addr, func(q *placeholders, b uintptr) int {
		return cmpUintptr(q.base, b)
	})
	if !found {
		k--
	}
	if k < 0 || !w.resv[k].contains(addr) {
		panic(fmt.Sprintf("host: %#x is in no placeholder reservation of this pool", addr))
	}
	return k
}

// mapFile maps the slots of [off, off+n) at at, one view per granule, each in
// place of a placeholder cut out for it, creating the sections that do not exist.
// On error nothing changed.
func (w *sharedWin) mapFile(at unsafe.Pointer, n, _ int, off int64, ro bool) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	p := w.resv[w.find(uintptr(at))]
	first := int(off / int64(w.g))
	i := p.unitOf(uintptr(at))
	var created []int
	err := p.mapUnits(i, n/w.g, func(j int, addr uintptr) error {
		slot := first + j - i
		h, fresh, err := w.section(slot)
		if err != nil {
			return err
		}
		if fresh {
			created = append(created, slot)
		}
		return w.ph.mapView(h, addr, w.g, ro)
	})
	if err != nil {
		// Sections this call created hold commit charge: a hole has none.
		for _, slot := range created {
			_ = windows.CloseHandle(w.sections[slot])
			w.sections[slot] = 0
		}
	}
	return err
}

// unmapTo unmaps the views in [at, at+n), leaving the range reserved (a
// placeholder again, merged with the free ones around it).
func (w *sharedWin) unmapTo(at unsafe.Pointer, n int) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	p := w.resv[w.find(uintptr(at))]
	return p.unmapUnits(p.unitOf(uintptr(at)), n/w.g)
}

// release unmaps every view of the reservation at at and gives its address space
// back.
func (w *sharedWin) release(at unsafe.Pointer, _ int) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	k := w.find(uintptr(at))
	if err := w.resv[k].release(); err != nil {
		return err
	}
	w.resv = slices.Delete(w.resv, k, k+1)
	return nil
}

// protect sets the access of the views in [at, at+n) (VirtualProtect, one view at a
// time: a call can not span views), read-only or read-write. On error the views
// before the failing one have the new access.
func (w *sharedWin) protect(at unsafe.Pointer, n int, ro bool) error {
	prot := uint32(windows.PAGE_READWRITE)
	if ro {
		prot = windows.PAGE_READONLY
	}
	for off := 0; off < n; off += w.g {
		var old uint32
		if err := windows.VirtualProtect(uintptr(sharedAt(at, off)), uintptr(w.g), prot, &old); err != nil {
			return err
		}
	}
	return nil
}

// sharedNoMemory reports whether err says the system had no memory (or commit
// charge) to give.
func sharedNoMemory(err error) bool {
	return errors.Is(err, windows.ERROR_NOT_ENOUGH_MEMORY) ||
		errors.Is(err, windows.ERROR_OUTOFMEMORY) ||
		errors.Is(err, windows.ERROR_COMMITMENT_LIMIT) ||
		errors.Is(err, windows.ERROR_NO_SYSTEM_RESOURCES) // no handle or view to be had

}

// sharedPopulate populates the pages of [at, at+n), for writing when write is true.
func sharedPopulate(at unsafe.Pointer, n int, write bool) error {
	return populate(at, n, os.Getpagesize(), write)
}
