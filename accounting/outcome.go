package accounting

import "fmt"

// ReleaseStatus says how a whole-allocation release ended.
type ReleaseStatus uint8

const (
	// Complete: everything was given back. Unmapped may be zero (nothing was held).
	Complete ReleaseStatus = iota
	// Failed: the release failed and nothing changed; the allocation is as it was
	// and may be released again.
	Failed
	// Quarantined: the release failed midway. Unmapped bytes were given back;
	// Residual bytes are still owned and can not be given back by this allocation.
	Quarantined
)

func (s ReleaseStatus) String() string {
	switch s {
	case Complete:
		return "complete"
	case Failed:
		return "failed"
	case Quarantined:
		return "quarantined"
	}
	return fmt.Sprintf("ReleaseStatus(%d)", uint8(s))
}

// ReleaseOutcome is the honest result of releasing a whole allocation.
type ReleaseOutcome struct {
	Status   ReleaseStatus
	Unmapped int64 // bytes actually given back
	Residual int64 // bytes still owned after the release (0 when Complete)
	Err      error // nil when Complete
}

// Released returns a Complete outcome for n bytes given back.
func Released(n int64) ReleaseOutcome { return ReleaseOutcome{Status: Complete, Unmapped: n} }

// FailedRelease returns a Failed outcome: nothing changed, held bytes are still owned.
func FailedRelease(held int64, err error) ReleaseOutcome {
	return ReleaseOutcome{Status: Failed, Residual: held, Err: err}
}

// Outcome returns the outcome of a release that gave back unmapped bytes and left
// residual bytes behind with err: Complete when err is nil, Failed when nothing was
// given back, Quarantined otherwise.
//
// NB: "nothing changed" is the caller's claim; pass changed=true when state moved even
// though no bytes were given back (an address range freed, say).
func Outcome(unmapped, residual int64, changed bool, err error) ReleaseOutcome {
	switch {
	case err == nil:
		return ReleaseOutcome{Status: Complete, Unmapped: unmapped, Residual: residual}
	case unmapped == 0 && !changed:
		return ReleaseOutcome{Status: Failed, Residual: residual, Err: err}
	default:
		return ReleaseOutcome{Status: Quarantined, Unmapped: unmapped, Residual: residual, Err: err}
	}
}

// OK reports whether the release was Complete.
func (o ReleaseOutcome) OK() bool { return o.Status == Complete }

func (o ReleaseOutcome) String() string {
	if o.Err != nil {
		return fmt.Sprintf("%v (unmapped %d, residual %d): %v", o.Status, o.Unmapped, o.Residual, o.Err)
	}
	return fmt.Sprintf("%v (unmapped %d, residual %d)", o.Status, o.Unmapped, o.Residual)
}
