//go:build race

package kv_test

// probeRace: under the race detector, sync.Pool drops a share of what is put back,
// so a Probe's buffers are made anew at times: allocations that are the detector's.
const probeRace = true
