package host_test

import (
	"errors"
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/host"
)

// TestSharedSupported: Linux and Windows have the shared backing; elsewhere
// NewShared says plainly that it is not supported, with errors.ErrUnsupported.
func TestSharedSupported(t *testing.T) {
	gov := accounting.NewGovernor()
	auth := gov.Authority("shared", accounting.HostKey)
	s, err := host.NewShared(host.SharedOptions{Authority: auth})
	if runtime.GOOS == "windows" && errors.Is(err, errors.ErrUnsupported) {
		s, err = underWine(t, err, host.SharedOptions{Authority: auth})
	}
	if runtime.GOOS != "linux" && runtime.GOOS != "windows" {
		assert.Nil(t, s)
		assert.ErrorIs(t, err, errors.ErrUnsupported)
		assert.ErrorIs(t, err, backing.ErrUnsupported)
		assert.ErrorContains(t, err, "not supported on this system")
		return
	}
	require.NoError(t, err)
	assert.Equal(t, 2<<20, s.Granularity())
	assert.Equal(t, accounting.HostKey, s.Device())
	assert.Same(t, auth, s.Accounting().Authority())
	assert.True(t, backing.IsHostAccessible(s))
	assert.False(t, s.CommitZeroes(), "pooled granules keep their contents")
	require.NoError(t, s.Close())
}
