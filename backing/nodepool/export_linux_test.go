package nodepool

// ServeUID makes o serve uid instead of its own, for the test of a refused peer.
func ServeUID(o *Owner, uid uint32) { o.uid.Store(uid) }
