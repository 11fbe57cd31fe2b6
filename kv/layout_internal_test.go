package kv

import (
	"testing"

	"github.com/vmarena/vmarena/arena"
)

// TestTokenAtIsOffsetAndWritable checks the one-division arithmetic of the token
// path against the two functions it stands for, for every token and every frozen
// byte count of a few shapes in each layout: the offset is offset's, and shared is
// exactly t < writableFrom(frozen).
func TestTokenAtIsOffsetAndWritable(t *testing.T) {
	g := Geometry{Name: "t", Layers: 3, KVHeads: 2, HeadDim: 8, DType: arena.Float16}
	for _, layout := range []Layout{Blocked, PerLayer, PerSequence} {
		for _, granule := range []int{64, 256, 4096} {
			for _, bt := range []int{0, 1, 3, 16} {
				if layout != Blocked && bt != 0 {
					continue
				}
				const maxTokens = 40
				sh, err := newShape(g, layout, granule, bt, maxTokens)
				if err != nil {
					continue // a granule too small for the layout's unit
				}
				for _, p := range sh.places {
					for frozen := 0; frozen <= sh.extent(maxTokens); frozen++ {
						w := sh.writableFrom(frozen)
						for tok := range maxTokens {
							at, shared := sh.tokenAt(p.off, tok, frozen)
							if want := sh.offset(p.off, tok); at != want {
								t.Fatalf("%v granule %d bt %d: token %d at %d, offset says %d", layout, granule, bt, tok, at, want)
							}
							if shared != (tok < w) {
								t.Fatalf("%v granule %d bt %d frozen %d: token %d shared=%v, writable from %d", layout, granule, bt, frozen, tok, shared, w)
							}
						}
					}
				}
			}
		}
	}
}
