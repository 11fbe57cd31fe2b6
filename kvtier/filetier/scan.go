package filetier

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/vmarena/vmarena/kv/tierval"
)

// scan is a warm start: it indexes the blocks a previous run left in the directory,
// the least recently written first out of the LRU list. What it finds:
//
//   - a directory named by a namespace (16 hex digits): its blocks are indexed, or,
//     with Options.Namespace set to another, ignored (logged, counted in Foreign,
//     left on disk for the tier of that namespace: never read, never removed);
//   - in it, a file named by a hash: indexed by its name and size. Its contents are
//     checked by the first Load, as every block's are; a size that can not be a
//     block's file (not whole alignment units) is refused now, counted and removed;
//   - a temporary file of a write a killed process left: removed (Leftovers);
//   - anything else: left alone.
//
// The lock is held by New (t is not shared yet); scan takes t.mu only to keep the
// invariant that the index changes under it.
func (t *Tier) scan() error {
	top, err := os.ReadDir(t.dir)
	if err != nil {
		return errors.Join(ErrDir, err)
	}
	type found struct {
		key  tierval.Key
		size int64
		mod  time.Time
	}
	var blocks []found
	for _, d := range top {
		ns, ok := parseHex(d.Name())
		if !ok || !d.IsDir() {
			continue
		}
		dir := filepath.Join(t.dir, d.Name())
		files, err := os.ReadDir(dir)
		if err != nil {
			return errors.Join(ErrDir, err)
		}
		if t.ns != 0 && ns != t.ns {
			t.counter.Foreign += int64(len(files))
			t.log.Info("filetier: ignoring the blocks of another namespace (another model, layout or prefix)",
				"dir", dir, "blocks", len(files), "namespace", hex(ns), "serving", hex(t.ns))
			continue
		}
		t.nsDirs[ns] = true
		for _, f := range files {
			name := f.Name()
			if strings.HasSuffix(name, tmpExt) {
				if os.Remove(filepath.Join(dir, name)) == nil {
					t.counter.Leftovers++
				}
				continue
			}
			hash, ok := parseHex(name)
			if !ok || !f.Type().IsRegular() {
				continue
			}
			info, err := f.Info()
			if errors.Is(err, fs.ErrNotExist) {
				continue
			} else if err != nil {
				return errors.Join(ErrDir, err)
			}
			if n := info.Size(); n < int64(t.align) || n%int64(t.align) != 0 {
				t.counter.Corrupt++
				_ = os.Remove(filepath.Join(dir, name))
				continue
			}
			blocks = append(blocks, found{tierval.Key{Namespace: ns, Hash: hash}, info.Size(), info.ModTime()})
		}
	}
	// The probe's own leftovers, from a killed New.
	for _, d := range top {
		if n := d.Name(); strings.HasPrefix(n, ".probe-") && strings.HasSuffix(n, tmpExt) {
			_ = os.Remove(filepath.Join(t.dir, n))
		}
	}
	slices.SortFunc(blocks, func(a, b found) int { return a.mod.Compare(b.mod) })
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, b := range blocks {
		e := &entry{key: b.key, size: b.size}
		t.index[b.key] = e
		t.pushFront(e)
		t.held += b.size
	}
	t.counter.Warm = int64(len(blocks))
	if len(blocks) > 0 || t.counter.Leftovers > 0 || t.counter.Foreign > 0 {
		t.log.Info("filetier: warm start", "dir", t.dir, "blocks", len(blocks), "bytes", t.held,
			"leftovers_removed", t.counter.Leftovers, "foreign", t.counter.Foreign)
	}
	return nil
}

// parseHex parses a name of exactly 16 lower-case hex digits.
func parseHex(s string) (uint64, bool) {
	if len(s) != 16 || strings.ToLower(s) != s {
		return 0, false
	}
	v, err := strconv.ParseUint(s, 16, 64)
	return v, err == nil
}
