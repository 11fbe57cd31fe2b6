package kv_test

import (
	"fmt"
	"go/ast"
	"go/build"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
)

// TestNoFileCallsBack holds kv's files to one direction: no file calls a function or
// method declared in another file that calls back into it. A file follows one seam,
// and two files that call each other are one seam cut in two, which the next change
// must read as one (STYLE.md's "a file follows one seam"). Calls are found by type:
// a method's file is where the method is declared, whatever its receiver's name.
// Only the package's own non-test files for this platform count.
func TestNoFileCallsBack(t *testing.T) {
	if runtime.GOOS != "linux" {
		// NB: the Windows binaries run under Wine, where neither the go tool nor its
		// sources are; the files and their calls are the same on every platform but
		// for per-OS files, of which kv's library has none.
		t.Skip("reads the package's source with the go tool's: checked on Linux")
	}
	calls, err := fileCalls(".")
	if err != nil {
		t.Fatal(err)
	}
	arrows := 0
	for _, tos := range calls {
		arrows += len(tos)
	}
	if arrows < 50 {
		t.Fatalf("found %d arrows between kv's files: the analysis reads nothing", arrows)
	}
	for _, pair := range twoWay(calls) {
		t.Errorf("%s", pair)
	}
}

// fileCalls returns, for the package in dir, which of its files calls functions or
// methods declared in which other: calls[from][to] is the names called.
func fileCalls(dir string) (map[string]map[string][]string, error) {
	pkg, err := build.Default.ImportDir(dir, 0)
	if err != nil {
		return nil, err
	}
	fset := token.NewFileSet()
	var files []*ast.File
	for _, name := range pkg.GoFiles {
		f, err := parser.ParseFile(fset, filepath.Join(dir, name), nil, 0)
		if err != nil {
			return nil, err
		}
		files = append(files, f)
	}
	info := &types.Info{Uses: map[*ast.Ident]types.Object{}}
	conf := types.Config{Importer: importer.ForCompiler(fset, "source", nil)}
	tp, err := conf.Check(pkg.ImportPath, fset, files, info)
	if err != nil {
		return nil, err
	}
	calls := map[string]map[string][]string{}
	for id, obj := range info.Uses {
		fn, ok := obj.(*types.Func)
		if !ok || fn.Pkg() != tp {
			continue
		}
		from := filepath.Base(fset.Position(id.Pos()).Filename)
		to := filepath.Base(fset.Position(fn.Origin().Pos()).Filename)
		if from == to {
			continue
		}
		if calls[from] == nil {
			calls[from] = map[string][]string{}
		}
		if !slices.Contains(calls[from][to], fn.Name()) {
			calls[from][to] = append(calls[from][to], fn.Name())
		}
	}
	return calls, nil
}

// twoWay returns the pairs of files in calls that call each other, each told once
// with what each side calls, in a fixed order.
func twoWay(calls map[string]map[string][]string) []string {
	var pairs []string
	for a, tos := range calls {
		for b, names := range tos {
			back, ok := calls[b][a]
			if !ok || a > b {
				continue
			}
			slices.Sort(names)
			slices.Sort(back)
			pairs = append(pairs, fmt.Sprintf("%s calls %s (%s), which calls it back (%s)",
				a, b, strings.Join(names, ", "), strings.Join(back, ", ")))
		}
	}
	slices.Sort(pairs)
	return pairs
}

// TestTwoWayFindsAPair checks the test above against calls that hold a pair, so that
// an analysis that found no pair because it could not see one fails here.
func TestTwoWayFindsAPair(t *testing.T) {
	calls := map[string]map[string][]string{
		"a.go": {"b.go": {"g", "f"}, "c.go": {"h"}},
		"b.go": {"a.go": {"k"}},
		"c.go": {"d.go": {"m"}},
	}
	want := []string{"a.go calls b.go (f, g), which calls it back (k)"}
	if got := twoWay(calls); !slices.Equal(got, want) {
		t.Fatalf("twoWay = %q, want %q", got, want)
	}
}
