package main

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/vmarena/vmarena/internal/baseline"
	"github.com/vmarena/vmarena/kv"
)

// errWrongBytes: a hit read back K/V other than what was written for its tokens.
var errWrongBytes = errors.New("read back K/V other than was written for its tokens")

// mix64 is splitmix64's finalizer.
func mix64(x uint64) uint64 {
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// prefixHashes returns, for each token, a hash of the tokens up to it: a model's K
// and V of a token depend on every token before it, and so do the replay's bytes
// under Verify, so that a block mapped or loaded for another prefix (or another
// position) reads back other bytes. seed is the adapter's (padapter): the same
// tokens give other K/V under another adapter.
func prefixHashes(tokens []int32, seed uint64) []uint64 {
	out := make([]uint64, len(tokens))
	h := uint64(0x6a09e667f3bcc909) ^ seed
	for i, t := range tokens {
		h = mix64(h ^ uint64(uint32(t)))
		out[i] = h
	}
	return out
}

// tokenBytes fills dst with the K (v 0) or V (v 1) of layer for the token whose
// prefix hash is h.
func tokenBytes(dst []byte, h uint64, layer, v int) {
	w := mix64(h ^ uint64(layer)<<1 ^ uint64(v))
	i := 0
	for ; i+8 <= len(dst); i += 8 {
		binary.LittleEndian.PutUint64(dst[i:], w)
		w += 0x9e3779b97f4a7c15
	}
	for ; i < len(dst); i++ {
		dst[i] = byte(w >> (8 * (i % 8)))
	}
}

// writePrompt writes q's prompt tokens [m, to) into s: the constant fill, or with
// w.Verify each token's own bytes, made in scratch, layer by layer as
// writeLayerMajor does.
func writePrompt(st pstrategy, s pseq, q *preq, m, to int, fill, scratch []byte, w PrefixWorkload) error {
	if !w.Verify {
		return st.write(s, m, to, fill)
	}
	if q.prefix == nil {
		q.prefix = q.adapter.prefixHashes(q.tokens)
	}
	for l := range w.Layers {
		kinds, tb := layerOf(w.Plan, l, len(scratch))
		for t := max(m, firstHeld(s, l)); t < to; t++ {
			for _, v := range kinds {
				tokenBytes(scratch[:tb], q.prefix[t], l, int(v))
				if err := st.writeToken(s, l, int(v), t, scratch[:tb]); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// layerOf returns the tensors of layer l and their bytes per token: plan's, or K and
// V of tokenBytes on a uniform model (plan nil).
func layerOf(plan []layerPlan, l, tokenBytes int) ([]baseline.Kind, int) {
	if plan == nil {
		return keyValue, tokenBytes
	}
	return plan[l].kinds, plan[l].tokenBytes
}

// firstHeld returns the first token of layer l that s still holds: a window layer of
// a kv sequence gives back what no later step reads; every other layer holds all.
func firstHeld(s pseq, l int) int {
	if q, ok := s.(*kv.Sequence); ok {
		return q.FirstHeld(l)
	}
	return 0
}

// verifyHit reads back the first m tokens of s, which a lookup found cached for q,
// and compares them with what writePrompt wrote for them; buf is scratch of a
// token's bytes.
func verifyHit(st pstrategy, s pseq, q *preq, m int, w PrefixWorkload, buf []byte) error {
	if m == 0 {
		return nil
	}
	if q.prefix == nil {
		q.prefix = q.adapter.prefixHashes(q.tokens)
	}
	want := make([]byte, len(buf))
	for l := range w.Layers {
		kinds, tb := layerOf(w.Plan, l, len(buf))
		// A window layer holds, of the hit, what the step after it reads.
		for t := firstHeld(s, l); t < m; t++ {
			for _, v := range kinds {
				got := buf[:tb]
				if err := st.readToken(s, l, int(v), t, got); err != nil {
					return fmt.Errorf("request %d: read back token %d: %w", q.ID, t, err)
				}
				tokenBytes(want[:tb], q.prefix[t], l, int(v))
				if !bytes.Equal(got, want[:tb]) {
					return fmt.Errorf("request %d: token %d of layer %d (%s) of a %d-token hit: %w", q.ID, t, l, [2]string{"K", "V"}[v], m, errWrongBytes)
				}
			}
		}
	}
	return nil
}
