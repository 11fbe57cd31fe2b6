package nodepool_test

import (
	"errors"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/nodepool"
)

// TestOptions checks the arguments every system validates before anything else.
func TestOptions(t *testing.T) {
	long := strings.Repeat("x", 120)
	for _, tt := range []struct {
		name string
		err  error
	}{
		{"Listen/empty path", func() error { _, err := nodepool.Listen("", nodepool.OwnerOptions{}); return err }()},
		{"Listen/long path", func() error { _, err := nodepool.Listen(long, nodepool.OwnerOptions{}); return err }()},
		{"Listen/granule", func() error {
			_, err := nodepool.Listen("s", nodepool.OwnerOptions{Granularity: 12345})
			return err
		}()},
		{"Listen/name", func() error {
			_, err := nodepool.Listen("s", nodepool.OwnerOptions{Name: strings.Repeat("n", 300)})
			return err
		}()},
		{"Attach/empty path", func() error { _, err := nodepool.Attach("", nodepool.ClientOptions{}); return err }()},
		{"Attach/long path", func() error { _, err := nodepool.Attach(long, nodepool.ClientOptions{}); return err }()},
		{"Attach/authority", func() error {
			a := accounting.NewGovernor().Authority("gpu", accounting.GPU(0))
			_, err := nodepool.Attach("s", nodepool.ClientOptions{Authority: a})
			return err
		}()},
	} {
		t.Run(tt.name, func(t *testing.T) { assert.ErrorIs(t, tt.err, nodepool.ErrInvalidOption) })
	}
	if runtime.GOOS != "linux" {
		_, err := nodepool.Listen(filepath.Join(t.TempDir(), "s"), nodepool.OwnerOptions{})
		assert.ErrorIs(t, err, errors.ErrUnsupported)
		_, err = nodepool.Attach(filepath.Join(t.TempDir(), "s"), nodepool.ClientOptions{})
		assert.ErrorIs(t, err, errors.ErrUnsupported)
	}
}
