package tierval_test

import (
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestLeaf holds tierval to a leaf: its library files import nothing of this module,
// so that kv (and every tier) may import it and it never imports kv back.
func TestLeaf(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("reads the package's source: checked on Linux") // the Windows run has none
	}
	files, err := filepath.Glob("*.go")
	require.NoError(t, err)
	fset := token.NewFileSet()
	read := 0
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		src, err := os.ReadFile(name)
		require.NoError(t, err)
		f, err := parser.ParseFile(fset, name, src, parser.ImportsOnly)
		require.NoError(t, err)
		read++
		for _, imp := range f.Imports {
			path, err := strconv.Unquote(imp.Path.Value)
			require.NoError(t, err)
			require.False(t, strings.HasPrefix(path, "github.com/vmarena/vmarena"), "%s imports %s", name, path)
		}
	}
	require.Positive(t, read, "no library file read")
}
