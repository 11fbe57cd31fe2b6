package host

import "math/bits"

// sharedBits is a bit set over the slots (granule-sized file offsets) of a memfd
// pool. Searches run a word at a time, so finding a free or idle slot in a pool of
// 32k granules (64 GiB at 2 MiB) scans at most 512 words.
type sharedBits []uint64

// resize makes room for n bits; new bits are clear.
func (b *sharedBits) resize(n int) {
	w := (n + 63) / 64
	for len(*b) < w {
		*b = append(*b, 0)
	}
}

func (b sharedBits) set(i int)      { b[i/64] |= 1 << (uint(i) % 64) }
func (b sharedBits) clear(i int)    { b[i/64] &^= 1 << (uint(i) % 64) }
func (b sharedBits) has(i int) bool { return b[i/64]&(1<<(uint(i)%64)) != 0 }

// next returns the first set bit in [i, n), or n.
func (b sharedBits) next(i, n int) int {
	for i < n {
		w := b[i/64] >> (uint(i) % 64)
		if w != 0 {
			return min(i+bits.TrailingZeros64(w), n)
		}
		i = (i/64 + 1) * 64
	}
	return n
}

// nextClear returns the first clear bit in [i, n), or n.
func (b sharedBits) nextClear(i, n int) int {
	for i < n {
		w := ^b[i/64] >> (uint(i) % 64)
		if w != 0 {
			return min(i+bits.TrailingZeros64(w), n)
		}
		i = (i/64 + 1) * 64
	}
	return n
}

// prev returns the last set bit below i, or -1.
func (b sharedBits) prev(i int) int {
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
func (b sharedBits) all(i, k, n int) bool {
	return i >= 0 && i+k <= n && b.nextClear(i, i+k) == i+k
}

// run returns the start of the first k consecutive set bits below n, or -1. When tail
// is true a run that reaches n counts whatever its length (the caller can extend it).
func (b sharedBits) run(k, n int, tail bool) int {
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
