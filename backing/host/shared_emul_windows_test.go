package host

import (
	"fmt"
	"sync"
	"testing"
	"unsafe"

	"golang.org/x/sys/windows"
)

// Wine 8.0 refuses placeholders (VirtualAlloc2 MEM_RESERVE_PLACEHOLDER is an invalid
// parameter there), which leaves the shared backing nothing to run on. So that the
// rest of it (the section pool, views at chosen addresses, read-only views, the
// placeholder record, the accounting) still runs under Wine, tests there emulate
// the placeholder calls with plain reservations: each placeholder is a reservation
// of its own (VirtualAlloc MEM_RESERVE), split and merged by releasing and
// reserving again, and replaced by a view by releasing it and mapping the view at
// its address (MapViewOfFileEx). The emulation checks what Windows documents about
// each call (a split lies inside one placeholder and is not all of it, a merge is
// exactly two or more adjacent placeholders, a view replaces exactly one), so a
// wrong record fails here as it would on Windows.
//
// NB: releasing and reserving again leaves the address space free for an instant,
// where another allocation of the process could land; that is why the backing
// itself uses placeholders. Under Wine an allocation that names no address takes
// the lowest free range that fits (a thread stack, when a blocking call makes the Go
// runtime start a thread, or the runtime's own metadata), so the emulation reserves
// far above everything else (from emulFar up), where a hole is never the lowest;
// and the emulated calls hold emulMu across that instant, as do the pool's own views
// anywhere (Prefill's), which could land there too. The emulation is for tests
// under Wine only.

const emulFar = 0x3000_0000_0000 // 48 TiB: above the Go heap's hints and Wine's own ranges

var (
	emulMu   sync.Mutex
	emulNext uintptr = emulFar // guarded by emulMu
)

// emulReserveFar reserves n bytes at the next free address from emulNext up.
func emulReserveFar(n int) (uintptr, error) {
	emulMu.Lock()
	defer emulMu.Unlock()
	var err error
	for range 64 {
		var p uintptr
		if p, err = emulReserve(emulNext, n); err == nil {
			emulNext = p + uintptr(n+placeholderGranularity-1)&^(placeholderGranularity-1)
			return p, nil
		}
		emulNext += 1 << 30
	}
	return 0, fmt.Errorf("emulated placeholders: no free range for %#x bytes above %#x: %w", n, emulFar, err)
}

var procMapViewOfFileEx = windows.NewLazySystemDLL("kernel32.dll").NewProc("MapViewOfFileEx")

// EmulatePlaceholders makes the Shared backings that NewShared creates until t ends
// use the emulated placeholder calls.
func EmulatePlaceholders(t testing.TB) {
	old := sharedPlaceholders
	sharedPlaceholders = &sharedPlaceholderCalls{
		placeholderOS: placeholderOS{
			split:    emulSplit,
			coalesce: emulCoalesce,
			free:     emulFree,
			unmap:    emulUnmap,
		},
		probe:   func() error { return nil },
		reserve: emulReserveFar,
		mapView: emulMap,
		view: func(h windows.Handle, n int) (unsafe.Pointer, error) {
			emulMu.Lock()
			defer emulMu.Unlock()
			return sectionView(h, n)
		},
	}
	t.Cleanup(func() { sharedPlaceholders = old })
}

func emulReserve(at uintptr, n int) (uintptr, error) {
	return windows.VirtualAlloc(at, uintptr(n), windows.MEM_RESERVE, windows.PAGE_NOACCESS)
}

// emulQuery returns the region at at.
func emulQuery(at uintptr) (windows.MemoryBasicInformation, error) {
	var mbi windows.MemoryBasicInformation
	err := windows.VirtualQuery(at, &mbi, unsafe.Sizeof(mbi))
	return mbi, err
}

// emulPlaceholder returns the placeholder that holds at: its start and size.
func emulPlaceholder(at uintptr) (uintptr, int, error) {
	q, err := emulQuery(at)
	if err != nil {
		return 0, 0, err
	}
	if q.State != windows.MEM_RESERVE {
		return 0, 0, fmt.Errorf("emulated placeholders: %#x is no placeholder (state %#x)", at, q.State)
	}
	whole, err := emulQuery(q.AllocationBase)
	if err != nil {
		return 0, 0, err
	}
	return q.AllocationBase, int(whole.RegionSize), nil
}

func emulSplit(at uintptr, n int) error {
	emulMu.Lock()
	defer emulMu.Unlock()
	a, size, err := emulPlaceholder(at)
	if err != nil {
		return err
	}
	end := a + uintptr(size)
	if at+uintptr(n) > end || (at == a && n == size) {
		return fmt.Errorf("emulated placeholders: split [%#x, +%#x) of the placeholder [%#x, +%#x): %w",
			at, n, a, size, windows.ERROR_INVALID_PARAMETER)
	}
	if err := windows.VirtualFree(a, 0, windows.MEM_RELEASE); err != nil {
		return err
	}
	for _, piece := range [][2]uintptr{{a, at}, {at, at + uintptr(n)}, {at + uintptr(n), end}} {
		if piece[1] > piece[0] {
			if _, err := emulReserve(piece[0], int(piece[1]-piece[0])); err != nil {
				return fmt.Errorf("emulated placeholders: reserve [%#x, %#x) again: %w", piece[0], piece[1], err)
			}
		}
	}
	return nil
}

func emulCoalesce(at uintptr, n int) error {
	emulMu.Lock()
	defer emulMu.Unlock()
	var starts []uintptr
	for cur := at; cur < at+uintptr(n); {
		a, size, err := emulPlaceholder(cur)
		if err != nil {
			return err
		}
		if a != cur || cur+uintptr(size) > at+uintptr(n) {
			return fmt.Errorf("emulated placeholders: [%#x, +%#x) does not cover whole placeholders: %w", at, n, windows.ERROR_INVALID_PARAMETER)
		}
		starts = append(starts, a)
		cur += uintptr(size)
	}
	if len(starts) < 2 {
		return fmt.Errorf("emulated placeholders: [%#x, +%#x) is one placeholder: %w", at, n, windows.ERROR_INVALID_PARAMETER)
	}
	for _, a := range starts {
		if err := windows.VirtualFree(a, 0, windows.MEM_RELEASE); err != nil {
			return err
		}
	}
	_, err := emulReserve(at, n)
	return err
}

func emulFree(at uintptr) error {
	if a, _, err := emulPlaceholder(at); err != nil || a != at {
		return fmt.Errorf("emulated placeholders: no placeholder starts at %#x: %w", at, windows.ERROR_INVALID_PARAMETER)
	}
	return windows.VirtualFree(at, 0, windows.MEM_RELEASE)
}

func emulUnmap(at uintptr) error {
	emulMu.Lock()
	defer emulMu.Unlock()
	q, err := emulQuery(at)
	if err != nil {
		return err
	}
	if q.Type != 0x40000 || q.AllocationBase != at { // MEM_MAPPED
		return fmt.Errorf("emulated placeholders: no view starts at %#x: %w", at, windows.ERROR_INVALID_PARAMETER)
	}
	if err := windows.UnmapViewOfFile(at); err != nil {
		return err
	}
	_, err = emulReserve(at, int(q.RegionSize))
	return err
}

func emulMap(h windows.Handle, at uintptr, n int, ro bool) error {
	emulMu.Lock()
	defer emulMu.Unlock()
	a, size, err := emulPlaceholder(at)
	if err != nil {
		return err
	}
	if a != at || size != n {
		return fmt.Errorf("emulated placeholders: a view of %#x bytes at %#x does not match the placeholder [%#x, +%#x): %w",
			n, at, a, size, windows.ERROR_INVALID_PARAMETER)
	}
	access := uintptr(windows.FILE_MAP_WRITE)
	if ro {
		access = windows.FILE_MAP_READ
	}
	if err := windows.VirtualFree(at, 0, windows.MEM_RELEASE); err != nil {
		return err
	}
	p, _, e := procMapViewOfFileEx.Call(uintptr(h), access, 0, 0, uintptr(n), at)
	if p == 0 {
		_, _ = emulReserve(at, n)
		return sysErr(e, "MapViewOfFileEx")
	}
	return nil
}

// FailPlaceholders makes the Shared backings that NewShared creates until t ends
// ask fail before each placeholder call ("split", "coalesce", "free", "unmap",
// "map": real or emulated, whichever NewShared would use) and fail the call with the
// error it returns, if any, without making it.
func FailPlaceholders(t testing.TB, fail func(call string) error) {
	old := sharedPlaceholders
	in := *old
	c := in
	c.split = func(at uintptr, n int) error {
		if err := fail("split"); err != nil {
			return err
		}
		return in.split(at, n)
	}
	c.coalesce = func(at uintptr, n int) error {
		if err := fail("coalesce"); err != nil {
			return err
		}
		return in.coalesce(at, n)
	}
	c.free = func(at uintptr) error {
		if err := fail("free"); err != nil {
			return err
		}
		return in.free(at)
	}
	c.unmap = func(at uintptr) error {
		if err := fail("unmap"); err != nil {
			return err
		}
		return in.unmap(at)
	}
	c.mapView = func(h windows.Handle, at uintptr, n int, ro bool) error {
		if err := fail("map"); err != nil {
			return err
		}
		return in.mapView(h, at, n, ro)
	}
	sharedPlaceholders = &c
	t.Cleanup(func() { sharedPlaceholders = old })
}

// EmulatePlaceholdersUnderWine is EmulatePlaceholders where the process runs under a
// Wine that refuses placeholders; elsewhere it does nothing.
func EmulatePlaceholdersUnderWine(t testing.TB) {
	if WineVersion() != "" && sharedProbe() != nil {
		EmulatePlaceholders(t)
	}
}
