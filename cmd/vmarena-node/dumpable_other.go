//go:build !linux

package main

// undumpable does nothing: the node pool needs Linux, and Listen says so.
func undumpable() error { return nil }
