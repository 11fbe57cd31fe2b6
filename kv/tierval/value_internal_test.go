package tierval

import (
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestTierValueUnsummedPayload checks the value an in-process tier gets: its payload
// is left out of the checksum and everything else is checked as ever; only a read
// from an in-process tier accepts it, and a summed value is checked whole there too.
func TestTierValueUnsummedPayload(t *testing.T) {
	key := Key{Namespace: 7, Hash: 9}
	tokens := []int32{1, 2, 3, 4}
	const payload = 64
	encode := func(flags uint16) []byte {
		v := make([]byte, Size(len(tokens), payload))
		require.NoError(t, encode(v, key, tokens, payload, func(p []byte) error {
			for i := range p {
				p[i] = byte(i)
			}
			return nil
		}, flags))
		return v
	}
	v := encode(payloadUnsummed)
	got, err := decode(v, key, tokens, payload, true)
	require.NoError(t, err)
	assert.Equal(t, byte(5), got[5])

	_, err = Decode(v, key, tokens, payload)
	assert.ErrorIs(t, err, ErrFormat, "an unsummed value from a tier that is not in-process")
	_, err = decode(v, key, tokens, payload, false)
	assert.ErrorIs(t, err, ErrFormat)

	// Every byte of the header and the tokens is still summed; the payload is not.
	body := HeaderSize + 4*len(tokens)
	for i := range body {
		if i >= crcOffset && i < HeaderSize {
			continue // the checksum and the reserved word after it
		}
		w := append([]byte(nil), v...)
		w[i] ^= 0x10
		_, err := decode(w, key, tokens, payload, true)
		assert.ErrorIs(t, err, ErrValue, "byte %d flipped", i)
	}
	w := append([]byte(nil), v...)
	w[body+3] ^= 0x10
	_, err = decode(w, key, tokens, payload, true)
	assert.NoError(t, err, "the payload of an in-process value is not summed")

	// A summed value read from an in-process tier is checked whole.
	s := encode(0)
	s[body+3] ^= 0x10
	_, err = decode(s, key, tokens, payload, true)
	assert.ErrorIs(t, err, ErrChecksum)

	// Flags this build does not know are refused even in process.
	u := encode(payloadUnsummed)
	binary.LittleEndian.PutUint16(u[6:], 2)
	_, err = decode(u, key, tokens, payload, true)
	assert.ErrorIs(t, err, ErrFormat)
}
