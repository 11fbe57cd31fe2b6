package host_test

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/vmarena/vmarena/internal/invariants"
)

// TestMain fails the package's tests when a goroutine is still running after them:
// a background refill, a reclaimer or a waiter that outlived its owner's Close; and,
// in the invariants build, when an owner was garbage-collected without being closed.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m, goleak.Cleanup(invariants.Exit)) }
