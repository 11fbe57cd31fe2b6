package host

import (
	"errors"
	"fmt"
	"unsafe"

	"golang.org/x/sys/windows"
)

// The placeholder calls of Windows 10 1803 and later, which x/sys/windows does not
// wrap: a placeholder is reserved address space that a section view can replace
// exactly, so that views are mapped into a reservation without ever leaving a hole
// another allocation of the process could take.

const (
	memReservePlaceholder   = 0x00040000 // VirtualAlloc2: reserve as a placeholder
	memReplacePlaceholder   = 0x00004000 // MapViewOfFile3: the view replaces a placeholder
	memPreservePlaceholder  = 0x00000002 // VirtualFree: split; UnmapViewOfFile2: leave a placeholder
	memCoalescePlaceholders = 0x00000001 // VirtualFree: merge adjacent placeholders
	placeholderGranularity  = 64 << 10   // allocation granularity: views start on it
	secCommit               = 0x08000000 // CreateFileMapping: commit the whole section now
)

var (
	modKernelBase        = windows.NewLazySystemDLL("kernelbase.dll")
	procVirtualAlloc2    = modKernelBase.NewProc("VirtualAlloc2")
	procMapViewOfFile3   = modKernelBase.NewProc("MapViewOfFile3")
	procUnmapViewOfFile2 = modKernelBase.NewProc("UnmapViewOfFile2")
)

// errNoPlaceholders says that the system lacks the placeholder calls (before
// Windows 10 1803).
var errNoPlaceholders = fmt.Errorf("host: kernelbase.dll has no VirtualAlloc2/MapViewOfFile3/UnmapViewOfFile2 (Windows 10 1803 or later): %w", errors.ErrUnsupported)

// placeholderSupported reports whether the placeholder calls exist.
func placeholderSupported() error {
	for _, p := range []*windows.LazyProc{procVirtualAlloc2, procMapViewOfFile3, procUnmapViewOfFile2} {
		if p.Find() != nil {
			return errNoPlaceholders
		}
	}
	return nil
}

// sysErr returns the error of a failed call: its errno, or a plain error where the
// call set none.
func sysErr(e error, call string) error {
	if en, ok := e.(windows.Errno); ok && en != 0 {
		return en
	}
	return fmt.Errorf("host: %s failed", call)
}

// placeholderReserve reserves n bytes (a multiple of 64 KiB) of address space as one
// placeholder (VirtualAlloc2 MEM_RESERVE|MEM_RESERVE_PLACEHOLDER, PAGE_NOACCESS).
func placeholderReserve(n int) (uintptr, error) {
	if err := placeholderSupported(); err != nil {
		return 0, err
	}
	p, _, e := procVirtualAlloc2.Call(uintptr(windows.CurrentProcess()), 0, uintptr(n),
		windows.MEM_RESERVE|memReservePlaceholder, windows.PAGE_NOACCESS, 0, 0)
	if p == 0 {
		return 0, sysErr(e, "VirtualAlloc2")
	}
	return p, nil
}

// placeholderSplit splits the placeholder holding [at, at+n) so that [at, at+n)
// is a placeholder of its own (VirtualFree MEM_RELEASE|MEM_PRESERVE_PLACEHOLDER). The
// range must lie inside one placeholder and not be all of it.
func placeholderSplit(at uintptr, n int) error {
	return windows.VirtualFree(at, uintptr(n), windows.MEM_RELEASE|memPreservePlaceholder)
}

// placeholderCoalesce merges the adjacent placeholders that make up exactly
// [at, at+n) into one (VirtualFree MEM_RELEASE|MEM_COALESCE_PLACEHOLDERS).
func placeholderCoalesce(at uintptr, n int) error {
	return windows.VirtualFree(at, uintptr(n), windows.MEM_RELEASE|memCoalescePlaceholders)
}

// placeholderFree gives back the placeholder that starts at at (VirtualFree
// MEM_RELEASE, size 0).
func placeholderFree(at uintptr) error {
	return windows.VirtualFree(at, 0, windows.MEM_RELEASE)
}

// placeholderMap maps n bytes of section h from offset off in place of the
// placeholder [at, at+n), which it must match exactly (MapViewOfFile3
// MEM_REPLACE_PLACEHOLDER), read-only or read-write.
func placeholderMap(h windows.Handle, at uintptr, off int64, n int, ro bool) error {
	prot := uintptr(windows.PAGE_READWRITE)
	if ro {
		prot = windows.PAGE_READONLY
	}
	p, _, e := procMapViewOfFile3.Call(uintptr(h), uintptr(windows.CurrentProcess()), at,
		uintptr(off), uintptr(n), memReplacePlaceholder, prot, 0, 0)
	if p == 0 {
		return sysErr(e, "MapViewOfFile3")
	}
	if p != at {
		// Not expected from MEM_REPLACE_PLACEHOLDER; never leave a view elsewhere.
		_ = windows.UnmapViewOfFile(p)
		return fmt.Errorf("host: MapViewOfFile3 mapped at %#x, not at the placeholder %#x", p, at)
	}
	return nil
}

// placeholderUnmap unmaps the view at at and leaves a placeholder of its size in its
// place (UnmapViewOfFile2 MEM_PRESERVE_PLACEHOLDER).
func placeholderUnmap(at uintptr) error {
	ok, _, e := procUnmapViewOfFile2.Call(uintptr(windows.CurrentProcess()), at, memPreservePlaceholder)
	if ok == 0 {
		return sysErr(e, "UnmapViewOfFile2")
	}
	return nil
}

// sectionCreate creates a pagefile-backed section of n bytes (CreateFileMapping of
// INVALID_HANDLE_VALUE, PAGE_READWRITE|SEC_COMMIT): its pages are charged to the
// commit limit now and read as zero until written.
func sectionCreate(n int) (windows.Handle, error) {
	h, err := windows.CreateFileMapping(windows.InvalidHandle, nil,
		windows.PAGE_READWRITE|secCommit, uint32(uint64(n)>>32), uint32(n), nil)
	if h == 0 {
		return 0, err
	}
	return h, nil
}

// sectionView maps all n bytes of section h read-write anywhere (MapViewOfFile).
func sectionView(h windows.Handle, n int) (unsafe.Pointer, error) {
	p, err := windows.MapViewOfFile(h, windows.FILE_MAP_WRITE, 0, 0, uintptr(n))
	if p == 0 {
		return nil, err
	}
	return privatePtr(p), nil
}

// queryRegion returns the region that holds at: its base, size, state and type
// (VirtualQuery).
func queryRegion(at uintptr) (windows.MemoryBasicInformation, error) {
	var mbi windows.MemoryBasicInformation
	err := windows.VirtualQuery(at, &mbi, unsafe.Sizeof(mbi))
	return mbi, err
}
