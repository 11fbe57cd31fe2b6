package backingtest

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/backing"
)

const (
	opsReservations = 3 // reservations RunOps juggles
	opsGranules     = 8 // granules per reservation
)

// SeedOps returns a short corpus for fuzz tests that call RunOps: each byte string
// exercises commits, decommits, writes, shares and unreserves, so that a plain
// `go test` runs them quickly.
func SeedOps() [][]byte {
	return [][]byte{
		{},
		{0, 0, 0x02, 2, 0, 0x10, 3, 0, 0x00, 1, 0, 0x02},
		{0, 1, 0x07, 0, 1, 0x03, 1, 1, 0x05, 2, 1, 0x40, 4, 1, 0},
		{0, 0, 0x03, 2, 0, 0x22, 5, 0x10, 0x05, 3, 1, 0x00, 1, 0, 0x03, 3, 1, 0x00, 4, 1, 0},
		{0, 2, 0x0f, 5, 0x21, 0x12, 5, 0x12, 0x24, 2, 1, 0x23, 3, 2, 0x03, 4, 0, 0, 4, 2, 0, 3, 1, 0x03},
		{0, 0, 0xf8, 6, 0, 0x3f, 1, 0, 0x7f, 6, 0, 0x07, 0, 0, 0x11, 4, 0, 0},
		// Protect read-only, write around it, share read-only, refuse the sharer
		// read-write, protect the owner back, read back.
		{0, 0, 0x18, 2, 0, 0x00, 7, 0x81, 0x08, 2, 0, 0x01, 2, 0, 0x02, 5, 0xA2, 0x08, 7, 1, 0x00,
			7, 0, 0x08, 2, 0, 0x01, 3, 1, 0, 3, 0, 0, 1, 0, 0x08, 0, 0, 0x08, 2, 0, 0x01, 3, 0, 0},
		// Refuse read-write shares of a protected granule and of a read-only share,
		// share it read-only, protect the owner back, share it read-write, write, read.
		{0, 0, 0x08, 7, 0x81, 0x01, 5, 0x12, 0x01, 5, 0xA2, 0x01, 5, 0x25, 0x00, 7, 0, 0x01,
			5, 0x24, 0x01, 2, 2, 0x01, 3, 0, 0, 3, 1, 0, 3, 2, 0},
	}
}

// RunOps drives the operation sequence that ops encodes (three bytes per step)
// against b and a model of what b must hold, and fails t at the first difference in
// results, errors, contents or physical bytes in use. It is the body of a fuzz test:
//
//	func FuzzMyBacking(f *testing.F) {
//		for _, s := range backingtest.SeedOps() {
//			f.Add(s)
//		}
//		f.Fuzz(func(t *testing.T, ops []byte) { backingtest.RunOps(t, newBacking(t), ops) })
//	}
//
// The steps commit, decommit, write, read back, populate, share (when b is a Sharer
// that shares), protect (when b is a Protector) and unreserve-and-reserve-again, over
// three reservations of eight granules. Writes go only to granules the model says are
// writable, so a direct write never faults. RunOps unreserves everything before it returns.
func RunOps[R any](t *testing.T, b backing.Backing[R], ops []byte) {
	t.Helper()
	m := &opsModel[R]{e: &env[R]{t: t, b: b}, stamp: make(map[int]int)}
	m.e.accessors()
	m.sharer, _ = b.(backing.Sharer[R])
	m.populator, _ = b.(backing.Populator[R])
	m.protector, _ = b.(backing.Protector[R])
	m.start, m.byBacking = m.e.inUse()
	for k := range m.res {
		m.reserve(k)
	}
	for ; len(ops) >= 3 && !t.Failed(); ops = ops[3:] {
		m.step(ops[0], ops[1], ops[2])
	}
	for k := range m.res {
		if !m.res[k].done {
			m.unreserve(k)
		}
	}
	if m.byBacking && !t.Failed() {
		now, _ := m.e.inUse()
		assert.Equal(t, m.start, now, "physical bytes in use after every reservation went")
	}
}

// opsModel is what the backing must hold: for each granule of each reservation, the
// physical granule mapped there (0: Reserved), whether the mapping is read-only, and
// whether it was shared read-only (so that it may never be made writable).
type opsModel[R any] struct {
	e         *env[R]
	sharer    backing.Sharer[R]
	populator backing.Populator[R]
	protector backing.Protector[R]
	byBacking bool
	start     int64

	res     [opsReservations]*res[R]
	phys    [opsReservations][opsGranules]int
	ro      [opsReservations][opsGranules]bool
	shared  [opsReservations][opsGranules]bool // shared read-only
	stamp   map[int]int                        // physical granule -> the seed last written to it (0: zero)
	nextID  int
	noShare bool // Share answered ErrUnsupported
}

func (m *opsModel[R]) reserve(k int) {
	m.res[k] = reserveOn(m.e.t, m.e.b, opsGranules*m.e.g())
	m.phys[k] = [opsGranules]int{}
	m.ro[k] = [opsGranules]bool{}
	m.shared[k] = [opsGranules]bool{}
}

func (m *opsModel[R]) unreserve(k int) {
	n := 0
	for _, p := range m.phys[k] {
		if p != 0 {
			n++
		}
	}
	m.e.unreserve(m.res[k], n*m.e.g())
	m.phys[k] = [opsGranules]int{}
}

// rng decodes a range of granules from one byte: the low 3 bits are the first
// granule, the next 3 bits the count less one; a count past the end is kept, to check
// ErrOutOfRange.
func rng(x byte) (i, n int) { return int(x & 7), int(x>>3&7) + 1 }

// want returns the error kind a call on [i, i+n) of reservation k must report, given
// that its granules must all be committed (committed true) or all reserved.
func (m *opsModel[R]) want(k, i, n int, committed bool) error {
	if i+n > opsGranules {
		return backing.ErrOutOfRange
	}
	for j := i; j < i+n; j++ {
		if (m.phys[k][j] != 0) != committed {
			if committed {
				return backing.ErrNotCommitted
			}
			return backing.ErrCommitted
		}
	}
	return nil
}

func (m *opsModel[R]) check(err, want error, what string) bool {
	t := m.e.t
	t.Helper()
	if want == nil {
		return assert.NoError(t, err, what)
	}
	isOp(t, err, want, what)
	return false
}

func (m *opsModel[R]) step(op, a, x byte) {
	t := m.e.t
	g := m.e.g()
	k := int(a) % opsReservations
	i, n := rng(x)
	switch op % 8 {
	case 0: // commit
		if m.check(m.e.b.Commit(m.res[k].r, i*g, n*g), m.want(k, i, n, false), "commit") {
			for j := i; j < i+n; j++ {
				m.nextID++
				m.phys[k][j] = m.nextID
				m.ro[k][j] = false
				m.shared[k][j] = false
				m.stamp[m.nextID] = 0
			}
		}
	case 1: // decommit
		if m.check(m.e.b.Decommit(m.res[k].r, i*g, n*g), m.want(k, i, n, true), "decommit") {
			for j := i; j < i+n; j++ {
				m.phys[k][j] = 0
			}
		}
	case 2: // write granule i through the first accessor, if it is writable here
		p := m.phys[k][i]
		switch {
		case p != 0 && !m.ro[k][i]:
			seed := int(x) + 1
			m.e.mark(m.res[k].r, i*g, g, seed-i) // mark adds the granule index
			m.stamp[p] = seed
		case p != 0 && m.e.copier:
			// Read-only: only a CopyIn may try, and it must be refused.
			err := m.e.b.(backing.Copier[R]).CopyIn(m.res[k].r, i*g, []byte{0xEE})
			isOp(t, err, backing.ErrReadOnly, "ops: CopyIn into a read-only granule")
		}
	case 3: // read every committed granule of reservation k back
		for j, p := range m.phys[k] {
			if p == 0 {
				continue
			}
			if s := m.stamp[p]; s == 0 {
				m.e.checkZero(m.res[k].r, j*g, g, "ops: fresh granule")
			} else {
				m.e.checkMark(m.res[k].r, j*g, g, s-j, "ops: written granule")
			}
		}
		if m.byBacking {
			live := map[int]bool{}
			for kk := range m.phys {
				for _, p := range m.phys[kk] {
					if p != 0 {
						live[p] = true
					}
				}
			}
			now, _ := m.e.inUse()
			assert.Equal(t, m.start+int64(len(live)*g), now, "physical bytes in use: each live granule once")
		}
	case 4: // unreserve with whatever is committed, and reserve afresh
		m.unreserve(k)
		m.reserve(k)
	case 5: // share [i, i+n) of reservation k at [j, j+n) of reservation l
		if m.sharer == nil || m.noShare {
			return
		}
		l := int(a>>4) % opsReservations
		j := int(a>>2) & 3
		prot := backing.Protection(a >> 7)
		err := m.sharer.Share(m.res[l].r, j*g, m.res[k].r, i*g, n*g, prot)
		if errors.Is(err, backing.ErrUnsupported) {
			m.noShare = true
			return
		}
		// Which range fault a backing reports first when there are several is its
		// choice; a read-only source comes after them.
		wantSrc, wantDst := m.want(k, i, n, true), m.want(l, j, n, false)
		want := wantSrc
		if want == nil || (wantDst != nil && errors.Is(err, wantDst)) {
			want = wantDst
		}
		for d := 0; want == nil && d < n; d++ {
			if prot == backing.ReadWrite && m.ro[k][i+d] {
				want = backing.ErrReadOnly
			}
		}
		if m.check(err, want, "share") {
			for d := range n {
				m.phys[l][j+d] = m.phys[k][i+d]
				m.ro[l][j+d] = prot == backing.ReadOnly
				m.shared[l][j+d] = prot == backing.ReadOnly
			}
		}
	case 6: // populate
		if m.populator == nil {
			return
		}
		err := m.populator.Populate(m.res[k].r, i*g, n*g)
		if errors.Is(err, backing.ErrUnsupported) {
			m.populator = nil
			return
		}
		m.check(err, m.want(k, i, n, true), "populate")
	case 7: // protect
		if m.protector == nil {
			return
		}
		prot := backing.Protection(a >> 7)
		err := m.protector.Protect(m.res[k].r, i*g, n*g, prot)
		if errors.Is(err, backing.ErrUnsupported) {
			m.protector = nil
			return
		}
		want := m.want(k, i, n, true)
		for j := i; want == nil && j < i+n; j++ {
			if prot == backing.ReadWrite && m.shared[k][j] {
				want = backing.ErrReadOnly
			}
		}
		if m.check(err, want, "protect") {
			for j := i; j < i+n; j++ {
				m.ro[k][j] = prot == backing.ReadOnly
			}
		}
	}
	require.False(t, t.Failed(), "step %d/%d/%#x", op%8, a, x)
}
