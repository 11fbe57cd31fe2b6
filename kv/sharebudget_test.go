package kv_test

import (
	"fmt"
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/cuda"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
)

// blockGranule is the granule of the share and map-ahead tests: 4 KiB, or on Windows
// the 64 KiB at which host.Shared maps views.
var blockGranule = func() int64 {
	if runtime.GOOS == "windows" {
		return 64 << 10
	}
	return 4 << 10
}()

// oneBlock is a model whose token takes blockGranule/16 bytes in all (one layer, K
// and V of blockGranule/64 fp16 elements each): a Blocked block of 16 tokens is one
// granule.
var oneBlock = kv.Uniform("one-block", 1, int(blockGranule/4096), 64, arena.Float16)

// shareBudgetBackings are the backings that share, as options of an env of a
// pool of up to 16 idle granules.
var shareBudgetBackings = []struct {
	name string
	opts []envOption
}{
	{"host.Shared/private", []envOption{onShared, withShared(host.SharedOptions{High: 16})}},
	{"host.Shared/NoPrivateGranules", []envOption{onShared, withShared(host.SharedOptions{High: 16, NoPrivateGranules: true})}},
	{"cuda", []envOption{onCUDA, withCUDA(cuda.Options{High: 16})}},
}

// TestShareWholeGranulesTakesNoNetMemory checks that a fork, a freeze and a prefix
// cache insert of whole granules are not refused while one granule of the budget
// is free, and that what they hold at their peak is at most one granule more than
// before (moving private granules into shared memory copies them one at a time).
func TestShareWholeGranulesTakesNoNetMemory(t *testing.T) {
	granule := blockGranule
	ops := []struct {
		name string
		do   func(t *testing.T, c *kv.Cache, s *kv.Sequence) error
	}{
		{"ForkAt", func(t *testing.T, c *kv.Cache, s *kv.Sequence) error {
			f, err := s.ForkAt(64)
			if err == nil {
				assert.Equal(t, 64, f.Len())
				require.True(t, f.Close().OK())
			}
			return err
		}},
		{"Freeze", func(t *testing.T, c *kv.Cache, s *kv.Sequence) error {
			p, err := s.Freeze(64)
			if err == nil {
				p.Release()
			}
			return err
		}},
		{"Insert", func(t *testing.T, c *kv.Cache, s *kv.Sequence) error {
			pc, err := kv.NewPrefixCache(c, kv.PrefixCacheOptions{})
			require.NoError(t, err)
			defer func() { assert.NoError(t, pc.Close()) }()
			tokens := make([]int32, 64)
			for i := range tokens {
				tokens[i] = int32(i)
			}
			if err := pc.Insert(s, tokens); err != nil {
				return err
			}
			// A hit maps the entry's granules from the live sequence that holds
			// them (a lazy entry: this is where they are shared).
			hit, m, err := pc.Lookup(append(tokens, 99))
			if err == nil {
				assert.Equal(t, 64, m)
				require.True(t, hit.Close().OK())
			}
			return err
		}},
	}
	for _, be := range shareBudgetBackings {
		for _, op := range ops {
			// 4 whole granules written, one granule of the limit free, or room.
			for _, free := range []int64{1, 60} {
				t.Run(fmt.Sprintf("%s/%s/free=%d", be.name, op.name, free), func(t *testing.T) {
					e := openEnv(t, append([]envOption{withConfig(oneBlockConfig(1024, false)), withGranule(int(blockGranule)), withLimit((4 + free) * granule)}, be.opts...)...)
					if be.name == "host.Shared/private" && !e.shared.Stats().PrivateGranules {
						t.Skipf("no private granules here: %s", e.shared.Stats().NoPrivateGranules)
					}
					c, gov, key := e.c, e.gov, e.auth.Device()
					defer e.finish(t)
					s, err := c.NewSequence()
					require.NoError(t, err)
					defer func() { assert.True(t, s.Close().OK()) }()
					require.NoError(t, s.Append(64))
					tok := make([]byte, oneBlock.Groups[0].TokenBytes())
					for i := range 64 {
						tok[0] = byte(i)
						require.NoError(t, s.WriteToken(0, kv.K, i, tok))
					}
					before := gov.Stats(key).Used
					require.Equal(t, int64(4*granule), before)
					gov.ResetPeak(key)
					require.NoError(t, op.do(t, c, s), "whole granules are mapped: no net memory")
					assert.LessOrEqual(t, gov.Stats(key).Peak, before+granule, "the move holds at most one granule more")
					got := make([]byte, oneBlock.Groups[0].TokenBytes())
					for i := range 64 {
						require.NoError(t, s.ReadToken(0, kv.K, i, got))
						require.Equal(t, byte(i), got[0], "token %d", i)
					}
				})
			}
		}
	}
}
