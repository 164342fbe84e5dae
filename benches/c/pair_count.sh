#!/usr/bin/env bash
# Instructions per cached sp_alloc + sp_free pair through libslotpool.so on the simulated
# device, counted by callgrind: benches/c/pair_count.c runs N and then 2N pairs, and the
# difference of the two totals over N is one pair's cost with the setup cancelled.
#
#   bash benches/c/pair_count.sh [LIBSLOTPOOL [N [SIZE]]]
#
# LIBSLOTPOOL defaults to target/release/libslotpool.so, built first (`cargo build --release
# -p slotpool-capi`) when it is the default; N to 20000; SIZE to 4096. Needs gcc and valgrind.
set -euo pipefail
cd "$(dirname "$0")/../.."
lib=${1:-}
n=${2:-20000}
size=${3:-4096}
if [[ -z $lib ]]; then
    cargo build --release -p slotpool-capi >&2
    lib=target/release/libslotpool.so
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
gcc -O2 -o "$tmp/pair_count" benches/c/pair_count.c -ldl
count() {
    valgrind --tool=callgrind --callgrind-out-file="$tmp/out.$1" \
        "$tmp/pair_count" "$lib" "$1" "$size" 2>/dev/null
    awk '/^(summary|totals):/ { print $2; exit }' "$tmp/out.$1"
}
one=$(count "$n")
two=$(count $((2 * n)))
awk -v one="$one" -v two="$two" -v n="$n" -v size="$size" 'BEGIN {
    printf "{\"size\": %d, \"pairs\": %d, \"ir_n\": %d, \"ir_2n\": %d, \"ir_per_pair\": %.1f}\n",
        size, n, one, two, (two - one) / n
}'
