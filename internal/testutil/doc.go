// Package testutil holds the helpers that the tests of several packages share: waiting
// for a condition another goroutine makes true, skipping without a redis-server,
// touching memory that may fault, filling buffers with a recognisable pattern, and
// reading the kernel's view of this process (/proc/self/maps, smaps and status).
//
// Only _test.go files import it, so no library package links it. It imports nothing
// of the module but internal/poll, so that any package's tests, internal or
// black-box, may import it without a cycle.
package testutil
