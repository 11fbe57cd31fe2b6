package kv_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/kv"
)

// TestPrefixLoanNoLending: on a backing that shares within its process only
// (host.Shared, cuda, the Fake), Lend and BorrowPrefix are refused with
// ErrNoLending, which matches errors.ErrUnsupported, and change nothing.
func TestPrefixLoanNoLending(t *testing.T) {
	for kind := range sharingBackings {
		t.Run(sharingNames[kind], func(t *testing.T) {
			e := openEnv(t, kind, withConfig(kv.Config{MaxTokens: 64}))
			s, err := e.c.NewSequence()
			require.NoError(t, err)
			e.onFail(func() { s.Close() })
			require.NoError(t, s.Append(20))
			writeTokens(t, s, 1, 0, 20)
			p, err := s.Freeze(20)
			require.NoError(t, err)
			released := false
			e.onFail(func() {
				if !released {
					p.Release()
				}
			})
			before := e.auth.Stats()

			_, err = p.Lend(1)
			require.ErrorIs(t, err, kv.ErrNoLending)
			assert.ErrorIs(t, err, errors.ErrUnsupported)
			_, err = e.c.BorrowPrefix(kv.PrefixLoan{})
			require.ErrorIs(t, err, kv.ErrNoLending)
			assert.Equal(t, before, e.auth.Stats(), "nothing changed")
			assert.Equal(t, 1, e.c.Stats().Prefixes)

			p.Release()
			released = true
			checkTokens(t, s, 1, 0, 20)
			require.Equal(t, accounting.Complete, s.Close().Status)
			e.finish(t)
		})
	}
}

// TestPrefixLoanUnmarshal: bytes that are not a marshalled loan are refused with
// ErrLoan and leave the loan as it was; a loan of nothing goes and comes back.
func TestPrefixLoanUnmarshal(t *testing.T) {
	zero, err := kv.PrefixLoan{}.MarshalBinary()
	require.NoError(t, err)
	var back kv.PrefixLoan
	require.NoError(t, back.UnmarshalBinary(zero))
	assert.Equal(t, kv.PrefixLoan{}, back)
	assert.Zero(t, back.Len())
	assert.Zero(t, back.Granules())

	// A loan of 5 tokens, one group, one range of 2 granules at 0, ids 7 and 300.
	good := append([]byte("vmkvloan\x01"), 1, 2, 3, 4, 5, 6, 7, 8, // fingerprint
		3, 5, 0, 1, 0, 2, 7, 0xac, 0x02) // to, tokens, groups, ranges, start, count, ids
	var l kv.PrefixLoan
	require.NoError(t, l.UnmarshalBinary(good))
	assert.Equal(t, 5, l.Len())
	assert.Equal(t, 2, l.Granules())
	again, err := l.MarshalBinary()
	require.NoError(t, err)
	assert.Equal(t, good, again)

	for _, tt := range []struct {
		name string
		data []byte
	}{
		{"empty", nil},
		{"another format", append([]byte("vmkvloan\x02"), good[9:]...)},
		{"no fingerprint", good[:12]},
		{"truncated", good[:len(good)-1]},
		{"trailing bytes", append(append([]byte(nil), good...), 0)},
		{"a count past the bytes", append(append([]byte(nil), good[:20]...), 0x7f, 0)},
		{"a varint past 64 bits", append(append([]byte(nil), good[:17]...), 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f)},
	} {
		t.Run(tt.name, func(t *testing.T) {
			was := l
			err := l.UnmarshalBinary(tt.data)
			require.ErrorIs(t, err, kv.ErrLoan)
			assert.Equal(t, was, l, "the loan is as it was")
		})
	}
}

// FuzzPrefixLoanUnmarshal: any bytes are refused with ErrLoan or read as a loan
// that marshals to bytes read back as the same loan; nothing panics.
func FuzzPrefixLoanUnmarshal(f *testing.F) {
	f.Add([]byte(nil))
	f.Add(append([]byte("vmkvloan\x01"), 1, 2, 3, 4, 5, 6, 7, 8, 3, 5, 0, 1, 0, 2, 7, 0xac, 0x02))
	f.Add(append([]byte("vmkvloan\x01"), 1, 2, 3, 4, 5, 6, 7, 8, 3, 30, 2, 0, 25, 2, 0, 1, 9, 0x80, 0x20, 1, 10))
	f.Fuzz(func(t *testing.T, data []byte) {
		var l kv.PrefixLoan
		if err := l.UnmarshalBinary(data); err != nil {
			require.ErrorIs(t, err, kv.ErrLoan)
			return
		}
		out, err := l.MarshalBinary()
		require.NoError(t, err)
		var back kv.PrefixLoan
		require.NoError(t, back.UnmarshalBinary(out))
		require.Equal(t, l, back)
	})
}
