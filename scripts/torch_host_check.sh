#!/usr/bin/env bash
# Host checks of the PyTorch shim's C++ (torch_plugin/tests/host_check.cpp): the allocator object
# runs on slotpool's simulated device and is called directly, never installed into PyTorch, so no
# GPU is needed. Compiles the shim against torch 2.11's headers and links it to torch's c10
# libraries and to libslotpool.so.
#
#   ./scripts/torch_host_check.sh                 compile, link and run the checks
#   ./scripts/torch_host_check.sh --syntax-only   compile every torch_plugin/csrc/*.cpp (the Python
#                                                 bindings too), the checks and the GPU bench's
#                                                 C++ (benches/gpu/ckpt_state_set.cpp), warnings
#                                                 as errors; needs neither libslotpool.so nor Rust
#   ./scripts/torch_host_check.sh --bench [N] [R] the setCheckpointPoolState binding's host cost
#                                                 (torch_plugin/tests/graph_state_bench.cpp: N
#                                                 live blocks, default 10000, R repeats), -O2;
#                                                 BENCH_WRAP runs it under a tool (callgrind)
#
# Where torch 2.11 is installed (the GPU machine), its headers and libraries are used, with the
# CUDA toolkit's (CUDA_HOME, default /usr/local/cuda). Elsewhere the torch wheel and the CUDA
# runtime headers are fetched from PyPI (about 570 MB, cached in SLOTPOOL_WHEEL_CACHE, default
# ~/.cache/slotpool/torch-host), so that first run needs network; it is not part of CI.
# SLOTPOOL_LIB: a built libslotpool.so to use (default: cargo build --release -p slotpool-capi).
set -euo pipefail
cd "$(dirname "$0")/.."
SYNTAX_ONLY=0
BENCH=0
case ${1:-} in
  --syntax-only) SYNTAX_ONLY=1 ;;
  --bench) BENCH=1; shift ;;
  "") ;;
  *) echo "torch_host_check.sh: unknown argument $1 (--syntax-only, --bench or none)" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
if "$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.11") else 1)' 2>/dev/null; then
  TORCH=$("$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__))')
  T=$TORCH/include
  TLIB=$TORCH/lib
  CUDA=${CUDA_HOME:-/usr/local/cuda}
  CUDA_INC=$CUDA/include
  CUDA_LIB=$CUDA/lib64
  CUDART=-lcudart
else
  CACHE=${SLOTPOOL_WHEEL_CACHE:-$HOME/.cache/slotpool/torch-host}
  mkdir -p "$CACHE/wheels" "$CACHE/root"
  if [ ! -f "$CACHE/root/.done" ]; then
    "$PY" -m pip download --quiet --no-deps --python-version 3.11 --only-binary=:all: \
      -d "$CACHE/wheels" torch==2.11.0 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88
    for w in "$CACHE"/wheels/torch-2.11.0-*.whl; do
      unzip -q -o "$w" 'torch/include/*' 'torch/lib/libc10.so' 'torch/lib/libc10_cuda.so' \
        -d "$CACHE/root"
    done
    for w in "$CACHE"/wheels/nvidia_cuda_*.whl; do
      unzip -q -o "$w" 'nvidia/*' -d "$CACHE/root"
    done
    touch "$CACHE/root/.done"
  fi
  T=$CACHE/root/torch/include
  TLIB=$CACHE/root/torch/lib
  CUDA_INC=$CACHE/root/nvidia/cu13/include
  CUDA_LIB=$CACHE/root/nvidia/cu13/lib
  CUDART=-l:libcudart.so.13
fi
PYINC=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
# The shim's sources as the extension builds them (slotpool_torch._loader, which needs no torch).
sources() { # allocator | all
  "$PY" -c 'import sys; sys.path.insert(0, "torch_plugin"); from slotpool_torch import _loader as l
print(" ".join("torch_plugin/csrc/" + s for s in (l.ALLOCATOR_SOURCES if sys.argv[1] == "allocator" else l.SOURCES)))' "$1"
}
if [ "$SYNTAX_ONLY" = 1 ]; then
  # torch's, CUDA's and Python's headers as system headers: the warnings are the shim's own.
  for f in $(sources all) torch_plugin/tests/host_check.cpp torch_plugin/tests/graph_state_bench.cpp \
    benches/gpu/ckpt_state_set.cpp; do
    echo "syntax: $f"
    g++ -std=c++17 -fsyntax-only -Wall -Wextra -Werror -D_GLIBCXX_USE_CXX11_ABI=1 -I include \
      -I torch_plugin/csrc -isystem "$T" -isystem "$T/torch/csrc/api/include" -isystem "$CUDA_INC" \
      -isystem "$PYINC" -DTORCH_EXTENSION_NAME=slotpool_torch_C "$f"
  done
  echo "torch_host_check: syntax only: all compiled"
  exit 0
fi
if [ -n "${SLOTPOOL_LIB:-}" ]; then
  SPLIB=$(cd "$(dirname "$SLOTPOOL_LIB")" && pwd)
else
  cargo build --release -p slotpool-capi
  SPLIB=$PWD/target/release
fi
PYLIB=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))")
PYVER=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('LDVERSION'))")
OUT=${TORCH_HOST_OUT:-target/torch-host}
mkdir -p "$OUT/lib"
# The program records the library's SONAME, libslotpool.so.0, which cargo's output lacks.
[ -e "$SPLIB/libslotpool.so.0" ] || ln -sf "$SPLIB/libslotpool.so" "$OUT/lib/libslotpool.so.0"
link() { # program source opt
  # shellcheck disable=SC2086 # $3: the flags, split
  g++ -std=c++17 $3 -g -D_GLIBCXX_USE_CXX11_ABI=1 -I include -I "$T" -I "$T/torch/csrc/api/include" \
    -I "$CUDA_INC" -I "$PYINC" \
    $(sources allocator) "$2" \
    -o "$OUT/$1" \
    -L "$SPLIB" -lslotpool -L "$TLIB" -lc10 -lc10_cuda -L "$CUDA_LIB" "$CUDART" \
    -L "$PYLIB" "-lpython$PYVER" \
    -Wl,-rpath,"$SPLIB:$(cd "$OUT/lib" && pwd):$TLIB:$CUDA_LIB:$PYLIB"
}
if [ "$BENCH" = 1 ]; then
  link graph_state_bench torch_plugin/tests/graph_state_bench.cpp "-O2 -DSLOTPOOL_TORCH_PHASES"
  ${BENCH_WRAP:-} "$OUT/graph_state_bench" "$@"
  exit
fi
link host_check torch_plugin/tests/host_check.cpp "-O1"
"$OUT/host_check"
