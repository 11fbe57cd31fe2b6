package snapshot_test

import (
	"bytes"
	"context"
	"errors"
	"testing"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/snapshot"
)

// model is what a store must show after each call: its snapshot, the slice it
// prepared, and the bytes it holds.
type model struct {
	snap     []byte
	prepared int
	held     int
}

// FuzzStore drives two stores of one factory under a budget of 6 granules with
// random Prepare, fill, Commit and Reset calls, checking each against a model:
// Len, Cap, Bytes, which Prepares the budget refuses, and the ledger.
func FuzzStore(f *testing.F) {
	f.Add([]byte{0, 40, 2, 40, 0, 200, 1, 3, 0, 90})
	f.Add([]byte{0, 255, 2, 255, 4, 0, 0, 255, 6, 1})
	f.Fuzz(func(t *testing.T, ops []byte) {
		const (
			limit   = 6 * gran
			maxSize = 8 * gran
			unit    = gran / 32 // sizes go in steps of 2 KiB, up to 8 granules
		)
		fac, g := newFactory(t, limit, snapshot.Options{MaxSize: maxSize})
		ctx := context.Background()
		stores := []*snapshot.Store{newStore(t, fac), newStore(t, fac)}
		models := make([]model, len(stores))
		bufs := make([][]byte, len(stores))
		roundUp := func(n int) int { return (n + gran - 1) / gran * gran }
		for i := 0; i+1 < len(ops); i += 2 {
			op, arg := ops[i], int(ops[i+1])
			k := int(op>>4) % len(stores)
			s, m := stores[k], &models[k]
			switch op % 4 {
			case 0: // Prepare; arg 255 asks a negative size
				size := arg * unit
				if arg == 255 {
					size = -1
				}
				buf, err := s.Prepare(ctx, size)
				other := models[1-k].held
				switch {
				case size < 0 || size > maxSize:
					if err == nil {
						t.Fatalf("Prepare(%d) accepted", size)
					}
					continue // nothing changed
				case roundUp(size)-m.held > limit-m.held-other:
					if !errors.Is(err, accounting.ErrBudgetExceeded) {
						t.Fatalf("Prepare(%d) with %d+%d held of %d: %v, want a refusal", size, m.held, other, limit, err)
					}
					*m = model{}
					bufs[k] = nil
				default:
					if err != nil || len(buf) != size {
						t.Fatalf("Prepare(%d): %d bytes, %v", size, len(buf), err)
					}
					*m = model{prepared: size, held: roundUp(size)}
					bufs[k] = buf
				}
			case 1: // fill the prepared slice
				for j := range bufs[k] {
					bufs[k][j] = byte(arg + j*3)
				}
			case 2: // Commit; arg 255 asks one byte past the slice
				n := min(arg*unit, m.prepared)
				if arg == 255 {
					n = m.prepared + 1
				}
				err := s.Commit(ctx, n)
				if n > m.prepared {
					if !errors.Is(err, snapshot.ErrCommitRange) {
						t.Fatalf("Commit(%d) of %d prepared: %v", n, m.prepared, err)
					}
					m.snap = nil
					continue
				}
				if err != nil {
					t.Fatalf("Commit(%d): %v", n, err)
				}
				m.snap = bytes.Clone(bufs[k][:n])
				m.prepared = 0
				bufs[k] = nil
			case 3:
				if err := s.Reset(ctx); err != nil {
					t.Fatal(err)
				}
				*m = model{}
				bufs[k] = nil
			}
			got, err := s.Bytes(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if s.Len() != len(m.snap) || !bytes.Equal(got, m.snap) {
				t.Fatalf("op %d: snapshot of %d bytes, want %d", i/2, s.Len(), len(m.snap))
			}
			if s.Cap() != m.held {
				t.Fatalf("op %d: Cap %d, want %d", i/2, s.Cap(), m.held)
			}
			if owned := fac.Authority().Stats().Owned; owned != int64(models[0].held+models[1].held) {
				t.Fatalf("op %d: ledger owns %d, stores hold %d", i/2, owned, models[0].held+models[1].held)
			}
			if g.Stats(accounting.HostKey).Used > limit {
				t.Fatal("over the budget")
			}
		}
	})
}
