package kv_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/kv"
)

// TestNewRefusesZeroBudget: a cache on a device whose budget is 0 bytes could never
// hold a token, so New refuses it with a clear error; a budget of one byte or none at
// all builds, and a limit lowered to 0 later only drains (nothing more is admitted).
func TestNewRefusesZeroBudget(t *testing.T) {
	for _, tt := range []struct {
		name   string
		limit  int64 // -1: never set
		refuse bool
	}{
		{"zero", 0, true},
		{"one byte", 1, false},
		{"unset", -1, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			gov := accounting.NewGovernor()
			if tt.limit >= 0 {
				require.NoError(t, gov.SetLimit(accounting.HostKey, tt.limit))
			}
			auth := gov.Authority("kv", accounting.HostKey)
			c, err := kv.New(backingtest.NewFake(backingtest.FakeOptions{Granularity: 4096}), kv.Config{Model: kv.Tiny(), MaxTokens: 64, Authority: auth})
			if tt.refuse {
				require.ErrorIs(t, err, kv.ErrConfig)
				assert.ErrorContains(t, err, "budget of host:0 is 0 bytes")
				assert.Nil(t, c)
				return
			}
			require.NoError(t, err)
			require.NoError(t, gov.SetLimit(accounting.HostKey, 0)) // drained after construction
			s, err := c.NewSequence()
			require.NoError(t, err)
			assert.ErrorIs(t, s.Append(1), accounting.ErrBudgetExceeded, "a drained device admits nothing")
			assert.True(t, s.Close().OK())
			require.NoError(t, c.Close())
		})
	}
}
