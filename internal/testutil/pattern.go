package testutil

// Fill writes seed's pattern into b: byte i is seed + 7i (mod 256), so buffers of two
// seeds differ, and a byte moved to another offset reads wrong.
func Fill(b []byte, seed byte) {
	for i := range b {
		b[i] = seed + byte(i*7)
	}
}

// Pattern returns n bytes of Fill's pattern for seed.
func Pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	Fill(b, seed)
	return b
}

// TokenByte is the byte at index i of token of (layer, kind) written by writer w: a
// cache test writes it and reads it back, and a byte of another writer, layer, kind,
// token or index reads wrong. Kind is the cache's own K or V type.
func TokenByte[Kind ~uint8](w uint64, layer int, kind Kind, token, i int) byte {
	return byte(w*131 + uint64(layer)*31 + uint64(kind)*17 + uint64(token)*7 + uint64(i)*3)
}
