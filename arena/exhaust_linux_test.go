package arena_test

import (
	"bytes"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/internal/testutil"
)

const exhaustEnv = "VMARENA_ARENA_EXHAUST_CHILD"

// A Buffer on host.Private whose growth the kernel refuses for lack of memory (its
// pages would pass RLIMIT_DATA, in a child process since the limit stays with it):
// the error matches backing.ErrOutOfMemory and ENOMEM, the buffer keeps its length,
// committed bytes and contents, and the ledger is charged exactly what stays
// committed (the lease taken for the refused granules is given back).
func TestBufferOutOfMemoryRlimit(t *testing.T) {
	if os.Getenv(exhaustEnv) != t.Name() {
		cmd := exec.Command(os.Args[0], "-test.run=^"+t.Name()+"$", "-test.v", "-test.count=1", "-test.timeout=5m")
		cmd.Env = append(os.Environ(), exhaustEnv+"="+t.Name())
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "child:\n%s", out)
		require.Contains(t, string(out), "--- PASS: "+t.Name(), "child:\n%s", out)
		for _, line := range strings.Split(string(out), "\n") {
			if strings.Contains(line, "under RLIMIT") {
				t.Log(strings.TrimSpace(line)) // the child's error, for the record
			}
		}
		return
	}
	const mib = 1 << 20
	p, err := host.NewPrivate(host.PrivateOptions{Granularity: mib})
	require.NoError(t, err)
	auth := accounting.NewGovernor().Authority("buffer", accounting.HostKey)
	buf, err := arena.NewBuffer(p, 4<<30, auth)
	require.NoError(t, err)
	require.NoError(t, buf.Resize(16*mib-10))
	mark := []byte("kept across the refusal")
	copy(buf.Bytes()[16*mib-10-len(mark):], mark)

	var old unix.Rlimit
	require.NoError(t, unix.Getrlimit(unix.RLIMIT_DATA, &old))
	limit := testutil.Status(t, "VmData") + 512<<20 // what the runtime may still map meanwhile
	require.Less(t, limit, old.Cur)
	require.NoError(t, unix.Setrlimit(unix.RLIMIT_DATA, &unix.Rlimit{Cur: limit, Max: old.Max}))
	err = buf.Resize(2 << 30)
	require.NoError(t, unix.Setrlimit(unix.RLIMIT_DATA, &old))

	require.Error(t, err, "2 GiB of pages past RLIMIT_DATA")
	t.Logf("resize under RLIMIT_DATA: %v", err)
	assert.ErrorIs(t, err, backing.ErrOutOfMemory)
	assert.ErrorIs(t, err, unix.ENOMEM)
	assert.Equal(t, 16*mib-10, buf.Len(), "the length is as it was")
	assert.Equal(t, 16*mib, buf.Committed(), "nothing more committed")
	assert.Equal(t, int64(16*mib), auth.Stats().Owned, "the ledger holds what is committed, exactly")
	assert.True(t, bytes.Equal(mark, buf.Bytes()[16*mib-10-len(mark):]), "the contents are intact")

	require.NoError(t, buf.Resize(2<<30), "the same growth within the limit")
	assert.Equal(t, int64(2<<30), auth.Stats().Owned)
	o := buf.Close()
	assert.True(t, o.OK(), "%v", o)
	assert.Zero(t, auth.Stats().Owned)
}
