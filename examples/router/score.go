package main

// Scorer picks a replica for a request as llm-d's scheduler does: the highest
// weighted sum of three scorers.
//
//   - The prefix score is the blocks a replica holds in a row from the prompt's first
//     (LongestPrefixScorer of llm-d/llm-d-kv-cache, pkg/kvcache/kvblock_scorer.go),
//     min-max normalized across the replicas that hold any, 0 for the others
//     (llm-d-inference-scheduler's precise prefix-cache scorer,
//     indexedScoresToNormalizedScoredPods).
//   - The load score is llm-d-inference-scheduler's load-aware scorer
//     (pkg/plugins/scorer/load_aware.go): 0.5 for a replica with no request waiting,
//     0.5*(1-q/QueueThreshold) for one with q waiting, 0 from QueueThreshold on.
//   - The active-request score is llm-d-inference-scheduler's active-request scorer
//     (pkg/plugins/scorer/active_request.go): of the requests the router sent and
//     that have not finished (a replica's own, running or waiting), (max-a)/max for
//     a replica with a of them when the busiest has max, 1 for one with none. The
//     router counts them itself, so unlike the waiting queue it never lags: a
//     replica that admits a burst at once (an idle batch's free slots) shows it.
//
// Ties go round-robin.
type Scorer struct {
	PrefixWeight, LoadWeight, ActiveWeight float64
	QueueThreshold                         int
	next                                   int // where the round-robin of ties starts
}

// load is what the router knows of a replica's load when it routes a request.
type load struct {
	waiting int // requests waiting to be admitted (the replica's queue, as it reports it)
	active  int // requests the router sent it that have not finished
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

// activeScores returns the active-request score of each replica of loads.
func activeScores(loads []load) []float64 {
	most := 0
	for _, l := range loads {
		most = max(most, l.active)
	}
	out := make([]float64, len(loads))
	for i, l := range loads {
		out[i] = 1
		if most > 0 {
			out[i] = float64(most-l.active) / float64(most)
		}
	}
	return out
}

// Pick returns the replica with the highest score for a request of which each
// replica r holds match[r] blocks in a row, with loads[r] its load.
func (s *Scorer) Pick(match []int, loads []load) int {
	ps, as := prefixScores(match), activeScores(loads)
	best, bestScore := -1, 0.0
	n := len(match)
	for k := range n {
		r := (s.next + k) % n
		sc := s.PrefixWeight*ps[r] + s.LoadWeight*s.loadScore(loads[r].waiting) + s.ActiveWeight*as[r]
		if best < 0 || sc > bestScore {
			best, bestScore = r, sc
		}
	}
	s.next = (best + 1) % n
	return best
}
