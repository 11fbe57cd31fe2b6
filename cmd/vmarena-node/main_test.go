package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/nodepool"
)

func TestParseSize(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want int64
	}{{"4096", 4096}, {"2MiB", 2 << 20}, {"8GiB", 8 << 30}, {"1TiB", 1 << 40}, {"512B", 512}, {"64KiB", 64 << 10}} {
		n, err := parseSize(tt.in)
		require.NoError(t, err, tt.in)
		assert.Equal(t, tt.want, n, tt.in)
	}
	for _, bad := range []string{"", "0", "-1", "x", "2XB", "1.5GiB", "99999999999TiB", "GiB"} {
		_, err := parseSize(bad)
		assert.Error(t, err, bad)
	}
}

func TestRunBadFlags(t *testing.T) {
	for _, args := range [][]string{{"-limit", "lots"}, {"-granule", "3KiB"}, {"-granule", "x"}, {"extra"}, {"-nosuchflag"}} {
		var log bytes.Buffer
		assert.Error(t, run(context.Background(), append([]string{"-socket", filepath.Join(t.TempDir(), "s")}, args...), &log, nil), "%q", args)
	}
}

func TestRun(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("the node pool needs Linux")
	}
	dir, err := os.MkdirTemp("", "vn")
	require.NoError(t, err)
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "n.sock")
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan *nodepool.Owner, 1)
	done := make(chan error, 1)
	var log bytes.Buffer
	go func() {
		done <- run(ctx, []string{"-socket", sock, "-limit", "8KiB", "-granule", "4KiB", "-stats", "1ms"}, &log, ready)
	}()
	o := <-ready
	c, err := nodepool.Attach(sock, nodepool.ClientOptions{})
	require.NoError(t, err)
	r, err := c.Reserve(3 << 12)
	require.NoError(t, err)
	require.NoError(t, c.Commit(r, 0, 2<<12))
	assert.ErrorIs(t, c.Commit(r, 2<<12, 1<<12), accounting.ErrBudgetExceeded, "the -limit")
	assert.Equal(t, int64(2<<12), o.Stats().Device.Used)
	require.True(t, c.Unreserve(r).OK())
	require.NoError(t, c.Close())
	cancel()
	require.NoError(t, <-done)
	_, err = os.Lstat(sock)
	assert.ErrorIs(t, err, os.ErrNotExist, "the socket is removed")
	assert.Contains(t, log.String(), "listening on "+sock)
}
