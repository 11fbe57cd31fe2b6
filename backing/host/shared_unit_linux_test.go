package host_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/host"
)

// TestSharedShareUnit: with Granularity 0, ShareUnit picks the largest granule from
// 64 KiB to 2 MiB that holds at most 64 units; a Granularity given wins; a negative
// unit is refused with ErrSharedOptions.
func TestSharedShareUnit(t *testing.T) {
	auth := accounting.NewGovernor().Authority("shared", accounting.HostKey)
	for _, tt := range []struct {
		unit, granularity, want int
	}{
		{0, 0, 2 << 20},
		{2 << 10, 0, 128 << 10},     // the small model's 2 KiB tokens: 64 a granule
		{24 << 10, 0, 1 << 20},      // gpt-oss-20b's group: 42 a granule
		{128 << 10, 0, 2 << 20},     // Llama-3-8B's: 16 a 2 MiB granule already
		{1, 0, 64 << 10},            // never below 64 KiB
		{2 << 10, 4 << 10, 4 << 10}, // a granularity given wins
		{3 << 20, 0, 2 << 20},       // a unit larger than a granule: 2 MiB
		{2<<10 + 1, 0, 128 << 10},   // 63 whole units of 2,049 bytes in 128 KiB
		{1<<10 - 1, 0, 64 << 10},    // 64 whole units of 1,023 bytes in 64 KiB
		{1<<10 + 1, 0, 64 << 10},    // 63 of 1,025 bytes
	} {
		s, err := host.NewShared(host.SharedOptions{Authority: auth, ShareUnit: tt.unit, Granularity: tt.granularity})
		require.NoError(t, err)
		assert.Equal(t, tt.want, s.Granularity(), "unit %d, granularity %d", tt.unit, tt.granularity)
		require.NoError(t, s.Close())
	}
	_, err := host.NewShared(host.SharedOptions{Authority: auth, ShareUnit: -1})
	assert.ErrorIs(t, err, host.ErrSharedOptions)
}
