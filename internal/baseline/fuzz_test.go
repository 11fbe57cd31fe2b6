package baseline_test

import (
	"bytes"
	"errors"
	"testing"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/internal/baseline"
)

// modelSeq is the reference model of a sequence: the byte each token of each tensor
// was last written with, and how many leading tokens are read-only.
type modelSeq struct {
	q        baseline.Sequence
	vals     [][]byte // [tensor][token]
	readOnly int
}

type modelPrefix struct {
	p    baseline.Prefix
	vals [][]byte
	// whole tokens mapped read-only into sequences started from it (paged only)
	readOnly int
}

// FuzzStrategies drives random operations against every strategy and checks each
// one against a simple model: what was written reads back, refusals change nothing,
// Physical matches the authority, and everything comes back at the end.
func FuzzStrategies(f *testing.F) {
	f.Add([]byte{0, 2, 5, 3, 1, 4, 0, 6, 2, 9, 7, 1, 3, 3, 8})
	f.Add([]byte{0, 2, 40, 4, 17, 1, 1, 2, 3, 3, 200, 6, 0, 5, 1, 7, 7, 2})
	f.Add([]byte{0, 2, 99, 2, 1, 4, 50, 1, 2, 1, 2, 6, 1, 6, 0, 3, 0, 3, 1})
	f.Fuzz(func(t *testing.T, ops []byte) {
		for _, fc := range factories {
			runModel(t, fc, ops)
		}
	})
}

func runModel(t *testing.T, fc factory, ops []byte) {
	s := testShape
	const bt = 4 // the paged factory's block tokens
	_, a := newAuthority(16 * int64(s.MaxTokens*s.BytesPerToken()))
	st, err := fc.make(s, a)
	if err != nil {
		t.Fatal(err)
	}
	var seqs []*modelSeq
	var prefixes []*modelPrefix
	next := func() int {
		if len(ops) == 0 {
			return 0
		}
		b := ops[0]
		ops = ops[1:]
		return int(b)
	}
	src := make([]byte, s.TokenBytes)
	dst := make([]byte, s.TokenBytes)
	check := func(m *modelSeq) {
		r := m.q.(baseline.Reader)
		for tn, vals := range m.vals {
			for tok, v := range vals {
				if err := r.ReadToken(tn/2, baseline.Kind(tn%2), tok, dst); err != nil {
					t.Fatalf("%s: read token %d: %v", fc.name, tok, err)
				}
				if !bytes.Equal(dst, bytes.Repeat([]byte{v}, s.TokenBytes)) {
					t.Fatalf("%s: tensor %d token %d: got %d, want %d", fc.name, tn, tok, dst[0], v)
				}
			}
		}
	}
	for step := 0; len(ops) > 0; step++ {
		switch next() % 8 {
		case 0, 1: // new sequence, from a prefix when the next byte is odd and there is one
			var q baseline.Sequence
			var vals [][]byte
			ro := 0
			if k := next(); k%2 == 1 && len(prefixes) > 0 {
				mp := prefixes[k/2%len(prefixes)]
				q, err = st.NewSequenceFrom(mp.p)
				vals = make([][]byte, len(mp.vals))
				for i := range vals {
					vals[i] = append([]byte(nil), mp.vals[i]...)
				}
				ro = mp.readOnly
			} else {
				q, err = st.NewSequence()
				vals = make([][]byte, 2*s.Layers)
			}
			if errors.Is(err, accounting.ErrBudgetExceeded) {
				continue
			}
			if err != nil {
				t.Fatalf("%s: new sequence: %v", fc.name, err)
			}
			seqs = append(seqs, &modelSeq{q: q, vals: vals, readOnly: ro})
		case 2: // append
			if len(seqs) == 0 {
				continue
			}
			m := seqs[next()%len(seqs)]
			n := next() % 40
			before := m.q.Len()
			err := m.q.Append(n)
			switch {
			case before+n > s.MaxTokens:
				if !errors.Is(err, baseline.ErrTooLong) {
					t.Fatalf("%s: append past MaxTokens: %v", fc.name, err)
				}
			case errors.Is(err, accounting.ErrBudgetExceeded):
			case err != nil:
				t.Fatalf("%s: append: %v", fc.name, err)
			default:
				for i := range m.vals {
					// New tokens read as whatever was there; the model writes them now.
					m.vals[i] = append(m.vals[i], make([]byte, n)...)
				}
				for tok := before; tok < before+n; tok++ {
					for tn := range m.vals {
						v := byte(step + tok + tn)
						for i := range src {
							src[i] = v
						}
						if err := m.q.WriteToken(tn/2, baseline.Kind(tn%2), tok, src); err != nil {
							t.Fatalf("%s: write new token %d: %v", fc.name, tok, err)
						}
						m.vals[tn][tok] = v
					}
				}
			}
			if m.q.Len() != len(m.vals[0]) {
				t.Fatalf("%s: Len %d, model %d", fc.name, m.q.Len(), len(m.vals[0]))
			}
		case 3: // overwrite a token
			if len(seqs) == 0 {
				continue
			}
			m := seqs[next()%len(seqs)]
			if m.q.Len() == 0 {
				continue
			}
			tok, tn := next()%m.q.Len(), next()%len(m.vals)
			v := byte(step)
			for i := range src {
				src[i] = v
			}
			err := m.q.WriteToken(tn/2, baseline.Kind(tn%2), tok, src)
			if tok < m.readOnly {
				if !errors.Is(err, baseline.ErrReadOnly) {
					t.Fatalf("%s: write into shared token %d: %v", fc.name, tok, err)
				}
				continue
			}
			if err != nil {
				t.Fatalf("%s: write token %d: %v", fc.name, tok, err)
			}
			m.vals[tn][tok] = v
		case 4: // freeze
			if len(seqs) == 0 {
				continue
			}
			m := seqs[next()%len(seqs)]
			n := next() % (m.q.Len() + 1)
			p, err := m.q.Freeze(n)
			if errors.Is(err, accounting.ErrBudgetExceeded) {
				continue
			}
			if err != nil {
				t.Fatalf("%s: freeze %d: %v", fc.name, n, err)
			}
			mp := &modelPrefix{p: p, vals: make([][]byte, len(m.vals))}
			for i := range m.vals {
				mp.vals[i] = append([]byte(nil), m.vals[i][:n]...)
			}
			if fc.sharesPrefix {
				mp.readOnly = n / bt * bt
				m.readOnly = max(m.readOnly, mp.readOnly)
			}
			prefixes = append(prefixes, mp)
		case 5: // release a prefix
			if len(prefixes) == 0 {
				continue
			}
			i := next() % len(prefixes)
			prefixes[i].p.Release()
			prefixes = append(prefixes[:i], prefixes[i+1:]...)
		case 6: // close a sequence
			if len(seqs) == 0 {
				continue
			}
			i := next() % len(seqs)
			check(seqs[i])
			if err := seqs[i].q.Close(); err != nil {
				t.Fatalf("%s: close: %v", fc.name, err)
			}
			seqs = append(seqs[:i], seqs[i+1:]...)
		case 7: // stats agree with the model and the authority
			stats := st.Stats()
			var tokens int64
			for _, m := range seqs {
				tokens += int64(len(m.vals[0]))
			}
			if stats.Sequences != len(seqs) || stats.Prefixes != len(prefixes) || stats.Tokens != tokens {
				t.Fatalf("%s: stats %+v, model %d sequences, %d prefixes, %d tokens", fc.name, stats, len(seqs), len(prefixes), tokens)
			}
			if owned := a.Stats().Owned; stats.Physical != owned {
				t.Fatalf("%s: physical %d, authority owns %d", fc.name, stats.Physical, owned)
			}
		}
	}
	for _, m := range seqs {
		check(m)
		if err := m.q.Close(); err != nil {
			t.Fatal(err)
		}
	}
	for _, mp := range prefixes {
		mp.p.Release()
	}
	if st := st.Stats(); st.Saved != 0 || st.Tokens != 0 {
		t.Fatalf("%s: after closing everything: %+v", fc.name, st)
	}
	if err := st.Close(); err != nil {
		t.Fatalf("%s: close: %v", fc.name, err)
	}
	if owned := a.Stats().Owned; owned != 0 {
		t.Fatalf("%s: %d bytes still owned after Close", fc.name, owned)
	}
}
