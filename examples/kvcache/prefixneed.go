package main

import "github.com/vmarena/vmarena/kv"

// liveNeed returns the bytes the prefix replay's live requests need, at a sample:
// the /need and waste columns' figure. On a uniform model (groups nil) it is the
// distinct live tokens, each whole 512-token block shared among live prompts once,
// times bpt. On a model of layer groups it is what kv.Model.Size's Need adds up for
// each live sequence of its length (every token of a full or MLA group, each window
// group's live window from Group.FirstLive of its last step, each recurrent group's
// state once the sequence has a token), a token of a block shared with another live
// prompt counted once in every group that still holds it.
func liveNeed(groups *kv.Model, bpt int64, running []*preq, liveTokens, shared int64) int64 {
	if groups == nil {
		return (liveTokens - shared) * bpt
	}
	var need, full int64
	for _, g := range groups.Groups {
		if g.Kind == kv.Recurrent {
			for _, q := range running {
				if len(q.tokens)+q.done > 0 {
					need += int64(len(g.Layers)) * int64(g.StateBytes)
				}
			}
			continue
		}
		gb := int64(g.BytesPerToken())
		if g.Kind != kv.SlidingWindow && g.Kind != kv.ChunkedLocal { // it keeps every token
			full += gb
			continue
		}
		// A window group: each sequence's tokens from FirstLive on; within a whole
		// block of its prompt they are a suffix of the block, and a block another
		// live prompt shares holds the longest of its sequences' suffixes once.
		var tokens int64
		var most map[uint64]int
		for _, q := range running {
			n := len(q.tokens) + q.done
			if n == 0 {
				continue
			}
			first := g.FirstLive(n - 1)
			tokens += int64(n - first)
			for b := first / MooncakeBlockTokens; b < len(q.liveKeys); b++ {
				k, c := q.liveKeys[b], (b+1)*MooncakeBlockTokens-max(first, b*MooncakeBlockTokens)
				if most == nil {
					most = map[uint64]int{}
				}
				prev, ok := most[k]
				switch {
				case !ok:
					most[k] = c
				case c > prev:
					tokens -= int64(prev)
					most[k] = c
				default:
					tokens -= int64(c)
				}
			}
		}
		need += tokens * gb
	}
	return need + (liveTokens-shared)*full
}
