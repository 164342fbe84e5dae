#!/usr/bin/env bash
# Installs the CUDA 13 runtime (libcudart.so.13 and the runtime headers) from NVIDIA's
# nvidia-cuda-runtime wheel, for tests that need a real libcudart but no GPU (the LD_PRELOAD
# tests of crates/slotpool-preload run this script when the directory is missing).
#
#   scripts/fetch-cudart.sh [DEST]        DEST defaults to target/cudart-wheel
#
# Afterwards: DEST/nvidia/cu13/lib/libcudart.so.13 and DEST/nvidia/cu13/include/.
# Needs python3 with pip and network access (PyPI); exits non-zero if either is missing.
# CUDART_WHEEL_VERSION picks another version (default: 13.0.96, the newest 13.0.x on PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."

dest="${1:-target/cudart-wheel}"
version="${CUDART_WHEEL_VERSION:-13.0.96}"
lib="$dest/nvidia/cu13/lib/libcudart.so.13"

if [ -f "$lib" ]; then
  echo "fetch-cudart: $lib already present"
  exit 0
fi

pip=()
if python3 -m pip --version >/dev/null 2>&1; then
  pip=(python3 -m pip)
elif command -v pip3 >/dev/null 2>&1; then
  pip=(pip3)
else
  echo "fetch-cudart: no pip (python3 -m pip, pip3) found" >&2
  exit 1
fi

# Install into a private directory, then move it into place, so that two concurrent runs (a
# debug and a release test, say) never see a half-installed wheel.
mkdir -p "$(dirname "$dest")"
tmp="$(mktemp -d "$dest.tmp.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
PIP_ROOT_USER_ACTION=ignore "${pip[@]}" install --quiet --disable-pip-version-check --no-deps --no-compile \
  --target "$tmp" "nvidia-cuda-runtime==$version"
if [ ! -f "$tmp/nvidia/cu13/lib/libcudart.so.13" ]; then
  echo "fetch-cudart: the wheel has no nvidia/cu13/lib/libcudart.so.13" >&2
  exit 1
fi
if mv -T "$tmp" "$dest" 2>/dev/null; then
  trap - EXIT
elif [ -f "$lib" ]; then
  : # another run installed it meanwhile
else
  echo "fetch-cudart: could not move $tmp to $dest" >&2
  exit 1
fi
echo "fetch-cudart: installed nvidia-cuda-runtime==$version into $dest"
