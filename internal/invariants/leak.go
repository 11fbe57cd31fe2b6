package invariants

import "fmt"

// Leak is the report of an owner garbage-collected without being closed.
type Leak struct {
	What  string // the owner's type, as given to Track
	Stack string // where it was made: one function and its file:line a line, innermost first
}

// String returns the report as written to standard error.
func (l Leak) String() string {
	return fmt.Sprintf("invariants: a %s was garbage-collected without being closed; it was made at\n%s", l.What, l.Stack)
}
