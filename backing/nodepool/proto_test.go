package nodepool_test

import (
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/backing/nodepool"
)

func TestDecodeBad(t *testing.T) {
	good := nodepool.Encode(nodepool.OpFree, 0, 7, 0, 0, 0, []uint64{1, 2})
	for _, tt := range []struct {
		name string
		p    []byte
	}{
		{"empty", nil},
		{"short header", good[:nodepool.HeaderLen-1]},
		{"reserved byte", func() []byte { p := clone(good); p[2] = 1; return p }()},
		{"unknown op 0", nodepool.Encode(0, 0, 1, 0, 0, 0, nil)},
		{"unknown op 99", nodepool.Encode(99, 0, 1, 0, 0, 0, nil)},
		{"code on a request", nodepool.Encode(nodepool.OpStats, 3, 1, 0, 0, 0, nil)},
		{"unknown code", nodepool.Encode(nodepool.OpStats|nodepool.ReplyBit, 200, 1, 0, 0, 0, nil)},
		{"too many ids", func() []byte {
			p := nodepool.Encode(nodepool.OpFree, 0, 1, 0, 0, 0, make([]uint64, nodepool.MaxBatch))
			binary.LittleEndian.PutUint32(p[4:], nodepool.MaxBatch+1)
			return append(p, make([]byte, 8)...)
		}()},
		{"count larger than the body", good[:len(good)-8]},
		{"body larger than the count", append(clone(good), make([]byte, 8)...)},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, _, _, _, _, err := nodepool.Decode(tt.p)
			assert.ErrorIs(t, err, nodepool.ErrProtocol)
		})
	}
}

func TestDecodeRoundTrip(t *testing.T) {
	p := nodepool.Encode(nodepool.OpFree, 0, 7, 0, 0, 0, []uint64{1, 1 << 63})
	require.Len(t, p, nodepool.HeaderLen+16)
	op, code, id, a, ids, err := nodepool.Decode(p)
	require.NoError(t, err)
	assert.Equal(t, nodepool.OpFree, op)
	assert.Zero(t, code)
	assert.Equal(t, uint64(7), id)
	assert.Zero(t, a)
	assert.Equal(t, []uint64{1, 1 << 63}, ids)
}

func FuzzDecode(f *testing.F) {
	f.Add(nodepool.Encode(nodepool.OpAlloc, 0, 1, 2, 0, 0, nil))
	f.Add(nodepool.Encode(nodepool.OpFree, 0, 1, 0, 0, 0, []uint64{1, 2, 3}))
	f.Fuzz(func(t *testing.T, p []byte) {
		op, code, id, a, ids, err := nodepool.Decode(p)
		if err != nil {
			return
		}
		// What decodes encodes back to the same bytes.
		q := nodepool.Encode(op, code, id, a, binary.LittleEndian.Uint64(p[24:]), binary.LittleEndian.Uint64(p[32:]), ids)
		assert.Equal(t, p, q)
	})
}

func clone(p []byte) []byte { return append([]byte(nil), p...) }
