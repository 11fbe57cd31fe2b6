package host

// PrivateNaming reports whether the kernel named a mapping (1), answered EINVAL (2),
// failed otherwise (3), or was not asked yet (0).
func PrivateNaming() int32 { return privateNaming.Load() }

// PrivateForceTouch makes populate fall back to touching pages, as on kernels before
// 5.14, until the returned function restores it.
func PrivateForceTouch() (restore func()) {
	old := noPopulate.Swap(true)
	return func() { noPopulate.Store(old) }
}

// HugeShare is hugeShare, for its overflow test.
func HugeShare(n int64, in, total uint64) int64 { return hugeShare(n, in, total) }
