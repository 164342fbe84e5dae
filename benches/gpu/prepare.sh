#!/usr/bin/env bash
# Builds what benches/gpu/run.sh needs, in release mode, and copies it into the library folder
# (default .gpu/ in the repository, ignored by git). Needs Rust and Cargo; no GPU. Run it on the
# GPU machine, or on any Linux x86-64 machine and copy the folder to the GPU machine beside the
# repository.
#   ./benches/gpu/prepare.sh [--lib DIR]
set -euo pipefail
LIB=
while [ $# -gt 0 ]; do
  case $1 in
    --lib) LIB=${2:?--lib needs a folder}; shift 2 ;;
    --lib=*) LIB=${1#--lib=}; shift ;;
    -h | --help) sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "prepare.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ -n "$LIB" ]; then mkdir -p "$LIB" && LIB=$(cd "$LIB" && pwd); fi
cd "$(dirname "$0")/../.."
LIB=${LIB:-$PWD/.gpu}
cargo build --release -p slotpool-capi -p slotpool-preload -p slotpool-cli
cargo build --release -p slotpool-cuda --examples --tests
mkdir -p "$LIB"
cp target/release/libslotpool.so target/release/libslotpool_preload.so "$LIB/"
# Programs linked with -lslotpool load it by its SONAME (a copy: links may not survive the trip).
cp target/release/libslotpool.so "$LIB/libslotpool.so.0"
cp target/release/examples/cuda_probe "$LIB/"
cp target/release/slotpool "$LIB/"
t=$(ls -t target/release/deps/gpu-* | grep -v '\.d$' | head -1)
cp "$t" "$LIB/slotpool_cuda_gpu_tests"
# The criterion host-cost bench (simulated device) runs on the GPU host too (step host_sim).
cargo bench --bench alloc --no-run 2>/dev/null
b=$(ls -t target/release/deps/alloc-* | grep -v '\.d$' | head -1)
cp "$b" "$LIB/alloc_bench_sim"
# The checkpoint / restore bench too (step host_restore): PyTorch's figures for it were measured
# on the GPU host, so the comparison belongs on that host.
cargo bench --bench checkpoint --no-run 2>/dev/null
c=$(ls -t target/release/deps/checkpoint-* | grep -v '\.d$' | head -1)
cp "$c" "$LIB/checkpoint_bench_sim"
strip "$LIB"/* 2>/dev/null || true
du -sh "$LIB"
