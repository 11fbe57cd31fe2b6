package backingtest_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/internal/mutanttest"
)

// Mutants are Fakes with one contract violation each. The suite must catch every one,
// in the property named, or it proves nothing.

type doubleCommitOK struct{ *backingtest.Fake }

func (m doubleCommitOK) Commit(r fakeR, off, size int) error {
	if err := m.Fake.Commit(r, off, size); !errors.Is(err, backing.ErrCommitted) {
		return err
	}
	return nil
}

type lyingUnreserve struct{ *backingtest.Fake }

func (m lyingUnreserve) Unreserve(r fakeR) accounting.ReleaseOutcome {
	m.Fake.Unreserve(r)
	return accounting.Released(0)
}

type noPanicBase struct{ *backingtest.Fake }

func (m noPanicBase) Base(r fakeR) (b uintptr) {
	defer func() { _ = recover() }()
	return m.Fake.Base(r)
}

type keepsContents struct{ *backingtest.Fake }

func (m keepsContents) Decommit(r fakeR, off, size int) error {
	if err := m.Fake.Decommit(r, off, size); err != nil {
		return err
	}
	// Commit again behind the caller's back and claim success: the granule stays
	// committed, so the suite's recommit must be refused.
	return m.Fake.Commit(r, off, size)
}

type roundsDown struct{ *backingtest.Fake }

func (m roundsDown) Commit(r fakeR, off, size int) error {
	g := m.Granularity()
	if off >= 0 && size >= 0 {
		off, size = off&^(g-1), (size+g-1)&^(g-1)
	}
	return m.Fake.Commit(r, off, size)
}

type ownsTwice struct{ *backingtest.Fake }

func (m ownsTwice) Share(dst fakeR, dstOff int, src fakeR, srcOff, size int, prot backing.Protection) error {
	if err := m.Fake.Share(dst, dstOff, src, srcOff, size, prot); err != nil {
		return err
	}
	return m.Accounting().Authority().TryAcquire(int64(size)) // charges a shared granule again
}

type sharesWritable struct{ *backingtest.Fake }

func (m sharesWritable) Share(dst fakeR, dstOff int, src fakeR, srcOff, size int, _ backing.Protection) error {
	return m.Fake.Share(dst, dstOff, src, srcOff, size, backing.ReadWrite)
}

type anyProtection struct{ *backingtest.Fake }

func (m anyProtection) Share(dst fakeR, dstOff int, src fakeR, srcOff, size int, prot backing.Protection) error {
	return m.Fake.Share(dst, dstOff, src, srcOff, size, min(prot, backing.ReadOnly))
}

type mapsSharesTwice struct{ *backingtest.Fake }

func (m mapsSharesTwice) Share(dst fakeR, dstOff int, src fakeR, srcOff, size int, prot backing.Protection) error {
	if err := m.Fake.Share(dst, dstOff, src, srcOff, size, prot); err != nil {
		return err
	}
	m.Accounting().Authority().Map(int64(size))
	return nil
}

type noShareWithin struct{ *backingtest.Fake }

func (m noShareWithin) Share(dst fakeR, dstOff int, src fakeR, srcOff, size int, prot backing.Protection) error {
	if dst == src {
		return &backing.OpError{Op: "share", Offset: dstOff, Size: size, Kind: backing.ErrCommitted}
	}
	return m.Fake.Share(dst, dstOff, src, srcOff, size, prot)
}

type decommitsNeighbour struct{ *backingtest.Fake }

func (m decommitsNeighbour) Decommit(r fakeR, off, size int) error {
	if err := m.Fake.Decommit(r, off, size); err != nil {
		return err
	}
	_ = m.Fake.Decommit(r, off+size, m.Granularity())
	return nil
}

// partialOnRefusal commits the first granule of a range the budget refuses.
type partialOnRefusal struct{ *backingtest.Fake }

func (m partialOnRefusal) Commit(r fakeR, off, size int) error {
	err := m.Fake.Commit(r, off, size)
	if errors.Is(err, accounting.ErrBudgetExceeded) && size > m.Granularity() {
		_ = m.Fake.Commit(r, off, m.Granularity())
	}
	return err
}

type impatient struct{ *backingtest.Fake }

func (m impatient) CommitCtx(_ context.Context, r fakeR, off, size int) error {
	return m.Fake.Commit(r, off, size)
}

// ghostWaiter leaves a request on the governor when its wait is cancelled, which takes
// the next bytes freed.
type ghostWaiter struct{ *backingtest.Fake }

func (m ghostWaiter) CommitCtx(ctx context.Context, r fakeR, off, size int) error {
	err := m.Fake.CommitCtx(ctx, r, off, size)
	if errors.Is(err, context.Canceled) {
		go func() { _ = m.Accounting().Authority().Acquire(context.Background(), int64(size)) }()
		// Let the ghost queue before the caller looks.
		for m.Accounting().Authority().Governor().Stats(m.Device()).Waiters == 0 {
			time.Sleep(time.Millisecond)
		}
	}
	return err
}

type protectIgnored struct{ *backingtest.Fake }

func (m protectIgnored) Protect(r fakeR, off, size int, prot backing.Protection) error {
	if err := m.Fake.Protect(r, off, size, prot); err != nil {
		return err
	}
	return m.Fake.Protect(r, off, size, backing.ReadWrite)
}

// sharerGainsWrite claims to have granted ReadWrite on a granule shared ReadOnly.
type sharerGainsWrite struct{ *backingtest.Fake }

func (m sharerGainsWrite) Protect(r fakeR, off, size int, prot backing.Protection) error {
	if err := m.Fake.Protect(r, off, size, prot); !errors.Is(err, backing.ErrReadOnly) {
		return err
	}
	return nil
}

// protectPartial protects granule by granule and stops at the first refusal.
type protectPartial struct{ *backingtest.Fake }

func (m protectPartial) Protect(r fakeR, off, size int, prot backing.Protection) error {
	g := m.Granularity()
	if off < 0 || size < 0 || off%g != 0 || size%g != 0 || off+size > m.Size(r) {
		return m.Fake.Protect(r, off, size, prot)
	}
	for o := off; o < off+size; o += g {
		if err := m.Fake.Protect(r, o, g, prot); err != nil {
			return err
		}
	}
	return nil
}

type protectAnyProtection struct{ *backingtest.Fake }

func (m protectAnyProtection) Protect(r fakeR, off, size int, prot backing.Protection) error {
	return m.Fake.Protect(r, off, size, min(prot, backing.ReadOnly))
}

// protectMemo remembers which granules were last protected ReadOnly, whatever
// happens to them after, for the mutants below.
type protectMemo struct {
	*backingtest.Fake
	mu sync.Mutex
	ro map[fakeR]map[int]bool
}

func (m *protectMemo) Protect(r fakeR, off, size int, prot backing.Protection) error {
	if err := m.Fake.Protect(r, off, size, prot); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.ro == nil {
		m.ro = make(map[fakeR]map[int]bool)
	}
	if m.ro[r] == nil {
		m.ro[r] = make(map[int]bool)
	}
	for o := off; o < off+size; o += m.Granularity() {
		m.ro[r][o] = prot == backing.ReadOnly
	}
	return nil
}

func (m *protectMemo) wasProtected(r fakeR, off, size int) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	for o := off; o < off+size; o += m.Granularity() {
		if m.ro[r][o] {
			return true
		}
	}
	return false
}

// commitKeepsProtection commits read-only where a decommitted granule was protected.
type commitKeepsProtection struct{ *protectMemo }

func (m commitKeepsProtection) Commit(r fakeR, off, size int) error {
	if err := m.Fake.Commit(r, off, size); err != nil {
		return err
	}
	for o := off; o < off+size; o += m.Granularity() {
		if m.wasProtected(r, o, m.Granularity()) {
			_ = m.Fake.Protect(r, o, m.Granularity(), backing.ReadOnly)
		}
	}
	return nil
}

// shareInheritsProtection shares read-only where asked read-write from a protected
// source, instead of refusing.
type shareInheritsProtection struct{ *protectMemo }

func (m shareInheritsProtection) Share(dst fakeR, dstOff int, src fakeR, srcOff, size int, prot backing.Protection) error {
	if m.wasProtected(src, srcOff, size) {
		prot = backing.ReadOnly
	}
	return m.Fake.Share(dst, dstOff, src, srcOff, size, prot)
}

// The mutants of the seed's safety contract (see the backing package's doc), one
// per point where no other mutant breaks it.

// granularityDrifts answers a granule twice as large on every other call.
type granularityDrifts struct {
	*backingtest.Fake
	calls *atomic.Int64
}

func (m granularityDrifts) Granularity() int {
	if m.calls.Add(1)%2 == 0 {
		return 2 * m.Fake.Granularity()
	}
	return m.Fake.Granularity()
}

// reserveCommits commits the first granule of every reservation it makes.
type reserveCommits struct{ *backingtest.Fake }

func (m reserveCommits) Reserve(size int) (fakeR, error) {
	r, err := m.Fake.Reserve(size)
	if err == nil && size >= m.Granularity() {
		err = m.Fake.Commit(r, 0, m.Granularity())
	}
	return r, err
}

// baseMoves reports a base one granule further on once the reservation committed
// something.
type baseMoves struct {
	*backingtest.Fake
	mu    *sync.Mutex
	moved map[fakeR]bool
}

func (m baseMoves) Commit(r fakeR, off, size int) error {
	err := m.Fake.Commit(r, off, size)
	if err == nil {
		m.mu.Lock()
		m.moved[r] = true
		m.mu.Unlock()
	}
	return err
}

func (m baseMoves) Base(r fakeR) uintptr {
	m.mu.Lock()
	moved := m.moved[r]
	m.mu.Unlock()
	if moved {
		return m.Fake.Base(r) + uintptr(m.Granularity())
	}
	return m.Fake.Base(r)
}

// commitsShort commits only the first granule of the range it is asked to commit.
type commitsShort struct{ *backingtest.Fake }

func (m commitsShort) Commit(r fakeR, off, size int) error {
	if g := m.Granularity(); size > g {
		size = g
	}
	return m.Fake.Commit(r, off, size)
}

// unreserveKeepsGranules maps every granule still committed in a reservation into a
// hidden one before it unreserves it: the address space goes, the memory stays.
type unreserveKeepsGranules struct{ *backingtest.Fake }

func (m unreserveKeepsGranules) Unreserve(r fakeR) accounting.ReleaseOutcome {
	g, size := m.Granularity(), m.Size(r)
	if hidden, err := m.Fake.Reserve(size); err == nil {
		for off := 0; off < size; off += g {
			_ = m.Fake.Share(hidden, off, r, off, g, backing.ReadOnly) // a reserved granule is refused
		}
	}
	return m.Fake.Unreserve(r)
}

var mutants = map[string]struct {
	make func(*backingtest.Fake) backing.Backing[fakeR]
	want []string // properties that must fail
}{
	"doubleCommitOK": {func(f *backingtest.Fake) backing.Backing[fakeR] { return doubleCommitOK{f} }, []string{"DoubleCommit", "FailedCallChangesNothing"}},
	"lyingUnreserve": {func(f *backingtest.Fake) backing.Backing[fakeR] { return lyingUnreserve{f} }, []string{"UnreserveCommitted", "CommitWriteRead"}},
	"noPanicBase":    {func(f *backingtest.Fake) backing.Backing[fakeR] { return noPanicBase{f} }, []string{"UseAfterUnreserve"}},
	"keepsContents":  {func(f *backingtest.Fake) backing.Backing[fakeR] { return keepsContents{f} }, []string{"DecommitForfeits", "DecommitUncommitted"}},
	"roundsDown":     {func(f *backingtest.Fake) backing.Backing[fakeR] { return roundsDown{f} }, []string{"Alignment"}},
	"ownsTwice":      {func(f *backingtest.Fake) backing.Backing[fakeR] { return ownsTwice{f} }, []string{"ShareLastMapping", "ShareReport"}},
	"sharesWritable": {func(f *backingtest.Fake) backing.Backing[fakeR] { return sharesWritable{f} }, []string{"ShareReadOnlyCopyIn"}},
	"anyProtection":  {func(f *backingtest.Fake) backing.Backing[fakeR] { return anyProtection{f} }, []string{"ShareUnknownProtection"}},
	"mapsSharesTwice": {func(f *backingtest.Fake) backing.Backing[fakeR] { return mapsSharesTwice{f} },
		[]string{"AccountingAxes", "ShareWithin"}},
	"noShareWithin":      {func(f *backingtest.Fake) backing.Backing[fakeR] { return noShareWithin{f} }, []string{"ShareWithin"}},
	"decommitsNeighbour": {func(f *backingtest.Fake) backing.Backing[fakeR] { return decommitsNeighbour{f} }, []string{"ShareDecommitPart"}},
	"partialOnRefusal":   {func(f *backingtest.Fake) backing.Backing[fakeR] { return partialOnRefusal{f} }, []string{"BudgetRefusal"}},
	"impatient": {func(f *backingtest.Fake) backing.Backing[fakeR] { return impatient{f} },
		[]string{"BudgetWaitFIFO", "BudgetWaitCancel"}},
	"ghostWaiter": {func(f *backingtest.Fake) backing.Backing[fakeR] { return ghostWaiter{f} }, []string{"BudgetWaitCancel"}},
	"protectIgnored": {func(f *backingtest.Fake) backing.Backing[fakeR] { return protectIgnored{f} },
		[]string{"ProtectRoundTrip", "ProtectOtherMappings", "ProtectErrors", "ProtectDecommit"}},
	"sharerGainsWrite": {func(f *backingtest.Fake) backing.Backing[fakeR] { return sharerGainsWrite{f} }, []string{"ProtectSharer"}},
	"protectPartial": {func(f *backingtest.Fake) backing.Backing[fakeR] { return protectPartial{f} },
		[]string{"ProtectSharer", "ProtectErrors"}},
	"protectAnyProtection": {func(f *backingtest.Fake) backing.Backing[fakeR] { return protectAnyProtection{f} }, []string{"ProtectErrors"}},
	"commitKeepsProtection": {func(f *backingtest.Fake) backing.Backing[fakeR] { return commitKeepsProtection{&protectMemo{Fake: f}} },
		[]string{"ProtectDecommit"}},
	"shareInheritsProtection": {func(f *backingtest.Fake) backing.Backing[fakeR] {
		return shareInheritsProtection{&protectMemo{Fake: f}}
	},
		[]string{"ShareFromReadOnly"}},
	"granularityDrifts": {func(f *backingtest.Fake) backing.Backing[fakeR] { return granularityDrifts{f, new(atomic.Int64)} },
		[]string{"Identity"}},
	"reserveCommits": {func(f *backingtest.Fake) backing.Backing[fakeR] { return reserveCommits{f} },
		[]string{"ReserveCommitsNothing", "ReserveUnreserve"}},
	"baseMoves": {func(f *backingtest.Fake) backing.Backing[fakeR] {
		return baseMoves{f, new(sync.Mutex), map[fakeR]bool{}}
	}, []string{"BaseStable"}},
	"commitsShort":           {func(f *backingtest.Fake) backing.Backing[fakeR] { return commitsShort{f} }, []string{"CommitWriteRead"}},
	"unreserveKeepsGranules": {func(f *backingtest.Fake) backing.Backing[fakeR] { return unreserveKeepsGranules{f} }, []string{"UnreserveCommitted"}},
	// A backing that maps read-only memory read-write elsewhere on request.
	"sharesFromReadOnly": {func(f *backingtest.Fake) backing.Backing[fakeR] { return backingtest.ShareAnySource(f) },
		[]string{"ShareFromReadOnly"}},
}

const mutantEnv = "BACKINGTEST_MUTANT"

// TestMutantChild runs the suite on the mutant named by $BACKINGTEST_MUTANT; it does
// nothing in a normal run. TestSuiteCatchesMutants starts it in a child process,
// since a failing subtest can not be contained inside the parent's test.
func TestMutantChild(t *testing.T) {
	name := mutanttest.Child(mutantEnv)
	if name == "" {
		return
	}
	m := mutants[name]
	backingtest.Run(t, func(t *testing.T) backing.Backing[fakeR] {
		auth := accounting.NewGovernor().Authority("mutant", accounting.HostKey)
		return m.make(backingtest.NewFake(backingtest.FakeOptions{Authority: auth, Wait: true}))
	})
}

func TestSuiteCatchesMutants(t *testing.T) {
	want := make(map[string][]string, len(mutants))
	for name, m := range mutants {
		want[name] = m.want
	}
	mutanttest.Catches(t, mutantEnv, "TestMutantChild", want)
}
