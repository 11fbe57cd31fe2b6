package testutil

import "bytes"

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

// tokenRun is byte(3k) for each k: TokenByte's bytes, a step of 3 apart, are
// tokenRun[k:], from the k where byte(3k) is its first (171 is 3's inverse mod 256),
// 256 at a time. FillToken and TokenAt copy and compare runs of it: a per-byte call
// was most of a fuzz input's time.
var tokenRun = func() (b [512]byte) {
	for k := range b {
		b[k] = byte(3 * k)
	}
	return b
}()

// FillToken sets buf[i] to TokenByte(w, layer, kind, token, i) for each i.
func FillToken[Kind ~uint8](buf []byte, w uint64, layer int, kind Kind, token int) {
	k := int(TokenByte(w, layer, kind, token, 0) * 171)
	for len(buf) > 0 {
		buf = buf[copy(buf, tokenRun[k:k+256]):]
	}
}

// TokenAt returns the index of the first byte of buf that is not
// TokenByte(w, layer, kind, token, i), or -1 when every one is.
func TokenAt[Kind ~uint8](buf []byte, w uint64, layer int, kind Kind, token int) int {
	k := int(TokenByte(w, layer, kind, token, 0) * 171)
	for at := 0; at < len(buf); at += 256 {
		part := buf[at:min(at+256, len(buf))]
		if bytes.Equal(part, tokenRun[k:k+len(part)]) {
			continue
		}
		for i := range part {
			if part[i] != tokenRun[k+i] {
				return at + i
			}
		}
	}
	return -1
}
