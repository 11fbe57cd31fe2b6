package nocopy_test

import (
	"reflect"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/vmarena/vmarena/internal/nocopy"
)

// TestVetSeesALock checks what go vet's copylocks check looks for: a pointer to the
// type is a sync.Locker and the type itself is not. It also checks that the marker
// takes no space in the structs that embed it.
func TestVetSeesALock(t *testing.T) {
	locker := reflect.TypeFor[sync.Locker]()
	typ := reflect.TypeFor[nocopy.NoCopy]()
	assert.True(t, reflect.PointerTo(typ).Implements(locker), "*NoCopy must be a sync.Locker")
	assert.False(t, typ.Implements(locker), "NoCopy must not be a sync.Locker")
	assert.Zero(t, typ.Size(), "NoCopy must take no space")
}
