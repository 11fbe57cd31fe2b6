package host

import (
	"bufio"
	"bytes"
	"fmt"
	"math/bits"
	"os"
	"path/filepath"
	"strconv"
	"sync"

	"golang.org/x/sys/unix"
)

const (
	hugeSysDir     = "/sys/kernel/mm/transparent_hugepage/"
	hugeDefaultPMD = 2 << 20
)

// hugeAnon and hugeShmem read the system's modes once: they change only when an
// administrator writes sysfs, and a backing decides at construction.
var (
	hugeAnon  = sync.OnceValue(func() hugeMode { return hugeReadMode("enabled", "always", "madvise") })
	hugeShmem = sync.OnceValue(func() hugeMode { return hugeReadMode("shmem_enabled", "always", "within_size", "advise", "force") })
)

// hugeReadMode reads the selected mode (the word in brackets) of a sysfs file of
// transparent huge pages and whether it is one of ok.
func hugeReadMode(file string, ok ...string) hugeMode {
	m := hugeMode{pmd: hugeDefaultPMD}
	if b, err := os.ReadFile(hugeSysDir + "hpage_pmd_size"); err == nil {
		if n, err := strconv.Atoi(string(bytes.TrimSpace(b))); err == nil && n > 0 {
			m.pmd = n
		}
	}
	b, err := os.ReadFile(hugeSysDir + file)
	if err != nil {
		m.why = fmt.Sprintf("the kernel has no transparent huge pages (%v)", err)
		return m
	}
	if i, j := bytes.IndexByte(b, '['), bytes.IndexByte(b, ']'); i >= 0 && j > i {
		m.mode = string(b[i+1 : j])
	}
	for _, s := range ok {
		if m.mode == s {
			return m
		}
	}
	m.why = fmt.Sprintf("%s%s is %q", hugeSysDir, file, m.mode)
	return m
}

// hugeReporting returns why a fresh huge page is slow on this system, or "": the
// system is a virtual machine whose balloon device reports free memory back to its
// host (virtio_balloon with VIRTIO_BALLOON_F_REPORTING) in blocks no larger than a
// huge page (/sys/module/page_reporting/parameters/page_reporting_order), so that a
// 2 MiB block left free for a moment goes back to the host and the next huge page
// made from it takes host faults on its first write: 2-6 ms per 2 MiB measured on
// such a guest, against 1.5-2.7 ms for 512 small pages, which come from blocks that
// stay.
var hugeReporting = sync.OnceValue(func() string {
	b, err := os.ReadFile("/sys/module/page_reporting/parameters/page_reporting_order")
	if err != nil {
		return ""
	}
	order, err := strconv.Atoi(string(bytes.TrimSpace(b)))
	if err != nil || order > bits.Len(uint(hugeAnon().pmd/os.Getpagesize()))-1 {
		return ""
	}
	devs, _ := filepath.Glob("/sys/bus/virtio/drivers/virtio_balloon/virtio*/features")
	for _, d := range devs {
		// Feature bits as '0'/'1' characters, bit 0 first; 5 is free page reporting.
		if f, err := os.ReadFile(d); err == nil && len(f) > 5 && f[5] == '1' {
			return fmt.Sprintf("this guest reports free %d-page blocks to its host (virtio_balloon), "+
				"so a fresh huge page takes host faults: set AlwaysHugePages to ask for them anyway", 1<<order)
		}
	}
	return ""
})

// hugeAdvise asks for transparent huge pages on [addr, addr+n) (MADV_HUGEPAGE), or,
// when huge is false, for none (MADV_NOHUGEPAGE): the mapping's flag, which later
// splits of the mapping keep.
func hugeAdvise(addr uintptr, n int, huge bool) error {
	advice := unix.MADV_HUGEPAGE
	if !huge {
		advice = unix.MADV_NOHUGEPAGE
	}
	return unix.Madvise(privateBytes(addr, 0, n), advice)
}

// hugeBytes sums the huge-page fields of /proc/self/smaps over the mappings inside
// [lo, hi). A mapping that only overlaps the range is counted in proportion to the
// overlap (the backings keep their committed memory from merging with a neighbour, so
// that does not happen to a reservation's own memory).
func hugeBytes(lo, hi uintptr) (HugePageBytes, error) {
	var out HugePageBytes
	f, err := os.Open("/proc/self/smaps")
	if err != nil {
		return out, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	in := false
	var start, end uintptr
	for sc.Scan() {
		line := sc.Bytes()
		if s, e, ok := hugeRange(line); ok {
			start, end = s, e
			in = s < hi && e > lo
			continue
		}
		if !in {
			continue
		}
		var field *int64
		switch {
		case bytes.HasPrefix(line, []byte("AnonHugePages:")):
			field = &out.Anon
		case bytes.HasPrefix(line, []byte("ShmemPmdMapped:")):
			field = &out.Shmem
		default:
			continue
		}
		kb, err := hugeKB(line)
		if err != nil {
			return out, err
		}
		n := kb << 10
		if start < lo || end > hi {
			n = hugeShare(n, uint64(min(end, hi)-max(start, lo)), uint64(end-start))
		}
		*field += n
	}
	return out, sc.Err()
}

// hugeShare returns the part of n huge-page bytes of a mapping of total bytes that
// falls in the in bytes of it inside the reservation, in proportion. It computes in
// 128 bits: a mapping of a few GiB would overflow n*in in 64.
func hugeShare(n int64, in, total uint64) int64 {
	un := min(uint64(max(n, 0)), total) // smaps never reports more than the mapping
	hi, lo := bits.Mul64(un, in)
	q, _ := bits.Div64(hi, lo, total) // q <= in <= total: no overflow
	return int64(q)
}

// hugeRange parses the "start-end perms ..." line that opens a mapping in smaps.
func hugeRange(line []byte) (start, end uintptr, ok bool) {
	dash := bytes.IndexByte(line, '-')
	sp := bytes.IndexByte(line, ' ')
	if dash <= 0 || sp <= dash {
		return 0, 0, false
	}
	s, err1 := strconv.ParseUint(string(line[:dash]), 16, 64)
	e, err2 := strconv.ParseUint(string(line[dash+1:sp]), 16, 64)
	if err1 != nil || err2 != nil {
		return 0, 0, false
	}
	return uintptr(s), uintptr(e), true
}

// hugeKB parses "Field:   1234 kB".
func hugeKB(line []byte) (int64, error) {
	f := bytes.Fields(line)
	if len(f) < 2 {
		return 0, fmt.Errorf("host: smaps line %q", line)
	}
	return strconv.ParseInt(string(f[1]), 10, 64)
}
