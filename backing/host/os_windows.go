package host

import "unsafe"

// populate makes the pages of the committed range [at, at+n) resident by touching
// each page of size page: a write (keeping the contents) when write is true, else a
// read. NB: PrefetchVirtualMemory only pages in what was paged out; it does not
// create the demand-zero pages of a fresh commit or a new section.
func populate(at unsafe.Pointer, n, page int, write bool) error {
	touch(at, n, page, write)
	return nil
}
