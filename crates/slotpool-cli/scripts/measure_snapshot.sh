#!/usr/bin/env bash
# Reading a real PyTorch snapshot, side by side in one run: `slotpool replay` of the file (wall
# time and peak RSS from /usr/bin/time -v, plus the replay loop's own time from its JSON) and
# Python's `pickle.load` of the same file, wall and CPU (user + system) seconds (gzip included; an Unpickler that turns any class into
# a plain object, so torch is not needed; peak RSS from getrusage).
#
# Usage: crates/slotpool-cli/scripts/measure_snapshot.sh [SNAPSHOT.pickle.gz] [REPEATS]
# Default: benches/traces/snapshots/big.pickle.gz, 5 repeats, alternating the two readers.
set -euo pipefail
root=$(cd "$(dirname "$0")/../../.." && pwd)
file=${1:-$root/benches/traces/snapshots/big.pickle.gz}
repeats=${2:-5}
cargo build --release -p slotpool-cli --manifest-path "$root/Cargo.toml" >/dev/null 2>&1
bin=$root/target/release/slotpool
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

cat >"$tmp/load.py" <<'PY'
import gzip, pickle, resource, sys, time

class Stub:
    def __init__(self, *a, **k): pass
    def __setstate__(self, state): pass

class Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        return Stub

t, c = time.perf_counter(), time.process_time()
with gzip.open(sys.argv[1], "rb") as f:
    snap = Unpickler(f).load()
dt, dc = time.perf_counter() - t, time.process_time() - c
entries = sum(len(d) for d in snap["device_traces"])
rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(f"{dt:.3f} {dc:.3f} {rss_kb} {entries}")
PY

echo "file: $file ($(stat -c %s "$file") bytes), $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores"
row='%-4s %-9s %-9s %-9s %-11s %-9s %-9s %-9s\n'
printf "$row" run sp_wall sp_cpu sp_MB replay_ms py_wall py_cpu py_MB
for i in $(seq 1 "$repeats"); do
    /usr/bin/time -v "$bin" replay "$file" --json >"$tmp/out.json" 2>"$tmp/time.txt"
    wall=$(awk -F': ' '/Elapsed \(wall clock\)/ {print $2}' "$tmp/time.txt" | awk -F: '{print $(NF-1)*60 + $NF}')
    rss=$(awk -F': ' '/Maximum resident set size/ {print $2}' "$tmp/time.txt")
    cpu=$(awk -F': ' '/User time|System time/ {s += $2} END {printf "%.2f", s}' "$tmp/time.txt")
    replay_ms=$(python3 -c 'import json,sys; print(round(json.load(open(sys.argv[1]))["replay_ms"], 1))' "$tmp/out.json")
    read -r py_s py_cpu py_rss entries < <(python3 "$tmp/load.py" "$file")
    printf "$row" "$i" "$wall" "$cpu" "$((rss / 1024))" "$replay_ms" "$py_s" "$py_cpu" "$((py_rss / 1024))"
done
echo "entries: $entries (sp: slotpool replay --json, the whole command; py: gzip + pickle.load only)"
