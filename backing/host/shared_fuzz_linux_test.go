package host_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/backing/host"
)

const (
	fuzzRes      = 3 // reservations
	fuzzGranules = 4 // granules per reservation
	fuzzBudget   = 8 // granules the governor allows
)

// fuzzModel is what the backing must look like: which physical granule backs each
// granule of each reservation, how, and what tag each physical granule holds.
type fuzzModel struct {
	rs   [fuzzRes]*host.SharedReservation
	phys [fuzzRes][fuzzGranules]int // physical granule id, -1 when reserved
	ro   [fuzzRes][fuzzGranules]bool
	tags map[int]uint64
	next int
}

func (m *fuzzModel) clear(k int) {
	for i := range fuzzGranules {
		m.phys[k][i], m.ro[k][i] = -1, false
	}
}

// state returns nil if granules [gi, gi+n) of reservation k are all committed
// (want) or all reserved, else the error the backing must return.
func (m *fuzzModel) state(k, gi, n int, committed bool) error {
	if gi+n > fuzzGranules {
		return backing.ErrOutOfRange
	}
	for i := gi; i < gi+n; i++ {
		if (m.phys[k][i] >= 0) != committed {
			if committed {
				return backing.ErrNotCommitted
			}
			return backing.ErrCommitted
		}
	}
	return nil
}

// fuzzEnv returns a backing with a pool of two granules in sharedModes[mode %
// len(sharedModes)]: 64 KiB granules, but for huge pages.
func fuzzEnv(t *testing.T, mode uint8) *sharedEnv {
	m := sharedModes[int(mode)%len(sharedModes)]
	opts := host.SharedOptions{High: 2}
	if m.huge == "" {
		opts.Granularity = kib64
	}
	return m.env(t, opts, false)
}

// FuzzShared drives random sequences of commit, decommit, share, write, unreserve,
// trim, prefill and populate against a model, under a tight budget and a small pool,
// and checks after every step that every mapping reads the tag of its physical
// granule, that the bookkeeping and the authority agree, and that the kernel's
// mappings are what the bookkeeping says, the park's included. mode picks one of
// sharedModes.
func FuzzShared(f *testing.F) {
	for mode := range uint8(len(sharedModes)) {
		f.Add(mode, []byte{0, 0, 0, 2, 2, 1, 0, 0, 3, 0, 1, 0, 1, 0, 0, 1})
		f.Add(mode, []byte{0, 0, 0, 3, 2, 1, 1, 0, 2, 2, 0, 1, 4, 0, 0, 0, 3, 1, 1, 9, 5, 0, 0, 0})
		f.Add(mode, []byte{0, 0, 0, 3, 0, 1, 0, 3, 0, 2, 0, 3, 1, 0, 0, 2, 6, 0, 3, 0, 0, 1, 0, 3, 7, 1, 0, 3})
		f.Add(mode, []byte{0, 0, 1, 2, 2, 1, 1, 0, 2, 130, 2, 0, 3, 1, 1, 7, 2, 2, 0, 1, 1, 0, 1, 2, 4, 1, 0, 0, 5, 0, 1, 0})
	}
	f.Fuzz(func(t *testing.T, mode uint8, ops []byte) {
		if len(ops) > 4*64 {
			ops = ops[:4*64]
		}
		e := fuzzEnv(t, mode)
		host.SetSharedParkChunk(e.s, 2) // runs of slots cross park chunks
		require.NoError(t, e.gov.SetLimit(accounting.HostKey, fuzzBudget*int64(e.g)))
		m := &fuzzModel{tags: map[int]uint64{}}
		for k := range m.rs {
			m.rs[k] = e.reserve(fuzzGranules)
			m.clear(k)
		}
		g := e.g
		write := func(k, i int) {
			m.next++
			v := uint64(m.next)
			e.tag(m.rs[k], i, v)
			m.tags[m.phys[k][i]] = v
		}
		for len(ops) >= 4 {
			op, a, b, c := ops[0], int(ops[1]), int(ops[2]), int(ops[3])
			ops = ops[4:]
			k, gi, n := a%fuzzRes, b%fuzzGranules, c%3+1
			r := m.rs[k]
			switch op % 8 {
			case 0: // commit
				err := e.s.Commit(r, gi*g, n*g)
				if want := m.state(k, gi, n, false); want != nil {
					require.ErrorIs(t, err, want)
					break
				}
				if err != nil {
					require.ErrorIs(t, err, accounting.ErrBudgetExceeded)
					break
				}
				for i := gi; i < gi+n; i++ {
					m.next++
					m.phys[k][i] = m.next
					write(k, i)
				}
			case 1: // decommit
				err := e.s.Decommit(r, gi*g, n*g)
				if want := m.state(k, gi, n, true); want != nil {
					require.ErrorIs(t, err, want)
					break
				}
				require.NoError(t, err)
				for i := gi; i < gi+n; i++ {
					m.phys[k][i], m.ro[k][i] = -1, false
				}
			case 2: // share
				src, si := (k+1+c/3)%fuzzRes, (c/8)%fuzzGranules
				prot := backing.ReadWrite
				if c&0x80 != 0 {
					prot = backing.ReadOnly
				}
				err := e.s.Share(r, gi*g, m.rs[src], si*g, n*g, prot)
				var want error
				if si+n > fuzzGranules || gi+n > fuzzGranules {
					want = backing.ErrOutOfRange
				} else if want = m.state(src, si, n, true); want == nil {
					want = m.state(k, gi, n, false)
				}
				for j := 0; want == nil && j < n; j++ {
					if prot == backing.ReadWrite && m.ro[src][si+j] {
						want = backing.ErrReadOnly // read-only memory is never shared writable
					}
				}
				if want != nil {
					require.ErrorIs(t, err, want)
					break
				}
				require.NoError(t, err)
				for j := range n {
					m.phys[k][gi+j] = m.phys[src][si+j]
					m.ro[k][gi+j] = prot == backing.ReadOnly
				}
			case 3: // write
				err := e.s.CopyIn(r, gi*g, []byte{1})
				switch {
				case m.phys[k][gi] < 0:
					require.ErrorIs(t, err, backing.ErrNotCommitted)
				case m.ro[k][gi]:
					require.ErrorIs(t, err, host.ErrSharedReadOnly)
				default:
					require.NoError(t, err)
					write(k, gi)
				}
			case 4: // unreserve and reserve again
				o := e.unreserve(r)
				require.True(t, o.OK())
				m.rs[k] = e.reserve(fuzzGranules)
				m.clear(k)
			case 5: // trim
				_, err := e.s.Trim(b % 4)
				require.NoError(t, err)
				require.LessOrEqual(t, e.pool().Idle, int64(b%4*g))
			case 6: // prefill
				if err := e.s.Prefill(b % 3); err != nil {
					require.ErrorIs(t, err, accounting.ErrBudgetExceeded)
				}
			case 7: // populate
				err := e.s.Populate(r, gi*g, n*g)
				if want := m.state(k, gi, n, true); want != nil {
					require.ErrorIs(t, err, want)
					break
				}
				require.NoError(t, err)
			}
			// Every mapping reads its physical granule's tag.
			for k := range m.rs {
				for i := range fuzzGranules {
					if id := m.phys[k][i]; id >= 0 {
						require.Equal(t, m.tags[id], e.tagOf(m.rs[k], i), "reservation %d granule %d", k, i)
					} else {
						require.ErrorIs(t, e.s.Decommit(m.rs[k], i*g, g), backing.ErrNotCommitted)
					}
				}
				e.checkMaps(m.rs[k], e.s.Base(m.rs[k]), fuzzGranules*g)
			}
			e.checkPark()
			require.NoError(t, host.CheckShared(e.s))
			require.NoError(t, host.SharedFileCheck(e.s))
			p := e.pool()
			require.LessOrEqual(t, p.Owned, fuzzBudget*int64(g), "within the budget")
			require.Equal(t, p.Owned-p.Idle, int64(len(live(m)))*int64(g), "owned = live physical granules + idle")
		}
	})
}

// live returns the physical granules mapped somewhere.
func live(m *fuzzModel) map[int]bool {
	out := map[int]bool{}
	for k := range m.rs {
		for i := range fuzzGranules {
			if id := m.phys[k][i]; id >= 0 {
				out[id] = true
			}
		}
	}
	return out
}

// FuzzSharedOps runs the shared random-op driver every backing shares
// (backingtest.RunOps) on a Shared backing with a small pool in one of sharedModes.
func FuzzSharedOps(f *testing.F) {
	for mode := range uint8(len(sharedModes)) {
		for _, s := range backingtest.SeedOps() {
			f.Add(mode, s)
		}
	}
	f.Fuzz(func(t *testing.T, mode uint8, ops []byte) {
		e := fuzzEnv(t, mode)
		backingtest.RunOps(t, e.s, ops)
		require.NoError(t, host.CheckShared(e.s))
	})
}
