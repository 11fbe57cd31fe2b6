package host

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

// phModel is an address space of units as Windows documents placeholders: regions
// that are each a placeholder or a view, and calls that refuse what Windows refuses.
type phModel struct {
	base, unit uintptr
	regions    []phRegion // sorted, covering what is still reserved
	fail       func(call string) bool
}

type phRegion struct {
	a, b int // units [a, b)
	view bool
}

var errPhInjected = errors.New("injected")

func (m *phModel) unitAt(at uintptr) int { return int((at - m.base) / m.unit) }

// find returns the index of the region that holds unit i, or -1.
func (m *phModel) find(i int) int {
	for k, r := range m.regions {
		if r.a <= i && i < r.b {
			return k
		}
	}
	return -1
}

func (m *phModel) os() placeholderOS {
	return placeholderOS{
		split: func(at uintptr, n int) error {
			if m.fail("split") {
				return errPhInjected
			}
			i, k := m.unitAt(at), n/int(m.unit)
			x := m.find(i)
			if x < 0 || m.regions[x].view || i+k > m.regions[x].b || (i == m.regions[x].a && i+k == m.regions[x].b) {
				return fmt.Errorf("split [%d, %d) of %v", i, i+k, m.regions)
			}
			r := m.regions[x]
			var pieces []phRegion
			for _, p := range []phRegion{{r.a, i, false}, {i, i + k, false}, {i + k, r.b, false}} {
				if p.b > p.a {
					pieces = append(pieces, p)
				}
			}
			m.regions = append(m.regions[:x], append(pieces, m.regions[x+1:]...)...)
			return nil
		},
		coalesce: func(at uintptr, n int) error {
			if m.fail("coalesce") {
				return errPhInjected
			}
			i, j := m.unitAt(at), m.unitAt(at)+n/int(m.unit)
			x := m.find(i)
			y := x
			for y < len(m.regions) && m.regions[y].b <= j && !m.regions[y].view {
				if m.regions[y].b == j {
					break
				}
				y++
			}
			if x < 0 || y == len(m.regions) || m.regions[x].a != i || m.regions[y].b != j || y == x || m.regions[y].view {
				return fmt.Errorf("coalesce [%d, %d) of %v", i, j, m.regions)
			}
			m.regions = append(m.regions[:x], append([]phRegion{{i, j, false}}, m.regions[y+1:]...)...)
			return nil
		},
		free: func(at uintptr) error {
			if m.fail("free") {
				return errPhInjected
			}
			x := m.find(m.unitAt(at))
			if x < 0 || m.regions[x].view || m.regions[x].a != m.unitAt(at) {
				return fmt.Errorf("free %d of %v", m.unitAt(at), m.regions)
			}
			m.regions = append(m.regions[:x], m.regions[x+1:]...)
			return nil
		},
		unmap: func(at uintptr) error {
			if m.fail("unmap") {
				return errPhInjected
			}
			x := m.find(m.unitAt(at))
			if x < 0 || !m.regions[x].view || m.regions[x].a != m.unitAt(at) {
				return fmt.Errorf("unmap %d of %v", m.unitAt(at), m.regions)
			}
			m.regions[x].view = false
			return nil
		},
	}
}

// mapOne is MEM_REPLACE_PLACEHOLDER: the view must match a placeholder exactly.
func (m *phModel) mapOne(j int, at uintptr) error {
	if m.fail("map") {
		return errPhInjected
	}
	x := m.find(j)
	if x < 0 || m.regions[x].view || m.regions[x].a != j || m.regions[x].b != j+1 || m.unitAt(at) != j {
		return fmt.Errorf("map %d of %v", j, m.regions)
	}
	m.regions[x].view = true
	return nil
}

// check compares the record with the model; merged says that no two placeholders
// may be adjacent (no merge has failed).
func (m *phModel) check(t *testing.T, p *placeholders, merged bool) {
	t.Helper()
	k := 0
	for i := 0; i < p.n; i++ {
		r := m.regions[m.find(i)]
		require.Equal(t, r.view, p.view.has(i), "unit %d: view; model %v", i, m.regions)
		require.Equal(t, r.a == i, p.start.has(i), "unit %d: region start; model %v", i, m.regions)
		if merged && r.a == i && k > 0 {
			require.False(t, !r.view && !m.regions[k-1].view, "adjacent placeholders at %d: %v", i, m.regions)
		}
		if r.a == i {
			k = m.find(i) + 1
		}
	}
}

// TestPlaceholderRecord drives the placeholder record of a reservation with random
// commits and decommits against a model of Windows' documented placeholder calls,
// with and without failing calls: the record always matches the model, free
// placeholders are merged whenever no merge failed, and release gives it all back.
func TestPlaceholderRecord(t *testing.T) {
	for _, faulty := range []bool{false, true} {
		t.Run(fmt.Sprintf("faulty=%v", faulty), func(t *testing.T) {
			for seed := range uint64(20) {
				rng := rand.New(rand.NewPCG(seed, 15))
				const n = 24
				m := &phModel{base: 1 << 40, unit: 64 << 10, regions: []phRegion{{0, n, false}}}
				coalesceFailed := false
				m.fail = func(call string) bool {
					if !faulty || rng.IntN(8) != 0 {
						return false
					}
					if call == "coalesce" {
						coalesceFailed = true
					}
					return true
				}
				p := newPlaceholders(uintptr(m.base), int(m.unit), n, m.os())
				for range 200 {
					i := rng.IntN(n)
					k := 1 + rng.IntN(min(4, n-i))
					if p.view.next(i, i+k) == i+k { // all placeholders: commit
						err := p.mapUnits(i, k, m.mapOne)
						if err == nil {
							require.Equal(t, i+k, p.view.nextClear(i, i+k), "mapped")
						} else {
							require.ErrorIs(t, err, errPhInjected)
						}
					} else if err := p.unmapUnits(i, k); err != nil {
						require.ErrorIs(t, err, errPhInjected)
					}
					m.check(t, p, !coalesceFailed)
				}
				for tries := 0; ; tries++ {
					err := p.release()
					if err == nil {
						break
					}
					require.ErrorIs(t, err, errPhInjected)
					require.Less(t, tries, 100)
				}
				require.Empty(t, m.regions, "released")
			}
		})
	}
}
