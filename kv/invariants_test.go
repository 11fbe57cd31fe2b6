//go:build invariants

package kv

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/vmarena/vmarena/internal/testutil"
)

// TestCountsChecked checks that kv's invariant checks panic, with a message that
// names the invariant, on counts that went wrong, and pass counts that did not.
func TestCountsChecked(t *testing.T) {
	for _, tt := range []struct {
		name  string
		check func()
		bad   bool
	}{
		{"prefix references at zero", (&Prefix{refs: 0}).checkRefs, false},
		{"prefix references below zero", (&Prefix{refs: -1}).checkRefs, true},
		{"prefix cache bytes with entries", (&PrefixCache{entries: 1, cachedBytes: 8}).checkCountsLocked, false},
		{"prefix cache bytes with no entry", (&PrefixCache{cachedBytes: 8}).checkCountsLocked, true},
		{"prefix cache entries below zero", (&PrefixCache{entries: -1}).checkCountsLocked, true},
		{"prefix cache emptied", (&PrefixCache{}).checkEmptyLocked, false},
		{"prefix cache emptied with entries left", (&PrefixCache{entries: 1, cachedBytes: 8}).checkEmptyLocked, true},
		{"cache sequences being made below zero", (&Cache{inflight: -1}).checkCountsLocked, true},
		{"cache entries below zero", (&Cache{entries: -1}).checkCountsLocked, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got := testutil.PanicOf(tt.check)
			if tt.bad {
				assert.Contains(t, got, "kv: invariant: ")
			} else {
				assert.Empty(t, got)
			}
		})
	}
}
