package filetier_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kvtier/filetier"
)

// benchDir is where the benchmarks write: $FILETIER_BENCH_DIR, else a temporary
// directory (on the file system the test runs on; tmpfs makes it a memory copy).
func benchDir(b *testing.B) string {
	if d := os.Getenv("FILETIER_BENCH_DIR"); d != "" {
		d, err := os.MkdirTemp(d, "bench")
		require.NoError(b, err)
		b.Cleanup(func() { os.RemoveAll(d) })
		return d
	}
	return b.TempDir()
}

const benchBlock = 2 << 20

// BenchmarkBlock stores and loads 2 MiB blocks one at a time, and has dd write and
// read as many bytes with direct I/O in 2 MiB requests on the same file system, in the
// same run, as the bound a single stream of the disk gives: compare each tier figure
// with its dd figure (benchstat's MB/s). dd's figures are of one file written in
// place, so they pay no file creation, rename or checksum: a stricter baseline than
// dd writing one file per block, which would pay a process start each.
func BenchmarkBlock(b *testing.B) {
	const keys = 64 // 128 MiB of files, recycled: stores replace, loads miss the page cache with O_DIRECT
	src := value(benchBlock, 1)
	b.Run("op=store/io=tier", func(b *testing.B) {
		tr := newTierB(b)
		b.SetBytes(benchBlock)
		i := 0
		for b.Loop() {
			if err := tr.Store(bg, key(nsA, i%keys), benchBlock, func(dst []byte) error { copy(dst, src); return nil }); err != nil {
				b.Fatal(err)
			}
			i++
		}
	})
	b.Run("op=store/io=dd", func(b *testing.B) {
		dd(b, "if=/dev/zero", "of=FILE", "oflag=direct")
	})
	b.Run("op=load/io=tier", func(b *testing.B) {
		tr := newTierB(b)
		for i := range keys {
			if err := tr.Store(bg, key(nsA, i), benchBlock, func(dst []byte) error { copy(dst, src); return nil }); err != nil {
				b.Fatal(err)
			}
		}
		b.SetBytes(benchBlock)
		i := 0
		var sum byte
		for b.Loop() {
			if err := tr.Load(bg, key(nsA, i%keys), func(v []byte) error { sum += v[len(v)-1]; return nil }); err != nil {
				b.Fatal(err)
			}
			i++
		}
	})
	b.Run("op=load/io=dd", func(b *testing.B) {
		dd(b, "if=FILE", "of=/dev/null", "iflag=direct")
	})
}

func newTierB(b *testing.B) *filetier.Tier {
	tr, err := filetier.New(filetier.Options{Dir: benchDir(b), Budget: 1 << 30, Logger: quiet})
	require.NoError(b, err)
	b.Cleanup(func() { tr.Close() })
	if st := tr.Stats(); st.IO != "O_DIRECT" && runtime.GOOS == "linux" {
		b.Logf("the tier's I/O here: %s", st.IO)
	}
	return tr
}

// dd runs dd once for b.N blocks of 2 MiB, with args (FILE: a file of the bench
// directory that a read finds written).
func dd(b *testing.B, args ...string) {
	if _, err := exec.LookPath("dd"); err != nil {
		b.Skip("no dd here")
	}
	file := filepath.Join(benchDir(b), "dd")
	// The file a read reads: written first, untimed.
	fill := exec.Command("dd", "if=/dev/zero", "of="+file, "bs=2M", "count=64", "oflag=direct", "status=none")
	if out, err := fill.CombinedOutput(); err != nil {
		b.Fatalf("dd: %v: %s", err, out)
	}
	b.SetBytes(benchBlock)
	b.ResetTimer()
	// dd reads at most the file's 64 blocks per run: a larger b.N runs it again.
	for left := b.N; left > 0; left -= 64 {
		n := min(left, 64)
		a := []string{fmt.Sprintf("count=%d", n), "bs=2M", "status=none"}
		for _, s := range args {
			a = append(a, replaceFile(s, file))
		}
		if out, err := exec.Command("dd", a...).CombinedOutput(); err != nil {
			b.Fatalf("dd %v: %v: %s", a, err, out)
		}
	}
}

func replaceFile(s, file string) string {
	switch s {
	case "if=FILE":
		return "if=" + file
	case "of=FILE":
		return "of=" + file
	}
	return s
}

var _ kv.Tier = (*filetier.Tier)(nil)
