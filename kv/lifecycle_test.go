package kv_test

import (
	"errors"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/kv"
)

type slowReserve struct {
	*backingtest.Fake
	entered, proceed chan struct{}
	once             sync.Once
}

func (s *slowReserve) Reserve(size int) (*backingtest.FakeReservation, error) {
	s.once.Do(func() { close(s.entered); <-s.proceed })
	return s.Fake.Reserve(size)
}

// Close refuses while a sequence is being made.
func TestCloseWhileNewSequence(t *testing.T) {
	e := openEnv(t, noCache, withLimit(1<<30))
	sr := &slowReserve{Fake: e.fake, entered: make(chan struct{}), proceed: make(chan struct{})}
	c, err := kv.New(sr, kv.Config{Model: tiny8, MaxTokens: 64})
	require.NoError(t, err)
	got := make(chan *kv.Sequence)
	go func() {
		s, err := c.NewSequence()
		assert.NoError(t, err)
		got <- s
	}()
	<-sr.entered
	assert.ErrorIs(t, c.Close(), kv.ErrBusy)
	close(sr.proceed)
	s := <-got
	assert.True(t, s.Close().OK())
	require.NoError(t, c.Close())
}

type slowUnreserve struct {
	*backingtest.Fake
	armed            atomic.Bool
	fail             atomic.Int32
	entered, proceed chan struct{}
}

func (s *slowUnreserve) Unreserve(r *backingtest.FakeReservation) accounting.ReleaseOutcome {
	if s.armed.CompareAndSwap(true, false) {
		close(s.entered)
		<-s.proceed
	}
	if s.fail.Add(-1) >= 0 {
		return accounting.FailedRelease(0, errors.New("boom"))
	}
	return s.Fake.Unreserve(r)
}

// Close refuses while a prefix is being given back, and retries what failed.
func TestCloseWhilePrefixRelease(t *testing.T) {
	e := openEnv(t, noCache, withLimit(1<<30))
	sb := &slowUnreserve{Fake: e.fake, entered: make(chan struct{}), proceed: make(chan struct{})}
	c, err := kv.New(sb, kv.Config{Model: tiny8, MaxTokens: 64})
	require.NoError(t, err)
	s, err := c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, s.Append(16))
	p, err := s.Freeze(16)
	require.NoError(t, err)
	require.True(t, s.Close().OK())

	sb.armed.Store(true)
	sb.fail.Store(2)
	done := make(chan struct{})
	go func() { p.Release(); close(done) }()
	<-sb.entered
	assert.ErrorIs(t, c.Close(), kv.ErrBusy)
	close(sb.proceed)
	<-done
	require.NoError(t, c.Close())
	assert.Zero(t, e.fake.LiveReservations())
}

func TestForeignAndNilPrefix(t *testing.T) {
	e := openEnv(t, noCache, withLimit(1<<30))
	a := e.cache(t, kv.Config{MaxTokens: 64, Layout: kv.PerLayer})
	b := e.cache(t, kv.Config{MaxTokens: 64, Layout: kv.PerLayer})
	s, err := a.NewSequence()
	require.NoError(t, err)
	p, err := s.Freeze(0)
	require.NoError(t, err)
	_, err = b.NewSequenceFrom(p)
	assert.ErrorIs(t, err, kv.ErrConfig)
	assert.PanicsWithValue(t, kv.PanicNilPrefix, func() { _, _ = b.NewSequenceFrom(nil) })
	assert.PanicsWithValue(t, kv.PanicLayerRange, func() { s.Base(-1, kv.K) })
	p.Release()
	assert.True(t, s.Close().OK())

	other := accounting.NewGovernor().Authority("gpu", accounting.GPU(0))
	private := backingtest.NewFake(backingtest.FakeOptions{Granularity: fakeGranule})
	_, err = kv.New(private, kv.Config{Model: tiny8, MaxTokens: 8, Authority: other})
	assert.ErrorIs(t, err, kv.ErrConfig, "authority on another device")
}

// A Close whose releases fail twice reports Quarantined (the sequence left its cache,
// its prefix reference went), never Failed; Cache.Close retries what was kept.
func TestCloseFailureIsQuarantined(t *testing.T) {
	e := openEnv(t, noCache, withLimit(1<<30), withFaults)
	c, err := e.tryCache(kv.Config{Model: tiny8, MaxTokens: 64})
	require.NoError(t, err)
	root, err := c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, root.Append(16))
	p, err := root.Freeze(16)
	require.NoError(t, err)
	s, err := c.NewSequenceFrom(p)
	require.NoError(t, err)
	require.True(t, root.Close().OK())
	p.Release()

	boom := errors.New("boom")
	e.faults.FailOp(backingtest.OpUnreserve, 1, boom)
	e.faults.FailOp(backingtest.OpUnreserve, 2, boom)
	out := s.Close()
	assert.Equal(t, accounting.Quarantined, out.Status)
	assert.ErrorIs(t, out.Err, boom)
	assert.Positive(t, out.Residual)
	again := s.Close()
	assert.Equal(t, accounting.Failed, again.Status, "a second Close changes nothing")
	assert.ErrorIs(t, again.Err, kv.ErrClosed)
	e.faults.Reset()
	require.NoError(t, c.Close(), "Close gives back what the failed release kept")
}

// A truncation into a shared granule whose replacement can not be had, where a token
// straddles the granule boundary, leaves the sequence damaged rather than holding a
// token it can not write. Q8_0 tokens of 272 bytes straddle PerLayer's 4 KiB granules.
func TestTruncateFailureStraddle(t *testing.T) {
	e := openEnv(t, noCache, withLimit(1<<30), withFaults)
	c, err := e.tryCache(kv.Config{Model: q8Tiny, MaxTokens: 64, Layout: kv.PerLayer})
	require.NoError(t, err)
	defer func() { require.NoError(t, c.Close()) }()
	parent, err := c.NewSequence()
	require.NoError(t, err)
	defer parent.Close()
	require.NoError(t, parent.Append(40)) // 10,880 bytes a tensor: two whole granules shared
	child, err := parent.Fork()
	require.NoError(t, err)
	defer child.Close()
	e.faults.FailOp(backingtest.OpCommit, 1, errors.New("boom"))
	// 20 tokens end inside the shared granule [4096, 8192), and token 15 straddles its
	// start ([4080, 4352)): no token count ends on the granule given up.
	require.Error(t, child.Truncate(20))
	assert.True(t, child.Damaged())
	assert.ErrorIs(t, child.Append(1), kv.ErrDamaged)
}

type faultySeq = kv.Sequence

// scenario runs create, append, share, fork, truncate and close on c, checking the
// data it wrote as it goes; it returns the first error. Sequences that survive a
// failure are checked before they are closed: a failure elsewhere must not touch them.
func scenario(c *kv.Cache) (err error) {
	type written struct {
		s        *faultySeq
		w        uint64
		from, to int
	}
	var live []*faultySeq
	var checks []written
	defer func() {
		if err != nil {
			for _, ck := range checks {
				if !ck.s.Damaged() {
					if cerr := tryCheck(ck.s, ck.w, ck.from, ck.to); errors.Is(cerr, errCorrupt) {
						err = errors.Join(err, cerr)
					}
				}
			}
		}
		for _, s := range live {
			if out := s.Close(); !out.OK() && err == nil {
				err = out.Err
			}
		}
	}()
	write := func(s *faultySeq, w uint64, from, to int) error {
		if err := tryWrite(s, w, from, to); err != nil {
			return err
		}
		checks = append(checks, written{s, w, from, to})
		return nil
	}
	root, err := c.NewSequence()
	if err != nil {
		return err
	}
	live = append(live, root)
	if err := root.Append(21); err != nil {
		return err
	}
	if err := write(root, 1, 0, 21); err != nil {
		return err
	}
	p, err := root.Freeze(19)
	if err != nil {
		return err
	}
	defer p.Release()
	s, err := c.NewSequenceFrom(p)
	if err != nil {
		return err
	}
	live = append(live, s)
	if err := s.Append(10); err != nil {
		return err
	}
	checks = append(checks, written{s, 1, 0, 19})
	if err := write(s, 2, 19, 29); err != nil {
		return err
	}
	f, err := s.Fork()
	if err != nil {
		return err
	}
	live = append(live, f)
	if err := f.Truncate(11); err != nil {
		return err
	}
	checks = append(checks, written{f, 1, 0, 11})
	if err := f.Append(5); err != nil {
		return err
	}
	if err := write(f, 3, 11, 16); err != nil {
		return err
	}
	for _, ck := range checks {
		if err := tryCheck(ck.s, ck.w, ck.from, ck.to); err != nil {
			return err
		}
	}
	return nil
}

func TestFaultInjectionAtEveryBackingCall(t *testing.T) {
	for _, layout := range layouts {
		t.Run(layout.String(), func(t *testing.T) {
			e := openEnv(t, noCache, withLimit(1<<30), withFaults)
			c, err := e.tryCache(kv.Config{Model: tiny8, MaxTokens: 64, Layout: layout})
			require.NoError(t, err)
			require.NoError(t, scenario(c))
			calls := e.faults.Calls()
			require.Greater(t, calls, 10)
			// NB: a failed release is retried once, so a fault there may be absorbed.
			failed := e.atEveryCall(t, calls, func() error { return scenario(c) }, func(n int) {
				assert.Equal(t, kv.Stats{}, holdings(c), "call %d", n)
			})
			assert.Greater(t, failed, calls*3/4, "most injected faults surface as errors")
			require.NoError(t, scenario(c), "works again once faults stop")
			require.NoError(t, c.Close())
		})
	}
}
