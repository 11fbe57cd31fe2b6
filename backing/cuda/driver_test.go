package cuda_test

import (
	"errors"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/cuda"
)

func TestSymbolTable(t *testing.T) {
	names, fields := cuda.SymbolNames()
	// Every func field of Driver is bound exactly once.
	typ := reflect.TypeOf(cuda.Driver{})
	assert.Equal(t, typ.NumField(), len(names), "one symbol per Driver field")
	seen := map[uintptr]bool{}
	for i, f := range fields {
		p := reflect.ValueOf(f).Pointer()
		assert.False(t, seen[p], "field bound twice: %s", names[i])
		seen[p] = true
	}
	// The entry points whose unsuffixed names still carry the CUDA 2.0 ABI (32-bit
	// pointers and sizes) must be bound to their _v2 symbols.
	v2 := []string{"cuMemGetInfo", "cuMemsetD8", "cuMemcpyHtoD", "cuMemcpyDtoH", "cuMemcpyDtoD", "cuDevicePrimaryCtxRelease"}
	for _, base := range v2 {
		assert.Contains(t, names, base+"_v2")
		assert.NotContains(t, names, base, "legacy ABI symbol %s", base)
	}
	// The other legacy names that must never be bound.
	for _, legacy := range []string{"cuCtxCreate", "cuCtxDestroy", "cuMemAlloc", "cuMemFree", "cuCtxCreate_v2"} {
		assert.NotContains(t, names, legacy)
	}
	// The VMM entry points have no suffix (they date from CUDA 10.2).
	for _, vmm := range []string{"cuMemAddressReserve", "cuMemAddressFree", "cuMemCreate", "cuMemRelease",
		"cuMemMap", "cuMemUnmap", "cuMemSetAccess", "cuMemGetAllocationGranularity"} {
		assert.Contains(t, names, vmm)
	}
	// So do the export entry points, and they are bound by their own names: the
	// export writes a descriptor, the import takes one by value.
	for _, export := range []string{"cuMemExportToShareableHandle", "cuMemImportFromShareableHandle"} {
		assert.Contains(t, names, export)
		assert.NotContains(t, names, export+"_v2")
	}
	for _, n := range names {
		assert.True(t, strings.HasPrefix(n, "cu"), n)
		assert.False(t, strings.HasSuffix(n, "_v3"), n)
	}
	assert.Equal(t, len(names), len(slices.Compact(slices.Sorted(slices.Values(names)))), "names are unique")
}

func TestLoadDriverMissingSymbols(t *testing.T) {
	// libc loads but has none of the driver's symbols: an error, never a panic.
	d, err := cuda.LoadDriverFrom("libc.so.6")
	require.Error(t, err)
	assert.Nil(t, d)
	assert.ErrorIs(t, err, cuda.ErrMissingSymbol)
	assert.NotErrorIs(t, err, cuda.ErrNoDriver)
	assert.Contains(t, err.Error(), "cuMemCreate")
	assert.Contains(t, err.Error(), "cuMemsetD8_v2")
}

func TestLoadDriverNoLibrary(t *testing.T) {
	d, err := cuda.LoadDriverFrom("libcuda-does-not-exist.so.1")
	require.Error(t, err)
	assert.Nil(t, d)
	assert.ErrorIs(t, err, cuda.ErrNoDriver)
	assert.ErrorIs(t, err, backing.ErrUnsupported, "a caller falls back on ErrUnsupported")
	assert.NotErrorIs(t, err, cuda.ErrMissingSymbol)
}

// On a machine without a driver, LoadDriver and New fail with the clean error.
func TestLoadDriverSystem(t *testing.T) {
	d, err := cuda.LoadDriver()
	if err != nil {
		assert.True(t, errors.Is(err, cuda.ErrNoDriver) || errors.Is(err, cuda.ErrMissingSymbol), "%v", err)
		assert.Nil(t, d)
		_, nerr := cuda.New(cuda.Options{Authority: gpuAuthority(0)})
		assert.ErrorIs(t, nerr, err, "New without a Driver reports LoadDriver's error")
		return
	}
	require.NotNil(t, d)
	d2, err := cuda.LoadDriver()
	require.NoError(t, err)
	assert.Same(t, d, d2, "the system driver is loaded once")
}

func TestResultError(t *testing.T) {
	oom := &cuda.Result{Func: "cuMemCreate", Code: cuda.CodeOutOfMemory, Name: "CUDA_ERROR_OUT_OF_MEMORY"}
	assert.ErrorIs(t, oom, backing.ErrOutOfMemory)
	assert.NotErrorIs(t, oom, backing.ErrUnsupported)
	assert.Equal(t, "cuda: cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY (2)", oom.Error())
	ns := &cuda.Result{Func: "cuMemMap", Code: cuda.CodeNotSupported, Name: "CUDA_ERROR_NOT_SUPPORTED"}
	assert.ErrorIs(t, ns, backing.ErrUnsupported)
	assert.NotErrorIs(t, ns, backing.ErrOutOfMemory)
	inv := &cuda.Result{Func: "cuMemMap", Code: cuda.CodeInvalidValue}
	assert.NotErrorIs(t, inv, backing.ErrOutOfMemory)
	assert.NotErrorIs(t, inv, backing.ErrUnsupported)

	assert.Equal(t, "CUDA_ERROR_STUB_LIBRARY", cuda.CodeStubLibrary.String())
	assert.Equal(t, "CUresult(12345)", cuda.Code(12345).String())
}

func TestSentinelsDistinct(t *testing.T) {
	all := []error{cuda.ErrNoDriver, cuda.ErrStubLibrary, cuda.ErrNoDevice, cuda.ErrNoVMM, cuda.ErrNoExport,
		cuda.ErrMissingSymbol, cuda.ErrBadDevice, cuda.ErrBadOptions, cuda.ErrBadGranularity,
		cuda.ErrReadOnly, cuda.ErrBusy, cuda.ErrNotExportable, cuda.ErrBadDescriptor}
	for i, a := range all {
		assert.True(t, strings.HasPrefix(a.Error(), "cuda: "), "%v", a)
		for j, b := range all {
			if i != j {
				assert.NotErrorIs(t, a, b, "%v is not %v", a, b)
			}
		}
	}
	for _, a := range all[:5] {
		assert.ErrorIs(t, a, backing.ErrUnsupported, "%v", a)
	}
	for _, a := range all[5:] {
		assert.NotErrorIs(t, a, backing.ErrUnsupported, "%v", a)
	}
}
