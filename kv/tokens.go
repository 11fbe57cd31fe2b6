package kv

import (
	"fmt"

	"github.com/vmarena/vmarena/arena"
)

// Reaching tokens: a bulk copy in and out (ReadTokens, WriteTokens) on any backing and
// layout, of which ReadToken and WriteToken are the one-token forms, and, on the
// host, the contiguous runs a layer's tensor is made of (Run). View gives the whole
// tensor; Base and the strides are for kernels.

// ReadTokens copies tokens [from, to) of layer's K or V tensor into dst, token after
// token ((to - from) × TokenBytes bytes), on any backing and layout: on the host by
// copy, on a device through the backing's copies (backing.Copier), one call per
// contiguous run (a run of a block in the Blocked layout, all of them in PerLayer),
// so that host code and tests need not call the driver. It
// fails with ErrRange for a layer, kind or token range outside the sequence or a dst
// of another length.
func (s *Sequence) ReadTokens(layer int, kind Kind, from, to int, dst []byte) error {
	if err := s.usable(); err != nil {
		return err
	}
	gi, buf, off, err := s.span(layer, kind, from, to, len(dst))
	if err != nil {
		return err
	}
	return s.c.groups[gi].copyRuns(buf, off, from, to, dst, false)
}

// WriteTokens copies src, token after token ((to - from) × TokenBytes bytes), into
// tokens [from, to) of layer's K or V tensor, on any backing and layout, one copy per
// contiguous run as ReadTokens does. Tokens below Writable lie (wholly or in part) in
// memory shared with a prefix or a fork: a range that starts below it is refused with
// ErrReadOnly and nothing is written. It fails with ErrRange as ReadTokens does. A
// server whose kernels do not write the cache in place stores a prefill chunk's K and
// V with it.
func (s *Sequence) WriteTokens(layer int, kind Kind, from, to int, src []byte) error {
	if err := s.usable(); err != nil {
		return err
	}
	gi, buf, off, err := s.span(layer, kind, from, to, len(src))
	if err != nil {
		return err
	}
	g := &s.c.groups[gi]
	if w := g.writableFrom(*s.frozenOf(gi)); from < w && from < to {
		return fmt.Errorf("%w: token %d of layer %d of sequence %d (tokens below %d are shared)", ErrReadOnly, from, layer, s.id, w)
	}
	if h := s.c.hooks(); h != nil && from < to {
		h.beforeWrite(s, from)
	}
	return g.copyRuns(buf, off, from, to, src, true)
}

// copyRuns copies tokens [from, to) of the tensor whose token 0 lies at off in buf
// out into p (or, with write set, in from p), one copy per contiguous run.
func (sh *shape) copyRuns(buf buffer, off, from, to int, p []byte, write bool) error {
	tb := sh.tb
	for t := from; t < to; {
		k := min(sh.run(t), to-t)
		at, part := sh.offset(off, t), p[(t-from)*tb:(t-from+k)*tb]
		var err error
		if write {
			err = buf.writeAt(at, part)
		} else {
			err = buf.readAt(at, part)
		}
		if err != nil {
			return err
		}
		t += k
	}
	return nil
}

// span checks tokens [from, to) of layer's K or V tensor against s and a buffer of n
// bytes, and returns the tensor's group, the range that holds it and the offset of
// its token 0.
func (s *Sequence) span(layer int, kind Kind, from, to, n int) (int, buffer, int, error) {
	gi, i, off, ok := s.c.where(layer, kind)
	if !ok {
		return 0, nil, 0, s.c.noTensor(layer, kind)
	}
	tb := s.c.groups[gi].tb
	switch held := s.heldOf(gi); {
	case from < 0 || to < from || to > s.n:
		return 0, nil, 0, fmt.Errorf("%w: tokens [%d, %d) of %d", ErrRange, from, to, s.n)
	case from < held && from < to:
		return 0, nil, 0, fmt.Errorf("%w: token %d of layer %d of sequence %d (its group holds the tokens from %d on)", ErrDropped, from, layer, s.id, held)
	case n != (to-from)*tb:
		return 0, nil, 0, fmt.Errorf("%w: %d bytes for %d tokens of %d bytes", ErrRange, n, to-from, tb)
	}
	return gi, s.bufs[i], off, nil
}

// Run returns the contiguous run of layer's K or V tensor that starts at token t, as
// k × KVHeads × HeadDim elements of T for the k >= 1 tokens it holds: up to the end of
// t's run of its block in the Blocked layout (Strides.RunTokens), up to Len in
// PerLayer: for CPU attention, which reads a tensor in place, in any layout. A reader
// walks a tensor run by run (t += len(run) / (KVHeads × HeadDim)) rather than element
// by element through a View. It needs host memory (ErrLayout on a device: use ReadTokens) and the layer group's
// element type (ErrElemType); t must be below Len (ErrRange). The slice is valid as a View is:
// until s shrinks below it or closes; its tokens below Writable MUST NOT be written.
// It allocates nothing.
func Run[T arena.Elem](s *Sequence, layer int, kind Kind, t int) ([]T, error) {
	if err := s.usable(); err != nil {
		return nil, err
	}
	gi, _, _, ok := s.c.where(layer, kind)
	if !ok {
		return nil, s.c.noTensor(layer, kind)
	}
	g := &s.c.groups[gi]
	if dt := arena.DTypeOf[T](); dt != g.spec.DType {
		return nil, fmt.Errorf("%w: %v run of a %v cache", ErrElemType, dt, g.spec.DType)
	}
	_, buf, off, err := s.span(layer, kind, t, t+1, g.tb)
	if err != nil {
		return nil, err
	}
	if !buf.HostAccessible() {
		return nil, fmt.Errorf("%w: device memory can not be touched by the CPU", ErrLayout)
	}
	k := min(g.run(t), s.n-t)
	return elems[T](buf.Bytes()[g.offset(off, t):][:k*g.tb]), nil
}

// WriteToken copies src (TokenBytes long) into token t of layer's K or V tensor, on
// any backing and layout: WriteTokens(layer, kind, t, t+1, src), with the same errors.
// Writing a token below Writable, which lies (wholly or in part) in memory shared with
// a prefix or a fork, is refused with ErrReadOnly. It is the call a model's forward
// pass makes once per layer and tensor for every token, so it takes a short path of
// its own: one division to find the token, none to check Writable.
func (s *Sequence) WriteToken(layer int, kind Kind, t int, src []byte) error {
	s.live()
	c := s.c
	gi, i, off, ok := c.where(layer, kind)
	if !ok || s.err != nil || uint(t) >= uint(s.n) || len(src) != c.groups[gi].tb || t < s.heldOf(gi) {
		return s.WriteTokens(layer, kind, t, t+1, src) // the error, worded once
	}
	at, shared := c.groups[gi].tokenAt(off, t, *s.frozenOf(gi))
	if shared {
		return s.WriteTokens(layer, kind, t, t+1, src)
	}
	// NB: the one write hook is a prefix cache's, for its lazy entries' tokens
	// (pcHooks.beforeWrite): a write past them, a decode step's, makes no call.
	if l := s.pcl; l != nil && t < l.lazyN {
		if h := c.hooks(); h != nil {
			h.beforeWrite(s, t)
		}
	}
	return s.bufs[i].writeAt(at, src)
}

// ReadToken copies token t of layer's K or V tensor into dst (TokenBytes long):
// ReadTokens(layer, kind, t, t+1, dst), with the same errors, on the short path
// WriteToken takes: for host code that reads one token of a step's layer.
func (s *Sequence) ReadToken(layer int, kind Kind, t int, dst []byte) error {
	s.live()
	c := s.c
	gi, i, off, ok := c.where(layer, kind)
	if !ok || s.err != nil || uint(t) >= uint(s.n) || len(dst) != c.groups[gi].tb || t < s.heldOf(gi) {
		return s.ReadTokens(layer, kind, t, t+1, dst)
	}
	at, _ := c.groups[gi].tokenAt(off, t, 0)
	return s.bufs[i].readAt(at, dst)
}

// stateAt returns the range and offset of layer's recurrent state in s, checking a
// buffer of n bytes against it.
func (s *Sequence) stateAt(layer, n int) (buffer, int, error) {
	if uint(layer) >= uint(len(s.c.layers)) {
		return nil, 0, fmt.Errorf("%w: layer %d of %d layers", ErrRange, layer, len(s.c.layers))
	}
	r := s.c.layers[layer]
	g := &s.c.groups[r.group]
	switch {
	case g.state == 0:
		return nil, 0, fmt.Errorf("%w: layer %d is %v, which has tokens and no state", ErrRange, layer, g.spec.Kind)
	case n != g.spec.StateBytes:
		return nil, 0, fmt.Errorf("%w: %d bytes for a state of %d", ErrRange, n, g.spec.StateBytes)
	case s.n == 0:
		return nil, 0, fmt.Errorf("%w: sequence %d has no tokens, so no state yet", ErrRange, s.id)
	}
	return s.bufs[g.first], r.local * g.spec.StateBytes, nil
}

// ReadState copies recurrent layer's state (StateBytes) into dst, on any backing:
// for host code that runs a recurrent layer's step (read the state, step, WriteState). The
// state exists from the sequence's first token on (it commits then, zeroed where the
// backing's fresh memory is), so an empty sequence has none: ErrRange, as for a layer
// that is not recurrent or a dst of another length.
func (s *Sequence) ReadState(layer int, dst []byte) error {
	if err := s.usable(); err != nil {
		return err
	}
	buf, off, err := s.stateAt(layer, len(dst))
	if err != nil {
		return err
	}
	return buf.readAt(off, dst)
}

// WriteState copies src (StateBytes) into recurrent layer's state, with ReadState's
// errors: the state a recurrent layer's step computed. A state is the sequence's own: forks copy it, so writing it never reaches
// another sequence.
func (s *Sequence) WriteState(layer int, src []byte) error {
	if err := s.usable(); err != nil {
		return err
	}
	buf, off, err := s.stateAt(layer, len(src))
	if err != nil {
		return err
	}
	return buf.writeAt(off, src)
}
