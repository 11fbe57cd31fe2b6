package main

import (
	"fmt"
	"math"
	"strconv"
	"strings"
)

// sizeFlag is a byte count written like 4GiB, 512MiB, 64KiB, 2GB or 1048576.
type sizeFlag int64

var sizeUnits = []struct {
	suffix string
	mult   int64
}{
	{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10},
	{"TB", 1e12}, {"GB", 1e9}, {"MB", 1e6}, {"KB", 1e3},
	{"T", 1 << 40}, {"G", 1 << 30}, {"M", 1 << 20}, {"K", 1 << 10},
	{"B", 1},
}

// parseSize reads a byte count with an optional unit (binary for KiB..TiB and for
// the bare K, M, G, T; decimal for KB..TB).
func parseSize(s string) (int64, error) {
	t := strings.TrimSpace(s)
	mult := int64(1)
	for _, u := range sizeUnits {
		if len(t) > len(u.suffix) && strings.EqualFold(t[len(t)-len(u.suffix):], u.suffix) {
			mult, t = u.mult, strings.TrimSpace(t[:len(t)-len(u.suffix)])
			break
		}
	}
	v, err := strconv.ParseFloat(t, 64)
	if err != nil || v < 0 || math.IsInf(v, 0) || math.IsNaN(v) {
		return 0, fmt.Errorf("%q is not a size like 4GiB, 512MiB or 1048576", s)
	}
	b := v * float64(mult)
	if b >= math.MaxInt64 {
		return 0, fmt.Errorf("%q is too large", s)
	}
	return int64(b), nil
}

func (f *sizeFlag) Set(s string) error {
	v, err := parseSize(s)
	if err != nil {
		return err
	}
	*f = sizeFlag(v)
	return nil
}

func (f *sizeFlag) String() string {
	if f == nil || *f == 0 {
		return "0"
	}
	return formatBytes(int64(*f))
}

// formatBytes writes n in the largest binary unit that keeps it at least 1, with
// up to two decimals.
func formatBytes(n int64) string {
	units := []string{"B", "KiB", "MiB", "GiB", "TiB"}
	v, u := float64(n), 0
	for math.Abs(v) >= 1024 && u < len(units)-1 {
		v /= 1024
		u++
	}
	if u == 0 {
		return fmt.Sprintf("%d B", n)
	}
	s := strconv.FormatFloat(v, 'f', 2, 64)
	s = strings.TrimRight(strings.TrimRight(s, "0"), ".")
	return s + " " + units[u]
}
