package main

// Scorer picks a replica for a request as llm-d's scheduler does: the highest
// weighted sum of two scorers.
//
//   - The prefix score is the blocks a replica holds in a row from the prompt's first
//     (LongestPrefixScorer of llm-d/llm-d-kv-cache, pkg/kvcache/kvblock_scorer.go),
//     min-max normalized across the replicas that hold any, 0 for the others
//     (llm-d-inference-scheduler's precise prefix-cache scorer,
//     indexedScoresToNormalizedScoredPods).
//   - The load score is llm-d-inference-scheduler's load-aware scorer
//     (pkg/plugins/scorer/load_aware.go): 0.5 for a replica with no request waiting,
//     0.5*(1-q/QueueThreshold) for one with q waiting, 0 from QueueThreshold on.
//
// Ties go round-robin.
type Scorer struct {
	PrefixWeight, LoadWeight float64
	QueueThreshold           int
	next                     int // where the round-robin of ties starts
}

// prefixScores returns match min-max normalized across the non-zero ones (1 for all
// when they are equal), 0 for a zero.
func prefixScores(match []int) []float64 {
	lo, hi, seen := 0, 0, false
	for _, x := range match {
		if x == 0 {
			continue
		}
		if !seen {
			lo, hi, seen = x, x, true
		}
		lo, hi = min(lo, x), max(hi, x)
	}
	out := make([]float64, len(match))
	for i, x := range match {
		switch {
		case x == 0:
		case lo == hi:
			out[i] = 1
		default:
			out[i] = float64(x-lo) / float64(hi-lo)
		}
	}
	return out
}

// loadScore returns the load-aware score of a replica with waiting requests waiting.
func (s *Scorer) loadScore(waiting int) float64 {
	q := float64(min(waiting, s.QueueThreshold))
	return 0.5 * (1 - q/float64(s.QueueThreshold))
}

// Pick returns the replica with the highest score for a request of which each
// replica holds match[r] blocks in a row, with waiting[r] requests waiting.
func (s *Scorer) Pick(match, waiting []int) int {
	ps := prefixScores(match)
	best, bestScore := -1, 0.0
	n := len(match)
	for k := range n {
		r := (s.next + k) % n
		if sc := s.PrefixWeight*ps[r] + s.LoadWeight*s.loadScore(waiting[r]); best < 0 || sc > bestScore {
			best, bestScore = r, sc
		}
	}
	s.next = (best + 1) % n
	return best
}
