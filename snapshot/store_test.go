package snapshot_test

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/internal/testutil"
	"github.com/vmarena/vmarena/snapshot"
)

const gran = 64 << 10

// newFactory returns a factory of 64 KiB granules on a governor whose host budget
// is limit (accounting.Unlimited for none), closed when the test ends.
func newFactory(t *testing.T, limit int64, opts snapshot.Options) (*snapshot.Factory, *accounting.Governor) {
	t.Helper()
	g := accounting.NewGovernor()
	if limit != accounting.Unlimited {
		require.NoError(t, g.SetLimit(accounting.HostKey, limit))
	}
	if opts.Granularity == 0 {
		opts.Granularity = gran
	}
	if opts.MaxSize == 0 {
		opts.MaxSize = 1 << 30
	}
	f, err := snapshot.NewFactory(g, opts)
	if errors.Is(err, errors.ErrUnsupported) {
		t.Skipf("backing %v: %v", opts.Backing, err)
	}
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, f.Close()) })
	return f, g
}

// newStore returns a store of f, closed when the test ends unless the test did.
func newStore(t *testing.T, f *snapshot.Factory) *snapshot.Store {
	t.Helper()
	s, err := f.New(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() {
		if err := s.Close(); !errors.Is(err, snapshot.ErrClosed) {
			assert.NoError(t, err)
		}
	})
	return s
}

// snap prepares, fills and commits n bytes with seed's pattern.
func snap(t *testing.T, s *snapshot.Store, n int, seed byte) {
	t.Helper()
	buf, err := s.Prepare(context.Background(), n)
	require.NoError(t, err)
	require.Len(t, buf, n)
	testutil.Fill(buf, seed)
	require.NoError(t, s.Commit(context.Background(), n))
}

func bytesOf(t *testing.T, s *snapshot.Store) []byte {
	t.Helper()
	b, err := s.Bytes(context.Background())
	require.NoError(t, err)
	return b
}

var backings = []snapshot.Kind{snapshot.Private, snapshot.Shared}

// TestStableBaseAcrossGrowth grows one snapshot a granule and a half at a time: the
// base never moves, the bytes of the last snapshot are still there when the next
// Prepare returns (nothing copied or cleared them), and the store holds exactly the
// granules that cover its size.
func TestStableBaseAcrossGrowth(t *testing.T) {
	for _, kind := range backings {
		t.Run(kind.String(), func(t *testing.T) {
			f, _ := newFactory(t, accounting.Unlimited, snapshot.Options{Backing: kind})
			s := newStore(t, f)
			assert.Zero(t, s.Base(), "no range before the first Prepare")
			var base uintptr
			prev := 0
			for turn := 1; turn <= 12; turn++ {
				n := turn * gran * 3 / 2
				buf, err := s.Prepare(context.Background(), n)
				require.NoError(t, err)
				require.Len(t, buf, n)
				if turn == 1 {
					base = s.Base()
					require.NotZero(t, base)
				}
				require.Equal(t, base, s.Base(), "turn %d moved the base", turn)
				require.Equal(t, base, uintptrOf(buf), "turn %d: the slice starts at the base", turn)
				assert.True(t, bytes.Equal(testutil.Pattern(prev, byte(turn-1)), buf[:prev]), "turn %d: the last snapshot's bytes were not kept in place", turn)
				assert.Zero(t, s.Len(), "Len before Commit")
				testutil.Fill(buf, byte(turn))
				require.NoError(t, s.Commit(context.Background(), n))
				want := (n + gran - 1) / gran * gran
				assert.Equal(t, want, s.Cap())
				assert.Equal(t, int64(want), f.Stats().Committed)
				if kind == snapshot.Private {
					assert.Equal(t, int64(want), f.Authority().Stats().Owned, "the ledger holds what the store holds")
				}
				assert.True(t, bytes.Equal(testutil.Pattern(n, byte(turn)), bytesOf(t, s)))
				prev = n
			}
		})
	}
}

// TestResetGivesMemoryBack: Reset decommits every granule (the ledger owns nothing
// under Private), keeps the range, and the next Prepare grows on the same base.
func TestResetGivesMemoryBack(t *testing.T) {
	f, _ := newFactory(t, accounting.Unlimited, snapshot.Options{})
	s := newStore(t, f)
	snap(t, s, 10*gran, 1)
	base := s.Base()
	require.Equal(t, int64(10*gran), f.Authority().Stats().Owned)

	require.NoError(t, s.Reset(context.Background()))
	assert.Zero(t, s.Len())
	assert.Zero(t, s.Cap())
	assert.Nil(t, bytesOf(t, s))
	assert.Zero(t, f.Authority().Stats().Owned, "Reset gave the granules back to the budget")
	assert.Zero(t, f.Stats().Committed)

	buf, err := s.Prepare(context.Background(), 4*gran)
	require.NoError(t, err)
	assert.Equal(t, base, s.Base(), "the range stays reserved across Reset")
	assert.Equal(t, make([]byte, 4*gran), buf, "recommitted private memory reads as zero: nothing of the reset snapshot survives")
}

// TestPrepareShrinkGivesBack: a smaller snapshot keeps only the granules it needs.
func TestPrepareShrinkGivesBack(t *testing.T) {
	f, _ := newFactory(t, accounting.Unlimited, snapshot.Options{})
	s := newStore(t, f)
	snap(t, s, 8*gran, 3)
	buf, err := s.Prepare(context.Background(), 2*gran+1)
	require.NoError(t, err)
	assert.Equal(t, 3*gran, s.Cap())
	assert.Equal(t, int64(3*gran), f.Authority().Stats().Owned)
	assert.Equal(t, testutil.Pattern(2*gran+1, 3), buf, "the kept granules keep their bytes")
}

// TestCommitPublishesExactly: every Bytes after Commit(n) is the n bytes written,
// for n short of the prepared slice too, and Commit(0) publishes an empty snapshot.
func TestCommitPublishesExactly(t *testing.T) {
	f, _ := newFactory(t, accounting.Unlimited, snapshot.Options{})
	s := newStore(t, f)
	ctx := context.Background()
	buf, err := s.Prepare(ctx, 3*gran)
	require.NoError(t, err)
	testutil.Fill(buf, 9)
	require.NoError(t, s.Commit(ctx, gran+5))
	assert.Equal(t, gran+5, s.Len())
	assert.Equal(t, testutil.Pattern(gran+5, 9), bytesOf(t, s))
	assert.Equal(t, 3*gran, s.Cap(), "Commit keeps the granules until the next Prepare or Reset")

	// The prepared slice is spent: a second Commit of anything but 0 is out of range.
	require.ErrorIs(t, s.Commit(ctx, 1), snapshot.ErrCommitRange)
	assert.Zero(t, s.Len())
	require.NoError(t, s.Commit(ctx, 0))
	assert.Zero(t, s.Len())

	zero, err := s.Prepare(ctx, 0)
	require.NoError(t, err)
	assert.NotNil(t, zero)
	assert.Empty(t, zero)
	assert.Zero(t, s.Cap(), "a zero-byte snapshot holds no granule")
}

// TestBadInput gives every entry point its bad inputs.
func TestBadInput(t *testing.T) {
	ctx := context.Background()
	done, cancel := context.WithCancel(ctx)
	cancel()

	t.Run("factory options", func(t *testing.T) {
		g := accounting.NewGovernor()
		// The options the backing refuses match ErrOptions and the backing's
		// sentinel (host, the backing's cause).
		for _, tt := range []struct {
			name string
			g    *accounting.Governor
			opts snapshot.Options
			host error
		}{
			{"nil governor", nil, snapshot.Options{}, nil},
			{"negative granularity", g, snapshot.Options{Granularity: -1}, nil},
			{"negative max size", g, snapshot.Options{MaxSize: -1}, nil},
			{"negative wait", g, snapshot.Options{WaitFor: -time.Second}, nil},
			{"unknown backing", g, snapshot.Options{Backing: snapshot.Shared + 1}, nil},
			{"pool authority", g, snapshot.Options{Backing: snapshot.Shared, Pool: hostSharedWithAuthority(accounting.NewGovernor())}, nil},
			{"granule not a power of two", g, snapshot.Options{Granularity: 3 << 12}, host.ErrPrivateOptions},
			{"name the kernel refuses", g, snapshot.Options{Name: "a$b"}, host.ErrPrivateOptions},
			{"pool granule above 1 GiB", g, snapshot.Options{Backing: snapshot.Shared, Granularity: 1 << 31}, host.ErrSharedOptions},
			{"pool low above high", g, snapshot.Options{Backing: snapshot.Shared, Pool: host.SharedOptions{Low: 9, High: 2}}, host.ErrSharedOptions},
		} {
			t.Run(tt.name, func(t *testing.T) {
				f, err := snapshot.NewFactory(tt.g, tt.opts)
				if errors.Is(err, errors.ErrUnsupported) {
					t.Skipf("backing %v: %v", tt.opts.Backing, err)
				}
				require.ErrorIs(t, err, snapshot.ErrOptions)
				if tt.host != nil {
					assert.ErrorIs(t, err, tt.host)
				}
				assert.Nil(t, f)
			})
		}
		assert.Empty(t, g.Stats(accounting.HostKey).Authorities, "a refused factory leaves no ledger behind")
	})

	t.Run("prepare", func(t *testing.T) {
		f, _ := newFactory(t, accounting.Unlimited, snapshot.Options{MaxSize: 4 * gran})
		s := newStore(t, f)
		snap(t, s, 100, 1)
		for _, tt := range []struct {
			name string
			ctx  context.Context
			size int
			want error
		}{
			{"negative", ctx, -1, snapshot.ErrInvalidSize},
			{"above MaxSize", ctx, 4*gran + 1, snapshot.ErrTooLarge},
			{"cancelled", done, 10, context.Canceled},
		} {
			t.Run(tt.name, func(t *testing.T) {
				buf, err := s.Prepare(tt.ctx, tt.size)
				require.ErrorIs(t, err, tt.want)
				assert.Nil(t, buf)
				assert.Equal(t, 100, s.Len(), "a bad argument changes nothing")
				assert.Equal(t, testutil.Pattern(100, 1), bytesOf(t, s))
				assert.Equal(t, gran, s.Cap())
			})
		}
	})

	t.Run("commit", func(t *testing.T) {
		f, _ := newFactory(t, accounting.Unlimited, snapshot.Options{})
		s := newStore(t, f)
		_, err := s.Prepare(ctx, 1024)
		require.NoError(t, err)
		for _, n := range []int{-50, 1025, 99999} {
			require.ErrorIs(t, s.Commit(ctx, n), snapshot.ErrCommitRange, "Commit(%d)", n)
			assert.Zero(t, s.Len(), "a failed Commit leaves Len at 0")
		}
		require.ErrorIs(t, s.Commit(done, 10), context.Canceled)
		assert.Zero(t, s.Len())
		require.NoError(t, s.Commit(ctx, 1024), "the prepared slice survives a refused Commit")
		assert.Equal(t, 1024, s.Len())
	})

	t.Run("cancelled context", func(t *testing.T) {
		f, _ := newFactory(t, accounting.Unlimited, snapshot.Options{})
		s := newStore(t, f)
		snap(t, s, 2*gran, 4)
		_, err := s.Bytes(done)
		require.ErrorIs(t, err, context.Canceled)
		require.ErrorIs(t, s.Reset(done), context.Canceled)
		assert.Equal(t, 2*gran, s.Len(), "a cancelled Reset changes nothing")
		_, err = f.New(done)
		require.ErrorIs(t, err, context.Canceled)
		assert.Equal(t, 1, f.Stats().Stores)
	})

	t.Run("nil context", func(t *testing.T) {
		f, _ := newFactory(t, accounting.Unlimited, snapshot.Options{})
		s := newStore(t, f)
		var nilCtx context.Context
		assert.PanicsWithValue(t, snapshot.PanicNilContext, func() { _, _ = s.Prepare(nilCtx, 1) })
		assert.PanicsWithValue(t, snapshot.PanicNilContext, func() { _, _ = s.Bytes(nilCtx) })
		assert.PanicsWithValue(t, snapshot.PanicNilContext, func() { _ = s.Commit(nilCtx, 0) })
		assert.PanicsWithValue(t, snapshot.PanicNilContext, func() { _ = s.Reset(nilCtx) })
		assert.PanicsWithValue(t, snapshot.PanicNilContext, func() { _, _ = f.New(nilCtx) })
	})

	t.Run("use after close", func(t *testing.T) {
		f, _ := newFactory(t, accounting.Unlimited, snapshot.Options{})
		s := newStore(t, f)
		snap(t, s, 3*gran, 5)
		require.NoError(t, s.Close())
		assert.Zero(t, s.Len())
		assert.Zero(t, s.Cap())
		_, err := s.Prepare(ctx, 1)
		require.ErrorIs(t, err, snapshot.ErrClosed)
		_, err = s.Bytes(ctx)
		require.ErrorIs(t, err, snapshot.ErrClosed)
		require.ErrorIs(t, s.Commit(ctx, 0), snapshot.ErrClosed)
		require.ErrorIs(t, s.Reset(ctx), snapshot.ErrClosed)
		require.ErrorIs(t, s.Close(), snapshot.ErrClosed)
		assert.Zero(t, f.Authority().Stats().Owned, "Close gave everything back")
		assert.Zero(t, f.Stats().Stores)
	})

	t.Run("factory close", func(t *testing.T) {
		g := accounting.NewGovernor()
		f, err := snapshot.NewFactory(g, snapshot.Options{Granularity: gran})
		require.NoError(t, err)
		s, err := f.New(ctx)
		require.NoError(t, err)
		require.ErrorIs(t, f.Close(), snapshot.ErrFactoryBusy)
		_, err = f.New(ctx)
		require.NoError(t, err, "a refused Close changes nothing")
		require.ErrorIs(t, f.Close(), snapshot.ErrFactoryBusy)
		require.NoError(t, s.Close())
		require.Equal(t, 1, f.Stats().Stores)
	})

	t.Run("closed factory", func(t *testing.T) {
		g := accounting.NewGovernor()
		f, err := snapshot.NewFactory(g, snapshot.Options{Granularity: gran})
		require.NoError(t, err)
		require.NoError(t, f.Close())
		require.ErrorIs(t, f.Close(), snapshot.ErrFactoryClosed, "a second Close changes nothing")
		_, err = f.New(ctx)
		require.ErrorIs(t, err, snapshot.ErrFactoryClosed)
		assert.Empty(t, g.Stats(accounting.HostKey).Authorities, "Close retired the ledger")
	})

	t.Run("FactoryFunc of a foreign interface", func(t *testing.T) {
		f, _ := newFactory(t, accounting.Unlimited, snapshot.Options{})
		assert.PanicsWithValue(t, snapshot.PanicNotStore, func() { snapshot.FactoryFunc[interface{ Foreign() }](f) })
	})
}

// sessionStore is the contract of Kronk's kvstorage.Store (v1.32.6), spelled here
// so that this module need not import Kronk.
type sessionStore interface {
	Len() int
	Cap() int
	Bytes(ctx context.Context) ([]byte, error)
	Prepare(ctx context.Context, size int) ([]byte, error)
	Commit(ctx context.Context, n int) error
	Reset(ctx context.Context) error
	Close() error
}

// TestFactoryFunc: the function FactoryFunc returns makes distinct stores of f, and
// hands New's error back with a nil interface.
func TestFactoryFunc(t *testing.T) {
	f, _ := newFactory(t, accounting.Unlimited, snapshot.Options{})
	fn := snapshot.FactoryFunc[sessionStore](f)
	a, err := fn(context.Background())
	require.NoError(t, err)
	b, err := fn(context.Background())
	require.NoError(t, err)
	assert.NotSame(t, a, b)
	require.NoError(t, a.Close())
	require.NoError(t, b.Close())

	done, cancel := context.WithCancel(context.Background())
	cancel()
	c, err := fn(done)
	require.ErrorIs(t, err, context.Canceled)
	assert.Nil(t, c, "an error comes with a nil interface, not a typed nil")
}
