//go:build !linux

package causes

import "errors"

// Track returns errors.ErrUnsupported: counting by thread needs Linux.
func Track() error { return errors.ErrUnsupported }

// Untrack does nothing off Linux.
func Untrack() {}

func onTracked() bool { return false }

func threadCounts() Counts { return Counts{} }
