package cuda

// readOnlyRefused records that the driver refused a read-only device mapping
// (CUDA_ERROR_NOT_SUPPORTED), so that read-only granules are mapped read-write and
// guarded on the Go side from now on, and logs it the first time.
func (b *Backing) readOnlyRefused() {
	if !b.noReadOnly.Swap(true) && b.log != nil {
		b.log.Info("cuda: the driver refuses read-only mappings; shares are mapped read-write and guarded on the Go side",
			"device", b.ordinal)
	}
}
