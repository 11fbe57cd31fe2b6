package arena

import (
	"fmt"

	"github.com/vmarena/vmarena/backing"
)

// checkBooks is run as each call on the buffer starts, in the invariants build (see
// internal/invariants), so it finds what the call before broke. It panics when the
// buffer's counts disagree: the committed run [Start, Start+Committed) must be whole
// granules inside the capacity, Len within the capacity and, once past Start, rounded
// up to the granule where the run ends (Committed's doc), and the shared spans in
// order, apart and inside the run.
func (buf *Buffer[R, B]) checkBooks() {
	bad := buf.start < 0 || buf.start > buf.end || buf.end > buf.capacity ||
		buf.start%buf.gran != 0 || buf.end%buf.gran != 0 || buf.length < 0 || buf.length > buf.capacity
	if up, _ := backing.AlignUp(buf.length, buf.gran); buf.length > buf.start && up != buf.end {
		bad = true
	}
	prev := buf.start
	for _, sp := range buf.shared {
		bad = bad || sp.off < prev || sp.off >= sp.end || sp.end > buf.end
		prev = sp.end
	}
	if bad {
		panic(fmt.Sprintf("arena: invariant: a buffer of %d bytes (%d-byte granule) commits [%d, %d) for Len %d, shares %v",
			buf.capacity, buf.gran, buf.start, buf.end, buf.length, buf.shared))
	}
}
