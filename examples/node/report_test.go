package main

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestMakeReport computes the figures of a run made by hand: the counts, the waits,
// a grant that came next after the other process's close (a handoff) and one that
// came after the process's own, a grant past half the budget while the other held
// nothing, and when each process and the node were back at 0.
func TestMakeReport(t *testing.T) {
	ms := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }
	job := func(id, arrival, asked, refused, granted, done int, burst bool, owned int64) served {
		return served{ID: id, Burst: burst, Arrival: ms(arrival), Asked: ms(asked), Refused: ms(refused), Granted: ms(granted),
			Admitted: ms(granted + 1), Done: ms(done), Owned: owned}
	}
	const limit = 100
	r := runResult{Mode: modeShared, Limit: limit, Peak: 90, Procs: [2]clientResult{
		{Name: "A", Jobs: []served{
			job(0, 0, 0, -1, 0, 50, true, 40),      // at once
			job(1, 10, 10, 10, 60, 120, true, 70),  // refused, granted 5 ms after B's close at 55: a handoff, past half
			job(2, 20, 20, 30, 130, 140, true, 30), // refused, granted after A's own close at 120: no handoff
			{ID: 3, Burst: true, Arrival: ms(30), Asked: ms(40), Refused: ms(40), Granted: -1, Admitted: -1, Done: -1, Rejected: true},
			job(4, 150, 150, -1, 150, 160, true, 60), // past half while B held nothing
		}, Closes: []time.Duration{ms(50), ms(120), ms(140), ms(160)}, LastClose: ms(160)},
		{Name: "B", Jobs: []served{
			job(5, 0, 0, -1, 0, 55, false, 20),
		}, Closes: []time.Duration{ms(55)}, LastClose: ms(55)},
	}}
	r.Procs[0].Jobs[1].Blocked = true // as the client marks a refused head
	r.Procs[0].Jobs[2].Blocked = true
	r.Procs[1].Jobs[0].Stalls = 2
	for _, s := range []struct {
		at   int
		a, b int64
	}{{0, 40, 20}, {54, 0, 20}, {56, 0, 0}, {61, 70, 0}, {145, 60, 0}, {165, 10, 0}, {170, 0, 0}} {
		r.Samples = append(r.Samples, nodeSample{At: ms(s.at), Used: s.a + s.b, Owned: [2]int64{s.a, s.b}})
	}
	rep := makeReport(options{step: ms(10)}, []runResult{r})
	require.Len(t, rep.Runs, 1)
	f := rep.Runs[0]
	a, b := f.Procs[0], f.Procs[1]
	assert.Equal(t, 5, a.Requests)
	assert.Equal(t, 4, a.Served)
	assert.Equal(t, 1, a.Rejected)
	assert.Equal(t, 2, a.Waited, "the refused heads")
	assert.Equal(t, ms(60-10+130-20), a.WaitSum)
	assert.Equal(t, 1, a.Handoffs)
	assert.Equal(t, ms(5), a.HandoffMax)
	assert.Equal(t, 2, a.Beyond)
	assert.Equal(t, 1, a.IdleBeyond, "request 4: B held nothing when it asked")
	assert.Equal(t, 0, a.IdleRefused)
	assert.Equal(t, ms(10), a.BackToZero, "A's last close at 160, 0 at 170")
	assert.Equal(t, ms(1), b.BackToZero, "B's last close at 55, 0 at 56")
	assert.Equal(t, 1, b.Waited, "refused a decode step")
	assert.Equal(t, int64(70), a.PeakOwned)
	assert.Equal(t, ms(10), f.NodeToZero)
	assert.Equal(t, 1, f.Rejected)
	assert.Equal(t, 3, f.Waited)
	assert.Equal(t, ms(111), f.BurstTTFTp99, "request 2: arrival 20, prompt written at 131")

	var out strings.Builder
	rep.o = options{model: "llama3-8b", budget: limit, granule: 1, step: ms(10), sample: ms(5)}
	rep.print(&out)
	assert.Contains(t, out.String(), "one budget")
	assert.NotContains(t, out.String(), "Targets", "one run: nothing to compare")
}
