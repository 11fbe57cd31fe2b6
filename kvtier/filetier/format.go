package filetier

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"

	"github.com/vmarena/vmarena/kv/tierval"
)

// The block file format: one file per block, named by its key (see tier.go), of
// whole alignment units so that it can be written and read with direct I/O. All
// integers are little-endian.
//
//	offset  size  field
//	0       4     magic "VMFT"
//	4       2     format version (fileVersion)
//	6       2     header size (headerSize): where the value starts
//	8       8     namespace of the key
//	16      8     hash of the key
//	24      8     value length n
//	32      4     alignment unit a the file is padded to
//	36      4     reserved, 0
//	40      4     CRC-32C (Castagnoli) of bytes [0, 40), [44, 64) and the value
//	44      20    reserved, 0
//	64      n     the value
//	64+n    pad   zeros up to a multiple of a (not summed; the file's length must be
//	              exactly roundUp(64+n, a))
//
// The key is in the header as well as in the name, so that a file copied or renamed
// over another's name (two files swapped) is refused; the namespace fingerprints the
// model, its layout and the user's prefix (kv.TierNamespace), so that a block of
// another model is refused even under a name that claims otherwise.
const (
	fileMagic   = "VMFT"
	fileVersion = 1
	headerSize  = 64
	crcOffset   = 40
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// fileSize returns the bytes of the file of a value of n bytes, padded to align.
func fileSize(n, align int) int {
	return roundUp(headerSize+n, align)
}

func roundUp(n, align int) int { return (n + align - 1) / align * align }

// seal writes the header of the value in b[headerSize:headerSize+n] under key, zeroes
// the padding after it, and sums it. b is the whole file: fileSize(n, align) bytes.
func seal(b []byte, key tierval.Key, n, align int) {
	h := b[:headerSize]
	copy(h, fileMagic)
	binary.LittleEndian.PutUint16(h[4:], fileVersion)
	binary.LittleEndian.PutUint16(h[6:], headerSize)
	binary.LittleEndian.PutUint64(h[8:], key.Namespace)
	binary.LittleEndian.PutUint64(h[16:], key.Hash)
	binary.LittleEndian.PutUint64(h[24:], uint64(n))
	binary.LittleEndian.PutUint32(h[32:], uint32(align))
	clear(h[36:])
	clear(b[headerSize+n:])
	binary.LittleEndian.PutUint32(h[crcOffset:], checksum(b, n))
}

// crcChunk is the most bytes one CRC call sums. The CRC's loop is assembly, where
// the Go scheduler can not stop a goroutine; a stop of the world (a collection's, or
// ReadMemStats') waits for it, with every other goroutine, the token path's
// included, stopped meanwhile. Summed in pieces, a store's goroutine stops at the
// next piece's call: a 64 KiB piece takes about 3 µs here, a 2 MiB value in one
// call 92 µs at best and longer on a busy CPU.
const crcChunk = 64 << 10

// checksum returns the CRC-32C of a file's header (all but its checksum field) and
// of its value of n bytes.
func checksum(b []byte, n int) uint32 {
	c := crc32.Update(0, castagnoli, b[:crcOffset])
	c = crc32.Update(c, castagnoli, b[crcOffset+4:headerSize])
	for v := b[headerSize : headerSize+n]; len(v) > 0; {
		k := min(len(v), crcChunk)
		c = crc32.Update(c, castagnoli, v[:k])
		v = v[k:]
	}
	return c
}

// open checks that b, the whole of a file read back, is the block of key padded to
// align, and returns its value: a sub-slice of b. A file that fails any check is
// refused with an error wrapping ErrCorrupt that says which.
func open(b []byte, key tierval.Key, align int) ([]byte, error) {
	n, err := header(b, key, align, int64(len(b)))
	if err != nil {
		return nil, err
	}
	if got, want := checksum(b, n), binary.LittleEndian.Uint32(b[crcOffset:]); got != want {
		return nil, corrupt("CRC-32C %#08x, header says %#08x", got, want)
	}
	return b[headerSize : headerSize+n], nil
}

// openHead is open for the first len(b) bytes of a file of size bytes (a Peek's
// read): it checks everything in the header but the checksum, which covers the whole
// value, and returns the value's bytes b holds.
func openHead(b []byte, key tierval.Key, align int, size int64) ([]byte, error) {
	n, err := header(b, key, align, size)
	if err != nil {
		return nil, err
	}
	return b[headerSize:min(len(b), headerSize+n)], nil
}

// header checks the header at the start of b, of a file of size bytes, for key's
// block padded to align: all but the checksum. It returns the value's length.
func header(b []byte, key tierval.Key, align int, size int64) (int, error) {
	if len(b) < headerSize {
		return 0, corrupt("%d bytes, a header is %d", len(b), headerSize)
	}
	h := b[:headerSize]
	if string(h[:4]) != fileMagic {
		return 0, corrupt("magic % x", h[:4])
	}
	if v, hs := binary.LittleEndian.Uint16(h[4:]), binary.LittleEndian.Uint16(h[6:]); v != fileVersion || hs != headerSize {
		return 0, corrupt("version %d header %d bytes, this build reads version %d of %d", v, hs, fileVersion, headerSize)
	}
	n := binary.LittleEndian.Uint64(h[24:])
	a := binary.LittleEndian.Uint32(h[32:])
	if a == 0 || int(a) != align || n > uint64(size) || int64(fileSize(int(n), align)) != size {
		return 0, corrupt("%d bytes for a value of %d padded to %d (this tier pads to %d)", size, n, a, align)
	}
	for _, off := range []int{36, 44, 48, 52, 56, 60} {
		if r := binary.LittleEndian.Uint32(h[off:]); r != 0 {
			return 0, corrupt("reserved word at %d is %#x", off, r)
		}
	}
	if ns, hash := binary.LittleEndian.Uint64(h[8:]), binary.LittleEndian.Uint64(h[16:]); ns != key.Namespace || hash != key.Hash {
		return 0, corrupt("key %016x:%016x, want %016x:%016x", ns, hash, key.Namespace, key.Hash)
	}
	return int(n), nil
}

func corrupt(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrCorrupt, fmt.Sprintf(format, args...))
}
