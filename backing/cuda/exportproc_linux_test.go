package cuda_test

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"syscall"
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

// runHelper is the body of a helper process in mode ("import": process B above;
// "export": an exporter that the test kills); it returns the exit status.
func runHelper(mode string) int {
	conn := os.NewFile(3, "socket") // ExtraFiles[0]
	defer runtime.KeepAlive(conn)   // its finalizer would close the descriptor
	sock := int(conn.Fd())
	var err error
	switch mode {
	case "import":
		err = importHelper(sock)
	case "export":
		err = exportHelper(sock)
	default:
		err = fmt.Errorf("unknown mode %q", mode)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "cuda helper:", err)
		_ = send(sock, "fail "+err.Error(), nil)
		return 1
	}
	return 0
}

// helperDriver returns the driver helperDriverEnv names, and the fake behind it.
func helperDriver() (*cuda.Driver, *cudatest.FakeDriver, error) {
	switch os.Getenv(helperDriverEnv) {
	case "fake":
		f := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{})
		return f.Driver(), f, nil
	case "system":
		d, err := cuda.LoadDriver()
		return d, nil, err
	}
	return nil, nil, fmt.Errorf("%s is %q", helperDriverEnv, os.Getenv(helperDriverEnv))
}

// refused reports whether err says that the driver refuses to export or import
// here (not supported, not permitted), which a GPU test skips on.
func refused(err error) bool {
	return errors.Is(err, backing.ErrUnsupported) || isCode(err, cuda.CodeNotPermitted)
}

// exportHelper commits, writes and exports crossGranules granules, sends them with
// "export SEED" (or "skip REASON"), and waits to be killed.
func exportHelper(sock int) error {
	d, _, err := helperDriver()
	if err != nil {
		return err
	}
	b, err := cuda.New(cuda.Options{Authority: gpuAuthority(0), Driver: d, Exportable: true})
	if refused(err) {
		return send(sock, "skip no exportable allocations here: "+err.Error(), nil)
	}
	if err != nil {
		return err
	}
	g := b.Granularity()
	r, err := b.Reserve(crossGranules * g)
	if err != nil {
		return err
	}
	if err := b.Commit(r, 0, crossGranules*g); err != nil {
		return err
	}
	const seed = 11
	if err := b.CopyIn(r, 0, pattern(seed, crossGranules*g)); err != nil {
		return err
	}
	if err := b.Synchronize(); err != nil {
		return err
	}
	fds, err := b.Export(r, 0, crossGranules*g)
	if refused(err) {
		return send(sock, "skip the driver refuses the export: "+err.Error(), nil)
	}
	if err != nil {
		return err
	}
	if err := send(sock, "export "+strconv.Itoa(seed), fds); err != nil {
		return err
	}
	_, _, err = recv(sock) // until killed
	return err
}

// importHelper is process B.
func importHelper(sock int) error {
	d, f, err := helperDriver()
	if err != nil {
		return err
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
	if refused(err) {
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
	if skippable && refused(err) {
		t.Skipf("the driver refuses the export: %v", err)
	}
	require.NoError(t, err)

	cmd, sock := startHelper(t, "import", helper)
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
	require.NoError(t, cmd.Wait(), "the helper exits cleanly")

	// The exported handles are released with A's last mapping, never pooled.
	require.NoError(t, b.Decommit(r, 0, crossGranules*g))
	s := b.PoolStats()
	assert.Zero(t, s.Idle)
	assert.Zero(t, s.Owned)
	assert.Zero(t, auth.Stats().Owned)
}

// startHelper starts this test binary as a helper process in mode on driver helper,
// with one end of a socket pair as its descriptor 3, and returns it and the other
// end. At cleanup the helper is killed if it still runs, and the socket closed.
func startHelper(t *testing.T, mode, helper string) (*exec.Cmd, int) {
	t.Helper()
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	theirs := os.NewFile(uintptr(pair[1]), "helper socket")
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"="+mode, helperDriverEnv+"="+helper)
	cmd.ExtraFiles = []*os.File{theirs}
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	err = cmd.Start()
	require.NoError(t, theirs.Close()) // the helper has its own: its exit ends our reads
	require.NoError(t, err)
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
		assert.NoError(t, unix.Close(pair[0]))
	})
	return cmd, pair[0]
}

// exporterKilled imports, in this process on driver d, granules that a helper on
// driver helper exported, then kills the helper with SIGKILL: the mappings here stay
// valid, bit-exact and writable, and go cleanly. With skippable, a driver that
// refuses the export or the import skips t, saying why.
func exporterKilled(t *testing.T, d *cuda.Driver, helper string, skippable bool) {
	auth := gpuAuthority(0)
	b, err := cuda.New(cuda.Options{Authority: auth, Driver: d})
	if skippable && errors.Is(err, backing.ErrUnsupported) {
		t.Skipf("no usable GPU: %v", err)
	}
	require.NoError(t, err)
	defer func() { assert.NoError(t, b.Close()) }()
	g := b.Granularity()

	cmd, sock := startHelper(t, "export", helper)
	msg, fds, err := recv(sock)
	require.NoError(t, err)
	if reason, ok := strings.CutPrefix(msg, "skip "); ok && skippable {
		t.Skip(reason)
	}
	seed, ok := strings.CutPrefix(msg, "export ")
	require.True(t, ok, "the helper says %q", msg)
	n, err := strconv.ParseUint(seed, 10, 64)
	require.NoError(t, err)
	require.Len(t, fds, crossGranules)
	r, err := b.Reserve(crossGranules * g)
	require.NoError(t, err)
	defer func() { assert.True(t, b.Unreserve(r).OK()) }()
	err = b.Import(r, 0, fds, backing.ReadWrite)
	closeAll(t, fds)
	if skippable && refused(err) {
		t.Skipf("the driver refuses the import: %v", err)
	}
	require.NoError(t, err)

	require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
	var ee *exec.ExitError
	require.ErrorAs(t, cmd.Wait(), &ee)
	require.Equal(t, syscall.SIGKILL, ee.Sys().(syscall.WaitStatus).Signal())

	got := make([]byte, crossGranules*g)
	require.NoError(t, b.CopyOut(got, r, 0))
	assert.True(t, bytes.Equal(pattern(n, crossGranules*g), got), "the exporter's bytes outlive it")
	require.NoError(t, b.CopyIn(r, g+1, []byte("still mine")))
	require.NoError(t, b.Synchronize())
	require.NoError(t, b.CopyOut(got[:10], r, g+1))
	assert.Equal(t, "still mine", string(got[:10]))
	s := auth.Stats()
	assert.Zero(t, s.Owned)
	assert.EqualValues(t, crossGranules*g, s.Mapped)
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

func TestExportImportExporterKilled(t *testing.T) {
	f := cudatest.NewFakeDriver(cudatest.FakeDriverOptions{})
	exporterKilled(t, f.Driver(), "fake", false)
	assert.NoError(t, f.CheckLeaks())
}

// TestGPUExportImportExporterKilled is the same on the system's driver (with
// -fakegpu, on the fake), run by scripts/gpu-check.sh: whether the driver keeps an
// imported allocation alive after its exporter died is what it finds out.
func TestGPUExportImportExporterKilled(t *testing.T) {
	helper := "system"
	if *fakeGPU {
		helper = "fake"
	}
	exporterKilled(t, gpuDriver(t), helper, true)
}
