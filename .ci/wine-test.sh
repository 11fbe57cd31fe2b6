#!/usr/bin/env bash
# Runs the Windows test binaries under Wine 10.0 and fails when one fails. Wine runs
# in a Debian 13 (trixie) root of its own, since Debian 12's Wine 8.0 refuses
# placeholders (VirtualAlloc2 MEM_RESERVE_PLACEHOLDER) and lacks ProcessPrng, which
# the Go runtime needs to start: under Wine 10.0 host.Shared runs on the system's
# placeholders, as on Windows. The binaries are cross-built on this machine and
# bind-mounted into the root with the source tree.
#
# The root is made once, with debootstrap from Debian's packages, and kept in
# $VMARENA_WINE_ROOT (default /var/cache/vmarena-wine-trixie) for later runs: making it
# took about two minutes on 2 cores (debootstrap ~40 s, Wine's packages ~75 s; four
# minutes while other work loaded the machine), 1.5 GB. A run on the cached root took
# 3.5 minutes on the loaded machine: 80 s building the test binaries, 100 s of it kv's.
# Needs root (debootstrap, mount, chroot).
set -euo pipefail
cd "$(dirname "$0")/.."

root=${VMARENA_WINE_ROOT:-/var/cache/vmarena-wine-trixie}
# The Debian mirror: $VMARENA_DEBIAN_MIRROR, else the one this machine's apt uses (its
# deb822 sources, then sources.list), else debootstrap's own default.
mirror=${VMARENA_DEBIAN_MIRROR:-}
if [ -z "$mirror" ]; then
  mirror=$(sed -n 's/^URIs:[[:space:]]*\([^[:space:]]*\).*/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null |
    grep -v -- '-security' | head -n 1 || true)
fi
if [ -z "$mirror" ] && [ -f /etc/apt/sources.list ]; then
  mirror=$(awk '$1 == "deb" && $0 !~ /-security/ { for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) { print $i; exit } }' /etc/apt/sources.list)
fi
src=$(pwd)
SECONDS=0

# in_root DIR CMD... runs CMD in the root DIR, with /proc, /dev and /tmp, the source
# tree at /vmarena/src and this run's work directory at /vmarena/work. NB: the mounts
# live in a mount namespace of their own (unshare), so they vanish with it even when
# the run is killed; the trap unmounts them as soon as CMD ends, whatever its status.
in_root() {
  local dir=$1
  shift
  unshare --mount --propagation private -- bash -euo pipefail -c '
    dir=$1 src=$2 work=$3
    shift 3
    trap "umount -R \"\$dir/vmarena/work\" \"\$dir/vmarena/src\" \"\$dir/tmp\" \"\$dir/dev\" \"\$dir/proc\" 2>/dev/null || true" EXIT
    mount -t proc proc "$dir/proc"
    mount --rbind /dev "$dir/dev"
    mount -t tmpfs tmpfs "$dir/tmp"
    mount --bind "$src" "$dir/vmarena/src"
    mount --bind "$work" "$dir/vmarena/work"
    chroot "$dir" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
      WINEPREFIX=/vmarena/work/prefix WINEARCH=win64 WINEDEBUG=-all WINEDLLOVERRIDES="mscoree,mshtml=" \
      DEBIAN_FRONTEND=noninteractive "$@"
  ' in_root "$dir" "$src" "$work" "$@"
}

work=$(mktemp -d)
cleanup() { rm -rf "$work"; }
trap cleanup EXIT

# Make the root where no run made it yet. One run makes it at a time (flock); it is
# made beside its final place and moved there only when whole, so an interrupted
# build leaves nothing a later run would trust.
mkdir -p "$(dirname "$root")"
exec 9>"$root.lock"
flock 9
if [ ! -e "$root/vmarena/ready" ]; then
  echo "== making the Wine root $root (debootstrap trixie, then wine64 wine)"
  if ! command -v debootstrap >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
  fi
  new="$root.new"
  rm -rf "$new" "$root"
  debootstrap --variant=minbase trixie "$new" ${mirror:+"$mirror"} >"$work/debootstrap.log" 2>&1 || {
    tail -50 "$work/debootstrap.log"
    exit 1
  }
  mkdir -p "$new/vmarena/src" "$new/vmarena/work"
  cp /etc/resolv.conf "$new/etc/resolv.conf"
  in_root "$new" sh -c 'apt-get update -qq && apt-get install -y -qq --no-install-recommends wine64 wine && apt-get clean' \
    >"$work/apt.log" 2>&1 || {
    tail -50 "$work/apt.log"
    exit 1
  }
  touch "$new/vmarena/ready"
  mv "$new" "$root"
  echo "   made in ${SECONDS}s"
fi
flock -u 9

# NB: placeholders came with Wine 9; an older Wine in the root would have the tests
# emulate them and test nothing of the real path.
version=$(in_root "$root" wine --version)
case $version in
wine-[1-9][0-9].*) ;;
*)
  echo "the root's Wine is $version: need 10 or later (rm -rf $root to make it anew)"
  exit 1
  ;;
esac
echo "== $version in $root (${SECONDS}s)"
in_root "$root" sh -c 'timeout 300 wine wineboot --init && wineserver -w' >"$work/wineboot.log" 2>&1 || {
  cat "$work/wineboot.log"
  exit 1
}

# The packages whose tests run under Wine (the CUDA ones need a driver Wine can not
# provide; examples are covered by their own Linux runs). One go test -c builds them
# all, in parallel. WINE_PKGS (a space-separated list) runs fewer, for a quick look.
read -r -a pkgs <<<"${WINE_PKGS:-accounting backing backing/backingtest backing/host arena kv kvtier/hosttier kvtier/tiertest kvtier/filetier}"
mkdir "$work/bin"
GOOS=windows GOARCH=amd64 go test -c -o "$work/bin/" "${pkgs[@]/#/./}"
echo "== test binaries built (${SECONDS}s)"
fail=0
for p in "${pkgs[@]}"; do
  bin="/vmarena/work/bin/$(basename "$p").test.exe"
  # NB: each binary runs from its package directory, as go test would run it; -test.v
  # only so that the skips can be listed below, the output shows on failure.
  # wineserver -k: the next binary starts a server of its own, in a namespace of its own.
  if in_root "$root" sh -c 'cd "/vmarena/src/$1" && timeout 600 wine "$2" -test.v -test.timeout 9m; rc=$?; wineserver -k; exit $rc' sh "$p" "$bin" >"$work/out" 2>&1; then
    echo "ok   $p ($(grep -c -- '--- PASS' "$work/out") passed, $(grep -c -- '--- SKIP' "$work/out") skipped, ${SECONDS}s)"
  else
    echo "FAIL $p"
    grep -v -e '^=== ' -e '--- PASS' "$work/out" | tail -200
    fail=1
  fi
  # Say what was skipped, with the reason: the test's last log line before its
  # "--- SKIP".
  awk '/^ +[^ ]+_test\.go:[0-9]+: / { why = $0 } /--- SKIP/ { sub(/^ +/, "", why); print "    skip: " $3 ": " why }' "$work/out"
  # Wine 10 has placeholders: a test that emulates them did not run the real path.
  if grep -q 'emulating them' "$work/out"; then
    echo "FAIL $p: placeholders were emulated under $version"
    grep -m1 'emulating them' "$work/out"
    fail=1
  fi
done
# With WINE_RACE=1, the Windows shared backing once more under the race detector
# (cgo through MinGW): its pool runs calls outside the backing's lock. Not by
# default: building the race runtime for Windows takes about three minutes here.
if [ "${WINE_RACE:-0}" = 1 ]; then
  if ! command -v x86_64-w64-mingw32-gcc >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc-mingw-w64-x86-64 >/dev/null
  fi
  GOOS=windows GOARCH=amd64 CGO_ENABLED=1 CC=x86_64-w64-mingw32-gcc \
    go test -race -c -o "$work/bin/host-race.test.exe" ./backing/host
  if in_root "$root" sh -c 'cd /vmarena/src/backing/host && timeout 600 wine /vmarena/work/bin/host-race.test.exe -test.run "Shared|Placeholder" -test.timeout 9m; rc=$?; wineserver -k; exit $rc' >"$work/out" 2>&1; then
    echo "ok   backing/host -race, Shared and placeholder tests (${SECONDS}s)"
  else
    echo "FAIL backing/host -race"
    tail -200 "$work/out"
    fail=1
  fi
fi
# With WINE_BENCH=regexp, those benchmarks of backing/host too, six times each (for
# benchstat): figures of Wine on this machine, not of Windows.
if [ -n "${WINE_BENCH:-}" ]; then
  echo "== backing/host benchmarks $WINE_BENCH under $version"
  in_root "$root" sh -c 'cd /vmarena/src/backing/host && timeout 600 wine /vmarena/work/bin/host.test.exe -test.run "^$" -test.bench "$1" -test.count 6; rc=$?; wineserver -k; exit $rc' sh "$WINE_BENCH" || fail=1
fi
# With WINE_FUZZ=name, that fuzz target of backing/host (the Windows-only ones, such as
# FuzzSharedOpsWindows, run nowhere else) for WINE_FUZZTIME (default 10m) with one
# worker; a failing input lands in backing/host/testdata/fuzz as under go test.
if [ -n "${WINE_FUZZ:-}" ]; then
  echo "== backing/host $WINE_FUZZ under $version for ${WINE_FUZZTIME:-10m}"
  mkdir -p "$work/fuzzcache"
  # NB: built as go test -fuzz builds it, the module's packages instrumented for
  # coverage (-d=libfuzzer), so the run is guided, not random.
  GOOS=windows GOARCH=amd64 go test -c -gcflags="$(go list -m)/...=-d=libfuzzer" -o "$work/bin/host-fuzz.test.exe" ./backing/host
  # -fuzzminimizetime 100x as in docs/benchmarks/fuzz.md.
  in_root "$root" sh -c 'cd /vmarena/src/backing/host && timeout 7200 wine /vmarena/work/bin/host-fuzz.test.exe -test.run "^$" -test.fuzz "^$1\$" -test.fuzztime "$2" -test.fuzzminimizetime 100x -test.parallel 1 -test.fuzzcachedir /vmarena/work/fuzzcache; rc=$?; wineserver -k; exit $rc' sh "$WINE_FUZZ" "${WINE_FUZZTIME:-10m}" || fail=1
fi
echo "== done (${SECONDS}s)"
exit $fail
