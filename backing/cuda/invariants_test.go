//go:build invariants

package cuda

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/vmarena/vmarena/internal/testutil"
)

// TestCountsChecked checks that the backing's invariant check panics, with a message
// that names the invariant, on counts that went wrong, and passes counts that did
// not.
func TestCountsChecked(t *testing.T) {
	const g = 2 << 20
	for _, tt := range []struct {
		name string
		b    *Backing
		bad  bool
	}{
		{"consistent", &Backing{gran: g, nres: 1, owned: 2, idle: make([]*handle, 1), mapped: g}, false},
		{"reservations below zero", &Backing{gran: g, nres: -1}, true},
		{"idle past owned", &Backing{gran: g, owned: 1, idle: make([]*handle, 1), stuck: make([]*handle, 1)}, true},
		{"mapped not whole granules", &Backing{gran: g, mapped: g + 1}, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got := testutil.PanicOf(tt.b.checkCountsLocked)
			if tt.bad {
				assert.Contains(t, got, "cuda: invariant: ")
			} else {
				assert.Empty(t, got)
			}
		})
	}
}
