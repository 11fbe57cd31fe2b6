package main

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
)

// TestAheadTwinBuilds: vmarena's twin is the same cache with map-ahead off, whatever
// -map-ahead says, and vmarena follows -map-ahead, whose default is kv's.
func TestAheadTwinBuilds(t *testing.T) {
	c, err := parseFlags(nil, nil)
	require.NoError(t, err)
	assert.Equal(t, !(kv.Config{}).NoMapAhead, c.mapAhead, "-map-ahead defaults to kv's default")
	for _, tt := range []struct {
		name     string
		mapAhead bool
		want     bool
	}{
		{nameCache, true, true},
		{nameCache, false, false},
		{nameCache + noAheadSuffix, true, false},
		{nameCache + noAheadSuffix, false, false},
	} {
		s := testSetup(1 << 30)
		s.backing, s.mapAhead = "shared", tt.mapAhead
		b, err := build(tt.name, s)
		require.NoError(t, err)
		cs := b.st.(*cacheStrategy)
		assert.Equal(t, tt.name, cs.Name())
		assert.Equal(t, tt.want, cs.c.Config().MapAhead, "%s, -map-ahead=%v", tt.name, tt.mapAhead)
		require.NoError(t, cs.Close())
	}
}
