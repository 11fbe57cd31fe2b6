#!/usr/bin/env bash
# gpu-check.sh: prove the CUDA backing on a real GPU. Two halves, because the GPU
# machine has no Go toolchain:
#
#   scripts/gpu-check.sh build        here: CGO_ENABLED=0 test binaries into bin/
#   OUT=/dir scripts/gpu-check.sh run  on the GPU machine: tests, benchmarks and the
#                                      PyTorch comparison, logs and a summary in $OUT
#   scripts/gpu-check.sh              both, on a GPU machine that has Go
#
# The binaries (bin/linux_amd64, bin/linux_arm64) are dynamically linked against glibc
# only and load libcuda.so.1 at run time (purego, no cgo). bin/ is git-ignored: a
# remote run must carry it. The run half took 75-100 s on an H200 (each step has its
# own timeout; together they stay under 15 minutes). See docs/gpu.md.
set -uo pipefail
cd "$(dirname "$0")/.."

# has_tests reports whether package dir $1 exists and has test files.
has_tests() { [ -d "$1" ] && compgen -G "$1/*_test.go" >/dev/null; }

build() {
	set -e
	for arch in amd64 arm64; do
		dir=bin/linux_$arch
		mkdir -p "$dir"
		CGO_ENABLED=0 GOOS=linux GOARCH=$arch go test -c -trimpath -o "$dir/cuda.test" ./backing/cuda
		if has_tests kv; then
			CGO_ENABLED=0 GOOS=linux GOARCH=$arch go test -c -trimpath -o "$dir/kv.test" ./kv
		fi
		if has_tests kvtier/hosttier; then
			CGO_ENABLED=0 GOOS=linux GOARCH=$arch go test -c -trimpath -o "$dir/hosttier.test" ./kvtier/hosttier
		fi
	done
	# Check the native binary here: the GPU tests must skip cleanly without a GPU and
	# pass on the fake driver, and a short benchmark must run.
	native=bin/linux_$(go env GOARCH)
	"$native/cuda.test" -test.run 'GPU' -test.count 1 >/dev/null
	"$native/cuda.test" -test.run 'GPU' -fakegpu -test.count 1 >/dev/null
	"$native/cuda.test" -test.run '^$' -test.bench 'Commit/driver=null/handle=pooled/granules=1$' -test.benchtime 100x >/dev/null
	if [ -x "$native/hosttier.test" ]; then
		# The host tier's CUDA benchmark runs on the fake driver (the GPU half skips).
		"$native/hosttier.test" -test.run '^$' -test.bench 'CUDATier' -test.benchtime 20x >/dev/null
	fi
	ls -l bin/linux_*/
	set +e
}

# step NAME SECONDS CMD...: runs CMD with a timeout, its output in $OUT/NAME.log.
step() {
	local name=$1 secs=$2
	shift 2
	local t0=$SECONDS
	echo "== $name: $*" | tee -a "$OUT/steps.txt"
	timeout --kill-after=10 "$secs" "$@" >"$OUT/$name.log" 2>&1
	local rc=$?
	echo "   rc=$rc in $((SECONDS - t0))s" | tee -a "$OUT/steps.txt"
	return $rc
}

# summarize turns go test -bench output into one line per benchmark: the median over
# the runs (-count) of ns/op, allocs/op and each p50/p99 metric.
summarize() {
	awk '
	/^Benchmark/ {
		name = $1; sub(/-[0-9]+$/, "", name)
		if (!(name in seen)) { seen[name] = 1; names[++nn] = name }
		for (i = 3; i < NF; i++) {
			unit = $(i + 1)
			if (unit == "ns/op" || unit == "allocs/op" || unit == "ns/step" || unit ~ /^(p50|p99|max)-ns\//) {
				key = name SUBSEP unit
				if (!(key in cnt)) units[name] = units[name] " " unit
				cnt[key]++; val[key, cnt[key]] = $i + 0
			}
		}
	}
	function median(key,    m, a, b, t, s) {
		m = cnt[key]
		for (a = 1; a <= m; a++) s[a] = val[key, a]
		for (a = 1; a <= m; a++) for (b = a + 1; b <= m; b++) if (s[b] < s[a]) { t = s[a]; s[a] = s[b]; s[b] = t }
		return (m % 2) ? s[(m + 1) / 2] : (s[m / 2] + s[m / 2 + 1]) / 2
	}
	END {
		for (j = 1; j <= nn; j++) {
			name = names[j]
			printf "%s (runs: %d)\n", name, cnt[name SUBSEP "ns/op"]
			k = split(substr(units[name], 2), us, " ")
			for (a = 1; a <= k; a++) printf "    %-22s %12.0f\n", us[a], median(name SUBSEP us[a])
		}
	}' "$@"
}

run() {
	: "${OUT:?set OUT to the folder the logs go to}"
	mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) # absolute: a step runs in kv/
	local arch
	case "$(uname -m)" in
	x86_64) arch=amd64 ;;
	aarch64 | arm64) arch=arm64 ;;
	*) echo "gpu-check: no binaries for $(uname -m)" >&2; return 1 ;;
	esac
	local bin=$PWD/bin/linux_$arch
	[ -x "$bin/cuda.test" ] || { echo "gpu-check: $bin/cuda.test missing: run '$0 build' first (and carry bin/)" >&2; return 1; }
	: >"$OUT/steps.txt"

	{
		echo "date: $(date -u +%FT%TZ)"
		echo "host: $(uname -a)"
		nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,compute_cap --format=csv 2>&1
		nvidia-smi 2>&1 | head -15
		ldconfig -p 2>/dev/null | grep -E 'libcuda\.so' || echo "libcuda.so not in the ldconfig cache"
		python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -1
	} >"$OUT/env.txt" 2>&1
	cat "$OUT/env.txt"

	# 1. The real-GPU tests: the conformance suite on the real driver (plain and
	#    pooled), the round trip, the shared-prefix aliasing test (write through A,
	#    sync, read through B; unmap A, B still reads), pool reuse, cuMemGetInfo, the
	#    driver's own rules.
	step cuda-gpu-tests 150 "$bin/cuda.test" -test.run 'GPU' -test.v -test.count 1 -test.timeout 140s
	grep -E '^(--- |ok|FAIL|PASS)|gpu_test.go:[0-9]+: (driver|free)' "$OUT/cuda-gpu-tests.log" | grep -v '^    ---' | head -60
	# 1b. Granules across two processes (issue 42): this process commits and writes
	#     granules of an exportable Backing and exports them
	#     (cuMemExportToShareableHandle); a helper process, the same binary started by
	#     the test, takes the descriptors by SCM_RIGHTS, imports and maps them
	#     (cuMemImportFromShareableHandle, cuMemMap, cuMemSetAccess), reads the bytes
	#     bit-exact and writes its own, which the first process reads back. Both use
	#     the system driver (the default; -fakegpu would pick the fake, and the test
	#     tells its helper which by CUDA_TEST_HELPER_DRIVER). Then the other way round,
	#     with the exporting helper killed by SIGKILL after the import: whether the
	#     driver keeps the imported memory valid, bit-exact and writable. Each skips,
	#     logging why, where the driver refuses exportable allocations, the export or
	#     the import. (Step 1 runs them too; this log holds them alone.)
	step cuda-gpu-export 60 "$bin/cuda.test" -test.run 'GPUExportImport' -test.v -test.count 1 -test.timeout 50s
	grep -E '^(--- |ok|FAIL|PASS)|    exportproc_linux_test.go:[0-9]+: ' "$OUT/cuda-gpu-export.log" | head -20
	# 2. The kv package's tests that touch CUDA, if it has any.
	if [ -x "$bin/kv.test" ]; then
		(cd kv && step kv-gpu-tests 60 "$bin/kv.test" -test.run 'GPU|CUDA|Cuda' -test.v -test.count 1 -test.timeout 50s)
		tail -5 "$OUT/kv-gpu-tests.log"
	fi
	# 3. Benchmarks on the GPU (5 runs for medians, 8 for the KV cache's steps), and the
	#    Go side alone (null driver).
	step bench-gpu 200 "$bin/cuda.test" -test.run '^$' -test.bench '/driver=gpu' -test.count 5 -test.benchtime 1s -test.timeout 190s
	if [ -x "$bin/kv.test" ]; then
		(cd kv && step kv-bench-gpu 90 "$bin/kv.test" -test.run '^$' -test.bench 'CUDAAppendStep/driver=gpu' -test.count 8 -test.benchtime 5x -test.timeout 80s)
	fi
	step bench-null 60 "$bin/cuda.test" -test.run '^$' -test.bench '/driver=null' -test.count 3 -test.benchtime 0.3s -test.timeout 50s
	# 3b. The host tier below the device (kvtier/hosttier, issue 28): GB/s per 2 MiB block
	#     DtoH, HtoD and both ways through the tier's pinned memory and stream, against
	#     cuMemcpy*Async of the same bytes to a pinned buffer (tier/raw-%, target >= 70),
	#     and the tier's CUDA tests.
	if [ -x "$bin/hosttier.test" ]; then
		step hosttier-gpu 90 "$bin/hosttier.test" -test.run 'CUDA' -test.bench 'CUDATier/driver=gpu' -test.count 5 -test.benchtime 200x -test.timeout 80s
	fi
	# 4. PyTorch growing the same tensor with expandable segments (and the default
	#    allocator for reference).
	PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True step torch-expandable 90 python3 scripts/torch_grow.py --repeat 50
	step torch-default 60 python3 scripts/torch_grow.py --repeat 30
	# 5. The KV layouts' attention read on the GPU (docs/gpu.md, "The KV layout").
	PYTHONUNBUFFERED=1 step layout-read 150 python3 scripts/gpu_layout_read.py
	# 6. The summary.
	{
		echo "# vmarena CUDA backing: $(head -1 "$OUT/env.txt")"
		sed -n '2,3p' "$OUT/env.txt"
		echo
		echo "## Granules across two processes (export, SCM_RIGHTS, import)"
		grep -E '^(--- |ok|FAIL)|    exportproc_linux_test.go:[0-9]+: ' "$OUT/cuda-gpu-export.log"
		echo
		echo "## Go benchmarks on the GPU (medians of p50 over the runs)"
		summarize "$OUT/bench-gpu.log"
		[ -f "$OUT/kv-bench-gpu.log" ] && summarize "$OUT/kv-bench-gpu.log"
		echo
		echo "## Go side alone (null driver) on this machine's CPU"
		summarize "$OUT/bench-null.log"
		if [ -f "$OUT/hosttier-gpu.log" ]; then
			echo
			echo "## Host tier: 2 MiB blocks through pinned memory and the tier's stream, vs raw async copies"
			grep -E '^(BenchmarkCUDATier|--- FAIL|ok|FAIL)' "$OUT/hosttier-gpu.log"
		fi
		echo
		echo "## PyTorch, expandable segments"
		cat "$OUT/torch-expandable.log"
		echo
		echo "## PyTorch, default allocator"
		cat "$OUT/torch-default.log"
		echo
		echo "## KV layouts, attention read per layer"
		cat "$OUT/layout-read.log"
		echo
		echo "## steps"
		cat "$OUT/steps.txt"
	} >"$OUT/summary.txt" 2>&1
	cat "$OUT/summary.txt"
}

case "${1:-all}" in
build) build ;;
run) run ;;
summarize) shift; summarize "$@" ;;
all) build && OUT=${OUT:-out/gpu-check} run ;;
*) echo "usage: $0 [build|run|summarize FILE...|all]" >&2; exit 2 ;;
esac
