//go:build !windows

package host_test

import (
	"testing"

	"github.com/vmarena/vmarena/backing/host"
)

// underWine returns err: only Windows binaries run under Wine.
func underWine(_ *testing.T, err error, _ host.SharedOptions) (*host.Shared, error) { return nil, err }
