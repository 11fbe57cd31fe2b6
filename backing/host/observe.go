package host

import (
	"log/slog"
	"sync"
)

// What the host backings log (SharedOptions.Logger, PrivateOptions.Logger): a
// fallback the system forces, once per backing at construction, and the shared pool's
// trims and reclaims. Nothing is logged on a commit or decommit.

// populateByTouch reports, once per process, whether the kernel lacks
// MADV_POPULATE_WRITE, so that populating a range touches each of its pages instead.
var populateByTouch = sync.OnceValue(populateByTouchOS)

// noteFallbacks logs the fallbacks a backing that populates will take. l may be nil.
func noteFallbacks(l *slog.Logger, backing string, populate bool) {
	if l == nil || !populate || !populateByTouch() {
		return
	}
	l.Info("host: no MADV_POPULATE_WRITE; populating touches each page instead",
		"backing", backing)
}
