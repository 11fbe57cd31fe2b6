//go:build invariants

package accounting

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/internal/testutil"
)

// TestLedgerChecked checks that, in the invariants build, the next transition of a
// ledger whose books were made to lie panics with a message that names the
// invariant.
func TestLedgerChecked(t *testing.T) {
	for _, tt := range []struct {
		name    string
		corrupt func(a *Authority)
	}{
		{"device uses less than its ledgers own", func(a *Authority) { a.d.used -= 5 }},
		{"credit the ledger does not own", func(a *Authority) { a.credit = a.owned + 5 }},
		{"mapped below zero", func(a *Authority) { a.mapped = -1 }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			g := NewGovernor()
			a := g.Authority("a", HostKey)
			require.NoError(t, a.TryAcquire(10))
			g.mu.Lock()
			tt.corrupt(a)
			g.mu.Unlock()
			assert.Contains(t, testutil.PanicOf(func() { _ = a.TryAcquire(1) }), "accounting: invariant: ", "a take")
			assert.Contains(t, testutil.PanicOf(func() { a.Release(1) }), "accounting: invariant: ", "a release")
		})
	}
}
