package hosttier_test

import (
	"testing"

	"github.com/vmarena/vmarena/internal/invariants"
)

// TestMain fails the package's tests, in the invariants build, when an owner (a
// sequence, a buffer, a reservation) was garbage-collected without being closed.
func TestMain(m *testing.M) { invariants.Exit(m.Run()) }
