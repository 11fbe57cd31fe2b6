//go:build !race

package kv_test

// probeRace: see probe_race_test.go.
const probeRace = false
