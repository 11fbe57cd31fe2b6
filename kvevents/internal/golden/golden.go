// Package golden reads the hand-written payloads of kvevents/testdata/golden, for
// the tests of kvevents and kvsub. A file holds hex bytes, "text" for the bytes of
// text (its msgpack header written out before it), and # comments to the end of a
// line.
package golden

import (
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
)

// Dir returns the directory of the golden files.
func Dir() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "testdata", "golden")
}

// Read returns the bytes the golden file name (in Dir) spells out.
func Read(name string) ([]byte, error) {
	text, err := os.ReadFile(filepath.Join(Dir(), name))
	if err != nil {
		return nil, err
	}
	return Parse(string(text))
}

// Parse returns the bytes text spells out.
func Parse(text string) ([]byte, error) {
	var out []byte
	for n, line := range strings.Split(text, "\n") {
		for line != "" {
			line = strings.TrimLeft(line, " \t\r")
			switch {
			case line == "" || line[0] == '#':
				line = ""
			case line[0] == '"':
				end := strings.IndexByte(line[1:], '"')
				if end < 0 {
					return nil, fmt.Errorf("golden: line %d: an unclosed string", n+1)
				}
				out = append(out, line[1:1+end]...)
				line = line[2+end:]
			default:
				end := strings.IndexAny(line, " \t\r\"#")
				if end < 0 {
					end = len(line)
				}
				b, err := hex.DecodeString(line[:end])
				if err != nil {
					return nil, fmt.Errorf("golden: line %d: %w", n+1, err)
				}
				out = append(out, b...)
				line = line[end:]
			}
		}
	}
	return out, nil
}
