package main

import (
	"bytes"
	"context"
	"image/png"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// runArgs runs the program with args and returns its exit status and output.
func runArgs(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code := run(context.Background(), args, &out, &errOut)
	return code, out.String(), errOut.String()
}

// small is a quick run of the bundled trace on the tiny model.
func small(t *testing.T, extra ...string) []string {
	return append([]string{"-model", "tiny", "-requests", "12", "-system-prompt", "64", "-max-tokens", "20000",
		"-budget", "0", "-idle", "0", "-out", t.TempDir()}, extra...)
}

// usageCase is a command line that must be refused as bad usage with msg.
type usageCase struct {
	name string
	args []string
	msg  string
}

// checkUsage runs each case: exit status 2, msg on stderr, nothing replayed.
func checkUsage(t *testing.T, tests []usageCase) {
	t.Helper()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			code, out, errOut := runArgs(t, tt.args...)
			assert.Equal(t, 2, code, errOut)
			assert.Contains(t, errOut, tt.msg)
			assert.Empty(t, out, "nothing replayed")
		})
	}
}

func TestRunBadFlags(t *testing.T) {
	tests := []usageCase{
		{"unknown flag", []string{"-frobnicate"}, "flag provided but not defined: -frobnicate"},
		{"not a number", []string{"-requests", "many"}, `invalid value "many" for flag -requests`},
		{"negative requests", []string{"-requests", "-1"}, "-requests -1 is negative"},
		{"negative skip", []string{"-skip", "-1"}, "-skip -1 is negative"},
		{"negative speed", []string{"-speed", "-2"}, "-speed -2 is negative"},
		{"zero step", []string{"-step", "0s"}, "-step 0s must be positive"},
		{"unknown model", []string{"-model", "gpt-5"}, `unknown model preset "gpt-5"`},
		{"bad budget", []string{"-budget", "lots"}, `"lots" is not a size`},
		{"negative system prompt", []string{"-system-prompt", "-5"}, "-system-prompt -5 is negative"},
		{"max tokens within the prompt", []string{"-max-tokens", "100"}, "-max-tokens 100 must exceed -system-prompt 1024"},
		{"zero concurrency", []string{"-concurrency", "0"}, "-concurrency 0 must be positive"},
		{"unknown backing", []string{"-backing", "tape"}, `-backing "tape"`},
		{"unknown layout", []string{"-layout", "diagonal"}, `-layout "diagonal"`},
		{"removed layout", []string{"-layout", "per-sequence"}, `-layout "per-sequence": want blocked or per-layer`},
		{"negative runs", []string{"-run-tokens", "-16"}, "-run-tokens -16: want a power of two"},
		{"runs per layer", []string{"-run-tokens", "16", "-layout", "per-layer"}, "-run-tokens 16: want a power of two, with -layout blocked"},
		{"granule not a power of two", []string{"-granule", "3000"}, "-granule 3000: want a power of two"},
		{"unknown strategy", []string{"-strategies", "vmarena,magic"}, `unknown strategy "magic"`},
		{"negative pool", []string{"-pool-low", "-1"}, "-pool-low -1: must not be negative"},
		{"negative pool high", []string{"-pool-high", "-1"}, "-pool-high -1: must not be negative"},
		{"pool high below low", []string{"-pool-low", "32", "-pool-high", "16"}, "-pool-high 16 is below -pool-low 32"},
		{"zero prompt scale", []string{"-prompt-scale", "0"}, "-prompt-scale 0: want a positive number"},
		{"negative prompt scale", []string{"-prompt-scale", "-2"}, "-prompt-scale -2: want a positive number"},
		{"NaN prompt scale", []string{"-prompt-scale", "NaN"}, "-prompt-scale NaN: want a positive number"},
		{"infinite prompt scale", []string{"-prompt-scale", "+Inf"}, "-prompt-scale +Inf: want a positive number"},
		{"prompt scale not a number", []string{"-prompt-scale", "long"}, `invalid value "long" for flag -prompt-scale`},
		{"negative idle", []string{"-idle", "-1s"}, "-idle -1s is negative"},
		{"negative rounds", []string{"-rounds", "-1"}, "-rounds -1 is negative"},
		{"rounds with cpuprofile", []string{"-rounds", "2", "-cpuprofile", "x.prof"}, "-cpuprofile profiles one process: it can not be used with -rounds 2"},
		{"rounds with metrics", []string{"-rounds", "2", "-metrics", "127.0.0.1:0"}, "-metrics serves one process: it can not be used with -rounds 2"},
		{"unknown format", []string{"-format", "gif"}, `-format "gif"`},
		{"unknown progress", []string{"-progress", "fancy"}, `-progress "fancy"`},
		{"stray argument", []string{"trace.csv"}, `unexpected argument "trace.csv"`},
	}
	checkUsage(t, tests)
}

func TestRunHelp(t *testing.T) {
	code, out, errOut := runArgs(t, "-help")
	assert.Equal(t, 0, code)
	assert.Empty(t, out)
	assert.Contains(t, errOut, "Usage: go run ./examples/kvcache")
	assert.Contains(t, errOut, "-budget")
	assert.Contains(t, errOut, "The defaults replay")
	assert.Regexp(t, `-idle duration\n.*\(default 6s\)`, errOut, "the default run ends with an idle tail")
}

func TestRunTraceErrors(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, []byte(content), 0o644))
		return p
	}
	tests := []struct {
		name, path, msg string
	}{
		{"missing", filepath.Join(dir, "nope.csv"), "no such file"},
		{"empty", write("empty.csv", ""), "empty file"},
		{"not a trace", write("words.csv", "hello,world\n1,2\n"), "has no TIMESTAMP column"},
		{"bad line", write("bad.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1,2\n2023-11-16 18:15:47,x,2\n"), `line 3: ContextTokens "x"`},
		{"skip past the end", write("short.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1,2\n"), "-skip 5: the trace has only 1 requests"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			args := small(t, "-trace", tt.path)
			if strings.HasPrefix(tt.name, "skip") {
				args = append(args, "-skip", "5")
			}
			code, out, errOut := runArgs(t, args...)
			assert.Equal(t, 1, code)
			assert.Contains(t, errOut, tt.msg)
			assert.Empty(t, out)
		})
	}
}

func TestRunSmall(t *testing.T) {
	for _, format := range []string{"png", "svg"} {
		t.Run(format, func(t *testing.T) {
			code, out, errOut := runArgs(t, small(t, "-format", format, "-progress", "lines")...)
			require.Equal(t, 0, code, errOut)
			assert.Empty(t, errOut)
			assert.Contains(t, out, "Trace:   Azure LLM inference trace 2023")
			for _, name := range allStrategies {
				assert.Regexp(t, regexp.MustCompile(`(?m)^ *`+name+` .* 12/12 *$`), out, "a table row for "+name)
				assert.Regexp(t, regexp.MustCompile(`(?m)^`+name+` +done: 12/12 requests`), out, "a progress line for "+name)
			}
			m := regexp.MustCompile(`Plot of physical memory over time: (.*)\n`).FindStringSubmatch(out)
			require.Len(t, m, 2, out)
			data, err := os.ReadFile(m[1])
			require.NoError(t, err)
			if format == "png" {
				_, err := png.Decode(bytes.NewReader(data))
				assert.NoError(t, err)
			} else {
				assert.Contains(t, string(data), "<svg")
			}
		})
	}
}

func TestRunProgressBar(t *testing.T) {
	// The bar draws with carriage returns on any writer; it must not disturb the
	// table that follows.
	code, out, errOut := runArgs(t, small(t, "-progress", "bar", "-strategies", "vmarena,paged")...)
	require.Equal(t, 0, code, errOut)
	assert.Contains(t, out, "\r")
	assert.Regexp(t, `(?m)^paged +done: 12/12 requests`, out)
	assert.Regexp(t, `(?m)^ *vmarena .* 12/12 *$`, out)
}

func TestRunStrategiesAndTrace(t *testing.T) {
	// A trace file of our own, one strategy, no progress.
	p := filepath.Join(t.TempDir(), "t.csv")
	require.NoError(t, os.WriteFile(p, []byte("TIMESTAMP,ContextTokens,GeneratedTokens\n"+
		"2023-11-16 18:15:46,100,5\n2023-11-16 18:15:46.5,200,7\n"), 0o644))
	code, out, errOut := runArgs(t, small(t, "-trace", p, "-strategies", "paged", "-progress", "none")...)
	require.Equal(t, 0, code, errOut)
	assert.Contains(t, out, "2 requests over 1s of trace time")
	assert.Contains(t, out, "2/2")
	assert.NotContains(t, out, "vmarena ")
	assert.NotContains(t, out, "done:", "no progress lines")
}

func TestRunBackings(t *testing.T) {
	t.Run("private", func(t *testing.T) {
		code, out, errOut := runArgs(t, small(t, "-backing", "private", "-strategies", "vmarena", "-progress", "none")...)
		require.Equal(t, 0, code, errOut)
		assert.Regexp(t, `(?m)^ *vmarena +\S+ \S+ +\S+ +\S+ +0 B *$`, out, "no sharing on private memory")
		assert.Regexp(t, `(?m)^ *vmarena .* 12/12 *$`, out)
	})
	t.Run("cuda", func(t *testing.T) {
		code, out, errOut := runArgs(t, small(t, "-backing", "cuda", "-strategies", "vmarena", "-progress", "none")...)
		if code == 0 {
			// A machine with a GPU: the replay ran on it.
			assert.Contains(t, out, "12/12")
			return
		}
		assert.Equal(t, 1, code)
		assert.Contains(t, errOut, "kvcache: vmarena: backing cuda: ")
		assert.Contains(t, errOut, "driver")
		assert.Empty(t, out, "nothing replayed")
	})
}

// TestRunPromptScale: -prompt-scale multiplies every prompt of a CSV trace (and
// clips past -max-tokens); a trace with token IDs refuses it.
func TestRunPromptScale(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "t.csv")
	require.NoError(t, os.WriteFile(p, []byte("TIMESTAMP,ContextTokens,GeneratedTokens\n"+
		"2023-11-16 18:15:46,100,5\n2023-11-16 18:15:46.5,3,7\n"), 0o644))
	for _, tt := range []struct {
		scale string
		want  []int
	}{{"1", []int{100, 3}}, {"2.5", []int{250, 8}}, {"0.1", []int{10, 1}}} {
		c, err := parseFlags([]string{"-trace", p, "-prompt-scale", tt.scale}, io.Discard)
		require.NoError(t, err)
		require.NoError(t, c.prefixDefaults())
		_, _, err = c.validate()
		require.NoError(t, err)
		reqs, _, err := c.loadTrace()
		require.NoError(t, err)
		assert.Equal(t, tt.want, []int{reqs[0].Context, reqs[1].Context}, "scale %s", tt.scale)
		assert.Equal(t, []int{5, 7}, []int{reqs[0].Generated, reqs[1].Generated}, "outputs unscaled")
	}
	code, out, errOut := runArgs(t, small(t, "-trace", p, "-prompt-scale", "300", "-max-tokens", "4096",
		"-strategies", "vmarena", "-progress", "none")...)
	require.Equal(t, 0, code, errOut)
	assert.Contains(t, out, "1 requests longer than 4096 tokens had their prompt clipped")

	mc := filepath.Join(dir, "m.jsonl")
	require.NoError(t, os.WriteFile(mc, []byte(`{"timestamp": 0, "input_length": 512, "output_length": 2, "hash_ids": [1]}`+"\n"), 0o644))
	code, out, errOut = runArgs(t, "-trace", mc, "-prompt-scale", "2", "-out", dir)
	assert.Equal(t, 2, code)
	assert.Contains(t, errOut, "a trace with token IDs can not be scaled")
	assert.Empty(t, out)
}

// TestRunIdle: with -idle the replay samples memory after the load stops; a pool
// whose High is above its Low gives its idle granules back by decay within it.
func TestRunIdle(t *testing.T) {
	if testing.Short() {
		t.Skip("waits 8 s of wall-clock time")
	}
	code, out, errOut := runArgs(t, small(t, "-backing", "shared", "-pool-low", "0", "-pool-high", "256",
		"-idle", "8s", "-strategies", "vmarena", "-progress", "none")...)
	if code == 1 && strings.Contains(errOut, "not supported") {
		t.Skip(errOut)
	}
	require.Equal(t, 0, code, errOut)
	m := regexp.MustCompile(`vmarena held (\S+ \S+) when the load stopped and (\S+ \S+) after`).FindStringSubmatch(out)
	require.Len(t, m, 3, out)
	assert.NotEqual(t, "0 B", m[1], "the pool kept idle granules when the load stopped")
	assert.Equal(t, "0 B", m[2], "and gave them all back by decay")
}

// -layout takes each of kv's layouts, and its default is kv's.
func TestRunLayouts(t *testing.T) {
	tests := []struct {
		args []string
		want string
	}{
		{nil, "vmarena: shared backing, blocked layout"},
		{[]string{"-layout", "per-layer"}, "per-layer layout"},
		{[]string{"-run-tokens", "8"}, "blocked layout in runs of 8 tokens"},
	}
	for _, tt := range tests {
		t.Run(strings.Join(append([]string{"layout"}, tt.args...), " "), func(t *testing.T) {
			code, out, errOut := runArgs(t, small(t, append([]string{"-requests", "3", "-progress", "none"}, tt.args...)...)...)
			require.Equal(t, 0, code, errOut)
			assert.Contains(t, out, tt.want)
		})
	}
}

// TestBundledMooncake: -trace mooncake reads the bundled Mooncake trace (the file as
// released: 12,031 requests with their prompts' block hashes) and selects the
// prefix-cache replay, as the same trace read from a file does.
func TestBundledMooncake(t *testing.T) {
	c, err := parseFlags([]string{"-trace", "mooncake", "-requests", "0"}, io.Discard)
	require.NoError(t, err)
	reqs, name, err := c.loadTrace()
	require.NoError(t, err)
	assert.Contains(t, name, "Mooncake")
	require.Len(t, reqs, 12031)
	assert.Equal(t, 6758, reqs[0].Context)
	assert.Equal(t, 500, reqs[0].Generated)
	assert.Equal(t, []int64{0, 28, 29}, reqs[2].Blocks[:3], "the third request shares its first block with the first")
	for _, r := range reqs {
		require.NotEmpty(t, r.Blocks, "request %d has no block hashes", r.ID)
	}

	fromFile, err := ReadAnyTrace(bundledMooncake)
	require.NoError(t, err)
	assert.Equal(t, fromFile, reqs, "the bundled trace is read like a file")

	code, out, errOut := runArgs(t, "-trace", "mooncake", "-requests", "3", "-budget", "512MiB",
		"-progress", "none", "-out", t.TempDir())
	require.Equal(t, 0, code, errOut)
	assert.Contains(t, out, "hit rate")
}

// TestRunCPUProfile: -cpuprofile writes a profile that pprof can read (gzipped
// protobuf), and a path that can not be created is an error before any replay.
func TestRunCPUProfile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "cpu.prof")
	code, _, errOut := runArgs(t, small(t, "-strategies", "vmarena", "-progress", "none", "-cpuprofile", path)...)
	require.Equal(t, 0, code, errOut)
	data, err := os.ReadFile(path)
	require.NoError(t, err)
	require.Greater(t, len(data), 2)
	assert.Equal(t, []byte{0x1f, 0x8b}, data[:2], "a gzipped profile")

	code, out, errOut := runArgs(t, small(t, "-strategies", "vmarena", "-cpuprofile", filepath.Join(t.TempDir(), "no", "such", "dir", "cpu.prof"))...)
	assert.Equal(t, 1, code)
	assert.Contains(t, errOut, "kvcache: -cpuprofile: ")
	assert.NotContains(t, out, "vmarena ", "nothing replayed")
}
