//go:build linux || darwin

package filetier_test

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/internal/invariants"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kvtier/filetier"
)

var soak = flag.Int("filetier.kills", 0, "TestKilledWriter: writers to kill (0: the short run's 4)")

// The helper process of TestKilledWriter: it opens a tier on the directory the
// environment names and stores blocks from several goroutines until it is killed.
// Block i always holds killValue(i), so whatever a later run reads back can be told
// whole or torn.
const killEnv = "FILETIER_KILL_DIR"

func killSize(i int) int { return 64<<10 + (i*37%29)*(32<<10) + i%4093 }

// killBase is the bytes every killValue is a window of: made once, so that neither
// the writer nor the check spends its time (under -race) making values.
var killBase = value(2<<20, 7)

// killValue is block i's value: a window of killBase at an offset of its own, its
// first word i, so that no two blocks are alike.
func killValue(i int) []byte {
	off := i * 4099 % (len(killBase) - killSize(i))
	v := bytes.Clone(killBase[off : off+killSize(i)])
	binary.LittleEndian.PutUint64(v, uint64(i))
	return v
}

func TestMain(m *testing.M) {
	if dir := os.Getenv(killEnv); dir != "" {
		killWriter(dir)
		return
	}
	invariants.Exit(m.Run())
}

func killWriter(dir string) {
	seed, _ := strconv.ParseUint(os.Getenv(killEnv+"_SEED"), 10, 64)
	tr, err := filetier.New(filetier.Options{Dir: dir, Budget: 48 << 20, Logger: quiet})
	if err != nil {
		fmt.Println("error:", err)
		os.Exit(2)
	}
	fmt.Println("ready")
	var stored sync.WaitGroup
	stored.Add(16)
	go func() { stored.Wait(); fmt.Println("stored") }()
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(seed, uint64(w)))
			n := 0 // of this writer's first 4 stores, counted in stored
			for {
				i := r.IntN(200)
				v := killValue(i)
				if tr.Store(bg, key(nsA, i), len(v), func(dst []byte) error { copy(dst, v); return nil }) == nil && n < 4 {
					n++
					stored.Done()
				}
				if r.IntN(8) == 0 {
					_ = tr.Delete(bg, key(nsA, r.IntN(200)))
				}
			}
		})
	}
	wg.Wait()
}

// A writer killed with SIGKILL at random points of its stores leaves a directory from
// which every block a later run serves is bit exact: each is served whole or refused,
// none torn. Leftover temporary files are removed, never indexed.
func TestKilledWriter(t *testing.T) {
	kills := 4
	if *soak > 0 {
		kills = *soak
	}
	dir := t.TempDir()
	var served, refused, leftovers int64
	for k := range kills {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), killEnv+"="+dir, fmt.Sprintf("%s_SEED=%d", killEnv, k))
		out, err := cmd.StdoutPipe()
		require.NoError(t, err)
		require.NoError(t, cmd.Start())
		// Killed at a random point once the writers have stored 16 blocks, so that
		// every round has stores to check, however slow the machine.
		lines := bufio.NewReader(out)
		for _, want := range []string{"ready\n", "stored\n"} {
			line, err := lines.ReadString('\n')
			require.NoError(t, err)
			require.Equal(t, want, line)
		}
		time.Sleep(time.Duration(rand.IntN(50)) * time.Millisecond)
		require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
		_ = cmd.Wait()

		tr, err := filetier.New(filetier.Options{Dir: dir, Budget: 48 << 20, Logger: quiet})
		require.NoError(t, err)
		leftovers += tr.Stats().Leftovers
		for i := range 200 {
			got, err := load(tr, key(nsA, i))
			switch {
			case errors.Is(err, kv.ErrTierMiss):
			case errors.Is(err, filetier.ErrCorrupt):
				refused++
			case err != nil:
				t.Errorf("kill %d: block %d: %v", k, i, err)
			default:
				served++
				if !bytes.Equal(got, killValue(i)) {
					t.Errorf("kill %d: block %d served torn: %d bytes, want %d", k, i, len(got), killSize(i))
				}
			}
		}
		require.NoError(t, tr.Close())
	}
	t.Logf("%d kills: %d blocks served bit exact, %d refused, %d leftover temporary files removed", kills, served, refused, leftovers)
	assert.Positive(t, served, "the writers stored nothing: the test proved nothing")
}
