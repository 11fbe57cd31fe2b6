//go:build linux || windows

package host_test

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/host"
)

// TestSharedChooseGranule: a Shared made with neither Granularity nor ShareUnit (nor
// Low) leaves its granule to the first of ChooseGranule and the entry points that
// read it; options that fix the granule, or a first call that fixed it, win over a
// later ChooseGranule.
func TestSharedChooseGranule(t *testing.T) {
	const small = 2 << 10 // the small model's 2 KiB tokens: 128 KiB granules
	for _, tt := range []struct {
		name  string
		opts  host.SharedOptions
		first func(*host.Shared) // called before ChooseGranule(small)
		want  int
	}{
		{name: "open", want: 128 << 10},
		{name: "open, chosen for a large unit", first: func(s *host.Shared) { s.ChooseGranule(128 << 10) }, want: 2 << 20},
		{name: "open, chosen for no unit", first: func(s *host.Shared) { s.ChooseGranule(0) }, want: 2 << 20},
		{name: "Granularity read first", first: func(s *host.Shared) { s.Granularity() }, want: 2 << 20},
		{name: "Reserve first", first: func(s *host.Shared) {
			r, err := s.Reserve(0)
			require.NoError(t, err)
			require.True(t, s.Unreserve(r).OK())
		}, want: 2 << 20},
		{name: "PoolStats first", first: func(s *host.Shared) { s.PoolStats() }, want: 2 << 20},
		{name: "Stats first", first: func(s *host.Shared) { s.Stats() }, want: 2 << 20},
		{name: "Prefill first", first: func(s *host.Shared) { require.NoError(t, s.Prefill(0)) }, want: 2 << 20},
		{name: "Trim first", first: func(s *host.Shared) { _, err := s.Trim(0); require.NoError(t, err) }, want: 2 << 20},
		{name: "Granularity given", opts: host.SharedOptions{Granularity: 64 << 10}, want: 64 << 10},
		{name: "ShareUnit given", opts: host.SharedOptions{ShareUnit: 24 << 10}, want: 1 << 20},
		{name: "Low given", opts: host.SharedOptions{Low: 1}, want: 2 << 20},
	} {
		t.Run(tt.name, func(t *testing.T) {
			gov := accounting.NewGovernor()
			opts := tt.opts
			opts.Authority = gov.Authority("shared", accounting.HostKey)
			s, err := host.NewShared(opts)
			require.NoError(t, err)
			defer func() { require.NoError(t, s.Close()) }()
			if tt.first != nil {
				tt.first(s)
			}
			assert.Equal(t, tt.want, s.ChooseGranule(small))
			assert.Equal(t, tt.want, s.Granularity(), "Granularity agrees from then on")
			assert.Equal(t, tt.want, s.ChooseGranule(3<<20), "a later choice changes nothing")
			assert.Equal(t, tt.want, s.PoolStats().Granule)
		})
	}
}

// TestSharedChooseGranuleWorks: a granule chosen small is the one every operation
// uses: a range of several granules commits, shares one granule into another
// reservation and gives everything back, and the ledger counts granules of that size.
func TestSharedChooseGranuleWorks(t *testing.T) {
	gov := accounting.NewGovernor()
	auth := gov.Authority("shared", accounting.HostKey)
	s, err := host.NewShared(host.SharedOptions{Authority: auth, High: host.SharedNoPool})
	require.NoError(t, err)
	defer func() { require.NoError(t, s.Close()) }()
	g := s.ChooseGranule(2 << 10)
	require.Equal(t, 128<<10, g)
	a, err := s.Reserve(4 * g)
	require.NoError(t, err)
	b, err := s.Reserve(4 * g)
	require.NoError(t, err)
	require.NoError(t, s.Commit(a, 0, 3*g))
	require.NoError(t, s.CopyIn(a, g, []byte("granule one")))
	require.NoError(t, s.Share(b, 0, a, g, g, backing.ReadOnly))
	got := make([]byte, len("granule one"))
	require.NoError(t, s.CopyOut(got, b, 0))
	assert.Equal(t, "granule one", string(got), "the shared granule is the one committed in a")
	assert.Equal(t, int64(3*g), auth.Stats().Owned, "three granules of the chosen size are owned")
	assert.True(t, s.Unreserve(b).OK())
	assert.True(t, s.Unreserve(a).OK())
	assert.Zero(t, auth.Stats().Owned)
}

// TestSharedChooseGranuleConcurrent: callers that race to fix an open granule all
// see the one that won (run with -race).
func TestSharedChooseGranuleConcurrent(t *testing.T) {
	s, err := host.NewShared(host.SharedOptions{Authority: accounting.NewGovernor().Authority("shared", accounting.HostKey)})
	require.NoError(t, err)
	defer func() { require.NoError(t, s.Close()) }()
	got := make([]int, 8)
	var wg sync.WaitGroup
	for i := range got {
		wg.Go(func() {
			if i%2 == 0 {
				got[i] = s.ChooseGranule(2 << 10)
			} else {
				got[i] = s.Granularity()
			}
		})
	}
	wg.Wait()
	for _, g := range got {
		assert.Equal(t, s.Granularity(), g)
	}
}

// TestSharedChooseGranuleNegative: a negative unit is misuse and panics, naming it.
func TestSharedChooseGranuleNegative(t *testing.T) {
	s, err := host.NewShared(host.SharedOptions{Authority: accounting.NewGovernor().Authority("shared", accounting.HostKey)})
	require.NoError(t, err)
	defer func() { require.NoError(t, s.Close()) }()
	assert.PanicsWithValue(t, "host: ChooseGranule of a -1-byte unit", func() { s.ChooseGranule(-1) })
}
