package host

import "fmt"

// The placeholders of one Windows reservation (see shared_windows.go).
//
// On Windows a reservation of the shared backing is address space reserved as a
// placeholder (VirtualAlloc2 MEM_RESERVE_PLACEHOLDER). A section view can only be
// mapped in place of a whole placeholder (MapViewOfFile3 MEM_REPLACE_PLACEHOLDER),
// so a commit first splits the unit it maps off its placeholder (VirtualFree
// MEM_RELEASE|MEM_PRESERVE_PLACEHOLDER), and a decommit unmaps the view leaving a
// placeholder of its size (UnmapViewOfFile2 MEM_PRESERVE_PLACEHOLDER), then merges it
// with the free placeholders around it (VirtualFree MEM_COALESCE_PLACEHOLDERS, which
// wants their exact overall range). Windows does not say where a placeholder
// begins, so the reservation keeps the record: the address space is cut into units
// (granules), each unit is a view or part of a placeholder, and a start bit marks
// the first unit of every region. This file keeps that record; the calls are
// placeholderOS's.

// placeholderOS is what the record drives: the placeholder calls of the system.
type placeholderOS struct {
	split    func(at uintptr, n int) error // cut [at, at+n) out of the placeholder that holds it
	coalesce func(at uintptr, n int) error // merge the placeholders that make up [at, at+n)
	free     func(at uintptr) error        // give back the placeholder that starts at at
	unmap    func(at uintptr) error        // unmap the view at at, leaving a placeholder
}

// placeholders is the record of one placeholder reservation of n units of unit
// bytes from base.
type placeholders struct {
	base  uintptr
	unit  int
	n     int
	view  sharedBits // unit i holds a view
	start sharedBits // unit i begins a region (a view or a placeholder); unit 0 always
	os    placeholderOS
}

// newPlaceholders returns the record of a reservation that is one placeholder.
func newPlaceholders(base uintptr, unit, n int, os placeholderOS) *placeholders {
	p := &placeholders{base: base, unit: unit, n: n, os: os}
	p.view.resize(n)
	p.start.resize(n + 1)
	p.start.set(0)
	p.start.set(n) // a sentinel: the end of the last region
	return p
}

// at returns the address of unit i.
func (p *placeholders) at(i int) uintptr { return p.base + uintptr(i)*uintptr(p.unit) }

// contains reports whether addr lies in the reservation.
func (p *placeholders) contains(addr uintptr) bool {
	return addr >= p.base && addr-p.base < uintptr(p.n)*uintptr(p.unit)
}

// unitOf returns the unit at addr, which must be the start of a unit inside p.
func (p *placeholders) unitOf(addr uintptr) int {
	off := addr - p.base
	if !p.contains(addr) || off%uintptr(p.unit) != 0 {
		panic(fmt.Sprintf("host: %#x is not a unit of the placeholder reservation at %#x", addr, p.base))
	}
	return int(off / uintptr(p.unit))
}

// region returns the region [a, b) that holds unit i.
func (p *placeholders) region(i int) (a, b int) {
	a = i
	if !p.start.has(i) {
		a = p.start.prev(i)
	}
	return a, p.start.next(i+1, p.n+1)
}

// isolate makes unit i, part of a placeholder, a placeholder of its own, splitting
// the one that holds it where it is larger.
func (p *placeholders) isolate(i int) error {
	if p.view.has(i) {
		panic(fmt.Sprintf("host: unit %d of the placeholder reservation at %#x already holds a view", i, p.base))
	}
	if a, b := p.region(i); a == i && b == i+1 {
		return nil
	}
	if err := p.os.split(p.at(i), p.unit); err != nil {
		return err
	}
	p.start.set(i)
	p.start.set(i + 1)
	return nil
}

// mapUnits maps k units from i, each in place of a placeholder of its own cut out for
// it, with mapOne(j, at) for unit j at address at. On error it unmaps what it
// mapped, merges the placeholders again, and returns the error (with that of the
// undoing, if any).
func (p *placeholders) mapUnits(i, k int, mapOne func(j int, at uintptr) error) error {
	for j := i; j < i+k; j++ {
		err := p.isolate(j)
		if err == nil {
			err = mapOne(j, p.at(j))
		}
		if err != nil {
			// NB: j+1, not j: the placeholder cut out for unit j merges back too.
			if uerr := p.unmapUnits(i, j-i+1); uerr != nil {
				return fmt.Errorf("%w; undoing the views mapped before it failed: %w", err, uerr)
			}
			return err
		}
		p.view.set(j)
	}
	return nil
}

// unmapUnits unmaps the views among the k units from i, each leaving a placeholder,
// then merges the free placeholders around them into one. A merge that fails is no
// error (the record keeps the split and a later one merges them); an unmap that
// fails is, and stops there.
func (p *placeholders) unmapUnits(i, k int) error {
	for j := p.view.next(i, i+k); j < i+k; j = p.view.next(j+1, i+k) {
		if err := p.os.unmap(p.at(j)); err != nil {
			p.merge(i, i+k)
			return err
		}
		p.view.clear(j)
	}
	p.merge(i, i+k)
	return nil
}

// merge coalesces each run of free placeholders that meets [i, j), up to the views
// around it, into one where it is more than one.
func (p *placeholders) merge(i, j int) {
	for a := p.view.prev(i) + 1; a < j; {
		b := p.view.next(a, p.n) // the run is [a, b)
		if b > a && p.start.next(a+1, b) < b && p.os.coalesce(p.at(a), (b-a)*p.unit) == nil {
			for s := p.start.next(a+1, b); s < b; s = p.start.next(s+1, b) {
				p.start.clear(s)
			}
		}
		a = b + 1
	}
}

// release gives the whole reservation back: it unmaps every view, merges the
// placeholders into one and frees it (or frees them one by one, from the end, where
// the merge failed). On error the record keeps what is left, and release may be
// called again.
func (p *placeholders) release() error {
	if err := p.unmapUnits(0, p.n); err != nil {
		return err
	}
	for p.n > 0 {
		a := p.start.prev(p.n)
		if err := p.os.free(p.at(a)); err != nil {
			return err
		}
		p.start.clear(p.n)
		p.n = a
	}
	return nil
}
