package snapshot_test

import (
	"unsafe"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/host"
)

// uintptrOf returns the address of b's first byte.
func uintptrOf(b []byte) uintptr {
	// Safety: the address is only compared, never turned back into a pointer.
	return uintptr(unsafe.Pointer(unsafe.SliceData(b)))
}

// hostSharedWithAuthority returns pool options that set what the factory sets.
func hostSharedWithAuthority(g *accounting.Governor) host.SharedOptions {
	return host.SharedOptions{Authority: g.Authority("foreign", accounting.HostKey)}
}
