package main

import "syscall"

// redisAttrs makes the redis-server the example starts die with it (SIGKILL when
// the example exits, however it exits), so that a run stopped by a signal leaves
// no server behind. NB: the kernel sends it when the thread that started the
// server exits; the example locks no goroutine to a thread, so that is the process.
func redisAttrs() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
