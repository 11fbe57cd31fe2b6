package kv_test

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestQuickStartInREADME keeps README.md's quick start identical to Example_quickStart,
// which go test compiles and runs: the README's program has the example's imports, its
// main is the example's body, and the output it shows is the example's Output.
func TestQuickStartInREADME(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	require.NoError(t, err)
	example, err := os.ReadFile("example_quickstart_test.go")
	require.NoError(t, err)

	ex := regexp.MustCompile(`(?s)\nimport \((.*?)\n\).*?\nfunc Example_quickStart\(\) \{\n(.*?)\t// Output:\n(.*?)\n\}`).FindSubmatch(example)
	require.NotNil(t, ex, "Example_quickStart with an Output comment in example_quickstart_test.go")
	rd := regexp.MustCompile("(?s)```go\npackage main\n\nimport \\((.*?)\n\\)\n\nfunc main\\(\\) \\{\n(.*?)\\}\n```\n\nIt prints:\n\n```\n(.*?)\n```").FindSubmatch(readme)
	require.NotNil(t, rd, "README.md's quick start: a Go program, then what it prints")

	assert.Equal(t, string(ex[1]), string(rd[1]), "the imports")
	assert.Equal(t, string(ex[2]), string(rd[2]), "main's body against the example's")
	var output []string
	for _, l := range strings.Split(string(ex[3]), "\n") {
		output = append(output, strings.TrimPrefix(l, "\t// "))
	}
	assert.Equal(t, strings.Join(output, "\n"), string(rd[3]), "the output")

	// The quick start is on the first screen: within the README's first 30 lines
	// after the go get line.
	lines := strings.Split(string(readme), "\n")
	goGet, quick := -1, -1
	for i, l := range lines {
		if goGet < 0 && strings.TrimSpace(l) == "go get github.com/vmarena/vmarena@latest" {
			goGet = i
		}
		if quick < 0 && l == "## Quick start" {
			quick = i
		}
	}
	require.GreaterOrEqual(t, goGet, 0, "README.md has the go get line")
	assert.Less(t, goGet, 20, "the go get line on the first screen")
	assert.Less(t, quick-goGet, 10, "the quick start right after it")
}
