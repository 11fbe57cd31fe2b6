package hosttier_test

import (
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kvtier/hosttier"
)

// fakeCgroup writes a cgroup mount under a temporary root: self is the content of
// the process's cgroup file, files maps paths under the root to contents.
func fakeCgroup(t *testing.T, self string, files map[string]string) (root, selfFile string) {
	t.Helper()
	root = t.TempDir()
	for p, c := range files {
		full := filepath.Join(root, p)
		require.NoError(t, os.MkdirAll(filepath.Dir(full), 0o755))
		require.NoError(t, os.WriteFile(full, []byte(c), 0o644))
	}
	selfFile = filepath.Join(t.TempDir(), "cgroup")
	require.NoError(t, os.WriteFile(selfFile, []byte(self), 0o644))
	return root, selfFile
}

func TestCgroupBudget(t *testing.T) {
	const mib = 1 << 20
	v1Self := "12:memory:/pod/app\n11:cpu,cpuacct:/pod/app\n0::/\n"
	tests := []struct {
		name   string
		self   string
		files  map[string]string
		budget int64
		refuse bool
		says   []string // in the error
	}{
		{"v2 fits", "0::/app\n", map[string]string{"app/memory.max": "1073741824\n", "app/memory.current": "104857600\n"}, 900 * mib, false, nil},
		{"v2 above", "0::/app\n", map[string]string{"app/memory.max": "1073741824\n", "app/memory.current": "104857600\n"}, 950 * mib,
			true, []string{"memory.max 1.0 GiB", "memory.current 100.0 MiB", "924.0 MiB (968884224 bytes) free", "950.0 MiB"}},
		{"v2 max", "0::/app\n", map[string]string{"app/memory.max": "max\n", "app/memory.current": "5\n"}, 1 << 40, false, nil},
		{"v2 parent tighter", "0::/a/b\n", map[string]string{
			"a/b/memory.max": "1073741824", "a/b/memory.current": "0",
			"a/memory.max": "209715200", "a/memory.current": "104857600",
		}, 101 * mib, true, []string{filepath.Join("a") + " has memory.max 200.0 MiB"}},
		{"v2 no files", "0::/app\n", map[string]string{"app/cgroup.procs": ""}, 1 << 40, false, nil},
		{"v2 namespaced: path not visible, root read", "0::/elsewhere/app\n", map[string]string{"memory.max": "104857600", "memory.current": "0"}, 101 * mib, true, nil},
		{"v1 above", v1Self, map[string]string{
			"memory/pod/app/memory.limit_in_bytes": "524288000", "memory/pod/app/memory.usage_in_bytes": "104857600",
		}, 401 * mib, true, []string{"memory.limit_in_bytes 500.0 MiB", "memory.usage_in_bytes 100.0 MiB"}},
		{"v1 fits", v1Self, map[string]string{
			"memory/pod/app/memory.limit_in_bytes": "524288000", "memory/pod/app/memory.usage_in_bytes": "104857600",
		}, 400 * mib, false, nil},
		{"v1 unlimited", v1Self, map[string]string{
			"memory/pod/app/memory.limit_in_bytes": "9223372036854771712", "memory/pod/app/memory.usage_in_bytes": "104857600",
		}, 1 << 40, false, nil},
		{"no memory controller", "3:cpu:/x\n", map[string]string{}, 1 << 40, false, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			root, self := fakeCgroup(t, tt.self, tt.files)
			tr, err := hosttier.New(hosttier.Options{Budget: tt.budget, CgroupRoot: root, CgroupSelf: self})
			if !tt.refuse {
				require.NoError(t, err)
				require.NoError(t, tr.Close())
				return
			}
			require.ErrorIs(t, err, hosttier.ErrCgroup)
			assert.Nil(t, tr)
			for _, s := range tt.says {
				assert.Contains(t, err.Error(), s)
			}
		})
	}
}

func TestCgroupUnreadable(t *testing.T) {
	root, self := fakeCgroup(t, "0::/app\n", map[string]string{"app/memory.max": "lots\n"})
	_, err := hosttier.New(hosttier.Options{Budget: 1 << 20, CgroupRoot: root, CgroupSelf: self})
	require.Error(t, err)
	assert.NotErrorIs(t, err, hosttier.ErrCgroup)
	assert.Contains(t, err.Error(), `not a byte count: "lots"`)

	// No cgroup file at all: no limit.
	tr, err := hosttier.New(hosttier.Options{Budget: 1 << 20, CgroupRoot: root, CgroupSelf: filepath.Join(root, "absent")})
	require.NoError(t, err)
	require.NoError(t, tr.Close())
}

// The real cgroup of this process: a budget above what it leaves free is refused.
func TestCgroupReal(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("cgroups are Linux's")
	}
	free, limited, err := hosttier.CgroupFree("", "")
	require.NoError(t, err)
	if !limited {
		t.Log("this process's memory cgroups set no limit")
		tr, err := hosttier.New(hosttier.Options{Budget: 1 << 40}) // reserves, commits nothing
		require.NoError(t, err)
		require.NoError(t, tr.Close())
		return
	}
	t.Logf("the memory cgroup leaves %d MiB free", free>>20)
	_, err = hosttier.New(hosttier.Options{Budget: free + 1<<30})
	assert.ErrorIs(t, err, hosttier.ErrCgroup)
}
