package backing

import (
	"fmt"
	"math"
	"math/bits"
)

// IsPowerOfTwo reports whether n is a positive power of two.
func IsPowerOfTwo(n int) bool { return n > 0 && n&(n-1) == 0 }

// AlignUp rounds n up to a multiple of g, a power of two. It reports false when the
// result would overflow int or n is negative.
func AlignUp(n, g int) (int, bool) {
	if n < 0 || !IsPowerOfTwo(g) || n > math.MaxInt-(g-1) {
		return 0, false
	}
	return (n + g - 1) &^ (g - 1), true
}

// AlignDown rounds n down to a multiple of g, a power of two.
func AlignDown(n, g int) int { return n &^ (g - 1) }

// Granules returns how many granules of size g cover n bytes.
func Granules(n, g int) int {
	if n <= 0 {
		return 0
	}
	return (n-1)/g + 1
}

// Log2 returns log2 of g, a power of two.
func Log2(g int) int { return bits.TrailingZeros(uint(g)) }

// CheckRange validates [off, off+size) against a reservation of reserved bytes with
// granule g: off and size non-negative multiples of g, no overflow, inside the
// reservation. It returns an *OpError for op, or nil.
func CheckRange(op string, off, size, reserved, g int) error {
	switch {
	case off < 0 || size < 0:
		return &OpError{Op: op, Offset: off, Size: size, Kind: ErrInvalidRange, Err: fmt.Errorf("negative offset or size")}
	case off&(g-1) != 0 || size&(g-1) != 0:
		return &OpError{Op: op, Offset: off, Size: size, Kind: ErrInvalidRange, Err: fmt.Errorf("not a multiple of the %d-byte granule", g)}
	case off > math.MaxInt-size:
		return &OpError{Op: op, Offset: off, Size: size, Kind: ErrInvalidRange, Err: fmt.Errorf("offset plus size overflows")}
	case off+size > reserved:
		return &OpError{Op: op, Offset: off, Size: size, Kind: ErrOutOfRange, Err: fmt.Errorf("reservation is %d bytes", reserved)}
	}
	return nil
}

// CheckReserve validates a reservation size for granule g.
func CheckReserve(size, g int) error {
	switch {
	case size < 0:
		return &OpError{Op: "reserve", Size: size, Kind: ErrInvalidRange, Err: fmt.Errorf("negative size")}
	case size&(g-1) != 0:
		return &OpError{Op: "reserve", Size: size, Kind: ErrInvalidRange, Err: fmt.Errorf("not a multiple of the %d-byte granule", g)}
	}
	return nil
}
