package kv_test

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/internal/logrec"
	"github.com/vmarena/vmarena/kv"
)

// smallUniform is the small uniform model: 4 layers × 2 KV heads × 64, bf16
// (2 KiB a token: a 2 MiB granule holds 1,024 tokens).
func smallUniform() kv.Model {
	return kv.Uniform("small", 4, 2, 64, arena.BFloat16)
}

// TestBlockChoice: each token group's default block is whole granules, holds at most
// its bound of tokens, has no dead byte where a whole number of tokens fills whole
// granules within the bound, and is the tests' own search's block (refBlock).
func TestBlockChoice(t *testing.T) {
	models := append(kv.Presets(), smallUniform(), hybrid())
	for _, m := range models {
		for _, granule := range []int{4 << 10, 64 << 10, 2 << 20} {
			s, err := m.Size(granule, 0, 1000)
			require.NoError(t, err)
			for i, g := range m.Groups {
				gs := s.Groups[i]
				if g.Kind == kv.Recurrent {
					assert.Zero(t, gs.BlockBytes%granule, "%s: a state in whole granules", m.Name)
					continue
				}
				bpt := g.BytesPerToken()
				assert.Zero(t, gs.BlockBytes%granule, "%s group %d: whole granules", m.Name, i)
				assert.LessOrEqual(t, gs.BlockTokens, gs.BoundTokens, "%s group %d", m.Name, i)
				assert.Equal(t, gs.BlockBytes-gs.BlockTokens*bpt, gs.DeadBytes, "%s group %d", m.Name, i)
				tpb, blk := refBlock(g, granule, 0)
				assert.Equal(t, tpb, gs.BlockTokens, "%s group %d on %d-byte granules: %s", m.Name, i, granule, gs.Block)
				assert.Equal(t, blk, gs.BlockBytes, "%s group %d", m.Name, i)
				// No dead byte exactly where some whole number of tokens within the
				// bound fills whole granules.
				exact := false
				for n := 1; n <= gs.BoundTokens && !exact; n++ {
					exact = n*bpt%granule == 0
				}
				assert.Equal(t, exact, gs.DeadBytes == 0, "%s group %d on %d-byte granules: %s", m.Name, i, granule, gs.Block)
				assert.NotEmpty(t, gs.Block)
			}
		}
	}
}

// TestBlockOverride: a Config.BlockTokens whose blocks are more than 1/8 dead bytes
// is reported, not refused: Size's group says so beside the default's block, and New
// logs it once per such group; one under that share is neither.
func TestBlockOverride(t *testing.T) {
	// One 70,272-byte MLA token takes two 64 KiB granules: 46% of each block dead.
	cfg := kv.Config{Model: kv.DeepSeekV3(), MaxTokens: 4096, BlockTokens: 1}
	s, err := cfg.Size(64<<10, 100)
	require.NoError(t, err)
	gs := s.Groups[0]
	assert.Equal(t, 1, gs.BlockTokens)
	assert.Equal(t, 128<<10, gs.BlockBytes)
	assert.Equal(t, 128<<10-70272, gs.DeadBytes)
	assert.Zero(t, gs.BoundTokens, "an override has no bound")
	assert.Contains(t, gs.Block, "more than 1/8")
	assert.Contains(t, gs.Block, "the default's block: 512 tokens")

	e := openEnv(t, noCache, withGranule(64<<10), withLimit(1<<30))
	var rec logrec.Recorder
	cfg.Logger = rec.Logger()
	c, err := e.tryCache(cfg)
	require.NoError(t, err)
	require.NoError(t, c.Close())
	warned := rec.Find("kv: Config.BlockTokens makes blocks of dead bytes")
	require.Len(t, warned, 1)
	assert.Equal(t, float64(128<<10-70272), warned[0]["dead_bytes"])
	assert.Equal(t, float64(512), warned[0]["default_block_tokens"])

	// 16 tokens of DeepSeek-V3 in 18 granules: 2.3% dead, told nowhere.
	var quiet logrec.Recorder
	cfg.BlockTokens, cfg.Logger = 16, quiet.Logger()
	s, err = cfg.Size(64<<10, 100)
	require.NoError(t, err)
	assert.NotContains(t, s.Groups[0].Block, "more than")
	c, err = e.tryCache(cfg)
	require.NoError(t, err)
	require.NoError(t, c.Close())
	assert.Empty(t, quiet.Records())
}

// TestBlockBadSizes: a negative block, or one whose bytes overflow, is refused with
// ErrConfig by Size, Model.Size and New, and New allocates nothing.
func TestBlockBadSizes(t *testing.T) {
	e := openEnv(t, noCache, withGranule(64<<10), withLimit(1<<30))
	auth, b := e.auth, e.fake
	for _, bt := range []int{-1, -4096, math.MaxInt / 2, math.MaxInt} {
		for _, cfg := range []kv.Config{
			{Model: kv.Llama3_8B(), MaxTokens: 100, BlockTokens: bt},
			{Model: kv.Gemma3_27B(), MaxTokens: 2048, BlockTokens: bt},
		} {
			_, err := cfg.Size(64<<10, 10)
			assert.ErrorIs(t, err, kv.ErrConfig, "BlockTokens %d", bt)
			c, err := kv.New(b, cfg)
			assert.ErrorIs(t, err, kv.ErrConfig, "BlockTokens %d", bt)
			assert.Nil(t, c)
			if cfg.Model.Name != "" {
				_, err = cfg.Model.Size(64<<10, bt, 10)
				assert.ErrorIs(t, err, kv.ErrConfig, "BlockTokens %d", bt)
			}
		}
	}
	assert.Zero(t, b.LiveGranules(), "nothing allocated")
	assert.Zero(t, auth.Stats().Owned)
}

// sizingTable returns the table of docs/benchmarks/sizing.md: per model, granule and
// length, one sequence's need and what it commits with the default blocks and with
// the blocks the default chose before (BlockTokens 1: the fewest granules that hold a
// token), in MiB, and the default's excess in granules per group; then the peak of a
// prefill of 128K tokens in chunks of 512, 2,048 and 8,192 tokens.
func sizingTable(t *testing.T) []string {
	mb := func(b int64) string { return fmt.Sprintf("%.1f", float64(b)/(1<<20)) }
	rows := []string{
		"| model | granule | tokens | need MiB | committed MiB | over (granules/group) | blocks (tokens × granules, dead) | before: committed MiB |",
		"|---|---|---:|---:|---:|---:|---|---:|",
	}
	models := append(kv.Presets(), smallUniform())
	for _, m := range models {
		for _, granule := range []int{2 << 20, 64 << 10} {
			for _, n := range []int{8 << 10, 32 << 10, 128 << 10} {
				s, err := m.Size(granule, 0, n)
				require.NoError(t, err)
				old, err := m.Size(granule, 1, n)
				require.NoError(t, err)
				var blocks []string
				for _, g := range s.Groups {
					if g.Kind == kv.Recurrent {
						blocks = append(blocks, "state")
						continue
					}
					blocks = append(blocks, fmt.Sprintf("%d×%d, %d B", g.BlockTokens, g.BlockBytes/granule, g.DeadBytes))
				}
				rows = append(rows, fmt.Sprintf("| %s | %d KiB | %dK | %s | %s | %.2f | %s | %s |", m.Name, granule>>10, n>>10,
					mb(s.Need), mb(s.Committed), float64(s.Committed-s.Need)/float64(granule)/float64(len(s.Groups)),
					strings.Join(blocks, "; "), mb(old.Committed)))
			}
		}
	}
	rows = append(rows, "", "| model | granule | mean over, MiB | before | most over, MiB | before |", "|---|---|---:|---:|---:|---:|")
	for _, m := range models {
		for _, granule := range []int{2 << 20, 64 << 10} {
			var sum, sumOld, most, mostOld int64
			count := int64(0)
			for n := 1; n <= 128<<10; n += 997 {
				s, err := m.Size(granule, 0, n)
				require.NoError(t, err)
				old, err := m.Size(granule, 1, n)
				require.NoError(t, err)
				sum, sumOld = sum+s.Committed-s.Need, sumOld+old.Committed-old.Need
				most, mostOld = max(most, s.Committed-s.Need), max(mostOld, old.Committed-old.Need)
				count++
			}
			assert.LessOrEqual(t, sum, sumOld, "%s on %d-byte granules: the default wastes no more than before on the mean", m.Name, granule)
			rows = append(rows, fmt.Sprintf("| %s | %d KiB | %s | %s | %s | %s |", m.Name, granule>>10,
				mb(sum/count), mb(sumOld/count), mb(most), mb(mostOld)))
		}
	}
	rows = append(rows, "", "| model | granule | need at 128K MiB | peak, 512-token chunks | 2,048 | 8,192 |", "|---|---|---:|---:|---:|---:|")
	for _, m := range models {
		for _, granule := range []int{2 << 20, 64 << 10} {
			s, err := m.Size(granule, 0, 128<<10)
			require.NoError(t, err)
			row := fmt.Sprintf("| %s | %d KiB | %s |", m.Name, granule>>10, mb(s.Need))
			for _, chunk := range []int{512, 2048, 8192} {
				p, err := m.ChunkedPeak(granule, 0, 128<<10, chunk)
				require.NoError(t, err)
				row += " " + mb(p.Committed) + " |"
			}
			rows = append(rows, row)
		}
	}
	return rows
}

// TestSizingTable checks that the default blocks commit no more than the blocks of
// one token did, for every model, granule and length of the table, and no more on the
// mean over lengths, and prints the table with -v (docs/benchmarks/sizing.md).
func TestSizingTable(t *testing.T) {
	for _, m := range append(kv.Presets(), smallUniform()) {
		for _, granule := range []int{2 << 20, 64 << 10} {
			for _, n := range []int{8 << 10, 32 << 10, 128 << 10} {
				s, err := m.Size(granule, 0, n)
				require.NoError(t, err)
				old, err := m.Size(granule, 1, n)
				require.NoError(t, err)
				assert.LessOrEqual(t, s.Committed, old.Committed, "%s at %d tokens on %d-byte granules", m.Name, n, granule)
			}
		}
	}
	rows := sizingTable(t)
	if testing.Verbose() {
		for _, r := range rows {
			t.Log(r)
		}
	}
}

// TestBlockSmallModelShares: on 64 KiB granules the small uniform model's blocks hold
// 32 tokens, so a sequence started on a 300-token prefix maps its 9 whole blocks and
// copies only the 12 tokens after them; on 2 MiB granules (host.Shared's default)
// its one block holds 1,024 tokens and the prefix is copied whole.
func TestBlockSmallModelShares(t *testing.T) {
	for _, tt := range []struct {
		granule int
		mapped  int64
	}{
		{64 << 10, 9 * (64 << 10)},
		{2 << 20, 0},
	} {
		t.Run(fmt.Sprintf("granule=%d", tt.granule), func(t *testing.T) {
			e := openEnv(t, onShared, noCache, withGranule(tt.granule), withLimit(1<<30))
			c := e.cache(t, kv.Config{Model: smallUniform(), MaxTokens: 2048})
			shared, _ := sharedOnPrefix(t, c, 300)
			assert.Equal(t, tt.mapped, shared, "the whole blocks are mapped, not copied")
		})
	}
}

// TestBlockSmallModelSharesByDefault: on host.Shared told the model's token size
// (SharedOptions.ShareUnit) and no granularity, the small model's granule is 128 KiB
// and its blocks 64 tokens, so a sequence started on a 300-token prefix maps 4 blocks
// rather than copying the prefix whole, as it does on the 2 MiB granule chosen
// without it.
func TestBlockSmallModelSharesByDefault(t *testing.T) {
	m := smallUniform()
	gov := accounting.NewGovernor()
	require.NoError(t, gov.SetLimit(accounting.HostKey, 1<<30))
	b, err := host.NewShared(host.SharedOptions{Authority: gov.Authority("kv", accounting.HostKey), ShareUnit: m.BytesPerToken()})
	if errors.Is(err, errors.ErrUnsupported) {
		t.Skip(err)
	}
	require.NoError(t, err)
	defer func() { assert.NoError(t, b.Close()) }()
	require.Equal(t, 128<<10, b.Granularity())
	c, err := kv.New(b, kv.Config{Model: m, MaxTokens: 2048})
	require.NoError(t, err)
	defer func() { assert.NoError(t, c.Close()) }()
	shared, blockTokens := sharedOnPrefix(t, c, 300)
	assert.Equal(t, 64, blockTokens)
	assert.Equal(t, int64(4*(128<<10)), shared, "4 whole blocks of 64 tokens mapped, 44 tokens copied")
}

// sharedOnPrefix freezes the first n tokens of a new sequence of c, starts a second
// sequence on that prefix and returns the bytes the second maps from it (its
// SequenceStats.Shared) and its block's tokens. Everything is closed on return.
func sharedOnPrefix(t *testing.T, c *kv.Cache, n int) (shared int64, blockTokens int) {
	t.Helper()
	s, err := c.NewSequence()
	require.NoError(t, err)
	defer s.Close()
	require.NoError(t, s.Append(n))
	p, err := s.Freeze(n)
	require.NoError(t, err)
	defer p.Release()
	q, err := c.NewSequenceFrom(p)
	require.NoError(t, err)
	defer q.Close()
	found := false
	for _, ss := range c.SequenceStats() {
		if ss.ID == q.ID() {
			shared, found = ss.Shared, true
		}
	}
	require.True(t, found, "the sequence on the prefix is in SequenceStats")
	return shared, q.BlockTokens()
}
