package host

import "math/bits"

// bitset is a bit set over granules: the committed granules of a Private reservation,
// the slots (granule-sized file offsets) of a Shared pool, the positions of its
// private park, the units of a placeholder record. Searches run a word at a time, so
// finding a free or idle slot in a pool of 32k granules (64 GiB at 2 MiB) scans at
// most 512 words.
type bitset []uint64

// newBitset returns a set of n clear bits.
func newBitset(n int) bitset { return make(bitset, (n+63)/64) }

// resize makes room for n bits; new bits are clear.
func (b *bitset) resize(n int) {
	w := (n + 63) / 64
	for len(*b) < w {
		*b = append(*b, 0)
	}
}

func (b bitset) set(i int)      { b[i/64] |= 1 << (uint(i) % 64) }
func (b bitset) clear(i int)    { b[i/64] &^= 1 << (uint(i) % 64) }
func (b bitset) has(i int) bool { return b[i/64]&(1<<(uint(i)%64)) != 0 }

// setRange sets bits [i, i+n).
func (b bitset) setRange(i, n int) {
	for ; n > 0; i, n = i+1, n-1 {
		b.set(i)
	}
}

// clearRange clears bits [i, i+n).
func (b bitset) clearRange(i, n int) {
	for ; n > 0; i, n = i+1, n-1 {
		b.clear(i)
	}
}

// next returns the first set bit in [i, n), or n.
func (b bitset) next(i, n int) int { return b.find(i, n, 0) }

// nextClear returns the first clear bit in [i, n), or n.
func (b bitset) nextClear(i, n int) int { return b.find(i, n, ^uint64(0)) }

// find returns the first bit in [i, n) that is set in b^flip, or n.
func (b bitset) find(i, n int, flip uint64) int {
	for i < n {
		if w := (b[i/64] ^ flip) >> (uint(i) % 64); w != 0 {
			return min(i+bits.TrailingZeros64(w), n)
		}
		i = (i/64 + 1) * 64
	}
	return n
}

// prev returns the last set bit below i, or -1.
func (b bitset) prev(i int) int {
	for i > 0 {
		i--
		w := b[i/64] << (63 - uint(i)%64)
		if w != 0 {
			return i - bits.LeadingZeros64(w)
		}
		i = i / 64 * 64
	}
	return -1
}

// all reports whether bits [i, i+k) are all set and lie below n.
func (b bitset) all(i, k, n int) bool {
	return i >= 0 && i+k <= n && b.nextClear(i, i+k) == i+k
}

// run returns the start of the first k consecutive set bits below n, or -1. When tail
// is true a run that reaches n counts whatever its length (the caller can extend it).
func (b bitset) run(k, n int, tail bool) int {
	for i := b.next(0, n); i < n; i = b.next(i, n) {
		j := b.nextClear(i, n)
		if j-i >= k || (tail && j == n) {
			return i
		}
		i = j
	}
	if tail {
		return n
	}
	return -1
}

// span returns a run of set bits below n for a request of want: the first run of at
// least want bits (start, want), else the first of the longest runs (start, its
// length), so that a caller that places want things in runs takes as few runs as
// the set allows. It returns (n, 0) when no bit below n is set.
func (b bitset) span(want, n int) (start, k int) { return b.spanOf(want, n, 0) }

// spanClear is span over the clear bits.
func (b bitset) spanClear(want, n int) (start, k int) { return b.spanOf(want, n, ^uint64(0)) }

func (b bitset) spanOf(want, n int, flip uint64) (start, k int) {
	start = n
	for i := b.find(0, n, flip); i < n; i = b.find(i, n, flip) {
		j := b.find(i, n, ^flip)
		if j-i >= want {
			return i, want
		}
		if j-i > k {
			start, k = i, j-i
		}
		i = j
	}
	return start, k
}

// count returns the number of set bits.
func (b bitset) count() int {
	n := 0
	for _, w := range b {
		n += bits.OnesCount64(w)
	}
	return n
}
