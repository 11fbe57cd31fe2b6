//go:build !linux

package nodepool_test

func runHelper(mode, path string) int { return 2 }
