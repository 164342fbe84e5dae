#!/usr/bin/env bash
# The project's test command: every crate's tests on the simulated device (no GPU needed).
# Heavy property runs: SLOTPOOL_HEAVY=1 (more proptest cases, longer stress).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${SLOTPOOL_HEAVY:-0}" = 1 ]; then
  export PROPTEST_CASES="${PROPTEST_CASES:-2000}"
fi
cargo test --workspace --release
# The installed C library as a user builds against it (pkg-config, CMake where it exists).
./scripts/test-install.sh
# slotpool_torch's tests; those that need torch and a GPU skip themselves here.
if ! python3 -m pytest --version >/dev/null 2>&1; then
  echo "test.sh: installing pytest with pip"
  python3 -m pip install --quiet pytest || python3 -m pip install --quiet --break-system-packages pytest
fi
python3 -m pytest -q -p no:cacheprovider torch_plugin/tests
# The model check of the shard / segment-registry protocol (loom), in a target directory of its
# own: `--cfg loom` would otherwise rebuild everything above.
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
  cargo test -p slotpool-core --release --test loom_shards
# The integration tests again with the core's lock ranks checked (crates/slotpool-core/src/sync/rank.rs:
# a lock taken out of order panics, naming both locks), in a target directory of its own.
RUSTFLAGS="--cfg slotpool_lock_ranks" CARGO_TARGET_DIR=target/ranks \
  cargo test -p slotpool --release --test integration
