package kv

import (
	"testing"

	"github.com/vmarena/vmarena/arena"
)

// TestTokenAtIsOffsetAndWritable checks the one-division arithmetic of the token
// path against the two functions it stands for, for every token and every frozen
// byte count of a few shapes in each layout: the offset is offset's, and shared is
// exactly t < writableFrom(frozen). The Q8_0 model's 34-byte tokens straddle
// granule boundaries in PerLayer, as the fp16 one's never do.
func TestTokenAtIsOffsetAndWritable(t *testing.T) {
	for _, g := range []Model{
		Uniform("t", 3, 2, 8, arena.Float16),
		Uniform("q", 3, 1, 32, arena.Q8_0),
	} {
		tokenAtCases(t, g)
	}
}

func tokenAtCases(t *testing.T, g Model) {
	for _, layout := range []Layout{Blocked, PerLayer} {
		for _, granule := range []int{64, 256, 4096} {
			for _, bt := range []int{0, 1, 3, 16} {
				if layout != Blocked && bt != 0 {
					continue
				}
				const maxTokens = 40
				sh, err := newGroupShape(g.Groups[0], layout, granule, bt, 0, maxTokens)
				if err != nil {
					continue // a granule too small for the layout's unit
				}
				for _, p := range sh.places {
					for frozen := 0; frozen <= sh.extent(maxTokens); frozen++ {
						w := sh.writableFrom(frozen)
						for tok := range maxTokens {
							at, shared := sh.tokenAt(p.off, tok, frozen)
							if want := sh.offset(p.off, tok); at != want {
								t.Fatalf("%s %v granule %d bt %d: token %d at %d, offset says %d", g.Name, layout, granule, bt, tok, at, want)
							}
							if shared != (tok < w) {
								t.Fatalf("%s %v granule %d bt %d frozen %d: token %d shared=%v, writable from %d", g.Name, layout, granule, bt, frozen, tok, shared, w)
							}
						}
					}
				}
			}
		}
	}
}
