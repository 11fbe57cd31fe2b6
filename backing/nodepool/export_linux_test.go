package nodepool

import "time"

// MaxStale is how many gone loans the owner remembers per client by id.
const MaxStale = maxStale

// ServeUID makes o serve uid instead of its own, for the test of a refused peer.
func ServeUID(o *Owner, uid uint32) { o.uid.Store(uid) }

// WaitReady waits until o's granules made ahead are all there again, so that a
// count of descriptors is steady.
func WaitReady(o *Owner) {
	for len(o.fresh) < cap(o.fresh) {
		time.Sleep(100 * time.Microsecond)
	}
}
