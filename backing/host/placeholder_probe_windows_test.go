package host

import (
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/windows"
)

// TestPlaceholderProbe walks one placeholder through the steps the shared backing
// takes (split, replace by a view, unmap keeping a placeholder, coalesce, free) and
// checks each against VirtualQuery, so that a system that accepts a call without
// doing what it says fails here rather than deep in the backing.
func TestPlaceholderProbe(t *testing.T) {
	const g = placeholderGranularity
	require.NoError(t, placeholderSupported())
	base, err := placeholderReserve(4 * g)
	if v := WineVersion(); v != "" && err != nil {
		t.Skipf("under Wine %s, which does not implement placeholders: VirtualAlloc2(MEM_RESERVE|MEM_RESERVE_PLACEHOLDER): %v", v, err)
	}
	require.NoError(t, err)
	region := func(at uintptr) windows.MemoryBasicInformation {
		mbi, err := queryRegion(at)
		require.NoError(t, err)
		return mbi
	}
	at := func(i int) uintptr { return uintptr(sharedAt(privatePtr(base), i*g)) }
	mbi := region(base)
	require.Equal(t, uintptr(4*g), mbi.RegionSize, "one placeholder of 4 units")
	require.Equal(t, uint32(windows.MEM_RESERVE), mbi.State)

	require.NoError(t, placeholderSplit(at(1), g), "split the second unit off")
	require.Equal(t, uintptr(g), region(base).RegionSize, "the first unit is a placeholder of its own")
	require.Equal(t, uintptr(g), region(at(1)).RegionSize)
	require.Equal(t, uintptr(2*g), region(at(2)).RegionSize)

	h, err := sectionCreate(g)
	require.NoError(t, err)
	defer windows.CloseHandle(h)
	require.NoError(t, placeholderMap(h, at(1), 0, g, false), "a view replaces the placeholder")
	mbi = region(at(1))
	require.Equal(t, uint32(windows.MEM_COMMIT), mbi.State)
	require.Equal(t, uint32(0x40000), mbi.Type, "MEM_MAPPED")
	p := (*uint64)(sharedAt(privatePtr(base), g))
	*p = 0xfeed
	v, err := sectionView(h, g)
	require.NoError(t, err)
	require.Equal(t, uint64(0xfeed), *(*uint64)(v), "the view shows the section")
	require.NoError(t, windows.UnmapViewOfFile(uintptr(v)))

	require.NoError(t, placeholderUnmap(at(1)), "unmap, keeping a placeholder")
	mbi = region(at(1))
	require.Equal(t, uint32(windows.MEM_RESERVE), mbi.State)
	require.Equal(t, uintptr(g), mbi.RegionSize)

	require.NoError(t, placeholderCoalesce(base, 4*g), "coalesce the three placeholders")
	require.Equal(t, uintptr(4*g), region(base).RegionSize)
	require.NoError(t, placeholderFree(base))
	require.Equal(t, uint32(0x10000), region(base).State)

}
