//go:build !linux

package main

import "syscall"

// redisAttrs returns nil: only Linux has a signal for a child on its parent's
// death, so elsewhere a run stopped by a signal may leave its redis-server behind.
func redisAttrs() *syscall.SysProcAttr { return nil }
