#!/usr/bin/env bash
# On the build machine: build what benches/gpu/run.sh needs in release mode and copy it into
# .gpu/ (ignored by git; name it in the device tool's `carry`).
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -p slotpool-capi -p slotpool-preload -p slotpool-cli
cargo build --release -p slotpool-cuda --examples --tests
mkdir -p .gpu
cp target/release/libslotpool.so target/release/libslotpool_preload.so .gpu/
cp target/release/examples/cuda_probe .gpu/
cp target/release/slotpool .gpu/
t=$(ls -t target/release/deps/gpu-* | grep -v '\.d$' | head -1)
cp "$t" .gpu/slotpool_cuda_gpu_tests
strip .gpu/* 2>/dev/null || true
du -sh .gpu
