package kv

// SetSwapChunk sets the most bytes of a value of a swap and returns what sets it
// back.
func SetSwapChunk(n int) func() {
	old := swapChunk
	swapChunk = n
	return func() { swapChunk = old }
}
