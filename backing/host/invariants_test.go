//go:build invariants

package host

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/vmarena/vmarena/internal/testutil"
)

// TestCountsChecked checks that the pool's invariant check panics, with a message
// that names the invariant, on counts that went wrong, and passes counts that did
// not.
func TestCountsChecked(t *testing.T) {
	const g = 4096
	for _, tt := range []struct {
		name string
		s    *Shared
		bad  bool
	}{
		{"consistent", &Shared{g: g, slots: make([]sharedSlot, 4), nIdle: 2, nResident: 1, owned: 3 * g, mapped: g}, false},
		{"idle past the slots", &Shared{g: g, slots: make([]sharedSlot, 1), nIdle: 2}, true},
		{"resident past idle", &Shared{g: g, slots: make([]sharedSlot, 4), nIdle: 1, nResident: 2}, true},
		{"owned not whole granules", &Shared{g: g, owned: g + 1}, true},
		{"mapped below zero", &Shared{g: g, mapped: -g}, true},
		{"live past the reservations", &Shared{g: g, live: 1}, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got := testutil.PanicOf(tt.s.checkCountsLocked)
			if tt.bad {
				assert.Contains(t, got, "host: invariant: ")
			} else {
				assert.Empty(t, got)
			}
		})
	}
}
