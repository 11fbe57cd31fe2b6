package kv_test

import (
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestPackageTourInREADME keeps README.md's package tour whole: every package of the
// module that a user can import or run (not under internal/, not in a nested module)
// has a row of its own, and every row names such a package.
func TestPackageTourInREADME(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	require.NoError(t, err)
	_, tour, ok := strings.Cut(string(readme), "\n## Package tour\n")
	require.True(t, ok, "README.md has a Package tour section")
	tour, _, _ = strings.Cut(tour, "\n## ")
	var rows []string
	for _, l := range strings.Split(tour, "\n") {
		if name, ok := strings.CutPrefix(l, "| `"); ok {
			name, _, ok = strings.Cut(name, "` |")
			require.True(t, ok, "a row names one package: %q", l)
			rows = append(rows, name)
		}
	}

	var pkgs []string
	err = filepath.WalkDir("..", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel("..", path)
		rel = filepath.ToSlash(rel)
		if d.IsDir() {
			base := d.Name()
			if rel != "." && (strings.HasPrefix(base, ".") || strings.HasPrefix(base, "_") ||
				base == "testdata" || base == "internal") {
				return filepath.SkipDir
			}
			if _, err := os.Stat(filepath.Join(path, "go.mod")); err == nil && rel != "." {
				return filepath.SkipDir // a module of its own
			}
			return nil
		}
		if strings.HasSuffix(path, ".go") && !strings.HasSuffix(path, "_test.go") {
			if dir := filepath.ToSlash(filepath.Dir(rel)); dir != "." && !slices.Contains(pkgs, dir) {
				pkgs = append(pkgs, dir)
			}
		}
		return nil
	})
	require.NoError(t, err)
	require.NotEmpty(t, pkgs)

	for _, p := range pkgs {
		assert.Contains(t, rows, p, "README.md's package tour has no row for %s", p)
	}
	for _, r := range rows {
		assert.Contains(t, pkgs, r, "README.md's package tour names %s, which is no package", r)
	}
	assert.Len(t, rows, len(pkgs), "one row a package: %v", rows)
}

// TestREADMEFitsOneSitting keeps README.md to what a newcomer reads first (under 200
// lines: what it is, the quick start, the two commands, the tables of pages and
// packages); reference material belongs in docs/.
func TestREADMEFitsOneSitting(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	require.NoError(t, err)
	lines := strings.Count(string(readme), "\n")
	assert.Less(t, lines, 200, "README.md has %d lines: move reference material to docs/", lines)
}
