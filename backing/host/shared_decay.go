package host

import (
	"cmp"
	"math"
	"slices"
	"time"
)

// Retention by decay: idle granules go back to the OS gradually after staying
// unused, as jemalloc purges dirty pages along a smooth curve over dirty_decay_ms
// and the Go runtime's background scavenger returns memory at a paced rate. A busy
// server reuses its idle granules long before they decay, so its working set stays
// warm; an idle one returns everything above SharedOptions.Low within
// SharedOptions.Decay.
//
// Each idle granule weighs 1 - smootherstep(age/Decay): 1 when it just went idle,
// 0 once it has been idle for Decay. The pool keeps max(Low, ceil(sum of the
// weights)) idle granules and gives back the longest idle first, so that a burst of
// K granules that go idle together leaves along K * (1 - smootherstep): slowly at
// first (a pause in the load costs little), half of them at Decay/2, all by Decay.

// sharedDefaultDecay is SharedOptions.Decay's default: half of jemalloc's 10 s, so
// that an idle server has given everything back well within 10 s.
const sharedDefaultDecay = 5 * time.Second

// sharedDecaySteps is how many passes the scavenger makes per Decay.
const sharedDecaySteps = 16

// sharedWeight is 1 - smootherstep(x) on [0, 1], 0 beyond.
func sharedWeight(x float64) float64 {
	if x >= 1 {
		return 0
	}
	x = max(x, 0)
	return 1 - x*x*x*(x*(6*x-15)+10)
}

// elapsed returns the time since the backing's epoch on its clock, by which it
// measures how long granules stay idle. NB: on the monotonic clock: time.Time.Sub
// of two readings of time.Now uses their monotonic readings, so a step of the wall
// clock (an NTP correction, a suspended virtual machine's resume, an administrator's
// date) moves no granule's age. s.mu must be held.
func (s *Shared) elapsed() time.Duration { return s.clock().Sub(s.epoch) }

// startDecay starts the scavenger when idle granules exceed the floor and none is
// running. s.mu must be held.
func (s *Shared) startDecay() {
	if s.decay <= 0 || s.decaying || s.closed || s.nIdle+s.nPrivIdle <= s.low {
		return
	}
	s.decaying = true
	s.scav.Add(1)
	go func() {
		defer s.scav.Done()
		t := time.NewTimer(s.decay / sharedDecaySteps)
		defer t.Stop()
		for {
			select {
			case <-t.C:
			case <-s.stop:
				return
			}
			if !s.decayPass(s.clock()) {
				return
			}
			t.Reset(s.decay / sharedDecaySteps)
		}
	}()
}

// decayPass gives back the idle granules that have decayed at now, and reports
// whether idle granules above the floor remain (when not, the scavenger stops; the
// next granule to go idle starts it again). s.mu must not be held.
func (s *Shared) decayPass(now time.Time) bool {
	type idler struct {
		since time.Duration
		at    int // slot, or -1-position for a private granule
	}
	s.mu.Lock()
	if s.closed || s.decay <= 0 {
		s.decaying = false
		s.mu.Unlock()
		return false
	}
	t, d := now.Sub(s.epoch), float64(s.decay.Nanoseconds())
	var all []idler
	var w float64
	for i := s.idle.next(0, len(s.slots)); i < len(s.slots); i = s.idle.next(i+1, len(s.slots)) {
		since := s.slots[i].since
		w += sharedWeight(float64(t-since) / d)
		all = append(all, idler{since, i})
	}
	for n, p := len(s.asince), s.aidle.next(0, len(s.asince)); p < n; p = s.aidle.next(p+1, n) {
		since := s.asince[p]
		w += sharedWeight(float64(t-since) / d)
		all = append(all, idler{since, -1 - p})
	}
	keep := max(s.low, int(math.Ceil(w-1e-9)))
	if k := s.claim(len(all) - keep); k > 0 {
		slices.SortFunc(all, func(a, b idler) int { return cmp.Compare(a.since, b.since) })
		var slots, pos []int
		for _, v := range all[:k] {
			if v.at >= 0 {
				s.takeIdle(v.at)
				slots = append(slots, v.at)
			} else {
				p := -1 - v.at
				s.aidle.clear(p)
				s.nPrivIdle--
				pos = append(pos, p)
			}
		}
		m, _ := s.givePriv(pos) // a granule that can not be given back stays idle
		s.mu.Unlock()
		n, err := s.giveBack(slots)
		if s.log != nil && (n+m > 0 || err != nil) {
			s.log.Debug("host: pool decay", "gave_back_bytes", n+m, "err", err)
		}
		s.mu.Lock()
	}
	more := !s.closed && s.nIdle+s.nPrivIdle > s.low
	if !more {
		s.decaying = false
	}
	s.mu.Unlock()
	return more
}
