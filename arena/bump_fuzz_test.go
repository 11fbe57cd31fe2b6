package arena_test

import (
	"math/rand/v2"
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
)

// arenaModel is what an Arena must do, written as plainly as possible: allocations
// are kept in a list, marks in another, and the bump pointer is a number.
type arenaModel struct {
	base     uintptr
	capacity int
	gran     int
	top      int
	high     int
	live     []modelAlloc // not yet freed, oldest first
	marks    []modelMark  // every mark ever taken
	lastOK   bool         // whether the latest allocation may still be released
	seq      int
}

type modelAlloc struct {
	off, size int
	seq       int
	fill      byte
	al        arena.Allocation
}

type modelMark struct {
	m     arena.Mark
	off   int
	seq   int
	valid bool
}

func (m *arenaModel) next() int { m.seq++; return m.seq }

// free drops the allocations made after seq, and invalidates the marks taken after it.
func (m *arenaModel) free(seq int) {
	n := 0
	for _, x := range m.live {
		if x.seq < seq {
			m.live[n] = x
			n++
		}
	}
	m.live = m.live[:n]
	for i := range m.marks {
		if m.marks[i].seq > seq {
			m.marks[i].valid = false
		}
	}
	m.lastOK = false
}

func alignUp(x, a int) int { return (x + a - 1) &^ (a - 1) }

// FuzzArena drives random Alloc / MakeTensor / Mark / Rewind / Release / Reset / Trim
// sequences against the model. After every step: the bump pointer, high-water mark and
// committed bytes are what the model says; every live allocation is aligned, inside
// the buffer's length, and still holds the bytes written into it, so no two overlap;
// and after a Reset the next allocations reuse the same memory without committing more.
func FuzzArena(f *testing.F) {
	f.Add([]byte{0, 0, 1, 0, 3, 0, 0, 2, 0, 2, 3, 1, 0, 5, 5, 5, 0, 2, 1, 1, 4, 1, 2, 0, 0, 9, 3, 0, 6, 3, 4, 0})
	f.Add([]byte{1, 0, 0xff, 0xff, 13, 0, 0x40, 0, 12, 5, 0, 0x08, 0x00, 0, 5, 1, 7, 7, 2, 4, 3})
	f.Add([]byte{0, 2, 2, 3, 0, 0, 0, 10, 3, 1, 3, 0, 4, 0, 4, 0, 5, 0, 1, 1, 1, 3, 0, 0})
	f.Add([]byte{0, 0, 0, 9, 3, 3, 0, 1, 0, 6, 4, 1, 3, 6, 4, 0, 0, 0, 1, 3}) // marks that a Reset invalidated
	rng := rand.New(rand.NewPCG(7, 8))
	for range 6 {
		seed := make([]byte, 300)
		for i := range seed {
			seed[i] = byte(rng.Uint32())
		}
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 {
			return
		}
		page := os.Getpagesize()
		opts := arena.ArenaOptions{DecommitOnReset: data[0]&1 != 0}
		a, g := newHostArena(t, 64*page, opts)
		m := &arenaModel{base: a.Buffer().Base(), capacity: a.Capacity(), gran: a.Buffer().Granularity()}
		require.Equal(t, 64*page, m.capacity)
		data = data[1:]
		byteAt := func() int {
			if len(data) == 0 {
				return 0
			}
			b := data[0]
			data = data[1:]
			return int(b)
		}
		for len(data) > 0 {
			switch op := byteAt() % 8; op {
			case 0, 1, 2: // Alloc, Allocate or MakeTensor
				size := byteAt()<<8 | byteAt()
				align := 1 << (byteAt() % 14)
				committed := a.Committed()
				pad := int(-(m.base + uintptr(m.top)) & uintptr(align-1))
				wantOff, wantEnd := m.top+pad, m.top+pad+size
				var (
					off int
					al  arena.Allocation
					err error
				)
				switch op {
				case 0:
					off, err = a.Alloc(size, align)
				case 1:
					al, err = a.Allocate(size, align)
					off = int(al.Ptr - m.base)
				case 2: // a float32 tensor of rows of 4, about size bytes, at DefaultAlign
					rows := size / 16
					size, align = rows*16, arena.DefaultAlign
					pad = int(-(m.base + uintptr(m.top)) & uintptr(align-1))
					wantOff, wantEnd = m.top+pad, m.top+pad+size
					var v arena.Tensor[float32]
					v, err = arena.MakeTensor[float32](a, rows, 4)
					off = v.Offset()
					if err == nil {
						s, serr := v.Slice()
						require.NoError(t, serr)
						require.Len(t, s, rows*4)
					}
				}
				if wantEnd > m.capacity {
					require.ErrorIs(t, err, arena.ErrArenaFull)
					require.Equal(t, committed, a.Committed(), "a failed Alloc commits nothing")
					break
				}
				require.NoError(t, err)
				require.Equal(t, wantOff, off, "the next aligned bytes")
				require.Zero(t, (m.base+uintptr(off))%uintptr(align), "aligned")
				if wantEnd <= committed {
					require.Equal(t, committed, a.Committed(), "committed memory is reused, not committed again")
				} else {
					require.Equal(t, alignUp(wantEnd, m.gran), a.Committed(), "grows to the next granule")
				}
				x := modelAlloc{off: off, size: size, seq: m.next(), fill: byte(m.seq%251 + 1), al: al}
				clear(a.Buffer().Bytes()[off : off+size]) // stale bytes from an earlier step
				for i := range a.Buffer().Bytes()[off : off+size] {
					a.Buffer().Bytes()[off+i] = x.fill
				}
				m.live = append(m.live, x)
				m.top = wantEnd
				m.high = max(m.high, m.top)
				m.lastOK = true
			case 3: // Mark
				mk := a.Mark()
				m.marks = append(m.marks, modelMark{m: mk, off: m.top, seq: m.next(), valid: true})
				m.lastOK = false
			case 4: // Rewind to some mark ever taken
				if len(m.marks) == 0 {
					break
				}
				mk := m.marks[byteAt()%len(m.marks)]
				if !mk.valid {
					require.PanicsWithValue(t, arena.PanicBadMark, func() { a.Rewind(mk.m) })
					break
				}
				a.Rewind(mk.m)
				m.free(mk.seq)
				m.top = mk.off
			case 5: // Release some allocation ever made through Allocate, maybe twice
				if len(m.live) == 0 {
					break
				}
				x := m.live[byteAt()%len(m.live)]
				if x.al == (arena.Allocation{}) {
					break // made by Alloc or MakeTensor
				}
				out := a.Release(x.al)
				require.Equal(t, accounting.Released(0), out)
				if last := m.live[len(m.live)-1]; m.lastOK && last.seq == x.seq {
					m.live = m.live[:len(m.live)-1]
					m.top = x.off
					m.lastOK = false
				}
			case 6: // Reset
				committed := a.Committed()
				require.NoError(t, a.Reset())
				want := committed
				if opts.DecommitOnReset {
					want = min(committed, alignUp(m.high, m.gran))
				}
				require.Equal(t, want, a.Committed(), "Reset keeps granules up to the policy's mark")
				m.free(0)
				m.marks = m.marks[:0]
				m.top, m.high = 0, 0
			case 7: // Trim
				committed := a.Committed()
				keep := byteAt() * page / 4
				require.NoError(t, a.Trim(keep))
				require.Equal(t, min(committed, alignUp(max(keep, m.top), m.gran)), a.Committed(), "Trim gives back what is past max(keep, Used)")
			}

			require.Equal(t, m.top, a.Used())
			require.Equal(t, m.high, a.HighWater())
			require.Zero(t, a.Committed()%m.gran)
			require.GreaterOrEqual(t, a.Committed(), m.top)
			require.Equal(t, int64(a.Committed()), g.Stats(accounting.HostKey).Used, "the ledger matches")
			mem := a.Buffer().Bytes()
			for _, x := range m.live {
				require.LessOrEqual(t, x.off+x.size, len(mem))
				for i, b := range mem[x.off : x.off+x.size] {
					if b != x.fill {
						assert.Failf(t, "live allocation overwritten", "allocation %d [%d, +%d) byte %d is %d, want %d", x.seq, x.off, x.size, i, b, x.fill)
						return
					}
				}
			}
		}
	})
}
