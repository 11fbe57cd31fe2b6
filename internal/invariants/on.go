//go:build invariants

package invariants

import (
	"fmt"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"weak"
)

// Enabled reports whether this is the invariants build. It is a constant, so the
// checks behind it are compiled out of the normal build.
const Enabled = true

// Tracker is an owner's leak record: it takes no space and does nothing in the
// normal build. It must not be the owner's last field (a zero-size last field pads
// the struct).
type Tracker struct{ s *tracked }

// tracked is what is known of one tracked owner. It does not point to the owner, so
// the owner can be collected.
type tracked struct {
	what     string
	pcs      []uintptr
	gone     func() bool // whether the owner was collected (its weak pointer is nil)
	done     atomic.Bool // closed, or reported: nothing more to say
	stopLeak runtime.Cleanup
}

// stackDepth is the most frames a leak report shows.
const stackDepth = 16

var (
	mu   sync.Mutex
	live = map[*tracked]struct{}{} // tracked owners not closed and not reported
	seen []Leak                    // reports not yet taken by Leaks
)

// Track starts tracking owner, which t lies in, as what (its type, such as
// "kv.Sequence"): where it was made is recorded, and the owner is reported if it is
// collected before t.Close. Tracking an owner twice starts over.
func Track[T any](t *Tracker, owner *T, what string) {
	var pcs [stackDepth]uintptr
	n := runtime.Callers(2, pcs[:]) // from the constructor that calls Track
	wp := weak.Make(owner)
	s := &tracked{what: what, pcs: append([]uintptr(nil), pcs[:n]...), gone: func() bool { return wp.Value() == nil }}
	t.Close()
	t.s = s
	mu.Lock()
	live[s] = struct{}{}
	mu.Unlock()
	s.stopLeak = runtime.AddCleanup(owner, report, s)
}

// Close records that the owner was closed: it is not reported when collected.
func (t *Tracker) Close() {
	s := t.s
	if s == nil || !s.done.CompareAndSwap(false, true) {
		return
	}
	s.stopLeak.Stop()
	mu.Lock()
	delete(live, s)
	mu.Unlock()
}

// report is the cleanup of a tracked owner: it runs once the owner was collected.
func report(s *tracked) {
	if !s.done.CompareAndSwap(false, true) {
		return
	}
	l := Leak{What: s.what, Stack: frames(s.pcs)}
	fmt.Fprintln(os.Stderr, l)
	mu.Lock()
	delete(live, s)
	seen = append(seen, l)
	mu.Unlock()
}

// collect runs the collector, then reports every tracked owner it found unreachable
// whose cleanup has not run yet: a weak pointer is cleared by the collection that
// finds its object unreachable, while the cleanup runs some time after.
func collect() {
	runtime.GC()
	mu.Lock()
	var gone []*tracked
	for s := range live {
		if s.gone() {
			gone = append(gone, s)
		}
	}
	mu.Unlock()
	for _, s := range gone {
		report(s)
	}
}

// Leaks runs the collector and returns the owners found collected unclosed, since
// the last call, whose report match accepts (all for a nil match), and forgets them.
// Reports it does not return stay for a later call.
func Leaks(match func(Leak) bool) []Leak {
	collect()
	mu.Lock()
	defer mu.Unlock()
	var out []Leak
	kept := seen[:0]
	for _, l := range seen {
		if match == nil || match(l) {
			out = append(out, l)
		} else {
			kept = append(kept, l)
		}
	}
	seen = kept
	return out
}

// Exit ends a test binary with code: the exit hook of a TestMain (goleak.Cleanup).
// A run that passed fails when an owner was collected unclosed; each is on standard
// error already.
func Exit(code int) {
	if leaks := Leaks(nil); code == 0 && len(leaks) > 0 {
		fmt.Fprintf(os.Stderr, "invariants: %d owners were garbage-collected without being closed\n", len(leaks))
		code = 1
	}
	os.Exit(code)
}

// frames formats the call stack pcs, one function and its file:line a line.
func frames(pcs []uintptr) string {
	var b strings.Builder
	fs := runtime.CallersFrames(pcs)
	for {
		f, more := fs.Next()
		if f.Function != "" {
			fmt.Fprintf(&b, "\t%s\n\t\t%s:%d\n", f.Function, f.File, f.Line)
		}
		if !more {
			return b.String()
		}
	}
}
