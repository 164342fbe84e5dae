#!/usr/bin/env bash
# Instructions of one checkpoint restore on the simulated device, counted by callgrind: the
# restores of benches/restore_count.rs (the pattern of benches/checkpoint.rs's half_changed/N)
# counted alone, over their number.
#
#   bash benches/restore_count.sh [N [REPEATS [fresh]]]
#
# N live blocks (10000, half of them changed before each restore), REPEATS restores (5); fresh:
# each in a pool of its own. Needs valgrind.
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-10000}
repeats=${2:-5}
mode=${3:-}
cargo bench --bench restore_count --no-run >&2
bin=$(ls -t target/release/deps/restore_count-* | grep -v '\.d$' | head -1)
out=$(mktemp)
trap 'rm -f "$out"' EXIT
valgrind --tool=callgrind --callgrind-out-file="$out" --toggle-collect='*restore_once*' \
    "$bin" "$n" "$repeats" $mode >&2 2>/dev/null
ir=$(awk '/^(summary|totals):/ { print $2; exit }' "$out")
awk -v ir="$ir" -v r="$repeats" -v n="$n" -v mode="${mode:-same pool}" 'BEGIN {
    printf "{\"live_blocks\": %d, \"restores\": %d, \"pool\": \"%s\", \"ir_per_restore\": %.0f}\n",
        n, r, mode, ir / r
}'
