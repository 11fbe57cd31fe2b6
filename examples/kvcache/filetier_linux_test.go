package main

import (
	"fmt"
	"os"
	"regexp"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestRunRestart: -restart replays a conversation trace in two halves, the second
// in a new process of this program on the same -file-tier directory, and its hit
// rate there is the no-restart run's within 5%, above a restart without the file
// tier (every hit checked byte for byte). 64 KiB granules make a block 256 tokens
// of the tiny model, so that its short prompts have whole blocks to store.
func TestRunRestart(t *testing.T) {
	path := t.TempDir() + "/conv.jsonl"
	require.NoError(t, os.WriteFile(path, []byte(conversationTrace(4, 4)), 0o644))
	dir := t.TempDir()
	code, out, errOut := runArgs(t, "-trace", path, "-model", "tiny", "-granule", "64KiB", "-max-tokens", "4096", "-budget", "0",
		"-idle", "0", "-progress", "none", "-tiers", "file", "-file-tier", dir, "-restart", "-tier-write-through", "-tier-wait", "10s",
		"-out", t.TempDir())
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", out, errOut)
	t.Log(out)
	assert.Contains(t, out, "Restart: requests 1-8, then 9-16 after a restart")
	rate := func(row string) float64 {
		m := regexp.MustCompile(row + `\s+([0-9.]+)%`).FindStringSubmatch(out)
		require.NotNil(t, m, "no row %q in:\n%s", row, out)
		v, err := strconv.ParseFloat(m[1], 64)
		require.NoError(t, err)
		return v
	}
	none, restart, cold := rate("no restart"), rate(`restart \(a new process on the same directory\)`), rate("restart without the file tier")
	assert.Positive(t, none)
	assert.GreaterOrEqual(t, restart, 0.95*none, "the restart's second half over the no-restart one's")
	assert.Less(t, cold, restart, "without the file tier the restart starts cold")
	assert.Regexp(t, `restart \(a new process on the same directory\)\s+[0-9.]+%\s+[0-9.]+%\s+[1-9][0-9.]*%`, out,
		"the restart's hits from the file tier")
	for _, sub := range []string{"no-restart", "restart"} {
		_, err := os.Stat(dir + "/" + sub + "/LOCK")
		assert.NoError(t, err, fmt.Sprintf("the %s run's tier directory", sub))
	}
}

func TestRunFileTierUsage(t *testing.T) {
	path := t.TempDir() + "/conv.jsonl"
	require.NoError(t, os.WriteFile(path, []byte(conversationTrace(2, 2)), 0o644))
	mc := []string{"-trace", path, "-out", t.TempDir()}
	checkUsage(t, []usageCase{
		{"file tier without a directory", append(mc, "-tiers", "file"), "-tiers file needs -file-tier DIR"},
		{"directory without the file tier", append(mc, "-tiers", "host", "-file-tier", t.TempDir()), "-file-tier needs file in -tiers"},
		{"restart without the file tier", append(mc, "-tiers", "host", "-restart"), "-restart needs file in -tiers"},
		{"restart without tiers", append(mc, "-restart"), "-restart needs file in -tiers"},
		{"restart with rounds", append(mc, "-tiers", "file", "-file-tier", t.TempDir(), "-restart", "-rounds", "2"), "-restart can not be used with -rounds 2"},
		{"a third half", append(mc, "-restart-half", "3"), "-restart-half 3: want 1 or 2"},
		{"missing directory", append(mc, "-tiers", "file", "-file-tier", t.TempDir()+"/missing"), "no such file or directory"},
		{"file tier on two replicas", append(mc, "-tiers", "redis,file", "-file-tier", t.TempDir(), "-replicas", "2"), "one directory serves one replica"},
	})
}
