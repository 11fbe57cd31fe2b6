package testutil

import (
	"bufio"
	"bytes"
	"errors"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
)

// Mapping is one mapping of this process as /proc/self/maps lists it, with the
// fields /proc/self/smaps adds where Smaps read it.
type Mapping struct {
	Lo, Hi uintptr // the range [Lo, Hi)
	Perms  string  // "rw-s", "---p", ...
	Offset uint64  // the offset in Path's file
	Inode  uint64  // 0 for anonymous memory
	Path   string  // "" for anonymous memory, else "/memfd:name (deleted)", "[anon:name]", ...
	Line   string  // the maps line as the kernel wrote it

	// From smaps only: the sizes it gives in kB (Rss, Pss, ...), in bytes, and the
	// VmFlags ("nh": MADV_NOHUGEPAGE, "hg": MADV_HUGEPAGE, ...).
	Sizes   map[string]int64
	VmFlags []string
}

// Overlaps reports whether m overlaps [lo, hi).
func (m Mapping) Overlaps(lo, hi uintptr) bool { return m.Lo < hi && m.Hi > lo }

// Overlapping returns the mappings of ms that overlap [lo, hi).
func Overlapping(ms []Mapping, lo, hi uintptr) []Mapping {
	var out []Mapping
	for _, m := range ms {
		if m.Overlaps(lo, hi) {
			out = append(out, m)
		}
	}
	return out
}

// Maps returns this process's mappings from /proc/self/maps, in address order, or
// nil where the system has no /proc (not Linux). Any other error fails tb.
func Maps(tb testing.TB) []Mapping {
	tb.Helper()
	return readProc(tb, "/proc/self/maps", false)
}

// MapsWith returns the lines of /proc/self/maps that contain s (a memfd's name, say),
// or nil where the system has no /proc (not Linux).
func MapsWith(tb testing.TB, s string) []string {
	tb.Helper()
	var out []string
	for _, m := range Maps(tb) {
		if strings.Contains(m.Line, s) {
			out = append(out, m.Line)
		}
	}
	return out
}

// Smaps returns this process's mappings from /proc/self/smaps, with their sizes and
// VmFlags, or nil where the system has no /proc (not Linux).
func Smaps(tb testing.TB) []Mapping {
	tb.Helper()
	return readProc(tb, "/proc/self/smaps", true)
}

// readProc reads path, a maps file (every line a mapping) or an smaps file (each
// mapping's line followed by its fields).
func readProc(tb testing.TB, path string, smaps bool) []Mapping {
	tb.Helper()
	raw, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) && runtime.GOOS != "linux" {
		return nil
	}
	if err != nil {
		tb.Fatal(err)
	}
	var out []Mapping
	sc := bufio.NewScanner(bytes.NewReader(raw))
	for sc.Scan() {
		line := sc.Text()
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		if m, ok := parseMapping(line, f); ok {
			out = append(out, m)
			continue
		}
		if !smaps || len(out) == 0 {
			tb.Fatalf("%s: %q is not a mapping", path, line)
		}
		m := &out[len(out)-1]
		if flags, ok := strings.CutPrefix(line, "VmFlags:"); ok {
			m.VmFlags = strings.Fields(flags)
			continue
		}
		if len(f) == 3 && f[2] == "kB" && strings.HasSuffix(f[0], ":") {
			kb, err := strconv.ParseInt(f[1], 10, 64)
			if err != nil {
				tb.Fatalf("%s: %q: %v", path, line, err)
			}
			if m.Sizes == nil {
				m.Sizes = map[string]int64{}
			}
			m.Sizes[strings.TrimSuffix(f[0], ":")] = kb << 10
		}
	}
	if err := sc.Err(); err != nil {
		tb.Fatal(err)
	}
	return out
}

// parseMapping parses a maps line (fields f): "lo-hi perms offset dev inode [path]".
func parseMapping(line string, f []string) (Mapping, bool) {
	lo, hi, ok := strings.Cut(f[0], "-")
	if !ok || len(f) < 5 || strings.HasSuffix(f[0], ":") {
		return Mapping{}, false
	}
	start, err1 := strconv.ParseUint(lo, 16, 64)
	end, err2 := strconv.ParseUint(hi, 16, 64)
	off, err3 := strconv.ParseUint(f[2], 16, 64)
	inode, err4 := strconv.ParseUint(f[4], 10, 64)
	if errors.Join(err1, err2, err3, err4) != nil {
		return Mapping{}, false
	}
	m := Mapping{Lo: uintptr(start), Hi: uintptr(end), Perms: f[1], Offset: off, Inode: inode, Line: line}
	if len(f) > 5 {
		m.Path = strings.Join(f[5:], " ")
	}
	return m, true
}

// Status returns a size field of /proc/self/status ("VmData", "VmRSS", ...) in
// bytes; a field that is missing fails tb.
func Status(tb testing.TB, field string) uint64 {
	tb.Helper()
	raw, err := os.ReadFile("/proc/self/status")
	if err != nil {
		tb.Fatal(err)
	}
	for line := range strings.Lines(string(raw)) {
		if rest, ok := strings.CutPrefix(line, field+":"); ok {
			kb, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			if err != nil {
				tb.Fatalf("/proc/self/status: %q: %v", line, err)
			}
			return kb << 10
		}
	}
	tb.Fatalf("no %s in /proc/self/status", field)
	return 0
}
