package tiertest_test

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/vmarena/vmarena/internal/mutanttest"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/tiertest"
)

// Mutants are Maps with one contract violation each. The suite must catch every one,
// in the properties named, or it proves nothing.

type noName struct{ *tiertest.Map }

func (noName) Name() string { return "" }

type missIsNil struct{ *tiertest.Map }

func (m missIsNil) Load(ctx context.Context, k tierval.Key, use func([]byte) error) error {
	if err := m.Map.Load(ctx, k, use); !errors.Is(err, kv.ErrTierMiss) {
		return err
	}
	return nil
}

type shortFill struct{ *tiertest.Map }

func (m shortFill) Store(ctx context.Context, k tierval.Key, size int, fill func([]byte) error) error {
	if size < 2 {
		return m.Map.Store(ctx, k, size, fill)
	}
	return m.Map.Store(ctx, k, size, func(dst []byte) error { return fill(dst[:size-1]) })
}

type keepsFailedFill struct{ *tiertest.Map }

func (m keepsFailedFill) Store(ctx context.Context, k tierval.Key, size int, fill func([]byte) error) error {
	var ferr error
	err := m.Map.Store(ctx, k, size, func(dst []byte) error { ferr = fill(dst); return nil })
	return errors.Join(err, ferr)
}

// inPlace writes a replacement of the same size into the held value itself.
type inPlace struct{ *tiertest.Map }

func (m inPlace) Store(ctx context.Context, k tierval.Key, size int, fill func([]byte) error) error {
	var held []byte
	if m.Map.Load(ctx, k, func(src []byte) error { held = src; return nil }) == nil && len(held) == size {
		return fill(held)
	}
	return m.Map.Store(ctx, k, size, fill)
}

type useErrorDeletes struct{ *tiertest.Map }

func (m useErrorDeletes) Load(ctx context.Context, k tierval.Key, use func([]byte) error) error {
	err := m.Map.Load(ctx, k, use)
	if err != nil && !errors.Is(err, kv.ErrTierMiss) {
		_ = m.Map.Delete(ctx, k)
	}
	return err
}

// hashOnly keys its values by Hash alone.
type hashOnly struct{ *tiertest.Map }

func (m hashOnly) strip(k tierval.Key) tierval.Key { return tierval.Key{Hash: k.Hash} }
func (m hashOnly) Store(ctx context.Context, k tierval.Key, size int, fill func([]byte) error) error {
	return m.Map.Store(ctx, m.strip(k), size, fill)
}
func (m hashOnly) Load(ctx context.Context, k tierval.Key, use func([]byte) error) error {
	return m.Map.Load(ctx, m.strip(k), use)
}
func (m hashOnly) Contains(ctx context.Context, keys []tierval.Key) (int, error) {
	s := make([]tierval.Key, len(keys))
	for i, k := range keys {
		s[i] = m.strip(k)
	}
	return m.Map.Contains(ctx, s)
}
func (m hashOnly) Delete(ctx context.Context, k tierval.Key) error {
	return m.Map.Delete(ctx, m.strip(k))
}

// countsAll counts every held key, not the run up to the first gap.
type countsAll struct{ *tiertest.Map }

func (m countsAll) Contains(ctx context.Context, keys []tierval.Key) (int, error) {
	n := 0
	for _, k := range keys {
		if c, err := m.Map.Contains(ctx, []tierval.Key{k}); err != nil {
			return 0, err
		} else {
			n += c
		}
	}
	return n, nil
}

type deleteMissErr struct{ *tiertest.Map }

func (m deleteMissErr) Delete(ctx context.Context, k tierval.Key) error {
	if n, _ := m.Map.Contains(ctx, []tierval.Key{k}); n == 0 {
		return kv.ErrTierMiss
	}
	return m.Map.Delete(ctx, k)
}

// ignoresCtx serves every call with a context of its own.
type ignoresCtx struct{ *tiertest.Map }

func (m ignoresCtx) Store(_ context.Context, k tierval.Key, size int, fill func([]byte) error) error {
	return m.Map.Store(context.Background(), k, size, fill)
}
func (m ignoresCtx) Load(_ context.Context, k tierval.Key, use func([]byte) error) error {
	return m.Map.Load(context.Background(), k, use)
}

type negativeIsEmpty struct{ *tiertest.Map }

func (m negativeIsEmpty) Store(ctx context.Context, k tierval.Key, size int, fill func([]byte) error) error {
	return m.Map.Store(ctx, k, max(size, 0), fill)
}

// lastValue hands every Load the bytes of the last Store, whatever its key, when
// they are the same length.
type lastValue struct {
	*tiertest.Map
	mu   *sync.Mutex
	last *[]byte
}

func (m lastValue) Store(ctx context.Context, k tierval.Key, size int, fill func([]byte) error) error {
	return m.Map.Store(ctx, k, size, func(dst []byte) error {
		err := fill(dst)
		m.mu.Lock()
		*m.last = dst
		m.mu.Unlock()
		return err
	})
}
func (m lastValue) Load(ctx context.Context, k tierval.Key, use func([]byte) error) error {
	return m.Map.Load(ctx, k, func(src []byte) error {
		m.mu.Lock()
		l := *m.last
		m.mu.Unlock()
		if len(l) == len(src) && !bytes.Equal(l, src) {
			return use(l)
		}
		return use(src)
	})
}

// peekWhole's Peek hands over the whole value, whatever was asked.
type peekWhole struct{ *tiertest.Map }

func (m peekWhole) Peek(ctx context.Context, k tierval.Key, n int, use func([]byte) error) error {
	return m.Load(ctx, k, use)
}

// peekEmptyMiss's Peek answers an empty value as a miss (as a GETRANGE alone would).
type peekEmptyMiss struct{ *tiertest.Map }

func (m peekEmptyMiss) Peek(ctx context.Context, k tierval.Key, n int, use func([]byte) error) error {
	return m.Map.Peek(ctx, k, n, func(head []byte) error {
		if len(head) == 0 {
			return kv.ErrTierMiss
		}
		return use(head)
	})
}

var mutants = map[string]struct {
	make func() kv.Tier
	want []string // properties that must fail
}{
	"noName":          {func() kv.Tier { return noName{tiertest.NewMap(0)} }, []string{"Name"}},
	"smallBound":      {func() kv.Tier { return tiertest.NewMap(1 << 20) }, []string{"Bounds", "StoreLoad"}},
	"missIsNil":       {func() kv.Tier { return missIsNil{tiertest.NewMap(0)} }, []string{"Miss", "Delete", "FillError"}},
	"shortFill":       {func() kv.Tier { return shortFill{tiertest.NewMap(0)} }, []string{"StoreLoad", "Replace"}},
	"keepsFailedFill": {func() kv.Tier { return keepsFailedFill{tiertest.NewMap(0)} }, []string{"FillError", "FillErrorKeepsNoPartial"}},
	"inPlace":         {func() kv.Tier { return inPlace{tiertest.NewMap(0)} }, []string{"FillErrorKeepsNoPartial"}},
	"useErrorDeletes": {func() kv.Tier { return useErrorDeletes{tiertest.NewMap(0)} }, []string{"UseError"}},
	"hashOnly":        {func() kv.Tier { return hashOnly{tiertest.NewMap(0)} }, []string{"NamespaceDistinct"}},
	"countsAll":       {func() kv.Tier { return countsAll{tiertest.NewMap(0)} }, []string{"Contains"}},
	"deleteMissErr":   {func() kv.Tier { return deleteMissErr{tiertest.NewMap(0)} }, []string{"Delete"}},
	"ignoresCtx":      {func() kv.Tier { return ignoresCtx{tiertest.NewMap(0)} }, []string{"Cancelled"}},
	"negativeIsEmpty": {func() kv.Tier { return negativeIsEmpty{tiertest.NewMap(0)} }, []string{"BadSize"}},
	"peekWhole":       {func() kv.Tier { return peekWhole{tiertest.NewMap(0)} }, []string{"Peek"}},
	"peekEmptyMiss":   {func() kv.Tier { return peekEmptyMiss{tiertest.NewMap(0)} }, []string{"Peek"}},
	"lastValue": {func() kv.Tier { return lastValue{tiertest.NewMap(0), new(sync.Mutex), new([]byte)} },
		[]string{"SourceNotRetained"}},
}

const mutantEnv = "TIERTEST_MUTANT"

// TestMutantChild runs the suite on the mutant named by $TIERTEST_MUTANT; it does
// nothing in a normal run. TestSuiteCatchesMutants starts it in a child process, since
// a failing subtest can not be contained inside the parent's test.
func TestMutantChild(t *testing.T) {
	name := mutanttest.Child(mutantEnv)
	if name == "" {
		return
	}
	tiertest.Run(t, func(*testing.T) kv.Tier { return mutants[name].make() })
}

func TestSuiteCatchesMutants(t *testing.T) {
	want := make(map[string][]string, len(mutants))
	for name, m := range mutants {
		want[name] = m.want
	}
	mutanttest.Catches(t, mutantEnv, "TestMutantChild", want)
}
