package cuda_test

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/cuda/cudatest"
)

// A granule exported by one process and imported by another: this test's process
// (A) commits granules, writes them, exports them and passes the descriptors by
// SCM_RIGHTS over a Unix socket to a helper process (B: this test binary run again,
// see TestMain), which imports and maps them, reads A's bytes bit-exact and writes
// its own, which A then reads.
//
// The messages, one SOCK_SEQPACKET record each, are text: A sends "import SEED" with
// the descriptors; B answers "read", "skip REASON" (the driver refuses the import) or
// "fail REASON"; A sends "bye" and B answers "closed" once it has unmapped and
// closed everything.

// helperDriverEnv selects the helper's driver: "fake" (a cudatest.FakeDriver of its
// own) or "system" (LoadDriver: the GPU).
const helperDriverEnv = "CUDA_TEST_HELPER_DRIVER"

// crossGranules is how many granules A exports; B writes into the last one.
const crossGranules = 3

// runHelper is the body of a helper process in mode; it returns the exit status.
func runHelper(mode string) int {
	if mode != "import" {
		fmt.Fprintln(os.Stderr, "cuda helper: unknown mode", mode)
		return 2
	}
	conn := os.NewFile(3, "socket") // ExtraFiles[0]
	if err := importHelper(int(conn.Fd())); err != nil {
		fmt.Fprintln(os.Stderr, "cuda helper:", err)
		_ = send(int(conn.Fd()), "fail "+err.Error(), nil)
		return 1
	}
	return 0
}

// importHelper is process B.
func importHelper(sock int) (err error) {
	var d *cuda.Driver
	var f *cudatest.FakeDriver
	switch os.Getenv(helperDriverEnv) {
	case "fake":
		f = cudatest.NewFakeDriver(cudatest.FakeDriverOptions{})
		d = f.Driver()
	case "system":
		if d, err = cuda.LoadDriver(); err != nil {
			return err
		}
	default:
		return fmt.Errorf("%s is %q", helperDriverEnv, os.Getenv(helperDriverEnv))
	}
	auth := gpuAuthority(0)
	b, err := cuda.New(cuda.Options{Authority: auth, Driver: d})
	if err != nil {
		return err
	}
	msg, fds, err := recv(sock)
	if err != nil {
		return err
	}
	seed, ok := strings.CutPrefix(msg, "import ")
	n, perr := strconv.ParseUint(seed, 10, 64)
	if !ok || perr != nil || len(fds) != crossGranules {
		return fmt.Errorf("unexpected message %q with %d descriptors", msg, len(fds))
	}
	g := b.Granularity()
	// Its own layout: the granules land at granule 1 of a larger reservation.
	r, err := b.Reserve((crossGranules + 2) * g)
	if err != nil {
		return err
	}
	err = b.Import(r, g, fds, backing.ReadWrite)
	for _, fd := range fds {
		_ = unix.Close(fd) // the mappings do not need them
	}
	if errors.Is(err, backing.ErrUnsupported) || isCode(err, cuda.CodeNotPermitted) {
		b.Unreserve(r)
		_ = b.Close()
		return send(sock, "skip the driver refuses the import: "+err.Error(), nil)
	}
	if err != nil {
		return err
	}
	if s := auth.Stats(); s.Owned != 0 || s.Mapped != int64(crossGranules*g) {
		return fmt.Errorf("imported granules: ledger owns %d and maps %d bytes, want 0 and %d", s.Owned, s.Mapped, crossGranules*g)
	}
	got := make([]byte, crossGranules*g)
	if err := b.CopyOut(got, r, g); err != nil {
		return err
	}
	if want := pattern(n, crossGranules*g); !bytes.Equal(got, want) {
		i := 0
		for got[i] == want[i] {
			i++
		}
		return fmt.Errorf("byte %d reads %#x, A wrote %#x", i, got[i], want[i])
	}
	if err := b.CopyIn(r, crossGranules*g, pattern(n+1, g)); err != nil {
		return err
	}
	if err := b.Synchronize(); err != nil {
		return err
	}
	if err := send(sock, "read", nil); err != nil {
		return err
	}
	if msg, _, err := recv(sock); err != nil || msg != "bye" {
		return fmt.Errorf("waiting for bye: %q, %v", msg, err)
	}
	if out := b.Unreserve(r); !out.OK() {
		return out.Err
	}
	if err := b.Close(); err != nil {
		return err
	}
	if f != nil {
		if err := f.CheckLeaks(); err != nil {
			return err
		}
	}
	return send(sock, "closed", nil)
}

// isCode reports whether err carries the driver result c.
func isCode(err error, c cuda.Code) bool {
	var res *cuda.Result
	return errors.As(err, &res) && res.Code == c
}

// send sends msg and the descriptors fds as one record.
func send(sock int, msg string, fds []int) error {
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	return unix.Sendmsg(sock, []byte(msg), oob, nil, 0)
}

// recv receives one record and the descriptors it carries.
func recv(sock int) (string, []int, error) {
	buf := make([]byte, 4096)
	oob := make([]byte, unix.CmsgSpace(64*4))
	n, oobn, _, _, err := unix.Recvmsg(sock, buf, oob, unix.MSG_CMSG_CLOEXEC)
	if err != nil {
		return "", nil, err
	}
	if n == 0 {
		return "", nil, errors.New("the peer closed the socket")
	}
	var fds []int
	if oobn > 0 {
		cmsgs, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err != nil {
			return "", nil, err
		}
		for _, c := range cmsgs {
			got, err := unix.ParseUnixRights(&c)
			if err != nil {
				return "", nil, err
			}
			fds = append(fds, got...)
		}
	}
	return string(buf[:n]), fds, nil
}

// crossProcess runs A in this process on driver d and B in a helper on driver
// helper ("fake" or "system"). With skippable, a driver that refuses exportable
// allocations, the export or the import skips t, saying why.
func crossProcess(t *testing.T, d *cuda.Driver, helper string, skippable bool) {
	auth := gpuAuthority(0)
	b, err := cuda.New(cuda.Options{Authority: auth, Driver: d, Exportable: true})
	if skippable && errors.Is(err, backing.ErrUnsupported) {
		t.Skipf("no exportable allocations here: %v", err)
	}
	require.NoError(t, err)
	defer func() { assert.NoError(t, b.Close()) }()
	g := b.Granularity()
	r, err := b.Reserve(crossGranules * g)
	require.NoError(t, err)
	defer func() { assert.True(t, b.Unreserve(r).OK()) }()
	require.NoError(t, b.Commit(r, 0, crossGranules*g))
	const seed = 7
	require.NoError(t, b.CopyIn(r, 0, pattern(seed, crossGranules*g)))
	require.NoError(t, b.Synchronize())
	fds, err := b.Export(r, 0, crossGranules*g)
	if skippable && (errors.Is(err, backing.ErrUnsupported) || isCode(err, cuda.CodeNotPermitted)) {
		t.Skipf("the driver refuses the export: %v", err)
	}
	require.NoError(t, err)

	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	sock := pair[0]
	defer func() { assert.NoError(t, unix.Close(sock)) }()
	theirs := os.NewFile(uintptr(pair[1]), "helper socket")
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"=import", helperDriverEnv+"="+helper)
	cmd.ExtraFiles = []*os.File{theirs}
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	require.NoError(t, cmd.Start())
	require.NoError(t, theirs.Close()) // the helper has its own: its exit ends our reads
	exited := false
	defer func() {
		if !exited {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	}()

	require.NoError(t, send(sock, "import "+strconv.Itoa(seed), fds))
	closeAll(t, fds) // sent: the helper has its own
	msg, _, err := recv(sock)
	require.NoError(t, err)
	if reason, ok := strings.CutPrefix(msg, "skip "); ok && skippable {
		t.Skip(reason)
	}
	require.Equal(t, "read", msg, "the helper read A's bytes bit-exact")

	// B's write reads back here, bit-exact, and A's other granules are as written.
	got := make([]byte, crossGranules*g)
	require.NoError(t, b.CopyOut(got, r, 0))
	want := pattern(seed, crossGranules*g)
	copy(want[(crossGranules-1)*g:], pattern(seed+1, g))
	assert.True(t, bytes.Equal(want, got), "A reads B's write")

	require.NoError(t, send(sock, "bye", nil))
	msg, _, err = recv(sock)
	require.NoError(t, err)
	assert.Equal(t, "closed", msg)
	exited = true
	require.NoError(t, cmd.Wait(), "the helper exits cleanly")

	// The exported handles are released with A's last mapping, never pooled.
	require.NoError(t, b.Decommit(r, 0, crossGranules*g))
	s := b.PoolStats()
	assert.Zero(t, s.Idle)
	assert.Zero(t, s.Owned)
	assert.Zero(t, auth.Stats().Owned)
}

func TestExportImportCrossProcess(t *testing.T) {
	f := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{})
	crossProcess(t, f.Driver(), "fake", false)
	assert.NoError(t, f.CheckLeaks())
}

// TestGPUExportImportCrossProcess is the same on the system's driver (with -fakegpu,
// on the fake): scripts/gpu-check.sh runs it on a GPU. It skips, saying why, where
// there is no GPU or the driver refuses exportable allocations, the export or the
// import.
func TestGPUExportImportCrossProcess(t *testing.T) {
	helper := "system"
	if *fakeGPU {
		helper = "fake"
	}
	crossProcess(t, gpuDriver(t), helper, true)
}
