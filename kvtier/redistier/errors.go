package redistier

import "errors"

var (
	// ErrConfig: options or a client New can not build a tier from.
	ErrConfig = errors.New("redistier: invalid configuration")
	// ErrUnavailable: the server failed a recent call and the tier is backing off;
	// the call did not reach the network.
	ErrUnavailable = errors.New("redistier: server unavailable (backing off)")
)
