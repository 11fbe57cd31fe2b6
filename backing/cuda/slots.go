package cuda

// A reservation's bookkeeping is a two-level table of slots, one slot per granule:
// a top-level slice with one pointer per chunkSlots granules, and a chunk allocated on
// the first commit into it and dropped with its last mapping. What a reservation
// costs on the heap is thus proportional to what is committed in it, plus a pointer
// per chunk reserved: a sequence may reserve far more address space than it ever
// maps (the point of reserving), and 128 TiB reserved at 2 MiB granules is 512 KiB of
// pointers, not a gibibyte of slots (and one chunk kept spare, see cleared).

const (
	chunkShift = 9
	chunkSlots = 1 << chunkShift // granules per chunk (1 GiB at 2 MiB granules)

	// maxChunks bounds a reservation's top-level table (2 MiB of pointers): beyond it
	// the address space asked for is past what the driver hands out (2^27 granules of
	// 2 MiB is 256 TiB, twice the 47-bit user address space unified addressing
	// shares), and Reserve refuses it before asking the driver.
	maxChunks = 1 << 18
)

// slotChunk holds the slots of chunkSlots consecutive granules.
type slotChunk struct {
	s [chunkSlots]slot
	n int // slots holding a mapping (h not nil)
}

// slotTable maps granule indexes to slots; an absent chunk reads as all Reserved.
type slotTable struct {
	c     []*slotChunk
	n     int        // granules
	spare *slotChunk // the last chunk dropped, all Reserved: the next one made
}

// newSlotTable returns the table for n granules (n at most maxChunks*chunkSlots).
func newSlotTable(n int) slotTable {
	return slotTable{c: make([]*slotChunk, (n+chunkSlots-1)>>chunkShift), n: n}
}

// run returns the slots of granules [i, next), next the lesser of end and the end of
// i's chunk: nil when that chunk holds no mapping (every granule Reserved). Loops over
// [first, end) take a chunk at a time:
//
//	for i := first; i < end; {
//		s, next := t.run(i, end)
//		...
//		i = next
//	}
func (t *slotTable) run(i, end int) ([]slot, int) {
	next := min(end, (i|(chunkSlots-1))+1)
	c := t.c[i>>chunkShift]
	if c == nil {
		return nil, next
	}
	lo := i & (chunkSlots - 1)
	return c.s[lo : lo+next-i], next
}

// at returns the slot of granule i (the zero slot where nothing is mapped).
func (t *slotTable) at(i int) slot {
	if c := t.c[i>>chunkShift]; c != nil {
		return c.s[i&(chunkSlots-1)]
	}
	return slot{}
}

// set records the mappings hs at granules from first on, each Reserved until now,
// allocating the chunks they fall in.
func (t *slotTable) set(first int, hs []*handle, ro bool) {
	for k := 0; k < len(hs); {
		i := first + k
		c := t.c[i>>chunkShift]
		if c == nil {
			if c = t.spare; c != nil {
				t.spare = nil
			} else {
				c = new(slotChunk)
			}
			t.c[i>>chunkShift] = c
		}
		lo := i & (chunkSlots - 1)
		m := min(len(hs)-k, chunkSlots-lo)
		for j, h := range hs[k : k+m] {
			c.s[lo+j] = slot{h: h, ro: ro, shared: ro}
		}
		c.n += m
		k += m
	}
}

// cleared notes that the m slots from granule i on, in one chunk, each mapped until
// now, were cleared, and drops the chunk when that was its last mapping. It keeps
// one dropped chunk for the next: a granule committed and decommitted in turn (a
// sequence's growth at a block boundary) must not make and drop a chunk each time.
func (t *slotTable) cleared(i, m int) {
	c := t.c[i>>chunkShift]
	if c.n -= m; c.n == 0 {
		t.c[i>>chunkShift] = nil
		if t.spare == nil {
			t.spare = c
		}
	}
}

// nextMapped returns the first run [i, j) of mapped granules at or after from, or
// i == t.n when none is left. It skips absent chunks whole.
func (t *slotTable) nextMapped(from int) (int, int) {
	i := from
	for i < t.n {
		s, next := t.run(i, t.n)
		k := 0
		for k < len(s) && s[k].h == nil {
			k++
		}
		if k < len(s) {
			i += k
			break
		}
		i = next
	}
	if i >= t.n {
		return t.n, t.n
	}
	j := i
	for j < t.n {
		s, next := t.run(j, t.n)
		k := 0
		for k < len(s) && s[k].h != nil {
			k++
		}
		j += k
		if k < len(s) || s == nil {
			break
		}
		j = next
	}
	return i, j
}

// setReadOnly sets the ro bit of the committed granules [i, end).
func (t *slotTable) setReadOnly(i, end int, ro bool) {
	for i < end {
		s, next := t.run(i, end)
		for k := range s {
			s[k].ro = ro
		}
		i = next
	}
}
