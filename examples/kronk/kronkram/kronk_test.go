package kronkram

// TestKronkRAMCases runs Kronk's own tests of its RAM store on a snapshot.Store.
// Nothing of Kronk's is in this tree: the test reads Kronk v1.32.6's
// sdk/kronk/kvstorage/ram/ram_test.go from the module cache, makes the few
// changes below, writes the result to a temporary file and has the go command
// build it into this package with -overlay, in a child `go test`. The changes:
//
//   - the package clause names this package;
//   - the RAM store's constructors (newCheckedStore's &Store{},
//     TestStore_CanceledContext's New() and TestNewFactory's NewFactory()) become
//     New(t) and NewFactory(t) of store_test.go, which make snapshot stores;
//   - the nine cases that test the RAM store's own capacity policy (leftOut), and
//     checkedStore's Reset method, which only they call, are left out: each is
//     replaced by a test of vmarena's under a name of its own in
//     ../policy_test.go.
//
// Every removed declaration becomes as many blank lines as it had, so a failure
// in the child names the line of Kronk's file. The rewrite fails the test, rather
// than guess, wherever Kronk's file differs from that shape.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io"
	"io/fs"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const (
	kronkModule  = "github.com/ardanlabs/kronk"
	kronkVersion = "v1.32.6"
	// kronkFile is the file of Kronk's module that the cases are in.
	kronkFile = "sdk/kronk/kvstorage/ram/ram_test.go"
	// overlayName is the name the rewritten file takes in this package, Kronk's own,
	// so that the child's failures read as lines of Kronk's file.
	overlayName = "ram_test.go"
	// childTimeout bounds the child go test, build included.
	childTimeout = 8 * time.Minute
)

// kept are the cases of Kronk's file that test the kvstorage.Store contract: they
// run unchanged but for the constructors.
var kept = []string{
	"TestNewFactory",
	"TestStore_ZeroValue",
	"TestStore_PrepareGrows",
	"TestStore_CommitRejectsInvalidLength",
	"TestStore_CanceledContext",
	"TestStore_BytesAliasesBuffer",
	"TestStore_PrepareReusesAfterHeadroomGrow",
	"TestStore_PrepareLogarithmicGrowCount",
	"TestStore_NoChurnUnderRepeatedSnapshots",
}

// leftOut are the declarations of Kronk's file that are not run: the cases of the
// RAM store's capacity policy and the helper only they call.
var leftOut = []string{
	"TestStore_PrepareReusesBackingArray",
	"TestStore_ResetZeroesRetainedCapacity",
	"TestStore_PrepareGrowsWhenExceeding",
	"TestStore_PrepareNegativeSize",
	"TestStore_Commit",
	"TestStore_Reset",
	"TestStore_PrepareAddsHeadroomOnGrow",
	"TestStore_PrepareLargeJumpHonorsExactSize",
	"TestStore_PrepareFirstAllocNoHeadroom",
	"checkedStore.Reset",
}

// helpers are the declarations of Kronk's file, other than cases, that are kept.
var helpers = []string{
	"import",
	"checkedStore",
	"newCheckedStore",
	"checkedStore.Bytes",
	"checkedStore.Prepare",
	"checkedStore.Commit",
}

// constructor is a call of the RAM store's constructors that the rewrite replaces:
// the source it has in Kronk's file, the declaration it is in, and what it becomes.
type constructor struct {
	from, in, to string
}

var constructors = []constructor{
	{"&Store{}", "newCheckedStore", "New(t)"},
	{"New()", "TestStore_CanceledContext", "New(t)"},
	{"NewFactory()", "TestNewFactory", "NewFactory(t)"},
}

// edit replaces src[from:to] with text.
type edit struct {
	from, to int
	text     string
}

// declName is the name of a top-level declaration: a method as Type.Method, a type
// by its name, the imports as "import".
func declName(d ast.Decl) (string, error) {
	switch d := d.(type) {
	case *ast.FuncDecl:
		if d.Recv == nil {
			return d.Name.Name, nil
		}
		recv := d.Recv.List[0].Type
		if star, ok := recv.(*ast.StarExpr); ok {
			recv = star.X
		}
		id, ok := recv.(*ast.Ident)
		if !ok {
			return "", fmt.Errorf("method %s has a receiver of an unexpected form", d.Name.Name)
		}
		return id.Name + "." + d.Name.Name, nil
	case *ast.GenDecl:
		switch d.Tok {
		case token.IMPORT:
			return "import", nil
		case token.TYPE:
			if len(d.Specs) == 1 {
				return d.Specs[0].(*ast.TypeSpec).Name.Name, nil
			}
		}
		return "", fmt.Errorf("unexpected %s declaration", d.Tok)
	}
	return "", fmt.Errorf("unexpected declaration %T", d)
}

// rewrite returns Kronk's file src as this package runs it (see the top of this
// file), or an error saying where src is not of the shape the rewrite expects.
func rewrite(src []byte) ([]byte, error) {
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, kronkFile, src, parser.ParseComments)
	if err != nil {
		return nil, err
	}
	off := func(p token.Pos) int { return fset.Position(p).Offset }
	text := func(n ast.Node) string { return string(src[off(n.Pos()):off(n.End())]) }

	if f.Name.Name != "ram" {
		return nil, fmt.Errorf("package %s, want ram", f.Name.Name)
	}
	edits := []edit{{off(f.Name.Pos()), off(f.Name.End()), "kronkram"}}

	want := slices.Concat(kept, leftOut, helpers)
	var have []string
	found := make(map[string]string) // constructor.from → declaration it is in
	for _, d := range f.Decls {
		name, err := declName(d)
		if err != nil {
			return nil, err
		}
		have = append(have, name)
		if slices.Contains(leftOut, name) {
			from := d.Pos()
			if fd, ok := d.(*ast.FuncDecl); ok && fd.Doc != nil {
				from = fd.Doc.Pos()
			}
			gone := src[off(from):off(d.End())]
			edits = append(edits, edit{off(from), off(d.End()), strings.Repeat("\n", bytes.Count(gone, []byte("\n")))})
			continue
		}
		var werr error
		ast.Inspect(d, func(n ast.Node) bool {
			var c *constructor
			switch n := n.(type) {
			case *ast.UnaryExpr:
				if lit, ok := n.X.(*ast.CompositeLit); ok && n.Op == token.AND && isIdent(lit.Type, "Store") {
					c = lookup(text(n))
				}
			case *ast.CallExpr:
				if isIdent(n.Fun, "New") || isIdent(n.Fun, "NewFactory") {
					c = lookup(text(n))
				}
			case *ast.CompositeLit:
				// Any other literal of the RAM store.
				if isIdent(n.Type, "Store") {
					werr = errors.Join(werr, fmt.Errorf("%s: %s in %s", fset.Position(n.Pos()), text(n), name))
				}
			case *ast.Ident:
				// Any other use of the RAM store's constructors.
				if n.Name == "New" || n.Name == "NewFactory" {
					werr = errors.Join(werr, fmt.Errorf("%s: %s used other than as %s() in %s", fset.Position(n.Pos()), n.Name, n.Name, name))
				}
				return false
			}
			if c == nil {
				return true
			}
			if c.in != name {
				werr = errors.Join(werr, fmt.Errorf("%s: %s in %s, want it only in %s", fset.Position(n.Pos()), c.from, name, c.in))
			} else if _, dup := found[c.from]; dup {
				werr = errors.Join(werr, fmt.Errorf("%s: %s twice in %s", fset.Position(n.Pos()), c.from, name))
			}
			found[c.from] = name
			edits = append(edits, edit{off(n.Pos()), off(n.End()), c.to})
			return false
		})
		if werr != nil {
			return nil, werr
		}
	}
	if !sameSet(have, want) {
		return nil, fmt.Errorf("declarations %v, want %v", sorted(have), sorted(want))
	}
	for _, c := range constructors {
		if _, ok := found[c.from]; !ok {
			return nil, fmt.Errorf("no %s in %s", c.from, c.in)
		}
	}

	sort.Slice(edits, func(i, j int) bool { return edits[i].from < edits[j].from })
	var out bytes.Buffer
	at := 0
	for _, e := range edits {
		out.Write(src[at:e.from])
		out.WriteString(e.text)
		at = e.to
	}
	out.Write(src[at:])
	return out.Bytes(), nil
}

// lookup returns the constructor whose source is from, or nil.
func lookup(from string) *constructor {
	for i := range constructors {
		if constructors[i].from == from {
			return &constructors[i]
		}
	}
	return nil
}

func isIdent(e ast.Expr, name string) bool {
	id, ok := e.(*ast.Ident)
	return ok && id.Name == name
}

func sorted(s []string) []string { return slices.Sorted(slices.Values(s)) }

func sameSet(a, b []string) bool { return slices.Equal(sorted(a), sorted(b)) }

// kronkDir returns the directory of Kronk's module in the module cache, from the
// go command.
func kronkDir(ctx context.Context, goCmd string) (string, error) {
	out, err := exec.CommandContext(ctx, goCmd, "list", "-m", "-f", "{{.Version}} {{.Dir}}", kronkModule).Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			err = fmt.Errorf("%w: %s", err, ee.Stderr)
		}
		return "", fmt.Errorf("go list -m %s: %w", kronkModule, err)
	}
	version, dir, _ := strings.Cut(strings.TrimSpace(string(out)), " ")
	if version != kronkVersion {
		return "", fmt.Errorf("go.mod requires %s %s, want %s", kronkModule, version, kronkVersion)
	}
	if dir == "" {
		return "", fmt.Errorf("%s %s is not in the module cache (go mod download)", kronkModule, version)
	}
	return dir, nil
}

// event is a line of go test -json (cmd/test2json).
type event struct {
	Action string
	Test   string
	Output string
}

func TestKronkRAMCases(t *testing.T) {
	goCmd, err := exec.LookPath("go")
	require.NoError(t, err, "TestKronkRAMCases runs Kronk's cases through the go command, which is not on PATH")

	timeout := childTimeout
	if d, ok := t.Deadline(); ok {
		timeout = min(timeout, time.Until(d)-10*time.Second)
	}
	require.Greater(t, timeout, time.Minute, "too little of the test's -timeout is left for a child go test")
	ctx, cancel := context.WithTimeout(t.Context(), timeout)
	defer cancel()

	dir, err := kronkDir(ctx, goCmd)
	require.NoError(t, err)
	src, err := os.ReadFile(filepath.Join(dir, filepath.FromSlash(kronkFile)))
	require.NoError(t, err, "Kronk's file")
	ours, err := rewrite(src)
	require.NoError(t, err, "%s of %s %s is not of the shape this test rewrites", kronkFile, kronkModule, kronkVersion)

	// The overlay adds a file to this package, so it must name one that is not
	// there.
	pkgDir, err := os.Getwd()
	require.NoError(t, err)
	target := filepath.Join(pkgDir, overlayName)
	_, err = os.Stat(target)
	require.ErrorIs(t, err, fs.ErrNotExist, "the overlay adds %s to this package", overlayName)

	tmp := t.TempDir()
	file := filepath.Join(tmp, overlayName)
	require.NoError(t, os.WriteFile(file, ours, 0o600))
	overlay, err := json.Marshal(map[string]map[string]string{"Replace": {target: file}})
	require.NoError(t, err)
	overlayFile := filepath.Join(tmp, "overlay.json")
	require.NoError(t, os.WriteFile(overlayFile, overlay, 0o600))

	// The child inherits the environment (GOTOOLCHAIN, GOFLAGS, the caches).
	args := []string{"test", "-json", "-count", "1", "-overlay", overlayFile,
		"-timeout", (timeout - 10*time.Second).String(),
		"-run", "^(" + strings.Join(kept, "|") + ")$"}
	if raceEnabled {
		args = append(args, "-race")
	}
	args = append(args, ".")
	cmd := exec.CommandContext(ctx, goCmd, args...)
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	cmd.WaitDelay = 10 * time.Second
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	t.Logf("running %s's cases: go %s", kronkVersion, strings.Join(args, " "))
	runErr := cmd.Run()

	// Each top-level case's last action, and everything the child said.
	result := make(map[string]string)
	var said strings.Builder
	dec := json.NewDecoder(bytes.NewReader(stdout.Bytes()))
	for {
		var e event
		if err := dec.Decode(&e); err != nil {
			if !errors.Is(err, io.EOF) {
				fmt.Fprintf(&said, "(not go test -json: %v)\n%s", err, stdout.Bytes()[dec.InputOffset():])
			}
			break
		}
		said.WriteString(e.Output)
		if e.Test != "" && !strings.Contains(e.Test, "/") && e.Action != "output" {
			result[e.Test] = e.Action
		}
	}
	said.Write(stderr.Bytes())

	ok := assert.NoError(t, runErr, "go test of Kronk's cases")
	ok = assert.ElementsMatch(t, kept, slices.Collect(maps.Keys(result)), "the cases that ran") && ok
	for _, name := range kept {
		ok = assert.Equal(t, "pass", result[name], "Kronk's %s on a snapshot.Store", name) && ok
	}
	if !ok || testing.Verbose() {
		t.Logf("go test of Kronk's cases said:\n%s", said.String())
	}
}

// TestRewriteRefusesOtherShapes checks that the rewrite fails, rather than
// guesses, when Kronk's file is not of the shape it expects.
func TestRewriteRefusesOtherShapes(t *testing.T) {
	goCmd, err := exec.LookPath("go")
	require.NoError(t, err, "the go command is not on PATH")
	dir, err := kronkDir(t.Context(), goCmd)
	require.NoError(t, err)
	src, err := os.ReadFile(filepath.Join(dir, filepath.FromSlash(kronkFile)))
	require.NoError(t, err, "Kronk's file")
	_, err = rewrite(src)
	require.NoError(t, err, "Kronk's own file")

	for _, tc := range []struct {
		name, old, new, want string
	}{
		{"another package", "package ram", "package ram2", "package ram2"},
		{"a constructor with arguments", "store := New()", "store := New(); _ = New(nil)", "New used other than"},
		{"a constructor twice", "store := New()", "store := New(); _ = New()", "New() twice in TestStore_CanceledContext"},
		{"a constructor elsewhere", "factory := NewFactory()", "factory := NewFactory(); _ = New()", "New() in TestNewFactory"},
		{"a constructor missing", "factory := NewFactory()", "factory := NewFactoryOf()", "no NewFactory()"},
		{"another literal", "Store: &Store{}", "Store: &Store{}, _: Store{}", "Store{} in newCheckedStore"},
		{"a case renamed", "func TestStore_Reset(", "func TestStore_Reset2(", "declarations"},
		{"a case added", "func TestNewFactory(", "func TestMore(t *testing.T) {}\n\nfunc TestNewFactory(", "declarations"},
		{"a case kept gone", "func TestStore_ZeroValue(", "func testStore_ZeroValue(", "declarations"},
		{"not Go", "func TestNewFactory(", "func TestNewFactory(((", "expected"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, 1, bytes.Count(src, []byte(tc.old)), "Kronk's file has %q once", tc.old)
			_, err := rewrite(bytes.Replace(src, []byte(tc.old), []byte(tc.new), 1))
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.want)
		})
	}
}
