package kvevents_test

import (
	"net"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kvevents"
)

// TestPortInUseErrno: the error for a port in use also matches the system's errno.
func TestPortInUseErrno(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	_, err = kvevents.New(kvevents.Options{Endpoint: "tcp://" + ln.Addr().String()})
	require.ErrorIs(t, err, kvevents.ErrListen)
	require.ErrorIs(t, err, syscall.EADDRINUSE)
}
