package hosttier

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// The cgroup check. A host pool sized past its container's memory limit is not
// refused by the kernel when it is made: it is OOM-killed later, when it fills (SGLang
// users met this with host KV pools). So New compares its budget with what the
// process's memory cgroup, and each cgroup above it, leaves free now: the limit less
// the usage, at the tightest level.
//
// Both hierarchies are read: cgroup v2 (memory.max, "max" meaning none, and
// memory.current) and v1's memory controller (memory.limit_in_bytes, where a value
// near 2^63 means none, and memory.usage_in_bytes). An absent file is no limit at that
// level; a process whose cgroup directory is not visible (a container with its own
// cgroup namespace) reads the mount's root, which is then its own cgroup.

const (
	defaultCgroupRoot = "/sys/fs/cgroup"
	defaultCgroupSelf = "/proc/self/cgroup"
	// v1 writes "no limit" as the largest page-aligned int64, 9223372036854771712.
	v1Unlimited = math.MaxInt64 / 2
)

// cgroupLevel is one cgroup with a memory limit.
type cgroupLevel struct {
	dir                 string
	limitFile, usedFile string
	limit, used         int64
}

func (l cgroupLevel) free() int64 { return max(l.limit-l.used, 0) }

// checkCgroup returns an error matching ErrCgroup when budget is above what the
// tightest memory cgroup of the process leaves free, and nil when it fits or no level
// has a limit. A file that exists but can not be parsed is an error too.
func checkCgroup(root, self string, budget int64) error {
	lvl, ok, err := tightestCgroup(root, self)
	if err != nil {
		return fmt.Errorf("hosttier: reading the memory cgroup: %w", err)
	}
	if !ok || budget <= lvl.free() {
		return nil
	}
	return fmt.Errorf("%w: budget %s, but cgroup %s has %s %s less %s %s used: %s free",
		ErrCgroup, fmtBytes(budget), lvl.dir, lvl.limitFile, fmtBytes(lvl.limit), lvl.usedFile, fmtBytes(lvl.used), fmtBytes(lvl.free()))
}

// tightestCgroup returns the level of the process's memory cgroups that leaves the
// least free, or false when none has a limit.
func tightestCgroup(root, self string) (cgroupLevel, bool, error) {
	if root == "" {
		root = defaultCgroupRoot
	}
	if self == "" {
		self = defaultCgroupSelf
	}
	mount, path, v1, err := memoryCgroup(root, self)
	if err != nil || mount == "" {
		return cgroupLevel{}, false, err
	}
	limitFile, usedFile := "memory.max", "memory.current"
	if v1 {
		limitFile, usedFile = "memory.limit_in_bytes", "memory.usage_in_bytes"
	}
	dir := filepath.Join(mount, path)
	if _, err := os.Stat(dir); err != nil {
		dir = mount
	}
	var best cgroupLevel
	found := false
	for {
		limit, ok, err := readLimit(filepath.Join(dir, limitFile), v1)
		if err != nil {
			return cgroupLevel{}, false, err
		}
		if ok {
			used, _, err := readLimit(filepath.Join(dir, usedFile), false)
			if err != nil {
				return cgroupLevel{}, false, err
			}
			l := cgroupLevel{dir: dir, limitFile: limitFile, usedFile: usedFile, limit: limit, used: used}
			if !found || l.free() < best.free() {
				best, found = l, true
			}
		}
		if dir == mount || len(dir) <= len(mount) {
			break
		}
		dir = filepath.Dir(dir)
	}
	return best, found, nil
}

// memoryCgroup reads the process's cgroup file and returns the memory hierarchy's
// mount, the process's path in it and whether it is v1; mount "" when there is none.
func memoryCgroup(root, self string) (mount, path string, v1 bool, err error) {
	data, err := os.ReadFile(self)
	if errors.Is(err, fs.ErrNotExist) {
		return "", "", false, nil
	}
	if err != nil {
		return "", "", false, err
	}
	var v2path string
	hasV2 := false
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		// hierarchy-ID:controller-list:path
		parts := strings.SplitN(sc.Text(), ":", 3)
		if len(parts) != 3 {
			continue
		}
		if parts[0] == "0" && parts[1] == "" {
			v2path, hasV2 = parts[2], true
			continue
		}
		if slices.Contains(strings.Split(parts[1], ","), "memory") {
			m := filepath.Join(root, "memory")
			if _, err := os.Stat(m); err == nil {
				return m, parts[2], true, nil
			}
		}
	}
	if err := sc.Err(); err != nil {
		return "", "", false, err
	}
	if !hasV2 {
		return "", "", false, nil
	}
	return root, v2path, false, nil
}

// readLimit reads a cgroup byte count: false for an absent file, "max", or (v1) a
// value meaning no limit.
func readLimit(file string, v1 bool) (int64, bool, error) {
	data, err := os.ReadFile(file)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, err
	}
	s := strings.TrimSpace(string(data))
	if s == "max" {
		return 0, false, nil
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 {
		return 0, false, fmt.Errorf("%s: not a byte count: %q", file, s)
	}
	if v1 && n >= v1Unlimited {
		return 0, false, nil
	}
	return n, true, nil
}

// fmtBytes writes n in GiB or MiB with the exact count.
func fmtBytes(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB (%d bytes)", float64(n)/(1<<30), n)
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB (%d bytes)", float64(n)/(1<<20), n)
	}
	return fmt.Sprintf("%d bytes", n)
}
