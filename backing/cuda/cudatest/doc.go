// Package cudatest holds test support for package cuda: FakeDriver, an in-memory
// model of the CUDA driver's virtual memory management API behind the [cuda.Driver]
// seam, so that the CUDA backing, and code built on it, can be tested on a machine
// without a GPU. It is pure Go (no cgo), as package cuda is.
//
// A FakeDriver enforces the rules the real driver documents strictly, injects
// faults on the n-th call of an entry point (Fail), and tells what a test left
// behind (LiveHandles, LiveReservations, LiveMappings, CheckLeaks).
//
// # Concurrency
//
// A FakeDriver is safe for concurrent use, as the Driver it fills is.
package cudatest
