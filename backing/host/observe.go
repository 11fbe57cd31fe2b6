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

// noteFallbacks logs the fallbacks the system forces on a backing: populating by
// touch when it populates, and small pages where its granule would take huge pages
// (noHuge says why not; "" when it gets them or its options turned them off). l may
// be nil.
func noteFallbacks(l *slog.Logger, backing string, populate bool, granule int, noHuge string) {
	if l == nil {
		return
	}
	if populate && populateByTouch() {
		l.Info("host: no MADV_POPULATE_WRITE; populating touches each page instead",
			"backing", backing)
	}
	if m := hugeAnon(); noHuge != "" && m.pmd > 0 && granule%m.pmd == 0 {
		l.Info("host: no huge pages; granules take small pages", "backing", backing, "why", noHuge)
	}
}
