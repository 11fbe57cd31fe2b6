// Package nocopy holds the one marker the project's owners embed so that go vet
// reports a copy of them.
package nocopy

// NoCopy, embedded as a blank field (`_ nocopy.NoCopy`), makes go vet's copylocks
// check report any copy of the struct that holds it: *NoCopy is a sync.Locker and
// NoCopy is not, which is what the check looks for. It takes no space and does
// nothing at run time; its zero value is the only value.
type NoCopy struct{}

// Lock does nothing; it exists for go vet.
func (*NoCopy) Lock() {}

// Unlock does nothing; it exists for go vet.
func (*NoCopy) Unlock() {}
