package host_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/internal/logrec"
)

// TestSharedLogs proves what a Shared logs: nothing on commits and decommits, a line
// for each trim and reclaim that gives granules back.
func TestSharedLogs(t *testing.T) {
	var rec logrec.Recorder
	e := newEnv(t, host.SharedOptions{Granularity: 64 << 10, Logger: rec.Logger()}, false)
	g := int64(e.g)
	r := e.reserve(4)
	e.commit(r, 0, 4)
	e.decommit(r, 0, 3)
	e.commit(r, 0, 1)
	e.decommit(r, 0, 1)
	assert.Empty(t, rec.Records(), "nothing logged on commits and decommits")

	n, err := e.s.Trim(1)
	require.NoError(t, err)
	require.Equal(t, 2*g, n)
	_, err = e.s.Trim(1) // gives nothing back: nothing logged
	require.NoError(t, err)
	trims := rec.Find("host: pool trim")
	require.Len(t, trims, 1)
	assert.Equal(t, float64(2*g), trims[0]["gave_back_bytes"])
	assert.Equal(t, float64(1), trims[0]["keep"])

	// Another ledger on the host waits: the pool's reclaimer gives its idle granule
	// back and says so.
	require.NoError(t, e.gov.SetLimit(accounting.HostKey, 2*g))
	other := e.gov.Authority("other", accounting.HostKey)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, other.Acquire(ctx, g), "granted once the idle granule is given back")
	other.Release(g)
	require.Eventually(t, func() bool { return len(rec.Find("host: pool reclaim")) == 1 }, 5*time.Second, time.Millisecond)
	rc := rec.Find("host: pool reclaim")[0]
	assert.Equal(t, float64(g), rc["gave_back_bytes"])
	assert.Equal(t, float64(g), rc["waiter_bytes"])
	assert.Equal(t, "INFO", rc["level"])
}

// TestPopulateFallbackNotice: a backing that populates says, once at construction,
// when the kernel makes it touch pages instead; one that does not populate says
// nothing.
func TestPopulateFallbackNotice(t *testing.T) {
	want := 0
	if host.PopulateByTouch() {
		want = 1
	}
	const msg = "host: no MADV_POPULATE_WRITE; populating touches each page instead"
	var rec logrec.Recorder
	_, err := host.NewPrivate(host.PrivateOptions{Populate: true, Logger: rec.Logger()})
	require.NoError(t, err)
	_, err = host.NewPrivate(host.PrivateOptions{Logger: rec.Logger()})
	require.NoError(t, err)
	assert.Len(t, rec.Find(msg), want)
	newEnv(t, host.SharedOptions{Populate: true, Logger: rec.Logger()}, false)
	assert.Len(t, rec.Find(msg), 2*want)
}

// TestHugePageFallbackNotice: a backing whose granule would take huge pages says,
// once at construction, when the system gives it small pages instead, and why; one
// whose options turn huge pages off, or whose granule is too small, says nothing.
func TestHugePageFallbackNotice(t *testing.T) {
	const msg = "host: no huge pages; granules take small pages"
	var rec logrec.Recorder
	p, err := host.NewPrivate(host.PrivateOptions{Granularity: 2 << 20, Logger: rec.Logger()})
	require.NoError(t, err)
	why := p.Stats().NoHugePages
	want := 0
	if why != "" {
		want = 1
	}
	got := rec.Find(msg)
	require.Len(t, got, want, "the system's answer: %q", why)
	if want == 1 {
		assert.Equal(t, why, got[0]["why"])
		assert.Equal(t, "private", got[0]["backing"])
	}
	_, err = host.NewPrivate(host.PrivateOptions{Granularity: 2 << 20, NoHugePages: true, Logger: rec.Logger()})
	require.NoError(t, err)
	_, err = host.NewPrivate(host.PrivateOptions{Granularity: 64 << 10, Logger: rec.Logger()})
	require.NoError(t, err)
	assert.Len(t, rec.Find(msg), want, "no notice for a choice of the caller's")

	e := newEnv(t, host.SharedOptions{Granularity: 2 << 20, Logger: rec.Logger()}, false)
	swhy := e.s.Stats().NoHugePages
	if swhy != "" {
		want++
	}
	t.Logf("private: %q; shared: %q", why, swhy)
	assert.Len(t, rec.Find(msg), want, "Shared: %q", swhy)
}

// TestSharedLogsDecay: a decay pass that gives idle granules back says so at Debug.
func TestSharedLogsDecay(t *testing.T) {
	var rec logrec.Recorder
	e := newEnv(t, host.SharedOptions{Granularity: 64 << 10, Decay: time.Second, NoHugePages: true, Logger: rec.Logger()}, false)
	r := e.reserve(4)
	e.commit(r, 0, 4)
	e.decommit(r, 0, 4)
	host.SharedDecay(e.s) // nothing has waited long: nothing goes
	assert.Empty(t, rec.Find("host: pool decay"))
	e.advance(2 * time.Second)
	host.SharedDecay(e.s)
	d := rec.Find("host: pool decay")
	require.Len(t, d, 1)
	assert.Equal(t, "DEBUG", d[0]["level"])
	assert.Equal(t, float64(4*e.g), d[0]["gave_back_bytes"])
	assert.Zero(t, e.pool().Idle)
}
