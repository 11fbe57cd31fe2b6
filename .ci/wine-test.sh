#!/usr/bin/env bash
# Runs the Windows test binaries under Wine (Debian's wine64, 8.0) and fails when one
# fails. Needs root for apt-get where wine64 or the MinGW compiler is missing. About
# 90 s after .ci/run's Windows cross-build (most of it building the test binaries and
# starting the prefix), plus about 70 s for the apt install on a fresh machine.
#
# NB: a Go 1.24+ Windows binary takes its random bytes from ProcessPrng in
# bcryptprimitives.dll, which Wine 8.0 lacks: the runtime dies at start with
# "bcryptprimitives.dll not found". .ci/wine/processprng.c is that one export over
# advapi32's RtlGenRandom; it goes into the private prefix's system32, where the Go
# runtime looks for system DLLs.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v wine64 >/dev/null || [ -x /usr/lib/wine/wine64 ] || need_apt+=(wine64)
command -v x86_64-w64-mingw32-gcc >/dev/null || need_apt+=(gcc-mingw-w64-x86-64)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "== installing ${need_apt[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi
wine=$(command -v wine64 || echo /usr/lib/wine/wine64)
wineserver=$(command -v wineserver || command -v wineserver64 || echo /usr/lib/wine/wineserver64)

work=$(mktemp -d)
export WINEPREFIX="$work/prefix" WINEDEBUG=-all WINEDLLOVERRIDES="mscoree,mshtml="
cleanup() {
  "$wineserver" -k >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

echo "== wine prefix ($("$wine" --version))"
SECONDS=0
timeout 300 "$wine" wineboot --init >"$work/wineboot.log" 2>&1 || { cat "$work/wineboot.log"; exit 1; }
x86_64-w64-mingw32-gcc -O2 -shared -o "$WINEPREFIX/drive_c/windows/system32/bcryptprimitives.dll" \
  .ci/wine/processprng.c -ladvapi32

# The packages whose tests run under Wine (the CUDA ones need a driver Wine can not
# provide; examples are covered by their own Linux runs). One go test -c builds them
# all, in parallel.
pkgs=(accounting backing backing/backingtest backing/host arena kv)
mkdir "$work/bin"
echo "   ${SECONDS}s"
GOOS=windows GOARCH=amd64 go test -c -o "$work/bin/" "${pkgs[@]/#/./}"
echo "== test binaries built (${SECONDS}s)"
fail=0
for p in "${pkgs[@]}"; do
  bin="$work/bin/$(basename "$p").test.exe"
  # NB: each binary runs from its package directory, as go test would run it; -test.v
  # only so that the skips can be listed below, the output shows on failure.
  if (cd "$p" && timeout 600 "$wine" "$bin" -test.v -test.timeout 9m) >"$work/out" 2>&1; then
    echo "ok   $p ($(grep -c -- '--- PASS' "$work/out") passed, $(grep -c -- '--- SKIP' "$work/out") skipped, ${SECONDS}s)"
  else
    echo "FAIL $p"; grep -v -e '^=== ' -e '--- PASS' "$work/out" | tail -200; fail=1
  fi
  # What Wine can not run is skipped by name, with the reason; say what was emulated.
  grep 'under Wine' "$work/out" | grep -v 'emulating them' | sed 's/^ */    skip: /' || true
  grep -m1 -o 'under Wine .*: emulating them' "$work/out" | sed 's/^/    note: /' || true
done
# With WINE_RACE=1, the Windows shared backing once more under the race detector
# (cgo through MinGW): its pool runs calls outside the backing's lock. Not by
# default: building the race runtime for Windows takes about three minutes here.
if [ "${WINE_RACE:-0}" = 1 ]; then
  GOOS=windows GOARCH=amd64 CGO_ENABLED=1 CC=x86_64-w64-mingw32-gcc \
    go test -race -c -o "$work/bin/host-race.test.exe" ./backing/host
  if (cd backing/host && timeout 600 "$wine" "$work/bin/host-race.test.exe" -test.run 'Shared|Placeholder' -test.timeout 9m) >"$work/out" 2>&1; then
    echo "ok   backing/host -race, Shared and placeholder tests (${SECONDS}s)"
  else
    echo "FAIL backing/host -race"; tail -200 "$work/out"; fail=1
  fi
fi
echo "== done (${SECONDS}s)"
exit $fail
