package filetier

import "os"

// SetWriteHook makes every later file write of t call hook instead (nil: the real
// write), so that a test can fail it as a full disk would.
func SetWriteHook(t *Tier, hook func(f *os.File, b []byte) error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.writeHook = hook
}

// FileSize is the bytes of the file of a value of n bytes.
func FileSize(n int) int { return fileSize(n, DefaultAlign) }

// HeaderSize is the bytes before a file's value.
const HeaderSize = headerSize
