//go:build !linux

package hosttier

// cgroupByDefault: outside Linux there are no cgroups; New checks only a fake one a
// test names (Options.CgroupRoot).
const cgroupByDefault = false
