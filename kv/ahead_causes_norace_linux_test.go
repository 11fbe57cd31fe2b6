//go:build !race

package kv_test

// causesRace: see ahead_causes_race_linux_test.go.
const causesRace = false
