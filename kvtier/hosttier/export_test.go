package hosttier

// CgroupFree returns what the tightest memory cgroup of the process leaves free, and
// whether any level sets a limit.
func CgroupFree(root, self string) (int64, bool, error) {
	l, ok, err := tightestCgroup(root, self)
	return l.free(), ok, err
}
