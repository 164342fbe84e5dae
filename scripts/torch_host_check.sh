#!/usr/bin/env bash
# Host checks of the PyTorch shim's C++ (torch_plugin/tests/host_check.cpp) on a machine with no
# GPU and no torch install: fetches the torch 2.11 wheel and the CUDA runtime headers from PyPI
# (about 570 MB, cached), compiles the shim against their headers and links it to their c10
# libraries and to libslotpool.so (simulated device). Needs network on first use; not part of CI.
#
#   ./scripts/torch_host_check.sh
#
# SLOTPOOL_WHEEL_CACHE: where wheels and extracted files go (default ~/.cache/slotpool/torch-host).
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${SLOTPOOL_WHEEL_CACHE:-$HOME/.cache/slotpool/torch-host}
PY=${PYTHON:-python3}
mkdir -p "$CACHE/wheels" "$CACHE/root"
WHEELS=(torch==2.11.0 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88)
if [ ! -f "$CACHE/root/.done" ]; then
  "$PY" -m pip download --quiet --no-deps --python-version 3.11 --only-binary=:all: \
    -d "$CACHE/wheels" "${WHEELS[@]}"
  for w in "$CACHE"/wheels/torch-2.11.0-*.whl; do
    unzip -q -o "$w" 'torch/include/*' 'torch/lib/libc10.so' 'torch/lib/libc10_cuda.so' \
      -d "$CACHE/root"
  done
  for w in "$CACHE"/wheels/nvidia_cuda_*.whl; do
    unzip -q -o "$w" 'nvidia/*' -d "$CACHE/root"
  done
  touch "$CACHE/root/.done"
fi
R=$CACHE/root
T=$R/torch/include
CUDA=$R/nvidia/cu13
cargo build --release -p slotpool-capi
PYINC=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
PYLIB=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))")
PYVER=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('LDVERSION'))")
OUT=target/torch-host
mkdir -p "$OUT"
g++ -std=c++17 -O1 -g -D_GLIBCXX_USE_CXX11_ABI=1 -I include -I "$T" -I "$T/torch/csrc/api/include" \
  -I "$CUDA/include" -I "$PYINC" \
  torch_plugin/csrc/slotpool_allocator.cpp torch_plugin/tests/host_check.cpp \
  -o "$OUT/host_check" \
  -L target/release -lslotpool -L "$R/torch/lib" -lc10 -lc10_cuda -L "$CUDA/lib" -l:libcudart.so.13 \
  -L "$PYLIB" "-lpython$PYVER" \
  -Wl,-rpath,"$PWD/target/release:$R/torch/lib:$CUDA/lib:$PYLIB"
"$OUT/host_check"
