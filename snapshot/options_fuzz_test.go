package snapshot_test

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/snapshot"
)

// optionsLimit is the budget FuzzOptions' factories run under: valid options whose
// granule or snapshot needs more must be refused by the governor, never committed.
const optionsLimit = 4 << 20

// FuzzOptions feeds every field of Options (and of its Pool) to NewFactory and a
// size to Prepare: NewFactory either refuses with an error matching ErrOptions (or,
// for a backing this system lacks, errors.ErrUnsupported) or makes a factory whose
// store prepares, fills, commits, reads back, resets and closes, refused there only
// by the budget, the address space, its own size errors or, while it waits for the
// budget, the test's short deadline. Nothing may panic.
func FuzzOptions(f *testing.F) {
	add := func(o snapshot.Options, size int) {
		p := o.Pool
		f.Add(byte(o.Backing), o.Granularity, o.MaxSize, o.NoPopulate, o.NoHugePages, int64(o.WaitFor), o.Name,
			p.Granularity, p.Low, p.High, p.Populate, p.Name, int64(p.Decay), p.NoHugePages, p.NoPrivateGranules, p.AlwaysHugePages, p.Authority != nil,
			size)
	}
	add(snapshot.Options{Granularity: gran, MaxSize: 1 << 20}, 100<<10)
	add(snapshot.Options{Backing: snapshot.Shared, Granularity: gran, MaxSize: 1 << 20, Pool: host.SharedOptions{Low: 1, High: 2}}, 3<<10)
	add(snapshot.Options{Backing: snapshot.Shared, Granularity: gran, NoHugePages: true, WaitFor: time.Second, Pool: host.SharedOptions{Decay: -1}}, optionsLimit+1)
	add(snapshot.Options{Granularity: 1 << 40, MaxSize: 1 << 41}, 1)
	add(snapshot.Options{Granularity: gran, MaxSize: 1 << 62, NoPopulate: true, Name: "snap"}, 1)
	add(snapshot.Options{Granularity: 3 << 10}, 1)
	f.Fuzz(func(t *testing.T, kind byte, granularity, maxSize int, noPopulate, noHuge bool, waitFor int64, name string,
		poolGran, poolLow, poolHigh int, poolPopulate bool, poolName string, poolDecay int64, poolNoHuge, poolNoPrivate, poolAlwaysHuge, poolAuth bool,
		size int) {
		g := accounting.NewGovernor()
		if err := g.SetLimit(accounting.HostKey, optionsLimit); err != nil {
			t.Fatal(err)
		}
		opts := snapshot.Options{
			Backing: snapshot.Kind(kind), Granularity: granularity, MaxSize: maxSize, NoPopulate: noPopulate, NoHugePages: noHuge,
			WaitFor: time.Duration(waitFor), Name: name,
			Pool: host.SharedOptions{Granularity: poolGran, Low: poolLow, High: poolHigh, Populate: poolPopulate, Name: poolName,
				Decay: time.Duration(poolDecay), NoHugePages: poolNoHuge, NoPrivateGranules: poolNoPrivate, AlwaysHugePages: poolAlwaysHuge},
		}
		if poolAuth {
			opts.Pool.Authority = g.Authority("foreign", accounting.HostKey)
		}
		fac, err := snapshot.NewFactory(g, opts)
		if err != nil {
			if !errors.Is(err, snapshot.ErrOptions) && !errors.Is(err, errors.ErrUnsupported) {
				t.Fatalf("NewFactory(%+v): %v", opts, err)
			}
			return
		}
		defer func() {
			if err := fac.Close(); err != nil {
				t.Fatalf("Factory.Close: %v", err)
			}
		}()
		ctx := context.Background()
		s, err := fac.New(ctx)
		if err != nil {
			t.Fatalf("New: %v", err)
		}
		defer func() {
			if err := s.Close(); err != nil {
				t.Fatalf("Store.Close: %v", err)
			}
		}()
		// NB: a wait for the budget (WaitFor) ends at this deadline, so that an
		// input costs at most that long; without one, nothing waits.
		wctx := ctx
		if opts.WaitFor > 0 {
			var cancel context.CancelFunc
			wctx, cancel = context.WithTimeout(ctx, 20*time.Millisecond)
			defer cancel()
		}
		buf, err := s.Prepare(wctx, size)
		switch {
		case err == nil:
		case errors.Is(err, snapshot.ErrInvalidSize), errors.Is(err, snapshot.ErrTooLarge),
			errors.Is(err, accounting.ErrBudgetExceeded), errors.Is(err, backing.ErrOutOfMemory):
			return
		case errors.Is(err, context.DeadlineExceeded) && opts.WaitFor > 0:
			return
		default:
			t.Fatalf("Prepare(%d) of %+v: %v", size, opts, err)
		}
		if len(buf) != size {
			t.Fatalf("Prepare(%d) returned %d bytes", size, len(buf))
		}
		for i := range buf {
			buf[i] = byte(i*7 + 1)
		}
		want := bytes.Clone(buf)
		if err := s.Commit(ctx, size); err != nil {
			t.Fatalf("Commit(%d): %v", size, err)
		}
		got, err := s.Bytes(ctx)
		if err != nil || !bytes.Equal(got, want) && size > 0 {
			t.Fatalf("Bytes after Commit(%d): %v, other bytes", size, err)
		}
		if err := s.Reset(ctx); err != nil {
			t.Fatalf("Reset: %v", err)
		}
		if s.Len() != 0 || s.Cap() != 0 {
			t.Fatalf("after Reset: Len %d, Cap %d", s.Len(), s.Cap())
		}
	})
}
