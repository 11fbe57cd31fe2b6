package host

import (
	"unsafe"

	"github.com/vmarena/vmarena/internal/causes"
)

// countedSys returns sys with each system call counted by kind on the thread that
// internal/causes tracks (examples/kvcache -causes, kv's step tests), or sys itself
// while counting is off: a Shared built before causes.Enable counts nothing and
// pays nothing.
func countedSys(sys sharedSys) sharedSys {
	if !causes.Enabled() {
		return sys
	}
	memfd, truncate, allocate, punch, closeFd := sys.memfd, sys.truncate, sys.allocate, sys.punch, sys.closeFd
	reserve, mapFile, unmapTo, move := sys.reserve, sys.mapFile, sys.unmapTo, sys.move
	protect, release, pop, advise, discard := sys.protect, sys.release, sys.populate, sys.advise, sys.discard
	sys.memfd = func(name string) (int, error) { causes.Add(causes.SysFile); return memfd(name) }
	sys.truncate = func(fd int, size int64) error { causes.Add(causes.SysFile); return truncate(fd, size) }
	sys.allocate = func(fd int, off, n int64) error { causes.Add(causes.SysFile); return allocate(fd, off, n) }
	sys.punch = func(fd int, off, n int64) error { causes.Add(causes.SysFile); return punch(fd, off, n) }
	sys.closeFd = func(fd int) error { causes.Add(causes.SysFile); return closeFd(fd) }
	sys.reserve = func(n int) (unsafe.Pointer, error) { causes.Add(causes.SysMap); return reserve(n) }
	sys.mapFile = func(at unsafe.Pointer, n, fd int, off int64, ro bool) error {
		causes.Add(causes.SysMap)
		return mapFile(at, n, fd, off, ro)
	}
	sys.unmapTo = func(at unsafe.Pointer, n int) error { causes.Add(causes.SysMap); return unmapTo(at, n) }
	sys.move = func(from, to unsafe.Pointer, n int) error { causes.Add(causes.SysMove); return move(from, to, n) }
	sys.protect = func(at unsafe.Pointer, n int, ro bool) error {
		causes.Add(causes.SysProtect)
		return protect(at, n, ro)
	}
	sys.release = func(at unsafe.Pointer, n int) error { causes.Add(causes.SysUnmap); return release(at, n) }
	sys.populate = func(at unsafe.Pointer, n int, write bool) error {
		causes.Add(causes.SysAdvise)
		return pop(at, n, write)
	}
	sys.advise = func(at unsafe.Pointer, n int, huge bool) error {
		causes.Add(causes.SysAdvise)
		return advise(at, n, huge)
	}
	sys.discard = func(at unsafe.Pointer, n int) error {
		causes.Add(causes.SysAdvise) // NB: madvise(DONTNEED) and mprotect: two calls
		causes.Add(causes.SysProtect)
		return discard(at, n)
	}
	return sys
}
