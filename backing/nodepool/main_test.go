package nodepool_test

import (
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/vmarena/vmarena/internal/invariants"
)

// helperEnv, when set, makes the test binary a helper process (see
// helper_linux_test.go) instead of running the tests.
const helperEnv = "NODEPOOL_TEST_HELPER"

// TestMain runs a helper process when asked to; otherwise it fails the package's
// tests when a goroutine is still running after them (a connection's reader, an
// allocation that outlived its owner's Close).
func TestMain(m *testing.M) {
	if mode := os.Getenv(helperEnv); mode != "" {
		os.Exit(runHelper(mode, os.Getenv(helperPathEnv)))
	}
	goleak.VerifyTestMain(m, goleak.Cleanup(invariants.Exit))
}

const helperPathEnv = "NODEPOOL_TEST_SOCKET"
