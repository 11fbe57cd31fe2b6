package testutil_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/internal/testutil"
)

// recorder is a testing.TB that records Fatalf and Skipf instead of ending the test,
// so that a helper's failure can be checked; anything else goes to the real test.
type recorder struct {
	testing.TB
	calls []string
}

func (r *recorder) Fatalf(format string, args ...any) {
	r.calls = append(r.calls, "Fatalf: "+fmt.Sprintf(format, args...))
}

func (r *recorder) Skipf(format string, args ...any) {
	r.calls = append(r.calls, "Skipf: "+fmt.Sprintf(format, args...))
}

func TestAwait(t *testing.T) {
	n := 0
	assert.True(t, testutil.Await(func() bool { n++; return n == 3 }))
	assert.Equal(t, 3, n, "cond is called until it holds, and no more")

	start := time.Now()
	assert.False(t, testutil.AwaitWithin(func() bool { return false }, 20*time.Millisecond))
	assert.GreaterOrEqual(t, time.Since(start), 20*time.Millisecond, "it waited the whole wait")
}

func TestWaitFor(t *testing.T) {
	r := &recorder{TB: t}
	n := 0
	testutil.WaitForWithin(r, "the third call", func() bool { n++; return n == 3 }, time.Minute)
	assert.Empty(t, r.calls)
	testutil.WaitForWithin(r, "nothing", func() bool { return false }, 10*time.Millisecond)
	assert.Equal(t, []string{"Fatalf: timed out waiting for nothing"}, r.calls)
}

func TestNeedRedisWithout(t *testing.T) {
	t.Setenv("PATH", t.TempDir()) // no redis-server, no redis-cli
	for _, tt := range []struct {
		env  string
		want string
	}{
		{"", "Skipf"},
		{"0", "Skipf"},
		{"1", "Fatalf"},
	} {
		t.Run("env="+tt.env, func(t *testing.T) {
			t.Setenv(testutil.RequireRedisEnv, tt.env)
			r := &recorder{TB: t}
			server, cli := testutil.NeedRedis(r)
			require.NotEmpty(t, r.calls)
			assert.Contains(t, r.calls[0], tt.want+": ")
			assert.Contains(t, r.calls[0], "redis-server")
			assert.Empty(t, server)
			assert.Empty(t, cli)
		})
	}
}

func TestFaultPassesOtherPanics(t *testing.T) {
	assert.NoError(t, testutil.Fault(func() {}))
	assert.PanicsWithValue(t, "not a fault", func() { _ = testutil.Fault(func() { panic("not a fault") }) })
}

func TestPattern(t *testing.T) {
	a, b := testutil.Pattern(300, 1), testutil.Pattern(300, 2)
	require.Len(t, a, 300)
	assert.NotEqual(t, a, b, "two seeds differ")
	for i := 1; i < len(a); i++ {
		require.NotEqual(t, a[i-1], a[i], "neighbouring bytes differ at %d", i)
	}
	c := make([]byte, 300)
	testutil.Fill(c, 1)
	assert.Equal(t, a, c, "Pattern is Fill's pattern")
}

// Every argument of TokenByte changes the byte: a byte written for another writer,
// layer, kind, token or index reads wrong.
func TestTokenByte(t *testing.T) {
	base := testutil.TokenByte(5, 3, uint8(1), 7, 11)
	for name, b := range map[string]byte{
		"writer": testutil.TokenByte(6, 3, uint8(1), 7, 11),
		"layer":  testutil.TokenByte(5, 4, uint8(1), 7, 11),
		"kind":   testutil.TokenByte(5, 3, uint8(0), 7, 11),
		"token":  testutil.TokenByte(5, 3, uint8(1), 8, 11),
		"index":  testutil.TokenByte(5, 3, uint8(1), 7, 12),
	} {
		assert.NotEqual(t, base, b, name)
	}
}

// FillToken writes TokenByte's bytes and TokenAt finds the first that differs, for
// every start of the pattern and lengths across the 256-byte runs they copy.
func TestFillTokenAt(t *testing.T) {
	for w := range uint64(256) {
		for _, n := range []int{0, 1, 255, 256, 257, 700} {
			buf := make([]byte, n)
			testutil.FillToken(buf, w, 2, uint8(1), 9)
			for i := range buf {
				require.Equal(t, testutil.TokenByte(w, 2, uint8(1), 9, i), buf[i], "writer %d byte %d of %d", w, i, n)
			}
			require.Equal(t, -1, testutil.TokenAt(buf, w, 2, uint8(1), 9))
			if n > 0 {
				at := (int(w) * 37) % n
				buf[at]++
				require.Equal(t, at, testutil.TokenAt(buf, w, 2, uint8(1), 9), "writer %d, %d bytes", w, n)
				require.Equal(t, 0, testutil.TokenAt(buf, w+1, 2, uint8(1), 9), "another writer's bytes")
			}
		}
	}
}

func TestPanicOf(t *testing.T) {
	assert.Empty(t, testutil.PanicOf(func() {}))
	assert.Equal(t, "pkg: invariant: x", testutil.PanicOf(func() { panic("pkg: invariant: x") }))
	assert.Equal(t, "an error", testutil.PanicOf(func() { panic(fmt.Errorf("an error")) }))
}
