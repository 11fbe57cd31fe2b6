package main

import "strings"

// Map-ahead on and off side by side: each vmarena strategy has a twin named with
// noAheadSuffix ("vmarena-noahead", "vmarena+prefix-cache-noahead") that builds the
// same cache with map-ahead off (kv.Config.NoMapAhead), whatever -map-ahead says. No
// run has it unless -strategies names it; with -rounds, vmarena's ratio to it is
// map-ahead on over off, measured in the same rounds, alternating, so that a loaded
// machine weighs on both alike.

// noAheadSuffix names a vmarena strategy's twin with map-ahead off.
const noAheadSuffix = "-noahead"

// aheadTwins returns the twins of the vmarena strategies among names, in their order.
func aheadTwins(names []string) []string {
	var out []string
	for _, n := range names {
		if n == nameCache || n == namePrefixOn || n == namePrefixOff {
			out = append(out, n+noAheadSuffix)
		}
	}
	return out
}

// splitAhead returns the strategy a name stands for, less noAheadSuffix, and whether
// it named the twin with map-ahead off.
func splitAhead(name string) (string, bool) {
	base, off := strings.CutSuffix(name, noAheadSuffix)
	if !off || (base != nameCache && base != namePrefixOn && base != namePrefixOff) {
		return name, false
	}
	return base, true
}

// noPrefixCache reports whether the prefix-cache replay's strategy name runs
// without a prefix cache (vmarena's, and its twin).
func noPrefixCache(name string) bool {
	base, _ := splitAhead(name)
	return base == namePrefixOff
}
