package host

import (
	"fmt"
	"math"
	"math/bits"
	"os"
	"unsafe"
)

// The park: where idle granules keep their page tables.
//
// A fresh mapping of a granule whose pages exist still takes a minor fault per page
// on first touch (0.5-0.6 ms per 2 MiB with 4 KiB pages), while moving a mapping
// (mremap) moves its page table entries with it (a few µs). So the backing keeps the
// whole memfd mapped, read-write and MAP_SHARED, in the park: slot i always at
// parkAt(i). A commit moves a slot's run from the park into the reservation
// (MREMAP_DONTUNMAP: the park keeps mapping the slot, without page table entries);
// a decommit that takes a granule's last read-write mapping moves it back into the
// park over the slot's own place. Either way the park stays one mapping per chunk,
// since what comes back maps the same file offsets; and nothing is ever left
// unmapped, so no other mmap can land in a reservation or in the park.
//
// An idle granule thus waits with the page tables its last mapping built, all of them
// after Prefill, or after a sequence wrote every page: the commit that takes it costs
// a few µs and its first touch takes no fault. Granules whose last mapping was
// read-only, or that a move could not take (the kernel refuses MREMAP_DONTUNMAP of
// shared mappings before 5.13), go idle without page tables and are mapped afresh.
//
// The park is a list of chunks, each mapping a range of slots in one mapping:
// chunk k maps park0<<k slots from slot park0*(2^k-1) on, so that the park's
// address space stays within twice the file's size and a run of slots rarely spans
// two chunks. A chunk maps its whole range of the file at once, also beyond the
// file's end (nothing touches a slot before the file covers it). The park costs
// address space, not memory, and its idle granules cost no vm.max_map_count entries
// of their own: it stays one mapping per chunk (up to three with alignment padding).
// With granules of 2 MiB or more, reservations and chunks are aligned to 2 MiB
// (sharedMoveAlign), so a reservation may use up to 2 MiB of address space more than
// its size.

const (
	// sharedParkFirst is the address space of the first chunk of the park.
	sharedParkFirst = 1 << 30
	// sharedMoveAlign is what one page-table page maps on x86-64 and arm64 with
	// 4 KiB pages: the kernel moves a whole page-table page, not its 512 entries one
	// by one, when source and destination are both aligned to it. Reservations and
	// park chunks of granules at least this large are aligned to it.
	sharedMoveAlign = 2 << 20
)

// sharedChunk is one chunk of the park.
type sharedChunk struct {
	raw  unsafe.Pointer // as reserved, for munmap
	rawN int
	base unsafe.Pointer // where its first slot is mapped
}

// sharedSpan is address space to give back at Close.
type sharedSpan struct {
	at unsafe.Pointer
	n  int
}

// chunkOf returns the park chunk of slot i.
func (s *Shared) chunkOf(i int) int { return bits.Len(uint(i/s.park0+1)) - 1 }

// chunkFirst returns the first slot of chunk k.
func (s *Shared) chunkFirst(k int) int { return s.park0 * (1<<k - 1) }

// parkAt returns the address of slot i in the park. Its chunk must exist; s.mu must
// be held.
func (s *Shared) parkAt(i int) unsafe.Pointer {
	if !sharedPark {
		return nil // no park: a move fails and the caller maps afresh
	}
	k := s.chunkOf(i)
	return sharedAt(s.park[k].base, (i-s.chunkFirst(k))<<s.shift)
}

// sharedAlignment returns the alignment of reservations and park chunks of granule
// g, and the bytes to reserve beyond a range to reach it.
func sharedAlignment(g int) (align, pad int) {
	if g < sharedMoveAlign || !sharedPark {
		return 1, 0
	}
	return sharedMoveAlign, sharedMoveAlign - os.Getpagesize()
}

// growPark maps park chunks until the park covers slots [0, n). A chunk that can
// not be mapped is not added, and its address space is given back (or, if that
// fails too, at Close). s.mu must be held.
func (s *Shared) growPark(n int) error {
	if !sharedPark {
		return nil
	}
	for len(s.park) == 0 || s.chunkFirst(len(s.park)) < n {
		k := len(s.park)
		slots := s.park0 << k
		if k >= 48 || slots > (math.MaxInt-sharedMoveAlign)>>s.shift {
			return fmt.Errorf("host: the park would need chunk %d of %d granules", k, slots)
		}
		size := slots << s.shift
		align, pad := sharedAlignment(s.g)
		raw, err := s.sys.reserve(size + pad)
		if err != nil {
			return err
		}
		base := sharedAlign(raw, align)
		if err := s.sys.mapFile(base, size, s.fd, int64(s.chunkFirst(k))<<s.shift, false); err != nil {
			if rerr := s.sys.release(raw, size+pad); rerr != nil {
				s.stray = append(s.stray, sharedSpan{raw, size + pad})
			}
			return err
		}
		s.adviseFile(base, size)
		s.park = append(s.park, sharedChunk{raw: raw, rawN: size + pad, base: base})
	}
	return nil
}

// releasePark unmaps the park and any stray address space, and reports whether it
// all went (the park maps the file, so while any of it stays the file's pages
// stay). s.mu must be held.
func (s *Shared) releasePark() (bool, error) {
	var err error
	for len(s.park) > 0 {
		c := s.park[len(s.park)-1]
		if rerr := s.sys.release(c.raw, c.rawN); rerr != nil {
			err = fmt.Errorf("host: unmap the park: %w", rerr)
			break
		}
		s.park = s.park[:len(s.park)-1]
	}
	for len(s.stray) > 0 {
		c := s.stray[len(s.stray)-1]
		if rerr := s.sys.release(c.at, c.n); rerr != nil {
			if err == nil {
				err = fmt.Errorf("host: unmap reserved address space: %w", rerr)
			}
			break
		}
		s.stray = s.stray[:len(s.stray)-1]
	}
	return len(s.park) == 0, err
}

// place maps slots[k] at granule gi+k of r for a commit, one call per run of
// consecutive slots in one chunk: it moves the run out of the park with its page
// tables, or, where the move fails, maps it afresh (its pages then fault on first
// touch). It returns how many granules (a prefix) it mapped and the first error of
// a fresh map. s.mu must be held.
func (s *Shared) place(r *SharedReservation, gi int, slots []int) (int, error) {
	for k := 0; k < len(slots); {
		end := s.chunkFirst(s.chunkOf(slots[k]) + 1)
		j := k + 1
		for j < len(slots) && slots[j] == slots[j-1]+1 && slots[j] < end {
			j++
		}
		at, n := r.at(gi+k), (j-k)<<s.shift
		if err := s.sys.move(s.parkAt(slots[k]), at, n); err != nil {
			if err := s.sys.mapFile(at, n, s.fd, int64(slots[k])<<s.shift, false); err != nil {
				return k, err
			}
			s.adviseFile(at, n)
		}
		k = j
	}
	return len(slots), nil
}

// parkable reports whether m, a mapping being removed, should go to the park: it is
// its slot's last, and read-write (a read-only one would have to be made writable,
// a step more; it goes idle without its page tables instead). s.mu must be held.
func (s *Shared) parkable(m sharedMap) bool {
	return m.at != 0 && !m.ro && s.slots[m.slot()].refs == 1
}

// parkLast moves into the park the mappings of granules [gi, gi+n) of r that drop will
// make idle and keep in the pool, one move per run of consecutive slots in one
// chunk, so that their page tables wait there for the next commit. The caller then
// unmaps the range as usual. A move that fails changes nothing but that the run's
// page tables go with the unmap; the granules still go idle. s.mu must be held.
func (s *Shared) parkLast(r *SharedReservation, gi, n int) {
	room := s.high - s.nIdle - s.nPrivIdle
	if room <= 0 || s.auth.OthersWait() {
		return // drop gives them all back
	}
	for i := gi; i < gi+n && room > 0; {
		m := r.maps[i]
		if !s.parkable(m) {
			i++
			continue
		}
		end := s.chunkFirst(s.chunkOf(m.slot()) + 1)
		j := i + 1
		for j < gi+n && j-i < room {
			next := r.maps[j]
			if !s.parkable(next) || next.slot() != r.maps[j-1].slot()+1 || next.slot() >= end {
				break
			}
			j++
		}
		_ = s.sys.move(r.at(i), s.parkAt(m.slot()), (j-i)<<s.shift)
		room -= j - i
		i = j
	}
}
