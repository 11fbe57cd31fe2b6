package hosttier

// cgroupByDefault: on Linux every New checks the budget against the process's
// memory cgroup.
const cgroupByDefault = true
