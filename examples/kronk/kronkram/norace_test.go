//go:build !race

package kronkram

// raceEnabled says that this test binary runs under the race detector, so that
// TestKronkRAMCases runs Kronk's cases under it too.
const raceEnabled = false
