package cuda

// LoadDriverFrom is the loader with the library name as a parameter, so tests can
// point it at a library that is not a CUDA driver.
var LoadDriverFrom = loadDriver

// SymbolNames returns the exported symbol each Driver field is bound to, in table
// order, and whether each field pointer is distinct (every field listed once).
func SymbolNames() (names []string, fields []any) {
	var d Driver
	for _, s := range append(append(symbols[:], hostSymbols[:]...), exportSymbols[:]...) {
		names = append(names, s.name)
		fields = append(fields, s.field(&d))
	}
	return names, fields
}

// Int32Ptr is int32Ptr, for tests that call the export entry point directly.
var Int32Ptr = int32Ptr

// BytesAddr is bytesPtr for tests that call the seam directly.
var BytesAddr = bytesPtr

// RefillHeld reports whether Trim or Quiesce holds the background refill.
func (b *Backing) RefillHeld() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.held
}

// Reclaim runs the reclaimer the Backing registered with its authority, as the
// governor would on a goroutine of its own.
func (b *Backing) Reclaim() { b.reclaim(0) }
