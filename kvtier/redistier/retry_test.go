package redistier_test

import (
	"bytes"
	"context"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/redistier"
)

// setStart is how go-redis starts a SET of a key and a value with no expiry.
var setStart = []byte("*3\r\n$3\r\nset\r\n")

// cutProxy forwards connections on 127.0.0.1 to a server. On its first connection,
// once the client starts a SET (setStart), it forwards only cut bytes of it (all of
// it, with cut < 0) and swallows the rest, and from then on every reply: the first
// SET is cut off mid-value, or lands whole and its reply is lost. Later connections
// are forwarded as they are.
type cutProxy struct {
	t      *testing.T
	l      net.Listener
	server string
	cut    int
	conns  atomic.Int32
	wg     sync.WaitGroup
	mu     sync.Mutex
	open   []net.Conn
}

func newCutProxy(t *testing.T, server string, cut int) *cutProxy {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &cutProxy{t: t, l: l, server: server, cut: cut}
	p.wg.Go(p.accept)
	t.Cleanup(func() {
		_ = l.Close()
		p.mu.Lock()
		for _, c := range p.open {
			_ = c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	return p
}

func (p *cutProxy) addr() string { return p.l.Addr().String() }

func (p *cutProxy) accept() {
	for {
		c, err := p.l.Accept()
		if err != nil {
			return
		}
		up, err := net.Dial("tcp", p.server)
		if err != nil {
			_ = c.Close()
			continue
		}
		p.mu.Lock()
		p.open = append(p.open, c, up)
		p.mu.Unlock()
		first := p.conns.Add(1) == 1
		var swallow atomic.Bool
		p.wg.Go(func() {
			defer up.Close()
			if !first {
				_, _ = io.Copy(up, c)
				return
			}
			p.forwardCut(c, up, &swallow)
		})
		p.wg.Go(func() {
			defer c.Close()
			buf := make([]byte, 64<<10)
			for {
				n, err := up.Read(buf)
				if n > 0 && !swallow.Load() {
					if _, werr := c.Write(buf[:n]); werr != nil {
						return
					}
				}
				if err != nil {
					return
				}
			}
		})
	}
}

// forwardCut copies from c to up until c starts a SET, then cut bytes of the rest
// (all, with cut < 0); it sets swallow as the SET starts, before any of it goes on.
func (p *cutProxy) forwardCut(c, up net.Conn, swallow *atomic.Bool) {
	buf := make([]byte, 64<<10)
	var carry []byte // the last bytes forwarded before the SET was seen
	sent := -1       // bytes of the SET forwarded, once it started
	for {
		n, err := c.Read(buf)
		chunk := buf[:n]
		if sent < 0 && n > 0 {
			win := append(carry, chunk...)
			i := bytes.Index(win, setStart)
			if i < 0 {
				if _, werr := up.Write(chunk); werr != nil {
					return
				}
				carry = append(carry[:0], win[max(0, len(win)-len(setStart)+1):]...)
			} else {
				swallow.Store(true)
				pre := i - len(carry) // bytes of chunk before the SET; < 0: it began in carry
				if pre > 0 {
					if _, werr := up.Write(chunk[:pre]); werr != nil {
						return
					}
				}
				sent, chunk = max(-pre, 0), chunk[max(pre, 0):]
			}
		}
		if sent >= 0 && len(chunk) > 0 {
			k := len(chunk)
			if p.cut >= 0 {
				k = max(0, min(k, p.cut-sent))
			}
			if k > 0 {
				if _, werr := up.Write(chunk[:k]); werr != nil {
					return
				}
			}
			sent += len(chunk)
		}
		if err != nil {
			return
		}
	}
}

// setCalls returns the SETs the server at addr ran since it started.
func setCalls(t *testing.T, c *redis.Client) int {
	t.Helper()
	info, err := c.Info(context.Background(), "commandstats").Result()
	require.NoError(t, err)
	for line := range strings.SplitSeq(info, "\r\n") {
		rest, ok := strings.CutPrefix(line, "cmdstat_set:calls=")
		if !ok {
			continue
		}
		n, err := strconv.Atoi(rest[:strings.IndexByte(rest, ',')])
		require.NoError(t, err)
		return n
	}
	return 0
}

// TestRetriedSetLandsWhole: go-redis retries a SET that timed out (MaxRetries) on a
// new connection, with the same value, which the Store's pooled buffer still holds:
// Set has not returned. A first SET cut off mid-value is never run (the server drops
// an unfinished command with its connection), and one that landed whole but whose
// reply was lost runs twice, with the same bytes. Either way the key holds the
// writer's whole value, which passes tierval.Decode: a retry tears no value (a byte
// changed on the second connection fails this test with a checksum mismatch).
func TestRetriedSetLandsWhole(t *testing.T) {
	const payload = 1 << 20
	tokens := []int32{5, 6, 7, 8}
	size := tierval.Size(len(tokens), payload)
	fill := func(key tierval.Key, w byte) func(dst []byte) error {
		return func(dst []byte) error {
			return tierval.Encode(dst, key, tokens, payload, func(p []byte) error {
				for i := range p {
					p[i] = w + byte(i%251)
				}
				return nil
			})
		}
	}
	for _, tt := range []struct {
		name  string
		cut   int // bytes of the first SET that reach the server; -1: all
		calls int // SETs the server runs
	}{
		{"cut mid-value", size / 2, 1},
		{"reply lost", -1, 2},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := startServer(t, false)
			direct := redis.NewClient(&redis.Options{Addr: s.addr(), MaxRetries: -1})
			t.Cleanup(func() { _ = direct.Close() })
			p := newCutProxy(t, s.addr(), tt.cut)
			// A socket timeout well below the tier's, so that the first SET's ends
			// it and go-redis retries within the call; a second timeout would be
			// a loaded machine's, not the cut's.
			c := redis.NewClient(&redis.Options{Addr: p.addr(), ContextTimeoutEnabled: true, MaxRetries: 1,
				ReadTimeout: 2 * time.Second, WriteTimeout: 2 * time.Second, DialTimeout: slow})
			t.Cleanup(func() { _ = c.Close() })
			tier := newTier(t, c, redistier.Options{Timeout: 4 * slow, Backoff: -1})

			key := tierval.Key{Namespace: 3, Hash: 0xc0ffee}
			require.NoError(t, tier.Store(context.Background(), key, size, fill(key, 1)), "the retry landed")
			assert.EqualValues(t, 2, p.conns.Load(), "the first SET timed out and went again on a second connection")
			// The Store's buffer goes back to the pool: another Store refills it.
			other := tierval.Key{Namespace: 3, Hash: 0xbeef}
			require.NoError(t, tier.Store(context.Background(), other, size, fill(other, 2)))

			assert.Equal(t, tt.calls, setCalls(t, direct)-1, "SETs the server ran for the first key")
			n, err := direct.DBSize(context.Background()).Result()
			require.NoError(t, err)
			assert.EqualValues(t, 2, n, "the cut SET left no key of its own")
			for _, k := range []struct {
				key tierval.Key
				w   byte
			}{{key, 1}, {other, 2}} {
				v, err := direct.Get(context.Background(), tier.Key(k.key)).Bytes()
				require.NoError(t, err)
				got, err := tierval.Decode(v, k.key, tokens, payload)
				require.NoError(t, err, "the value passes its check")
				want := make([]byte, payload)
				for i := range want {
					want[i] = k.w + byte(i%251)
				}
				if !bytes.Equal(got, want) {
					i := 0
					for got[i] == want[i] {
						i++
					}
					require.FailNowf(t, "another writer's bytes", "key %#x: byte %d is %d, want %d", k.key.Hash, i, got[i], want[i])
				}
			}
			t.Logf("%d connections; tier %+v", p.conns.Load(), tier.Stats())
		})
	}
}
