package filetier_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/filetier"
)

var bg = context.Background()

const nsA, nsB = 0xa11ce, 0xb0b

// value returns n bytes that depend on seed (xorshift64, a word at a time: the kill
// test makes megabytes of them under -race).
func value(n int, seed uint64) []byte {
	b := make([]byte, n+7)
	x := seed*0x9e3779b97f4a7c15 | 1
	for i := 0; i < n; i += 8 {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		binary.LittleEndian.PutUint64(b[i:], x)
	}
	return b[:n:n]
}

func key(ns uint64, i int) tierval.Key {
	return tierval.Key{Namespace: ns, Hash: uint64(i+1) * 0x9e3779b97f4a7c15}
}

func store(t *testing.T, tr kv.Tier, k tierval.Key, v []byte) {
	t.Helper()
	require.NoError(t, tr.Store(bg, k, len(v), func(dst []byte) error { copy(dst, v); return nil }))
}

// load returns the value under k, or the error; a use func never called returns nil.
func load(tr kv.Tier, k tierval.Key) ([]byte, error) {
	var got []byte
	err := tr.Load(bg, k, func(src []byte) error { got = bytes.Clone(src); return nil })
	return got, err
}

// path returns the file of k under dir.
func path(dir string, k tierval.Key) string {
	return filepath.Join(dir, fmt.Sprintf("%016x", k.Namespace), fmt.Sprintf("%016x", k.Hash))
}

// reopen closes tr and opens a tier on its directory with opts.
func reopen(t *testing.T, tr *filetier.Tier, opts filetier.Options) *filetier.Tier {
	t.Helper()
	require.NoError(t, tr.Close())
	opts.Dir = tr.Dir()
	return newTier(t, opts)
}

// logLines is a slog handler that keeps the messages it is given.
type logLines struct {
	mu    sync.Mutex
	lines []string
}

func (l *logLines) logger() *slog.Logger {
	return slog.New(slog.NewTextHandler(writerFunc(func(p []byte) (int, error) {
		l.mu.Lock()
		defer l.mu.Unlock()
		l.lines = append(l.lines, string(p))
		return len(p), nil
	}), nil))
}

func (l *logLines) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.lines, "")
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// A tier opened again on the directory finds every block the last one stored, bit
// exact, and counts them as warm.
func TestWarmStart(t *testing.T) {
	tr := newTier(t, filetier.Options{Budget: 64 << 20, Namespace: nsA})
	want := map[tierval.Key][]byte{}
	for i := range 10 {
		k, v := key(nsA, i), value(1000+i*4099, uint64(i))
		store(t, tr, k, v)
		want[k] = v
	}
	require.NoError(t, tr.Delete(bg, key(nsA, 9)))
	delete(want, key(nsA, 9))

	var log logLines
	tr = reopen(t, tr, filetier.Options{Budget: 64 << 20, Namespace: nsA, Logger: log.logger()})
	st := tr.Stats()
	assert.EqualValues(t, 9, st.Warm)
	assert.Equal(t, 9, st.Blocks)
	assert.Contains(t, log.String(), "warm start")
	keys := make([]tierval.Key, 9)
	for i := range keys {
		keys[i] = key(nsA, i)
	}
	n, err := tr.Contains(bg, keys)
	require.NoError(t, err)
	assert.Equal(t, 9, n)
	for k, v := range want {
		got, err := load(tr, k)
		require.NoError(t, err)
		assert.True(t, bytes.Equal(v, got), "block %x after the restart", k.Hash)
	}
	_, err = load(tr, key(nsA, 9))
	assert.ErrorIs(t, err, kv.ErrTierMiss, "a deleted block after the restart")
	assert.EqualValues(t, 9, tr.Stats().Hits)
}

// A tier of another namespace (another model, layout or prefix) ignores the
// directory of the first, says so, and leaves it for the first to find again.
func TestWarmStartOtherNamespace(t *testing.T) {
	tr := newTier(t, filetier.Options{Budget: 64 << 20, Namespace: nsA})
	store(t, tr, key(nsA, 0), value(5000, 1))
	store(t, tr, key(nsA, 1), value(5000, 2))

	var log logLines
	tr = reopen(t, tr, filetier.Options{Budget: 64 << 20, Namespace: nsB, Logger: log.logger()})
	st := tr.Stats()
	assert.EqualValues(t, 0, st.Warm)
	assert.EqualValues(t, 2, st.Foreign)
	assert.Contains(t, log.String(), "another namespace")
	_, err := load(tr, key(nsA, 0))
	assert.ErrorIs(t, err, kv.ErrTierMiss, "a block of the other namespace")
	n, err := tr.Contains(bg, []tierval.Key{key(nsA, 0)})
	require.NoError(t, err)
	assert.Zero(t, n)
	err = tr.Store(bg, key(nsA, 2), 10, func([]byte) error { return nil })
	assert.ErrorIs(t, err, filetier.ErrNamespace, "a store of another namespace")

	tr = reopen(t, tr, filetier.Options{Budget: 64 << 20, Namespace: nsA})
	got, err := load(tr, key(nsA, 1))
	require.NoError(t, err)
	assert.Equal(t, value(5000, 2), got, "the first namespace's block, kept for it")
}

// Every damage to a block's file is refused, counted and removed; the use func
// never sees it; an undamaged neighbour is still served.
func TestCorruption(t *testing.T) {
	flip := func(off int) func(t *testing.T, dir string, k, other tierval.Key) {
		return func(t *testing.T, dir string, k, _ tierval.Key) {
			f, err := os.OpenFile(path(dir, k), os.O_RDWR, 0)
			require.NoError(t, err)
			defer f.Close()
			b := make([]byte, 1)
			_, err = f.ReadAt(b, int64(off))
			require.NoError(t, err)
			b[0] ^= 0x10
			_, err = f.WriteAt(b, int64(off))
			require.NoError(t, err)
		}
	}
	truncate := func(size int64) func(t *testing.T, dir string, k, other tierval.Key) {
		return func(t *testing.T, dir string, k, _ tierval.Key) {
			require.NoError(t, os.Truncate(path(dir, k), size))
		}
	}
	size := 3 * 4096 // the value: its file is four units
	for _, tt := range []struct {
		name   string
		damage func(t *testing.T, dir string, k, other tierval.Key)
	}{
		{"flip a byte of the value", flip(filetier.HeaderSize + 100)},
		{"flip the last byte of the value", flip(filetier.HeaderSize + size - 1)},
		{"flip a byte of the magic", flip(0)},
		{"flip a byte of the length", flip(24)},
		{"flip a byte of the checksum", flip(40)},
		{"flip a reserved byte", flip(50)},
		{"truncate to whole units", truncate(4096)},
		{"truncate mid-unit", truncate(5000)},
		{"truncate to nothing", truncate(0)},
		{"grow by a unit", truncate(5 * 4096)},
		{"swap two files", func(t *testing.T, dir string, k, other tierval.Key) {
			tmp := path(dir, k) + ".swap"
			require.NoError(t, os.Rename(path(dir, k), tmp))
			require.NoError(t, os.Rename(path(dir, other), path(dir, k)))
			require.NoError(t, os.Rename(tmp, path(dir, other)))
		}},
		{"another model's block under this name", func(t *testing.T, dir string, k, _ tierval.Key) {
			// A block of namespace B, with k's hash, copied over k's file.
			tb := newTier(t, filetier.Options{Budget: 64 << 20})
			kb := tierval.Key{Namespace: nsB, Hash: k.Hash}
			store(t, tb, kb, value(size, 99))
			b, err := os.ReadFile(path(tb.Dir(), kb))
			require.NoError(t, err)
			require.NoError(t, os.WriteFile(path(dir, k), b, 0o644))
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			tr := newTier(t, filetier.Options{Budget: 64 << 20})
			k, other, fine := key(nsA, 0), key(nsA, 1), key(nsA, 2)
			for _, restart := range []bool{false, true} {
				for i, kk := range []tierval.Key{k, other, fine} {
					store(t, tr, kk, value(size, uint64(i)))
				}
				tt.damage(t, tr.Dir(), k, other)
				if restart {
					// The same damage found by a later run.
					tr = reopen(t, tr, filetier.Options{Budget: 64 << 20})
				}
				before := tr.Stats().Corrupt
				used := false
				err := tr.Load(bg, k, func([]byte) error { used = true; return nil })
				if errors.Is(err, kv.ErrTierMiss) && restart {
					// A size no block has is refused by the scan, before any load.
					assert.EqualValues(t, 1, tr.Stats().Corrupt)
					continue
				}
				assert.ErrorIs(t, err, filetier.ErrCorrupt)
				assert.False(t, used, "use called with a damaged block")
				assert.EqualValues(t, before+1, tr.Stats().Corrupt)
				_, err = load(tr, k)
				assert.ErrorIs(t, err, kv.ErrTierMiss, "a refused block is forgotten")
				if got, err := load(tr, fine); assert.NoError(t, err) {
					assert.Equal(t, value(size, 2), got, "an undamaged block beside it")
				}
			}
		})
	}
}

// A write the file system refuses (a full disk) keeps nothing, leaves no file
// behind, changes no block held, and is counted; the next store that can be written
// is.
func TestWriteError(t *testing.T) {
	tr := newTier(t, filetier.Options{Budget: 64 << 20})
	k := key(nsA, 0)
	store(t, tr, k, value(9000, 1))
	filetier.SetWriteHook(tr, func(*os.File, []byte) error { return syscall.ENOSPC })
	err := tr.Store(bg, k, 9000, func(dst []byte) error { copy(dst, value(9000, 2)); return nil })
	assert.ErrorIs(t, err, filetier.ErrWrite)
	assert.ErrorIs(t, err, syscall.ENOSPC)
	err = tr.Store(bg, key(nsA, 1), 10, func([]byte) error { return nil })
	assert.ErrorIs(t, err, syscall.ENOSPC)
	st := tr.Stats()
	assert.EqualValues(t, 2, st.Drops)
	assert.EqualValues(t, 2, st.WriteErrors)
	assert.Equal(t, 1, st.Blocks)
	got, err := load(tr, k)
	require.NoError(t, err)
	assert.Equal(t, value(9000, 1), got, "the block held before the failed store")
	files, err := os.ReadDir(filepath.Dir(path(tr.Dir(), k)))
	require.NoError(t, err)
	assert.Len(t, files, 1, "a failed write leaves no file")

	filetier.SetWriteHook(tr, nil)
	store(t, tr, key(nsA, 1), value(10, 3))
	assert.Equal(t, 2, tr.Stats().Blocks)
}

// The budget holds three files: a fourth store evicts the least recently used.
func TestEviction(t *testing.T) {
	const size = 10000
	tr := newTier(t, filetier.Options{Budget: 3 * int64(filetier.FileSize(size)), MaxValueSize: size})
	for i := range 3 {
		store(t, tr, key(nsA, i), value(size, uint64(i)))
	}
	_, err := load(tr, key(nsA, 0)) // 0 is now the most recently used
	require.NoError(t, err)
	store(t, tr, key(nsA, 3), value(size, 3))
	st := tr.Stats()
	assert.EqualValues(t, 1, st.Evictions)
	assert.Equal(t, 3, st.Blocks)
	assert.LessOrEqual(t, st.Bytes, st.Budget)
	_, err = load(tr, key(nsA, 1))
	assert.ErrorIs(t, err, kv.ErrTierMiss, "the least recently used block")
	_, err = os.Stat(path(tr.Dir(), key(nsA, 1)))
	assert.ErrorIs(t, err, fs.ErrNotExist, "an evicted block's file")
	for _, i := range []int{0, 2, 3} {
		_, err := load(tr, key(nsA, i))
		assert.NoError(t, err, "block %d", i)
	}

	// A smaller budget at the next start evicts the oldest down to it.
	tr = reopen(t, tr, filetier.Options{Budget: 2 * int64(filetier.FileSize(size)), MaxValueSize: size})
	assert.Equal(t, 2, tr.Stats().Blocks)
}

// What a killed writer left (a temporary file) is removed by the next start, and
// never indexed.
func TestLeftovers(t *testing.T) {
	tr := newTier(t, filetier.Options{Budget: 64 << 20})
	k := key(nsA, 0)
	store(t, tr, k, value(100, 1))
	tmp := path(tr.Dir(), key(nsA, 1)) + ".7.tmp"
	require.NoError(t, os.WriteFile(tmp, value(4096, 2), 0o644))
	tr = reopen(t, tr, filetier.Options{Budget: 64 << 20})
	st := tr.Stats()
	assert.EqualValues(t, 1, st.Leftovers)
	assert.Equal(t, 1, st.Blocks)
	_, err := os.Stat(tmp)
	assert.ErrorIs(t, err, fs.ErrNotExist)
}

func TestNewErrors(t *testing.T) {
	file := filepath.Join(t.TempDir(), "file")
	require.NoError(t, os.WriteFile(file, nil, 0o644))
	for _, tt := range []struct {
		name string
		opts filetier.Options
		want []error
	}{
		{"no directory", filetier.Options{}, []error{filetier.ErrBadOptions}},
		{"negative budget", filetier.Options{Dir: t.TempDir(), Budget: -1}, []error{filetier.ErrBadOptions}},
		{"negative MaxValueSize", filetier.Options{Dir: t.TempDir(), MaxValueSize: -1}, []error{filetier.ErrBadOptions}},
		{"negative Loads", filetier.Options{Dir: t.TempDir(), Loads: -1}, []error{filetier.ErrBadOptions}},
		{"negative Stores", filetier.Options{Dir: t.TempDir(), Stores: -1}, []error{filetier.ErrBadOptions}},
		{"MaxValueSize above the budget", filetier.Options{Dir: t.TempDir(), Budget: 1 << 20, MaxValueSize: 1 << 20}, []error{filetier.ErrBadOptions}},
		{"budget below one unit", filetier.Options{Dir: t.TempDir(), Budget: 100}, []error{filetier.ErrBadOptions}},
		{"missing directory", filetier.Options{Dir: filepath.Join(t.TempDir(), "missing")}, []error{filetier.ErrDir, fs.ErrNotExist}},
		{"a file, not a directory", filetier.Options{Dir: file}, []error{filetier.ErrDir}},
		{"budget above the free space", filetier.Options{Dir: t.TempDir(), Budget: 1 << 62}, []error{filetier.ErrNoSpace}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			tt.opts.Logger = quiet
			tr, err := filetier.New(tt.opts)
			if err == nil {
				tr.Close()
			}
			for _, w := range tt.want {
				assert.ErrorIs(t, err, w)
			}
		})
	}
}

// One directory, one tier: a second is refused until the first closes.
func TestLocked(t *testing.T) {
	tr := newTier(t, filetier.Options{Budget: 1 << 20})
	_, err := filetier.New(filetier.Options{Dir: tr.Dir(), Budget: 1 << 20, Logger: quiet})
	assert.ErrorIs(t, err, filetier.ErrLocked)
	require.NoError(t, tr.Close())
	assert.ErrorIs(t, tr.Close(), filetier.ErrClosed)
	tr2, err := filetier.New(filetier.Options{Dir: tr.Dir(), Budget: 1 << 20, Logger: quiet})
	require.NoError(t, err)
	require.NoError(t, tr2.Close())
}

func TestMisuse(t *testing.T) {
	tr := newTier(t, filetier.Options{Budget: 1 << 20})
	assert.PanicsWithValue(t, filetier.PanicNilFunc, func() { _ = tr.Store(bg, key(nsA, 0), 1, nil) })
	assert.PanicsWithValue(t, filetier.PanicNilFunc, func() { _ = tr.Load(bg, key(nsA, 0), nil) })
	assert.PanicsWithValue(t, filetier.PanicNilFunc, func() { _ = tr.Peek(bg, key(nsA, 0), 1, nil) })
	err := tr.Store(bg, key(nsA, 0), tr.MaxValueSize()+1, func([]byte) error { return nil })
	assert.ErrorIs(t, err, filetier.ErrTooLarge)
	assert.ErrorIs(t, err, tierval.ErrSize)
	err = tr.Store(bg, key(nsA, 0), -1, func([]byte) error { return nil })
	assert.ErrorIs(t, err, filetier.ErrBadSize)
	n, err := tr.Contains(bg, nil)
	assert.NoError(t, err)
	assert.Zero(t, n)
	assert.Equal(t, "file", tr.Name())
	require.NoError(t, tr.Close())
	for name, f := range map[string]func(){
		"Store":    func() { _ = tr.Store(bg, key(nsA, 0), 1, func([]byte) error { return nil }) },
		"Load":     func() { _ = tr.Load(bg, key(nsA, 0), func([]byte) error { return nil }) },
		"Contains": func() { _, _ = tr.Contains(bg, nil) },
		"Delete":   func() { _ = tr.Delete(bg, key(nsA, 0)) },
	} {
		assert.PanicsWithValue(t, filetier.PanicClosed, f, name)
	}
}

// The file format's header: the key in the file as well as in its name.
func TestHeaderCarriesKey(t *testing.T) {
	tr := newTier(t, filetier.Options{Budget: 1 << 20})
	k := key(nsA, 5)
	store(t, tr, k, value(10, 1))
	b, err := os.ReadFile(path(tr.Dir(), k))
	require.NoError(t, err)
	require.Len(t, b, 4096)
	assert.Equal(t, "VMFT", string(b[:4]))
	assert.Equal(t, k.Namespace, binary.LittleEndian.Uint64(b[8:]))
	assert.Equal(t, k.Hash, binary.LittleEndian.Uint64(b[16:]))
	assert.EqualValues(t, 10, binary.LittleEndian.Uint64(b[24:]))
}

// Peek refuses a file whose header is damaged (ErrCorrupt, counted, the block
// forgotten), as Load does; a damaged byte of the value it can not see, having no
// checksum of its own to check: the Load after it refuses the block.
func TestPeekCorruption(t *testing.T) {
	size := 3 * 4096
	damage := map[string]func(dir string, k, other tierval.Key){
		"magic":  func(dir string, k, _ tierval.Key) { flipAt(t, path(dir, k), 0) },
		"length": func(dir string, k, _ tierval.Key) { flipAt(t, path(dir, k), 25) }, // 3 units of value to 2
		"a reserved byte": func(dir string, k, _ tierval.Key) {
			flipAt(t, path(dir, k), 50)
		},
		"truncated": func(dir string, k, _ tierval.Key) { require.NoError(t, os.Truncate(path(dir, k), 4096)) },
		"swapped": func(dir string, k, other tierval.Key) {
			tmp := path(dir, k) + ".swap"
			require.NoError(t, os.Rename(path(dir, k), tmp))
			require.NoError(t, os.Rename(path(dir, other), path(dir, k)))
			require.NoError(t, os.Rename(tmp, path(dir, other)))
		},
	}
	for name, hurt := range damage {
		t.Run(name, func(t *testing.T) {
			tr := newTier(t, filetier.Options{Budget: 64 << 20})
			k, other := key(nsA, 0), key(nsA, 1)
			store(t, tr, k, value(size, 0))
			store(t, tr, other, value(size, 1))
			hurt(tr.Dir(), k, other)
			used := false
			err := tr.Peek(bg, k, 64, func([]byte) error { used = true; return nil })
			assert.ErrorIs(t, err, filetier.ErrCorrupt)
			assert.False(t, used)
			assert.EqualValues(t, 1, tr.Stats().Corrupt)
			_, err = load(tr, k)
			assert.ErrorIs(t, err, kv.ErrTierMiss, "a refused block is forgotten")
		})
	}
	t.Run("a byte of the value", func(t *testing.T) {
		tr := newTier(t, filetier.Options{Budget: 64 << 20})
		k := key(nsA, 0)
		store(t, tr, k, value(size, 0))
		flipAt(t, path(tr.Dir(), k), filetier.HeaderSize+10)
		var head []byte
		require.NoError(t, tr.Peek(bg, k, 64, func(h []byte) error { head = bytes.Clone(h); return nil }))
		want := value(size, 0)[:64]
		want[10] ^= 0x10
		assert.Equal(t, want, head, "the head as the file holds it")
		_, err := load(tr, k)
		assert.ErrorIs(t, err, filetier.ErrCorrupt, "the Load checks the whole value")
	})
}

// flipAt flips a bit of the byte at off of the file name.
func flipAt(t *testing.T, name string, off int64) {
	t.Helper()
	f, err := os.OpenFile(name, os.O_RDWR, 0)
	require.NoError(t, err)
	defer f.Close()
	b := make([]byte, 1)
	_, err = f.ReadAt(b, off)
	require.NoError(t, err)
	b[0] ^= 0x10
	_, err = f.WriteAt(b, off)
	require.NoError(t, err)
}
