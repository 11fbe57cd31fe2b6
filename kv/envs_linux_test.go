package kv_test

import "github.com/vmarena/vmarena/backing/host"

// withPrivate gives the rest of host.Private's options, as withShared does
// host.Shared's: only Linux tests use it.
func withPrivate(o host.PrivateOptions) envOption {
	return envFunc(func(sp *envSpec) { sp.private = o })
}
