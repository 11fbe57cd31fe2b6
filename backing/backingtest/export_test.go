package backingtest

// ShareAnySource makes f's Share grant ReadWrite from source granules that are
// read-only in their reservation, which the contract forbids: a mutant the suite must
// catch.
func ShareAnySource(f *Fake) *Fake {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.shareAnySource = true
	return f
}
