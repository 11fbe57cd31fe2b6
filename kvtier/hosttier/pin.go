package hosttier

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/vmarena/vmarena/backing/cuda"
)

// A CUDA tier commits its whole region at New and pins it from a goroutine, piece by
// piece from the start, off every caller's path: pinning costs ~0.1 s/GB, so a large
// tier would otherwise hold New for seconds. Pieces are at most cuda.MaxPinChunk: one
// 512 GiB registration fails where 64 GiB ones succeed (vLLM issue #51080).

// pinner pins a tier's region in the background.
type pinner struct {
	b      *cuda.Backing
	stop   chan struct{}
	done   chan struct{}
	pinned atomic.Int64 // bytes from the region's start pinned so far

	mu     sync.Mutex
	pieces [][]byte // pinned, in order; read after done
	err    error    // the failure that ended pinning early, if any
}

// startCUDA commits and charges the whole region, creates the tier's stream and starts
// pinning. On error the caller releases the tier.
func (t *Tier) startCUDA(b *cuda.Backing, chunk int) error {
	if err := t.auth.TryAcquire(t.region); err != nil {
		return err
	}
	t.held = t.region
	if err := t.priv.Commit(t.res, 0, int(t.region)); err != nil {
		t.held = 0
		t.auth.Release(t.region)
		return err
	}
	all := run{0, int(t.region / int64(t.gran))}
	t.sp.setCommitted(all, true)
	s, err := b.NewStream()
	if err != nil {
		return err
	}
	t.stream = s
	p := &pinner{b: b, stop: make(chan struct{}), done: make(chan struct{})}
	t.pin = p
	go p.run(bytesAt(t.base, int(t.region)), chunk)
	return nil
}

// run pins mem in pieces of chunk bytes until it is done, stopped, or a piece fails;
// what is not pinned stays pageable and works, slower.
func (p *pinner) run(mem []byte, chunk int) {
	defer close(p.done)
	for off := 0; off < len(mem); off += chunk {
		select {
		case <-p.stop:
			return
		default:
		}
		piece := mem[off:min(off+chunk, len(mem))]
		if err := p.b.PinHost(piece); err != nil {
			p.mu.Lock()
			p.err = fmt.Errorf("hosttier: pinning bytes %d to %d of the region: %w", off, off+len(piece), err)
			p.mu.Unlock()
			return
		}
		p.mu.Lock()
		p.pieces = append(p.pieces, piece)
		p.mu.Unlock()
		p.pinned.Store(int64(off + len(piece)))
	}
}

// wait waits until pinning is over or ctx ends, and returns the pinning's failure.
func (p *pinner) wait(ctx context.Context) error {
	select {
	case <-p.done:
	case <-ctx.Done():
		return ctx.Err()
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// stopAndUnpin stops the goroutine, waits for it, and unpins every piece it pinned.
func (p *pinner) stopAndUnpin() error {
	close(p.stop)
	<-p.done
	p.mu.Lock()
	defer p.mu.Unlock()
	var errs []error
	for _, piece := range p.pieces {
		errs = append(errs, p.b.UnpinHost(piece))
	}
	p.pieces = nil
	return errors.Join(errs...)
}

// Stream returns the tier's own CUDA stream, on which the cache copies device ranges
// into a value's memory inside fill (Stream.CopyOutAsync, then Synchronize) and out
// of it inside use (CopyInAsync, then Synchronize). nil for a tier without CUDA. The
// tier closes it; callers must not.
func (t *Tier) Stream() *cuda.Stream { return t.stream }

// WaitPinned waits until the background pinning has pinned the whole region, stopped
// on a failure (returned: the rest stays pageable) or ctx ends. A tier without CUDA
// returns nil at once.
func (t *Tier) WaitPinned(ctx context.Context) error {
	if t.pin == nil {
		return nil
	}
	return t.pin.wait(ctx)
}

// IsPinned reports whether p lies wholly in the part of the region pinned so far.
func (t *Tier) IsPinned(p []byte) bool {
	if t.pin == nil || len(p) == 0 {
		return false
	}
	a := addrOf(p)
	return a >= t.base && a+uintptr(len(p)) <= t.base+uintptr(t.pin.pinned.Load())
}
