#!/usr/bin/env bash
# Memory at the program defaults on the H200: slotpool_torch as it comes against PyTorch's
# allocator (gpt2_train, llama_train), and the memory fraction at which gpt2_train runs out of
# memory under PyTorch's expandable segments (benches/gpu/pages_ab.py says what is measured).
#
# Here (the build machine):  ./benches/gpu/prepare.sh
# There:                     bash benches/gpu/pages_ab.sh        (carry: .gpu)
# Results: $OUT (default /tmp/slotpool-pages): pages_ab.jsonl (every run), pages_ab.md (the table,
# also printed last).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
export OUT=${OUT:-/tmp/slotpool-pages}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$ROOT/.gpu:${LD_LIBRARY_PATH:-}
export SLOTPOOL_LIB=$ROOT/.gpu/libslotpool.so
export SLOTPOOL_TORCH_BUILD_DIR=${SLOTPOOL_TORCH_BUILD_DIR:-/tmp/slotpool-build}
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'
  date -u
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
# Build (or load from the cache) the extension once, outside the timed runs.
python3 -c "import sys; sys.path.insert(0, 'torch_plugin'); import slotpool_torch; slotpool_torch.load()" \
  >"$OUT/build.log" 2>&1 || { echo "extension build failed"; tail -n 30 "$OUT/build.log"; exit 1; }
python3 benches/gpu/pages_ab.py 2>"$OUT/pages_ab.err"
