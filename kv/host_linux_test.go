package kv_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/internal/testutil"
	"github.com/vmarena/vmarena/kv"
)

// pssOf sums the proportional set size of every mapping of the memfd named name.
// NB: smaps gives each mapping's Pss rounded down to a whole KiB, so the true sum
// lies in [pss, hi): with many small mappings of widely shared pages (a private
// tail beside each mapped prefix keeps them from merging) the rounding is a large
// part of it.
func pssOf(t *testing.T, name string) (pss, hi int64) {
	t.Helper()
	var n int64 // mappings counted
	for _, m := range testutil.Smaps(t) {
		if p, ok := m.Sizes["Pss"]; ok && strings.Contains(m.Line, "/memfd:"+name) {
			pss += p
			n++
		}
	}
	return pss, pss + n<<10
}

// touchPages reads every page of every tensor of a PerLayer sequence s of tiny8
// tokens through its own mapping, so that each mapping counts in Pss.
func touchPages(t *testing.T, s *kv.Sequence) {
	t.Helper()
	var sum byte
	for layer := range tiny8.Layers {
		for _, kind := range kv.KindsOf(tiny8) {
			b, err := s.Bytes(layer, kind)
			require.NoError(t, err)
			for i := 0; i < len(b); i += 4096 {
				sum += b[i]
			}
		}
	}
	_ = sum
}

// TestPrefixOwnedOnceByPss shows on real memory what the ledger says: 64 sequences on
// a 1,024-token prefix hold it once.
func TestPrefixOwnedOnceByPss(t *testing.T) {
	const name = "kv-pss-test"
	e := openEnv(t, onShared, withGranule(64<<10), withName(name), withConfig(kv.Config{MaxTokens: 2048, Layout: kv.PerLayer}))
	c, pool := e.c, e.auth
	src, err := c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, src.Append(1024))
	for layer := range tiny8.Layers {
		for _, kind := range kv.KindsOf(tiny8) {
			b, err := src.Bytes(layer, kind)
			require.NoError(t, err)
			for i := range b {
				b[i] = testutil.TokenByte(1, layer, kind, i/tiny8.Groups[0].TokenBytes(), i%tiny8.Groups[0].TokenBytes())
			}
		}
	}
	p, err := src.Freeze(1024)
	require.NoError(t, err)
	assert.True(t, src.Close().OK())

	prefixBytes := int64(1024 * tiny8.BytesPerToken()) // 3 MiB
	var seqs []*hostSeq
	for range 64 {
		s, err := c.NewSequenceFrom(p)
		require.NoError(t, err)
		seqs = append(seqs, s)
		touchPages(t, s)
	}
	p.Release()
	checkTokens(t, seqs[63], 1, 0, 1024)

	st := c.Stats()
	assert.Equal(t, prefixBytes, pool.Stats().Owned, "the governor: owned once")
	assert.Equal(t, 64*prefixBytes, st.Shared, "64 sequences map it")
	assert.Equal(t, 65*prefixBytes, pool.Stats().Mapped, "64 sequences and the prefix's own ranges map it")
	pss, _ := pssOf(t, name)
	t.Logf("Pss of 64 sequences on a %d KiB prefix: %d KiB (mapped %d KiB)", prefixBytes>>10, pss>>10, (64*prefixBytes)>>10)
	assert.InDelta(t, float64(prefixBytes), float64(pss), float64(prefixBytes)/10, "the kernel: resident once, not 64 times")

	for _, s := range seqs {
		assert.True(t, s.Close().OK())
	}
}
