package kv_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
)

// TestMapAheadDefault: a cache maps ahead by default where its backing pools
// (host.Shared, cuda), NoMapAhead turns it off and wins over the old MapAhead, and
// Config reports what the cache does. A backing without a pool has nothing to map
// ahead with, and a model of recurrent groups alone nothing to map ahead: the
// default is off there without an error.
func TestMapAheadDefault(t *testing.T) {
	stateOnly := kv.Model{Name: "state-only", Layers: 1, Groups: []kv.Group{{Kind: kv.Recurrent, Layers: []int{0}, StateBytes: 64}}}
	for _, tt := range []struct {
		name    string
		kind    backingKind
		no, old bool // NoMapAhead, MapAhead
		states  bool // the model of recurrent groups alone
		want    bool // the cache maps ahead
	}{
		{"host.Shared", onShared, false, false, false, true},
		{"host.Shared/NoMapAhead", onShared, true, false, false, false},
		{"host.Shared/MapAhead", onShared, false, true, false, true},
		{"host.Shared/both", onShared, true, true, false, false},
		{"host.Shared/states alone", onShared, false, false, true, false},
		{"cuda", onCUDA, false, false, false, true},
		{"cuda/NoMapAhead", onCUDA, true, false, false, false},
		{"backingtest.Fake", onFake, false, false, false, false},
		{"host.Private", onPrivate, false, false, false, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cfg := oneBlockConfig(256, tt.old)
			cfg.NoMapAhead = tt.no
			if tt.states {
				cfg.Model = stateOnly
			}
			e := openEnv(t, tt.kind, withGranule(int(blockGranule)), withDefaultAhead, withConfig(cfg))
			assert.Equal(t, tt.want, e.c.Config().MapAhead, "what Config reports")
			if tt.states {
				return
			}
			s, err := e.c.NewSequence()
			require.NoError(t, err)
			require.NoError(t, s.Append(16)) // a whole block: the next one is within reach
			e.c.WaitAhead()
			if tt.want {
				assert.Equal(t, blockGranule, e.c.Stats().Ahead, "the next block, committed ahead")
			} else {
				assert.Zero(t, e.c.Stats().Ahead)
			}
			assert.True(t, s.Close().OK())
			e.finish(t)
		})
	}
}
