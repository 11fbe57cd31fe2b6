//go:build linux || windows

package kv_test

import "github.com/vmarena/vmarena/accounting"

// The env's options that only the tests on host.Shared (Linux and Windows) use.

// withAuthority has the backing (or, onPrivate, the cache) charge a rather than a
// new governor's ledger: the env then knows no governor and withLimit is unused.
func withAuthority(a *accounting.Authority) envOption {
	return envFunc(func(sp *envSpec) { sp.auth = a })
}

// withName names host.Shared's memfd; by default one of the process's own.
func withName(name string) envOption { return envFunc(func(sp *envSpec) { sp.name = name }) }
