#!/usr/bin/env bash
# Two builds of the LD_PRELOAD library, alternated N times (default 10) on one pinned CPU:
# preload_loop's batch-timed pair per build and API, medians last. Compares
# libslotpool_preload_prev.so (a previous build, copied into the library folder by hand) with
# libslotpool_preload.so.
#   bash benches/gpu/preload_ab.sh [--out DIR] [--lib DIR] [N] [CPU]
# --out: results folder (default $OUT, else ./gpu-results); --lib: library folder (default .gpu).
set -uo pipefail
OUT=${OUT:-./gpu-results}
LIB=
ARGS=()
while [ $# -gt 0 ]; do
  case $1 in
    --out) OUT=${2:?--out needs a folder}; shift 2 ;;
    --out=*) OUT=${1#--out=}; shift ;;
    --lib) LIB=${2:?--lib needs a folder}; shift 2 ;;
    --lib=*) LIB=${1#--lib=}; shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
if [ -n "$LIB" ]; then LIB=$(cd "$LIB" && pwd) || exit 2; fi
N=${ARGS[0]:-10}
CPU=${ARGS[1]:-5}
cd "$(dirname "$0")/../.."
LIB=${LIB:-$PWD/.gpu}
BUILD=/tmp/slotpool-build
mkdir -p "$BUILD"
export LD_LIBRARY_PATH=$LIB SLOTPOOL_LIB=$LIB/libslotpool.so SLOTPOOL_BACKEND=cuda
nvcc -O2 -std=c++17 -cudart shared benches/gpu/preload_loop.cu -o "$BUILD/preload_loop" || exit 1
: >"$OUT/preload_ab.jsonl"
for _ in $(seq "$N"); do
  for v in prev new; do
    lib=$LIB/libslotpool_preload.so
    [ "$v" = prev ] && lib=$LIB/libslotpool_preload_prev.so
    LD_PRELOAD=$lib taskset -c "$CPU" "$BUILD/preload_loop" --sizes 4096,1048576 --iters 50000 |
      grep '^{' | sed "s/^{/{\"build\": \"$v\", /" >>"$OUT/preload_ab.jsonl"
  done
done
python3 - "$OUT/preload_ab.jsonl" <<'PY'
import json, sys, statistics
runs = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    key = (r["build"], "async" if "Async" in r["api"] else "sync", r["size"])
    runs.setdefault(key, []).append(r["ns_per_pair_batch"])
for key in sorted(runs):
    v = runs[key]
    print(*key, f"median {statistics.median(v):.1f} ns/pair", f"min {min(v):.1f}", f"n {len(v)}")
PY
