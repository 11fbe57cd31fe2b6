package nodepool_test

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/nodepool"
	"github.com/vmarena/vmarena/kv"
)

// A helper process with a KV cache and a prefix cache on a client (no pool of its
// own, so that what it gives back can only come from its cached prefixes): it
// caches one prompt that no live sequence maps any more, and a second that a live
// sequence still maps, then says "ready <number> <bytes it holds> <bytes of the
// first prompt's entry>". On "check" it says "intact <true|false> <bytes evicted>":
// whether the live sequence's K and V still read as written.

var prefixModel = kv.Uniform("reclaim", 2, 1, 64, arena.Float16)

const prefixTokens = 256

func runPrefixHelper(path string) int {
	fail := func(what string, err error) int {
		fmt.Fprintln(os.Stderr, what+":", err)
		return 1
	}
	c, err := nodepool.Attach(path, nodepool.ClientOptions{High: nodepool.ClientNoPool})
	if err != nil {
		return fail("attach", err)
	}
	cache, err := kv.New(c, kv.Config{Model: prefixModel, MaxTokens: 4 * prefixTokens})
	if err != nil {
		return fail("kv.New", err)
	}
	pc, err := kv.NewPrefixCache(cache, kv.PrefixCacheOptions{})
	if err != nil {
		return fail("prefix cache", err)
	}
	fill := func(first int32, seed byte) (*kv.Sequence, []int32, error) {
		s, err := cache.NewSequence()
		if err != nil {
			return nil, nil, err
		}
		if err := s.Append(prefixTokens); err != nil {
			return nil, nil, err
		}
		for l := range prefixModel.Layers {
			for _, k := range []kv.Kind{kv.K, kv.V} {
				if err := s.WriteTokens(l, k, 0, prefixTokens, pattern(seed+byte(2*l)+byte(k))); err != nil {
					return nil, nil, err
				}
			}
		}
		tokens := make([]int32, prefixTokens)
		for i := range tokens {
			tokens[i] = first + int32(i)
		}
		return s, tokens, pc.Insert(s, tokens)
	}
	cached, _, err := fill(1, 10)
	if err != nil {
		return fail("cache a prompt", err)
	}
	cached.Close()
	entry := pc.Stats().CachedBytes
	live, _, err := fill(100000, 20)
	if err != nil {
		return fail("cache a live prompt", err)
	}
	fmt.Printf("ready %d %d %d\n", c.Number(), c.Accounting().Authority().Stats().Owned, entry)
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		if in.Text() != "check" {
			continue
		}
		intact := true
		for l := range prefixModel.Layers {
			for _, k := range []kv.Kind{kv.K, kv.V} {
				want := pattern(20 + byte(2*l) + byte(k))
				got := make([]byte, len(want))
				if err := live.ReadTokens(l, k, 0, prefixTokens, got); err != nil || !bytes.Equal(got, want) {
					intact = false
				}
			}
		}
		fmt.Printf("intact %v %d\n", intact, pc.Stats().EvictedBytes)
	}
	return 0
}

// pattern returns the bytes a helper writes to one tensor of a sequence.
func pattern(seed byte) []byte {
	p := make([]byte, prefixTokens*prefixModel.Groups[0].TokenBytes())
	for i := range p {
		p[i] = byte(i*31) ^ seed
	}
	return p
}

// lineHelper is a helper process the test talks to in lines, on its stdin and
// stdout.
type lineHelper struct {
	cmd *exec.Cmd
	in  io.WriteCloser
	out *bufio.Reader
}

// startLineHelper starts this test binary as a helper process in mode on path.
func startLineHelper(t testing.TB, mode, path string) *lineHelper {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"="+mode, helperPathEnv+"="+path)
	in, err := cmd.StdinPipe()
	require.NoError(t, err)
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	cmd.Stderr = os.Stderr
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return &lineHelper{cmd: cmd, in: in, out: bufio.NewReader(out)}
}

// say writes a line to the helper.
func (h *lineHelper) say(t testing.TB, line string) {
	t.Helper()
	_, err := io.WriteString(h.in, line+"\n")
	require.NoError(t, err)
}

// prefixHelper is a running prefix helper.
type prefixHelper struct {
	*lineHelper
	number        uint64
	owned, cached int64
}

func startPrefixHelper(t *testing.T, path string) *prefixHelper {
	t.Helper()
	h := &prefixHelper{lineHelper: startLineHelper(t, "prefix", path)}
	f := h.line(t, "ready", 4)
	h.number, _ = strconv.ParseUint(f[1], 10, 64)
	h.owned, _ = strconv.ParseInt(f[2], 10, 64)
	h.cached, _ = strconv.ParseInt(f[3], 10, 64)
	return h
}

// line reads the helper's next line, which must be word and n fields.
func (h *lineHelper) line(t testing.TB, word string, n int) []string {
	t.Helper()
	line, err := h.out.ReadString('\n')
	require.NoError(t, err, "the helper says %s", word)
	f := strings.Fields(line)
	require.Len(t, f, n, "the helper says %q", line)
	require.Equal(t, word, f[0])
	return f
}

// check asks the helper whether its live sequence is intact, and what it evicted.
func (h *prefixHelper) check(t *testing.T) (bool, int64) {
	t.Helper()
	h.say(t, "check")
	f := h.line(t, "intact", 3)
	evicted, err := strconv.ParseInt(f[2], 10, 64)
	require.NoError(t, err)
	return f[1] == "true", evicted
}
