//go:build linux || windows

package kv_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
)

// trimFailing is a Faulty whose pool refuses to give idle granules back.
type trimFailing[R any] struct {
	*backingtest.Faulty[R]
	err error
}

func (f trimFailing[R]) Trim(int) (int64, error) { return 0, f.err }

// A failed batch step whose pool can not give back the granules the undone part
// took says so next to the step's own error; the sequences are as before and whole,
// and the granules wait idle in the pool for a Trim that works.
func TestAppendBatchRollbackTrimFails(t *testing.T) {
	e := openEnv(t, onShared, withGranule(64<<10), noCache, withName("kv-rollback-trim"))
	b, pool := e.shared, e.auth
	faulty := backingtest.NewFaulty[*host.SharedReservation](b)
	errTrim := errors.New("trim refused")
	c, err := kv.New(trimFailing[*host.SharedReservation]{faulty, errTrim}, kv.Config{Model: tiny8, MaxTokens: 1024, BlockTokens: 1})
	require.NoError(t, err)
	defer func() { assert.NoError(t, c.Close()) }()
	pair := func() []*kv.Sequence {
		seqs := newSeqs(t, c, 2)
		for i, s := range seqs {
			require.NoError(t, s.Append(5)) // one granule
			writeTokens(t, s, uint64(i), 0, s.Len())
		}
		return seqs
	}
	// The calls the first sequence's growth makes, alone: the fault goes to the next.
	probe := pair()
	faulty.Reset()
	require.NoError(t, c.AppendBatch([]kv.Growth{{probe[0], 20}})) // a second granule
	first := faulty.Calls()
	require.Positive(t, first)
	closeAll(t, probe...)

	seqs := pair()
	defer closeAll(t, seqs...)
	_, err = b.Trim(0) // the step's granules are new ones
	require.NoError(t, err)
	idle, owned := b.PoolStats().Idle, pool.Stats().Owned
	boom := errors.New("injected")
	faulty.Reset()
	faulty.FailAt(first+1, boom) // the second sequence's growth
	err = c.AppendBatch([]kv.Growth{{seqs[0], 20}, {seqs[1], 20}})
	require.ErrorIs(t, err, boom)
	require.ErrorIs(t, err, errTrim, "the granules that stay in the pool are reported")
	assert.NotErrorIs(t, err, kv.ErrDamaged)
	assert.Equal(t, []int{5, 5}, lens(seqs), "the step undone whole")
	for i, s := range seqs {
		assert.False(t, s.Damaged())
		checkTokens(t, s, uint64(i), 0, s.Len())
	}
	assert.Greater(t, b.PoolStats().Idle, idle, "the first sequence's new granule waits idle in the pool")
	_, err = b.Trim(0)
	require.NoError(t, err)
	assert.Equal(t, owned, pool.Stats().Owned, "a Trim that works gives it back")
}
