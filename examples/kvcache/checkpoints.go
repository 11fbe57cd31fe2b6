package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"slices"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/kv"
)

// The prefix-cache replay on a model with recurrent groups (qwen3-next-80b-a3b): the
// prefill records the states at each block boundary of the trace (kv.Sequence's
// Checkpoint), where a later prompt's hit may start, and the replay is run again on
// the model's full-attention layers alone, at the same budget, for the ratio of the
// hit rates.

// checkpointer is a prefix strategy that records recurrent-state checkpoints.
type checkpointer interface {
	// checkpointEvery returns the tokens between checkpoints; 0: none.
	checkpointEvery() int
	// checkpoint records s's states after its n tokens, its length.
	checkpoint(s pseq, n int) error
	// checkpoints returns the bytes of checkpoints the prefix cache's entries hold.
	checkpoints() int64
	// checkpointSize returns the bytes of one checkpoint.
	checkpointSize() int64
}

func (k *kvPrefix) checkpointEvery() int { return k.every }

func (k *kvPrefix) checkpoint(s pseq, n int) error { return s.(*kv.Sequence).Checkpoint(n) }

func (k *kvPrefix) checkpoints() int64 {
	if k.pc == nil {
		return 0
	}
	return k.pc.Stats().CheckpointBytes
}

// hasRecurrent reports whether m has a recurrent group.
func hasRecurrent(m *kv.Model) bool {
	return m != nil && slices.ContainsFunc(m.Groups, func(g kv.Group) bool { return g.Kind == kv.Recurrent })
}

// prefillPrompt appends q's prompt tokens from m on to s, all at once (a refusal
// changes nothing, and the request waits), and writes them (writePrompt). On a
// strategy that records checkpoints it writes them chunk by chunk, each chunk ending on
// a multiple of its interval, where it records one and inserts the tokens so far,
// which hands the checkpoint to the prefix cache's entry (kv.PrefixCache.Insert), so
// that eviction may take it while the prefill goes on: with w.Verify the states are
// written first, as a function of the prompt up to there (stateBytes), as a model's
// are. A checkpoint or insert the budget refuses is left out (the prompt is served
// without it, as an Insert the budget refuses is not cached); it returns how many
// checkpoints it recorded.
func prefillPrompt(st pstrategy, s pseq, q *preq, m int, fill, scratch []byte, w PrefixWorkload) (int, error) {
	every := 0
	cp, _ := st.(checkpointer)
	if cp != nil {
		every = cp.checkpointEvery()
	}
	n := len(q.tokens)
	if err := s.Append(n - m); err != nil {
		return 0, err
	}
	if every == 0 {
		return 0, writePrompt(st, s, q, m, n, fill, scratch, w)
	}
	made := 0
	for from := m; from < n; {
		to := min(n, (from/every+1)*every)
		if err := writePrompt(st, s, q, from, to, fill, scratch, w); err != nil {
			return made, err
		}
		if to%every == 0 {
			if w.Verify {
				if err := writeStatesAt(s, q, to, w); err != nil {
					return made, err
				}
			}
			err := cp.checkpoint(s, to)
			if err == nil {
				made++
				err = st.insert(q.adapter, s, q.tokens[:to])
			}
			if err != nil && !errors.Is(err, accounting.ErrBudgetExceeded) {
				return made, err
			}
		}
		from = to
	}
	return made, nil
}

// stateBytes fills dst with layer's state after the tokens whose last prefix hash is
// h: a function of every one of them.
func stateBytes(dst []byte, h uint64, layer int) { tokenBytes(dst, h, layer, 2) }

// writeStatesAt writes each recurrent layer's state after q's first n tokens into s.
func writeStatesAt(s pseq, q *preq, n int, w PrefixWorkload) error {
	ks := s.(*kv.Sequence)
	if q.prefix == nil {
		q.prefix = q.adapter.prefixHashes(q.tokens)
	}
	for l, p := range w.Plan {
		if p.stateBytes == 0 {
			continue
		}
		buf := make([]byte, p.stateBytes)
		stateBytes(buf, q.prefix[n-1], l)
		if err := ks.WriteState(l, buf); err != nil {
			return fmt.Errorf("layer %d's state: %w", l, err)
		}
	}
	return nil
}

// verifyStates reads back each recurrent layer's state of s, which a lookup started
// on q's first m tokens, and compares it with the one writeStatesAt wrote after them.
func verifyStates(s pseq, q *preq, m int, w PrefixWorkload) error {
	ks, ok := s.(*kv.Sequence)
	if !ok || m == 0 {
		return nil
	}
	if q.prefix == nil {
		q.prefix = q.adapter.prefixHashes(q.tokens)
	}
	for l, p := range w.Plan {
		if p.stateBytes == 0 {
			continue
		}
		got, want := make([]byte, p.stateBytes), make([]byte, p.stateBytes)
		if err := ks.ReadState(l, got); err != nil {
			return fmt.Errorf("request %d: layer %d's state: %w", q.ID, l, err)
		}
		stateBytes(want, q.prefix[m-1], l)
		if !bytes.Equal(got, want) {
			return fmt.Errorf("request %d: layer %d's state after a %d-token hit: %w", q.ID, l, m, errWrongBytes)
		}
	}
	return nil
}

// fullLayersAlone returns the setup and workload of the replay on m's groups that keep
// tokens alone (its recurrent layers dropped, the others numbered in order), at s's
// budget: a full-attention model of the same per-token bytes, whose prefix cache needs
// no checkpoint. Its one full group is a uniform model, as lookupModel makes.
func fullLayersAlone(s setup, w PrefixWorkload, m kv.Model) (setup, PrefixWorkload) {
	kept := kv.Model{Name: m.Name + " (full-attention layers alone)"}
	var layers []int
	for _, g := range m.Groups {
		if g.Kind != kv.Recurrent {
			layers = append(layers, g.Layers...)
		}
	}
	slices.Sort(layers)
	at := make(map[int]int, len(layers))
	for i, l := range layers {
		at[l] = i
	}
	for _, g := range m.Groups {
		if g.Kind == kv.Recurrent {
			continue
		}
		g.Layers = slices.Clone(g.Layers)
		for i, l := range g.Layers {
			g.Layers[i] = at[l]
		}
		kept.Groups = append(kept.Groups, g)
	}
	kept.Layers = len(layers)
	s.groups = nil
	if g := kept.Groups[0]; len(kept.Groups) == 1 && g.Kind == kv.FullAttention {
		s.model = kv.Uniform(kept.Name, kept.Layers, g.KVHeads, g.HeadDim, g.DType)
		s.model.Groups[0].Scales = g.Scales
	} else {
		s.model, s.groups = kept, &kept
	}
	w.Layers, w.TokenBytes, w.Plan, w.Groups = kept.Layers, s.model.Groups[0].TokenBytes(), planLayers(s.groups), s.groups
	return s, w
}

// nameFullLayers labels the replay of the full-attention layers alone.
const nameFullLayers = namePrefixOn + " (full layers alone)"

// printCheckpointLine writes what the checkpoints cost and found: the hit rate next
// to the full-attention layers' alone at the same budget, and their ratio.
func printCheckpointLine(w io.Writer, rs []PrefixResult, every int) {
	var ck, full *PrefixResult
	for i := range rs {
		switch rs[i].Strategy {
		case namePrefixOn:
			ck = &rs[i]
		case nameFullLayers:
			full = &rs[i]
		}
	}
	if ck == nil || ck.Queries == 0 {
		return
	}
	hit := float64(ck.Hits) / float64(ck.Queries)
	fmt.Fprintf(w, "\nCheckpoints: %s recorded %d of the recurrent states, one at each %d-token block boundary of a prefill (the trace's hash blocks), %s each; the entries held %s of them at the peak, %s at the end.\n",
		ck.Strategy, ck.Checkpoints, every, formatBytes(ck.CheckpointSize), formatBytes(ck.CheckpointPeak), formatBytes(ck.CheckpointBytes))
	if full == nil || full.Queries == 0 || full.Hits == 0 {
		return
	}
	fh := float64(full.Hits) / float64(full.Queries)
	fmt.Fprintf(w, "Hit rate %.2f%% against %.2f%% for the full-attention layers alone at the same budget: %.3f of it (ideal %.2f%%).\n",
		100*hit, 100*fh, hit/fh, 100*float64(ck.IdealHits)/float64(ck.Queries))
}

// checkpointSize returns the bytes of one checkpoint: each recurrent group's states of
// a sequence in whole granules.
func (k *kvPrefix) checkpointSize() int64 {
	var n int64
	gran := int64(k.cs.c.Granularity())
	for _, g := range k.cs.c.Config().Model.Groups {
		if g.Kind == kv.Recurrent {
			n += (int64(len(g.Layers)*g.StateBytes) + gran - 1) / gran * gran
		}
	}
	return n
}
