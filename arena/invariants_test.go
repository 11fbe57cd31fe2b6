//go:build invariants

package arena

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/internal/testutil"
)

// TestBooksChecked checks that, in the invariants build, the next call on a buffer
// whose counts were made to disagree panics with a message that names the
// invariant.
func TestBooksChecked(t *testing.T) {
	const g = 4096
	for _, tt := range []struct {
		name    string
		corrupt func(buf *Buffer[*backingtest.FakeReservation, *backingtest.Fake])
	}{
		{"run past the capacity", func(buf *Buffer[*backingtest.FakeReservation, *backingtest.Fake]) { buf.end = buf.capacity + g }},
		{"run not whole granules", func(buf *Buffer[*backingtest.FakeReservation, *backingtest.Fake]) { buf.end-- }},
		{"Len past the run", func(buf *Buffer[*backingtest.FakeReservation, *backingtest.Fake]) { buf.length = buf.end + 1 }},
		{"shared span outside the run", func(buf *Buffer[*backingtest.FakeReservation, *backingtest.Fake]) {
			buf.shared = []span{{buf.end, buf.end + g}}
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			gov := accounting.NewGovernor()
			auth := gov.Authority("buf", accounting.HostKey)
			buf, err := NewBuffer(backingtest.NewFake(backingtest.FakeOptions{Granularity: g}), 4*g, auth)
			require.NoError(t, err)
			require.NoError(t, buf.Resize(g+1))
			start, end, length := buf.start, buf.end, buf.length
			tt.corrupt(buf)
			assert.Contains(t, testutil.PanicOf(func() { _ = buf.Resize(1) }), "arena: invariant: ")
			buf.start, buf.end, buf.length, buf.shared = start, end, length, nil
			require.True(t, buf.Close().OK())
		})
	}
}
