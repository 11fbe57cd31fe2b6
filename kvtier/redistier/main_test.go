package redistier_test

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/vmarena/vmarena/internal/invariants"
)

// quiet drops go-redis's own log lines (a dial refused while a test has the server
// down, say): the tests check what the tier counts and returns instead.
type quiet struct{}

func (quiet) Printf(context.Context, string, ...any) {}

// TestMain fails the package's tests when a goroutine outlives them: every client
// the tests make is closed at cleanup.
func TestMain(m *testing.M) {
	redis.SetLogger(quiet{})
	goleak.VerifyTestMain(m, goleak.Cleanup(invariants.Exit))
}
