//go:build linux || windows

package arena_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/internal/testutil"
)

// TestBufferProtectHostFaults stores through the buffers' host memory: after Protect
// the origin of a read-only share faults on a write as its sharer does.
func TestBufferProtectHostFaults(t *testing.T) {
	pool := accounting.NewGovernor().Authority("pool", accounting.HostKey)
	mem, err := host.NewShared(host.SharedOptions{Granularity: g, Authority: pool})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, mem.Close()) })
	origin, err := arena.NewBuffer(mem, 2*g, nil)
	require.NoError(t, err)
	defer origin.Close()
	require.NoError(t, origin.Resize(2*g))
	fork, err := arena.NewBuffer(mem, 2*g, nil)
	require.NoError(t, err)
	defer fork.Close()
	require.NoError(t, fork.ShareFrom(origin, 2*g, backing.ReadOnly))

	assert.Error(t, testutil.Touch(fork.Base()+g, true), "the sharer's store faults")
	assert.NoError(t, testutil.Touch(origin.Base()+g, true), "the origin's store lands, before Protect")
	assert.Equal(t, byte(1), fork.Bytes()[g], "and the sharer reads it")
	require.NoError(t, origin.Protect(0, 2*g, backing.ReadOnly))
	assert.Error(t, testutil.Touch(origin.Base()+g+1, true), "after Protect the origin's store faults too")
	assert.Zero(t, fork.Bytes()[g+1], "and wrote nothing")
	require.NoError(t, origin.Protect(0, 2*g, backing.ReadWrite))
	assert.NoError(t, testutil.Touch(origin.Base()+g+1, true), "the owner writes again")
	assert.Equal(t, byte(1), fork.Bytes()[g+1])
}

func ExampleBuffer_Protect() {
	pool := accounting.NewGovernor().Authority("kv", accounting.HostKey)
	mem, err := host.NewShared(host.SharedOptions{Granularity: 64 << 10, Authority: pool})
	if err != nil {
		panic(err)
	}
	defer mem.Close()
	prompt, _ := arena.NewBuffer(mem, 1<<20, nil)
	defer prompt.Close()
	_ = prompt.Resize(128 << 10)
	copy(prompt.Bytes(), "system prompt")

	// A fork maps the prompt's granules read-only; the prompt stops writing them too.
	fork, _ := arena.NewBuffer(mem, 1<<20, nil)
	defer fork.Close()
	_ = fork.ShareFrom(prompt, 128<<10, backing.ReadOnly)
	fmt.Println(prompt.Protect(0, 128<<10, backing.ReadOnly))
	err = mem.CopyIn(prompt.Reservation(), 0, []byte("S"))
	fmt.Println(errors.Is(err, backing.ErrReadOnly))
	err = fork.Protect(0, 128<<10, backing.ReadWrite)
	fmt.Println(errors.Is(err, backing.ErrReadOnly))
	fmt.Println(string(fork.Bytes()[:13]))
	// Output:
	// <nil>
	// true
	// true
	// system prompt
}
