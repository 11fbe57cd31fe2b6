package main

// Scorer picks a replica for a request as llm-d's scheduler does: a weighted sum of
// scorers, each normalized across the replicas. The prefix score is the blocks a
// replica holds in a row from the prompt's first, min-max normalized across the
// replicas that hold any and 0 for the others (llm-d-inference-scheduler's precise
// prefix-cache scorer, indexedScoresToNormalizedScoredPods); the load score is the requests it has
// waiting or running, the fewest scoring 1 and the most 0, 1 for all when all are
// equal (the queue scorer of kubernetes-sigs/gateway-api-inference-extension,
// pkg/epp/scheduling/framework/plugins/scorer/queue.go). Ties go round-robin.
type Scorer struct {
	PrefixWeight, LoadWeight float64
	next                     int // where the round-robin of ties starts
}

// minMax returns v min-max normalized, 1 for all when they are equal: the highest
// value scores 1 when high is set, the lowest otherwise. With skipZero, a 0 scores 0
// and takes no part in the range.
func minMax(v []int, high, skipZero bool) []float64 {
	lo, hi, seen := 0, 0, false
	for _, x := range v {
		if skipZero && x == 0 {
			continue
		}
		if !seen {
			lo, hi, seen = x, x, true
		}
		lo, hi = min(lo, x), max(hi, x)
	}
	out := make([]float64, len(v))
	for i, x := range v {
		switch {
		case skipZero && x == 0:
		case lo == hi:
			out[i] = 1
		case high:
			out[i] = float64(x-lo) / float64(hi-lo)
		default:
			out[i] = float64(hi-x) / float64(hi-lo)
		}
	}
	return out
}

// Pick returns the replica with the highest score for a request of which each
// replica holds match[r] blocks in a row, with load[r] requests on it.
func (s *Scorer) Pick(match, load []int) int {
	ps, ls := minMax(match, true, true), minMax(load, false, false)
	best, bestScore := -1, 0.0
	n := len(match)
	for k := range n {
		r := (s.next + k) % n
		if sc := s.PrefixWeight*ps[r] + s.LoadWeight*ls[r]; best < 0 || sc > bestScore {
			best, bestScore = r, sc
		}
	}
	s.next = (best + 1) % n
	return best
}
