package kv_test

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests when a goroutine is still running after them:
// a background refill, a reclaimer or a waiter that outlived its owner's Close.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
