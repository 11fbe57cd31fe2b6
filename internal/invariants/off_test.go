//go:build !invariants

package invariants_test

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"

	"github.com/vmarena/vmarena/internal/invariants"
)

// TestOff checks that the normal build has the checks off and that a Tracker costs
// its owner no space and reports nothing.
func TestOff(t *testing.T) {
	assert.False(t, invariants.Enabled)
	assert.Zero(t, unsafe.Sizeof(invariants.Tracker{}))
	func() {
		o := &struct {
			leak invariants.Tracker
			n    int
		}{}
		invariants.Track(&o.leak, o, "test.Leaked")
	}()
	assert.Empty(t, invariants.Leaks(nil))
}
