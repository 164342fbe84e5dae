#!/usr/bin/env bash
# slotpool on a machine with an NVIDIA GPU: builds the CUDA and C++ parts, runs the GPU tests and
# the benchmarks side by side with PyTorch's allocator, writes everything into the results folder
# and prints a short table last.
#
#   ./benches/gpu/prepare.sh [--lib DIR]                      build the libraries into DIR (.gpu)
#   bash benches/gpu/run.sh [--out DIR] [--lib DIR] [STEP...]  run; results in DIR
#
# prepare.sh needs Rust; run it on the GPU machine, or on another machine and copy the library
# folder over. run.sh needs nvcc, g++, Python with PyTorch for the torch steps; no Rust, no network.
# --out: the results folder (default: $OUT, else ./gpu-results); --lib: the library folder
# (default: .gpu in the repository).
#
# Steps (default: all): probe suite preload torch_uncached alloc_bench variants torch_host torch
# On demand: hostile (hostile-use pattern run: tests/gpu/hostile_patterns.cu), ckpt_state
# (setCheckpointPoolState under slotpool_torch and PyTorch's allocator: benches/gpu/ckpt_state_bench.py), baselines (PyTorch's own figures: ckpt_probe, graph_variants, seed_shared_pools,
# trace_workloads under three allocator settings), record_traces (the three workload traces),
# record_seed (the seed scenario's allocation trace), oom_probe (where an unsatisfiable allocation crashes under slotpool_torch), vmm_sizes
# (growth cost per chunk size), vmm_runs (pause / resume at the driver: pages against physical runs), host_sim (the criterion host-cost bench on this host), host_restore
# (the criterion checkpoint / restore bench on this host), ipc_probe (PyTorch's own CUDA IPC handle
# of expandable-segment memory), host_abi
# (sp_alloc + sp_free through the .so, simulated device and CUDA, one thread and 16), cpu_probe (the same, pinned to
# each CPU in turn)
# Env: TORCH_SCENARIOS, TORCH_TIMEOUT, CHILD_TIMEOUT, CHILD_CPUS (pin torch children, "2-9"), PRELOAD_CPU,
# CKPT_ROUNDS,
# PARITY_WORKLOADS, PARITY_RUNS, PARITY_STEPS, KINDS, SKIP_UNCACHED
set -uo pipefail
usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; }
OUT=${OUT:-./gpu-results}
LIB=
ARGS=()
while [ $# -gt 0 ]; do
  case $1 in
    --out) OUT=${2:?--out needs a folder}; shift 2 ;;
    --out=*) OUT=${1#--out=}; shift ;;
    --lib) LIB=${2:?--lib needs a folder}; shift 2 ;;
    --lib=*) LIB=${1#--lib=}; shift ;;
    -h | --help) usage; exit 0 ;;
    -*) echo "run.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
# Both folders are resolved from where run.sh was started, before it moves to the repository.
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
if [ -n "$LIB" ]; then
  [ -d "$LIB" ] || { echo "run.sh: no library folder $LIB (run prepare.sh --lib $LIB)" >&2; exit 2; }
  LIB=$(cd "$LIB" && pwd)
fi
cd "$(dirname "$0")/../.."
ROOT=$PWD
LIB=${LIB:-$ROOT/.gpu}
[ -f "$LIB/libslotpool.so" ] || { echo "run.sh: $LIB/libslotpool.so missing: run ./benches/gpu/prepare.sh" >&2; exit 2; }
export OUT
BUILD=/tmp/slotpool-build
mkdir -p "$BUILD"
export LD_LIBRARY_PATH=$LIB:${LD_LIBRARY_PATH:-}
export SLOTPOOL_LIB=$LIB/libslotpool.so
export PYTHONUNBUFFERED=1
STEPS=${ARGS[*]:-probe suite preload torch_uncached alloc_bench variants torch_host torch}
RES=$OUT/results.jsonl
: >"$RES"
has() { [[ " $STEPS " == *" $1 "* ]]; }
note() { echo "{\"step\": \"$1\", $2}" >>"$RES"; }
run() { # name timeout_s command...
  local name=$1 t=$2
  shift 2
  echo "== $name"
  local t0=$SECONDS
  timeout "$t" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  note "$name" "\"rc\": $rc, \"seconds\": $((SECONDS - t0))"
  tail -n 25 "$OUT/$name.log"
  return $rc
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvcc --version | tail -n 2
  python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'
  date -u
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if has probe; then
  run cuda_probe 120 "$LIB/cuda_probe"
  if [ -x "$LIB/slotpool_cuda_gpu_tests" ]; then
    run cuda_gpu_tests 300 "$LIB/slotpool_cuda_gpu_tests" --test-threads=1
  fi
fi

if has suite; then
  if nvcc -O2 -std=c++17 -cudart shared -I include tests/gpu/gpu_suite.cu -L "$LIB" -lslotpool \
    -Xlinker -rpath="$LIB" -o "$BUILD/gpu_suite" >"$OUT/gpu_suite_build.log" 2>&1; then
    if command -v gdb >/dev/null; then
      SLOTPOOL_BACKEND=cuda run gpu_suite 400 gdb -q -batch -ex run -ex bt "$BUILD/gpu_suite"
    else
      SLOTPOOL_BACKEND=cuda run gpu_suite 400 "$BUILD/gpu_suite"
    fi
    grep '^{' "$OUT/gpu_suite.log" | sed 's/^{/{"step": "gpu_suite", /' >>"$RES"
  else
    note gpu_suite "\"build\": false"
    tail -n 30 "$OUT/gpu_suite_build.log"
  fi
fi

if has hostile; then
  # Hostile-use pattern run (tests/gpu/hostile_patterns.cu): 8 threads on their own streams and
  # pools, every allocation filled with its own pattern and read back before its free and after
  # every restore and empty_cache, under a 1.5 GiB limit; vmm with 2 and 16 MiB pages, classic,
  # and a shorter run under compute-sanitizer's memcheck.
  if nvcc -O2 -std=c++17 -cudart shared -I include tests/gpu/hostile_patterns.cu -L "$LIB" -lslotpool \
    -lcuda -Xlinker -rpath="$LIB" -o "$BUILD/hostile_patterns" >"$OUT/hostile_build.log" 2>&1; then
    HOSTILE_OPS=${HOSTILE_OPS:-20000}
    run hostile_vmm2 300 "$BUILD/hostile_patterns" growth:vmm,vmm_page_mb:2 8 "$HOSTILE_OPS"
    run hostile_vmm16 300 "$BUILD/hostile_patterns" growth:vmm,vmm_page_mb:16 8 "$HOSTILE_OPS"
    run hostile_classic 300 "$BUILD/hostile_patterns" growth:classic 8 "$HOSTILE_OPS"
    if command -v compute-sanitizer >/dev/null; then
      run hostile_memcheck 300 compute-sanitizer --tool memcheck --leak-check no --error-exitcode 7 \
        "$BUILD/hostile_patterns" growth:vmm,vmm_page_mb:2 8 "${HOSTILE_MEMCHECK_OPS:-1500}"
    fi
    for f in hostile_vmm2 hostile_vmm16 hostile_classic hostile_memcheck; do
      [ -f "$OUT/$f.log" ] && grep '^{' "$OUT/$f.log" | sed "s/^{/{\"step\": \"$f\", /" >>"$RES"
      [ -f "$OUT/$f.log" ] && grep -m1 'ERROR SUMMARY' "$OUT/$f.log"
    done
  else
    note hostile "\"build\": false"
    tail -n 30 "$OUT/hostile_build.log"
  fi
fi

if has preload; then
  if nvcc -O2 -std=c++17 -cudart shared benches/gpu/preload_loop.cu -o "$BUILD/preload_loop" \
    >"$OUT/preload_build.log" 2>&1; then
    # PRELOAD_CPU=n pins every run to CPU n (one process's host cost varies up to 2x with
    # where it lands otherwise).
    PIN=(${PRELOAD_CPU:+taskset -c $PRELOAD_CPU})
    run preload_native 300 "${PIN[@]}" "$BUILD/preload_loop"
    LD_PRELOAD=$LIB/libslotpool_preload.so SLOTPOOL_BACKEND=cuda SLOTPOOL_LOG=info \
      run preload_slotpool 300 "${PIN[@]}" "$BUILD/preload_loop"
    # Without SLOTPOOL_LOG: the log's byte counts cost a lookup per free. With a previous build
    # of the library in the library folder (libslotpool_preload_prev.so), the two alternate, twice each.
    runs=(preload_native preload_slotpool)
    for r in 1 2; do
      if [ -f "$LIB/libslotpool_preload_prev.so" ]; then
        LD_PRELOAD=$LIB/libslotpool_preload_prev.so SLOTPOOL_BACKEND=cuda \
          run preload_prev_quiet$r 300 "${PIN[@]}" "$BUILD/preload_loop"
        runs+=(preload_prev_quiet$r)
      fi
      LD_PRELOAD=$LIB/libslotpool_preload.so SLOTPOOL_BACKEND=cuda \
        run preload_slotpool_quiet$r 300 "${PIN[@]}" "$BUILD/preload_loop"
      runs+=(preload_slotpool_quiet$r)
    done
    for f in "${runs[@]}"; do
      grep '^{' "$OUT/$f.log" | sed "s/^{/{\"step\": \"$f\", /" >>"$RES"
    done
    # What the runtime and driver calls made on every intercepted allocation cost here.
    if nvcc -O2 -std=c++17 -cudart shared benches/gpu/runtime_calls.cu -o "$BUILD/runtime_calls" \
      -lcuda >>"$OUT/preload_build.log" 2>&1; then
      run runtime_calls 120 "${PIN[@]}" "$BUILD/runtime_calls"
      grep '^{' "$OUT/runtime_calls.log" | sed 's/^{/{"step": "runtime_calls", /' >>"$RES"
    fi
  else
    note preload "\"build\": false"
    tail -n 30 "$OUT/preload_build.log"
  fi
fi

if has torch_uncached; then
  # PyTorch with caching off: every tensor is a cudaMalloc/cudaFree, served by slotpool through
  # LD_PRELOAD, against PyTorch's own caching allocator in the same run.
  OUT=$OUT run gpt2_native 400 python3 benches/gpu/trace_workloads.py gpt2_train
  if [ -z "${SKIP_UNCACHED:-}" ]; then # PyTorch with no caching at all (baseline: 228 ms/step)
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 OUT=$OUT run gpt2_uncached 600 python3 benches/gpu/trace_workloads.py gpt2_train
  fi
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 LD_PRELOAD=$LIB/libslotpool_preload.so SLOTPOOL_BACKEND=cuda \
    SLOTPOOL_LOG=info OUT=$OUT run gpt2_preload 400 python3 benches/gpu/trace_workloads.py gpt2_train
  # Physical memory following live bytes exactly (no slack, 2 MiB pages: the old defaults).
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 LD_PRELOAD=$LIB/libslotpool_preload.so SLOTPOOL_BACKEND=cuda \
    SLOTPOOL_CONF=vmm_slack_percent:0,vmm_page_mb:2 SLOTPOOL_LOG=info OUT=$OUT \
    run gpt2_preload_exact 400 python3 benches/gpu/trace_workloads.py gpt2_train
fi

if has vmm_sizes; then
  # Growth cost against physical chunk size, and whether growth waits for running kernels.
  if nvcc -O2 -std=c++17 benches/gpu/vmm_sizes.cu -lcuda -o "$BUILD/vmm_sizes" >"$OUT/vmm_sizes_build.log" 2>&1; then
    run vmm_sizes 200 "$BUILD/vmm_sizes"
    grep '^{' "$OUT/vmm_sizes.log" | sed 's/^{/{"step": "vmm_sizes", /' >>"$RES"
  else
    note vmm_sizes "\"build\": false"
    tail -n 30 "$OUT/vmm_sizes_build.log"
  fi
fi

if has vmm_runs; then
  # Pause / resume at the driver: per page against per physical run, one unmap over several
  # mappings, cuMemRelease, copy bandwidth and the pinning of the backup buffer (1, 10, 40 GB).
  if nvcc -O2 -std=c++17 benches/gpu/vmm_runs.cu -lcuda -lpthread -o "$BUILD/vmm_runs" >"$OUT/vmm_runs_build.log" 2>&1; then
    run vmm_runs 540 "$BUILD/vmm_runs"
    grep '^{' "$OUT/vmm_runs.log" | sed 's/^{/{"step": "vmm_runs", /' >>"$RES"
  else
    note vmm_runs "\"build\": false"
    tail -n 30 "$OUT/vmm_runs_build.log"
  fi
fi

if has ipc_probe; then
  # What PyTorch's own allocator writes in a CUDA IPC handle of its expandable segments, and
  # whether a spawned process may open it here (pidfd_getfd): the format the shim's 'e' follows.
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run ipc_probe 200 python3 benches/gpu/ipc_probe.py
fi

if has host_sim && [ -x "$LIB/alloc_bench_sim" ]; then
  # The criterion host-cost bench on the simulated device, run on this host: separates the CPU's
  # speed from what the CUDA backend adds to a pair (compare with alloc_bench's slotpool rows).
  run host_sim 300 "$LIB/alloc_bench_sim" --bench --noplot --warm-up-time 1 --measurement-time 3 \
    'pair/vmm/(4KiB|1MiB)$|pair/classic/1MiB$|^threads/1$'
  # A previous build's bench beside it ($LIB/alloc_bench_sim_prev), alternated: what a change
  # costs the pairs, before and after on one host in one run.
  if [ -x "$LIB/alloc_bench_sim_prev" ]; then
    for r in 1 2; do
      for b in prev new; do
        bin=$LIB/alloc_bench_sim; [ $b = prev ] && bin=$LIB/alloc_bench_sim_prev
        run host_sim_$b$r 300 "$bin" --bench --noplot --warm-up-time 1 --measurement-time 2 \
          'pair/vmm/(4KiB|1MiB)$|pair/classic/1MiB$|random_64_live'
      done
    done
    for f in "$OUT"/host_sim_*.log; do
      echo "-- $(basename "$f" .log)"
      grep -E "^(pair|random)|time:" "$f" | paste - - | awk '{print $1, $5, $6}'
    done
  fi
fi

if has host_restore && [ -x "$LIB/checkpoint_bench_sim" ]; then
  # Checkpoint / restore against block count on this host, where PyTorch's own figures were
  # measured (benches/traces/README.md: restore 32,104 us at 10,000 live blocks).
  run host_restore 300 "$LIB/checkpoint_bench_sim" --bench --noplot --warm-up-time 1 \
    --measurement-time 3
  # A previous build's bench beside it ($LIB/checkpoint_bench_sim_prev), alternated: before and
  # after on one host in one run.
  if [ -x "$LIB/checkpoint_bench_sim_prev" ]; then
    for r in 1 2; do
      run host_restore_prev$r 300 "$LIB/checkpoint_bench_sim_prev" --bench --noplot \
        --warm-up-time 1 --measurement-time 3 half_changed
      run host_restore_new$r 300 "$LIB/checkpoint_bench_sim" --bench --noplot \
        --warm-up-time 1 --measurement-time 3 half_changed
    done
  fi
  for f in "$OUT"/host_restore*.log; do
    echo "-- $(basename "$f" .log)"
    grep -E "^checkpoint/|time:" "$f" | paste - - | awk '{print $1, $5, $6}'
  done
fi

if has host_abi; then
  # One thread's sp_alloc + sp_free through the shared library, on the simulated device and on
  # CUDA in the same run: what the CUDA backend adds to a pair on this host.
  if gcc -O2 -o "$BUILD/pair_dlopen" benches/c/pair_dlopen.c -ldl >"$OUT/host_abi_build.log" 2>&1; then
    : >"$OUT/host_abi.log"
    for rep in 1 2; do
      for b in sim cuda; do
        for sz in 4096 1048576; do
          timeout 120 "$BUILD/pair_dlopen" "$LIB/libslotpool.so" "$sz" "$b" >>"$OUT/host_abi.log" 2>&1
        done
      done
    done
    # The same pairs on 1 and 16 threads, each on its own stream: what a backend adds across
    # threads, outside PyTorch's process (benches/c/threads_dlopen.c).
    if gcc -O2 -pthread -o "$BUILD/threads_dlopen" benches/c/threads_dlopen.c -ldl \
      >>"$OUT/host_abi_build.log" 2>&1; then
      # FRESH=1: new streams each run, warmed by the main thread (alloc_bench.py's pattern:
      # shards made in a row by one thread: the false-sharing case of docs/design.md).
      for fresh in 0 1; do
        for b in sim cuda; do
          for sz in 4096 67108864; do
            FRESH=$fresh timeout 120 "$BUILD/threads_dlopen" "$LIB/libslotpool.so" "$sz" "$b" 16 100000 \
              >>"$OUT/host_abi.log" 2>&1
          done
        done
      done
    fi
    cat "$OUT/host_abi.log"
    grep '^{' "$OUT/host_abi.log" | sed 's/^{/{"step": "host_abi", /' >>"$RES"
    if command -v perf >/dev/null; then # where a pair's time goes, per backend
      for b in sim cuda; do
        perf record -q -o "$BUILD/perf_$b.data" -F 10000 "$BUILD/pair_dlopen" "$LIB/libslotpool.so" 4096 "$b" \
          >/dev/null 2>&1 && perf report -i "$BUILD/perf_$b.data" --no-children --stdio 2>/dev/null |
          grep '%' | head -40 >"$OUT/host_abi_perf_$b.log"
      done
    else
      echo "no perf on this host" >"$OUT/host_abi_perf.log"
    fi
  else
    note host_abi "\"build\": false"
  fi
fi

if has cpu_probe; then
  # Is a pair's cost a property of the CPU it runs on? The .so pair pinned to each CPU in turn.
  gcc -O2 -o "$BUILD/pair_dlopen" benches/c/pair_dlopen.c -ldl
  (lscpu; cat /sys/fs/cgroup/cpu.max 2>/dev/null) >"$OUT/cpu_probe_lscpu.log" 2>&1
  : >"$OUT/cpu_probe.log"
  for cpu in $(seq 0 $(($(nproc) - 1))); do
    for b in sim cuda; do
      line=$(timeout 60 python3 -c 'import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])}); os.execv(sys.argv[2], sys.argv[2:])' \
        "$cpu" "$BUILD/pair_dlopen" "$LIB/libslotpool.so" 4096 "$b" 2>&1 | grep '^{')
      echo "${line%\}}, \"cpu\": $cpu}" | tee -a "$OUT/cpu_probe.log"
    done
  done
  grep '^{' "$OUT/cpu_probe.log" | sed 's/^{/{"step": "cpu_probe", /' >>"$RES"
fi

if has alloc_bench; then
  OUT=$OUT KINDS=${KINDS:-0,1,3} run alloc_bench 600 python3 benches/gpu/alloc_bench.py
fi

if has variants; then
  for m in separate single:0 shared; do
    OUT=$OUT run "record_${m/:/}" 400 python3 benches/gpu/record_graph_variants.py "$m"
  done
fi

if has record_seed; then # the seed scenario's trace, for `slotpool replay --variants shared`
  OUT=$OUT run record_seed 300 python3 benches/gpu/record_seed.py shared
fi

if has record_traces; then # benches/traces/{gpt2_train,llama_train,llama_generate}.trace.csv.gz
  for w in gpt2_train llama_train llama_generate; do
    OUT=$OUT run "record_$w" 900 python3 benches/gpu/trace_workloads.py "$w" --record
  done
fi

if has baselines; then # PyTorch's own figures of benches/traces/README.md, PyTorch alone
  OUT=$OUT run ckpt_probe 300 python3 benches/gpu/ckpt_probe.py
  for m in separate shared single:0; do
    OUT=$OUT run "graph_${m/:/}" 400 python3 benches/gpu/graph_variants.py "$m"
  done
  for m in eager per_entry shared; do
    OUT=$OUT run "seed_$m" 400 python3 benches/gpu/seed_shared_pools.py "$m"
  done
  for w in gpt2_train llama_train llama_generate; do
    for c in "" expandable_segments:True backend:cudaMallocAsync; do
      OUT=$OUT run "torch_${w}_${c%%:*}" 900 env ${c:+PYTORCH_CUDA_ALLOC_CONF=$c} \
        python3 benches/gpu/trace_workloads.py "$w"
    done
  done
fi

if has oom_probe; then
  gcc -shared -fPIC -O0 -g -o "$BUILD/segv_backtrace.so" benches/gpu/segv_backtrace.c
  SEGV_BT=$BUILD/segv_backtrace.so SLOTPOOL_TORCH_DEBUG=1 SLOTPOOL_TORCH_BUILD_DIR=/tmp/slotpool-torch-ext-debug \
    run oom_probe 500 python3 benches/gpu/oom_probe.py
  grep '^{' "$OUT/oom_probe.log" | sed 's/^{/{"step": "oom_probe", /' >>"$RES"
fi

if has ckpt_state; then
  # CUDA graph trees' restore path: setCheckpointPoolState on a private pool of 100 / 1,000 /
  # 10,000 live blocks, half changed, under slotpool_torch and under PyTorch's allocator, each in
  # CKPT_ROUNDS children (default 2) alternated; then the binding's own steps at 10,000 blocks
  # (a build of the extension with SLOTPOOL_TORCH_PHASES=1).
  SLOTPOOL_TORCH_BUILD_DIR=${SLOTPOOL_TORCH_BUILD_DIR:-/tmp/slotpool-torch-ext} \
    run ckpt_state 480 python3 benches/gpu/ckpt_state_bench.py --rounds "${CKPT_ROUNDS:-2}" \
    --out "$OUT"
  grep '^{' "$OUT/ckpt_state.log" | sed 's/^{/{"step": "ckpt_state", /' >>"$RES"
  SLOTPOOL_TORCH_BUILD_DIR=${SLOTPOOL_TORCH_BUILD_DIR:-/tmp/slotpool-torch-ext} \
    run ckpt_state_phases 240 python3 benches/gpu/ckpt_state_bench.py --sizes 10000 --repeats 9 \
    --only-set --phases --alloc slotpool --out "$OUT/phases"
  grep '^{' "$OUT/ckpt_state_phases.log" | sed 's/^{/{"step": "ckpt_state_phases", /' >>"$RES"
fi

if has torch_host; then
  # The shim's C++ against the installed torch, on the simulated device (scripts/torch_host_check.sh).
  TORCH_HOST_OUT=$BUILD/torch-host run torch_host 240 bash scripts/torch_host_check.sh
fi

if has torch; then
  # The api scenario is the pytest suite torch_plugin/tests. Where pytest is missing and there is
  # no network, it is installed from .whl/ in the repository (made where there is a network:
  # python3 -m pip download pytest -d .whl).
  python3 -c 'import pytest' 2>/dev/null || { [ -d .whl ] &&
    python3 -m pip install -q --no-index --find-links .whl pytest >"$OUT/pytest_install.log" 2>&1; }
  if [ -f benches/gpu/torch_scenarios.py ]; then
    SLOTPOOL_TORCH_BUILD_DIR=${SLOTPOOL_TORCH_BUILD_DIR:-/tmp/slotpool-torch-ext} OUT=$OUT \
      run torch_scenarios "${TORCH_TIMEOUT:-540}" python3 benches/gpu/torch_scenarios.py ${TORCH_SCENARIOS:-}
    grep '^{' "$OUT/torch_scenarios.log" | sed 's/^{/{"step": "torch", /' >>"$RES"
  fi
fi

echo "== summary"
python3 benches/gpu/summarize.py "$OUT" || cat "$RES"

# The logs and JSON files are packed into one archive, logs.tar.gz (results.jsonl, env.txt and
# any recorded traces stay loose), so that the folder stays small to copy back.
(cd "$OUT" && tar czf logs.tar.gz --remove-files ./*.log ./*.json 2>/dev/null) || true
