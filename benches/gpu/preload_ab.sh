#!/usr/bin/env bash
# Two builds of the LD_PRELOAD library, alternated N times (default 10) on one pinned CPU:
# preload_loop's batch-timed pair per build and API, medians last. Compares
# .gpu/libslotpool_preload_prev.so (a previous build) with .gpu/libslotpool_preload.so.
#   bash benches/gpu/preload_ab.sh [N] [CPU]          (device tool, carry .gpu)
set -uo pipefail
cd "$(dirname "$0")/../.."
N=${1:-10}
CPU=${2:-5}
OUT=${OUT:-/tmp/slotpool-gpu}
BUILD=/tmp/slotpool-build
mkdir -p "$OUT" "$BUILD"
export LD_LIBRARY_PATH=$PWD/.gpu SLOTPOOL_LIB=$PWD/.gpu/libslotpool.so SLOTPOOL_BACKEND=cuda
nvcc -O2 -std=c++17 -cudart shared benches/gpu/preload_loop.cu -o "$BUILD/preload_loop" || exit 1
: >"$OUT/preload_ab.jsonl"
for _ in $(seq "$N"); do
  for v in prev new; do
    lib=.gpu/libslotpool_preload.so
    [ "$v" = prev ] && lib=.gpu/libslotpool_preload_prev.so
    LD_PRELOAD=$PWD/$lib taskset -c "$CPU" "$BUILD/preload_loop" --sizes 4096,1048576 --iters 50000 |
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
