//go:build !invariants

package invariants

import "os"

// Enabled reports whether this is the invariants build. It is a constant, so the
// checks behind it are compiled out of the normal build.
const Enabled = false

// Tracker is an owner's leak record: it takes no space and does nothing in the
// normal build. It must not be the owner's last field (a zero-size last field pads
// the struct).
type Tracker struct{}

// Track starts tracking owner, which t lies in, as what (its type, such as
// "kv.Sequence"); it does nothing in the normal build.
func Track[T any](t *Tracker, owner *T, what string) {}

// Close records that the owner was closed; it does nothing in the normal build.
func (t *Tracker) Close() {}

// Leaks returns the owners found collected unclosed since the last call whose report
// match accepts, and forgets them; in the normal build there are none.
func Leaks(match func(Leak) bool) []Leak { return nil }

// Exit ends a test binary with code: the exit hook of a TestMain (goleak.Cleanup).
// In the invariants build a run that passed fails when an owner was collected
// unclosed.
func Exit(code int) { os.Exit(code) }
