#!/usr/bin/env bash
# On the build machine: build what benches/gpu/run.sh needs in release mode and copy it into
# .gpu/ (ignored by git; name it in the device tool's `carry`).
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -p slotpool-capi -p slotpool-preload -p slotpool-cli
cargo build --release -p slotpool-cuda --examples --tests
mkdir -p .gpu
cp target/release/libslotpool.so target/release/libslotpool_preload.so .gpu/
# Programs linked with -lslotpool load it by its SONAME (a copy: links may not survive the trip).
cp target/release/libslotpool.so .gpu/libslotpool.so.0
cp target/release/examples/cuda_probe .gpu/
cp target/release/slotpool .gpu/
t=$(ls -t target/release/deps/gpu-* | grep -v '\.d$' | head -1)
cp "$t" .gpu/slotpool_cuda_gpu_tests
# The criterion host-cost bench (simulated device) runs on the GPU host too (step host_sim).
cargo bench --bench alloc --no-run 2>/dev/null
b=$(ls -t target/release/deps/alloc-* | grep -v '\.d$' | head -1)
cp "$b" .gpu/alloc_bench_sim
# The checkpoint / restore bench too (step host_restore): PyTorch's figures for it were measured
# on the H200 host, so the 100x comparison belongs on that host.
cargo bench --bench checkpoint --no-run 2>/dev/null
c=$(ls -t target/release/deps/checkpoint-* | grep -v '\.d$' | head -1)
cp "$c" .gpu/checkpoint_bench_sim
strip .gpu/* 2>/dev/null || true
du -sh .gpu
