#!/usr/bin/env bash
# The project's test command: every crate's tests on the simulated device (no GPU needed).
# Heavy property runs: SLOTPOOL_HEAVY=1 (more proptest cases, longer stress).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${SLOTPOOL_HEAVY:-0}" = 1 ]; then
  export PROPTEST_CASES="${PROPTEST_CASES:-2000}"
fi
cargo test --workspace --release
