package cuda_test

import (
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/vmarena/vmarena/internal/invariants"
)

// helperEnv, when set, makes the test binary a helper process (see
// exportproc_linux_test.go) instead of running the tests.
const helperEnv = "CUDA_TEST_HELPER"

// TestMain runs a helper process when asked to. Otherwise it fails the package's
// tests when a goroutine is still running after them: a background refill, a
// reclaimer or a waiter that outlived its owner's Close; and, in the invariants
// build, when an owner was garbage-collected without being closed.
func TestMain(m *testing.M) {
	if mode := os.Getenv(helperEnv); mode != "" {
		os.Exit(runHelper(mode))
	}
	goleak.VerifyTestMain(m, goleak.Cleanup(invariants.Exit))
}
