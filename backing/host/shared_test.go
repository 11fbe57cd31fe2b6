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

// TestSharedHugeMode: how NewShared picks its new granules from the system's modes,
// and what its stats say, on any system. Where the kernel has no transparent huge
// pages the huge page size is unknown (0), as on Windows: the choice must not divide
// by it.
func TestSharedHugeMode(t *testing.T) {
	const g = 2 << 20
	priv := "private" // what a system with mremap makes where huge pages are off
	shmemNoPriv := "memfd granules get huge pages"
	if runtime.GOOS != "linux" {
		priv, shmemNoPriv = "memfd", "need mremap" // the first reason is the system's
	}
	type test struct {
		name            string
		opts            host.SharedOptions
		shmem, anon     string // why each kind of memory may have no huge pages
		pmd             int
		reporting       string
		mode, noHuge    string
		noPrivContained string // "" when granules are private
	}
	tests := []test{
		{name: "no THP, huge page size unknown", opts: host.SharedOptions{Granularity: g},
			shmem: "no shmem THP", anon: "no anon THP", pmd: 0,
			mode: priv, noHuge: "no shmem THP and no anon THP"},
		{name: "no THP, small granule, huge page size unknown", opts: host.SharedOptions{Granularity: 64 << 10},
			shmem: "no shmem THP", anon: "no anon THP", pmd: 0,
			mode: priv, noHuge: "no shmem THP and no anon THP"},
		{name: "no THP, NoPrivateGranules", opts: host.SharedOptions{Granularity: g, NoPrivateGranules: true},
			shmem: "no shmem THP", anon: "no anon THP", pmd: 0,
			mode: "memfd", noHuge: "no shmem THP and no anon THP", noPrivContained: "NoPrivateGranules"},
		{name: "NoHugePages", opts: host.SharedOptions{Granularity: g, NoHugePages: true},
			shmem: "no shmem THP", pmd: g,
			mode: priv, noHuge: "turned off by SharedOptions.NoHugePages"},
		{name: "guest that reports free memory", opts: host.SharedOptions{Granularity: g},
			shmem: "no shmem THP", pmd: g, reporting: "reports",
			mode: priv, noHuge: "reports"},
		{name: "shmem huge pages", opts: host.SharedOptions{Granularity: g}, pmd: g,
			mode: "shmem-huge", noPrivContained: shmemNoPriv},
		{name: "granule not a multiple", opts: host.SharedOptions{Granularity: 64 << 10},
			shmem: "no shmem THP", pmd: g,
			mode: priv, noHuge: "the 65536-byte granule is not a multiple of the 2097152-byte huge page"},
	}
	if runtime.GOOS == "linux" {
		tests = append(tests, test{name: "private huge pages", opts: host.SharedOptions{Granularity: g},
			shmem: "no shmem THP", pmd: g, mode: "private-huge"})
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			mode, noHuge, noPriv := host.SharedHugeMode(tt.opts, tt.shmem, tt.anon, tt.pmd, tt.reporting)
			assert.Equal(t, tt.mode, mode)
			assert.Equal(t, tt.noHuge, noHuge)
			switch {
			case tt.noPrivContained != "":
				assert.Contains(t, noPriv, tt.noPrivContained)
			case mode == "memfd":
				assert.NotEmpty(t, noPriv, "memfd granules say why they are not private")
			default:
				assert.Empty(t, noPriv)
			}
		})
	}
}
