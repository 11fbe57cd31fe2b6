package filetier_test

import (
	"encoding/binary"
	"hash/crc32"
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kvtier/filetier"
)

// TestChecksumField checks a file's CRC-32C field against the sum the format
// documents (header bytes [0, 40) and [44, 64), then the value), taken in one call
// over a copy, for values below, at and above the piece the tier sums at a time.
func TestChecksumField(t *testing.T) {
	tr := newTier(t, filetier.Options{Budget: 8 << 20})
	for i, n := range []int{0, 1, 64<<10 - 1, 64 << 10, 64<<10 + 1, 300 << 10, 2 << 20} {
		k := key(nsA, i)
		store(t, tr, k, value(n, uint64(i)))
		b, err := os.ReadFile(path(tr.Dir(), k))
		require.NoError(t, err)
		require.Len(t, b, filetier.FileSize(n))
		summed := append(append(append([]byte(nil), b[:40]...), b[44:filetier.HeaderSize]...), b[filetier.HeaderSize:filetier.HeaderSize+n]...)
		assert.Equal(t, crc32.Checksum(summed, crc32.MakeTable(crc32.Castagnoli)), binary.LittleEndian.Uint32(b[40:]), "value of %d bytes", n)
	}
}
