#!/usr/bin/env python3
"""The restore path of CUDA graph trees: torch._C._cuda_setCheckpointPoolState on a private pool
of N live blocks with half of them changed since torch._C._cuda_getCheckpointState, under slotpool
(slotpool_torch) and under PyTorch's own allocator, each in its own process.

usage: python3 benches/gpu/ckpt_state_bench.py [--out DIR] [--sizes 100,1000,10000]
                                               [--repeats 7] [--rounds 1] [--cpus 2-5]
                                               [--only-set] [--phases]
                                               [--alloc native,slotpool]

One repeat, in a fresh MemPool (a private pool, as a graph's), for N live blocks:
  1. 2N tensors of 512 B .. 6.5 KiB allocated into the pool, every other one dropped: N live
     blocks with holes between them (the pattern of benches/gpu/ckpt_probe.py);
  2. the checkpoint: getCheckpointState (timed apart, get_us);
  3. half changed: N/2 of the checkpoint's tensors die (every other one) and N/2 new tensors of
     other sizes are allocated into the pool and stay alive;
  4. timed (set_us): torch._C._cuda_setCheckpointPoolState(device, state, stale, []) (what graph
     trees call; slotpool_torch.install() puts slotpool's binding there) with the N/2 new tensors'
     storages as the stale ones (their memory goes back to the pool: PyTorch requires every
     pointer the restore frees for good to come with its stale storage);
  5. as graph trees do after the call, the blocks of the tensors that died since the checkpoint
     (re-created by the restore) are freed with raw_delete (switch_us: steps 4 and 5 together);
  6. checked: the pool's live allocations are exactly the N/2 survivors
     (torch._C._cuda_checkPoolLiveAllocations); a repeat that fails the check fails the run.
The first repeat of each size warms up and is left out; the table shows medians of the others.
Step 4 also records the minor page faults it took (set_faults) and its thread's CPU time
(set_cpu_us): wall time well above the CPU time is time the thread was not running.
With --rounds R each allocator runs in R children, alternated (native, slotpool, then slotpool,
native, ...), and the figures are medians of every round's repeats pooled, so that a host that
drifts over the run weighs on both alike; set_us_rounds gives each round's median. --cpus pins
every child to the same CPUs. --phases builds slotpool_torch with SLOTPOOL_TORCH_PHASES=1 (in a
build folder of its own) and reports the binding's steps (phase_<step>_us: ints, setup, stale,
add, events, restore, lists, checks; torch_plugin/csrc/phases.h).
Then graph trees' own pattern (gt_*: no stale storages, the survivors' storages made without a
deleter take one from the call; one_repeat_graph_trees), through torch._C and, under slotpool,
PyTorch's binding.
Under slotpool the same repeats again through PyTorch's own binding (pytorch_binding_us:
slotpool_torch.torch_set_checkpoint_pool_state). Then the same repeats again with step 4 through benches/gpu/ckpt_state_set.cpp (built just in
time): the allocator's setCheckpointPoolState alone, timed in C++ (alloc_us), without the
binding's list conversion and pointer sets; the stale storages lose their deleters as there.

Writes DIR/ckpt_state_bench.json (DIR: --out, else $OUT, else .) and prints one JSON line per
allocator and size, then the table. Environment: SLOTPOOL_LIB (libslotpool.so or its folder),
SLOTPOOL_TORCH_BUILD_DIR (where the extension is built just in time), SLOTPOOL_TORCH_CONF.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PLUGIN = os.path.join(REPO, "torch_plugin")
TARGET_RATIO = 100  # slotpool's set_us at least this many times below PyTorch's, at 10,000 blocks


# =================================================================================================
# Child: one allocator, every size.

def build_set_ext():
    """benches/gpu/ckpt_state_set.cpp as a module (after CUDA is initialised: the build may query
    the GPUs), or the reason it could not be built."""
    from torch.utils.cpp_extension import load

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # no .cu sources: the arch is unused
    try:
        return load(name="ckpt_state_set", sources=[os.path.join(HERE, "ckpt_state_set.cpp")],
                    extra_cflags=["-O2"], extra_ldflags=["-l:libstdc++.so.6"], with_cuda=True,
                    verbose=False)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"[:1000]


def minor_faults():
    """The process's minor page faults so far (a fault taken inside a timed call is its time)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def one_repeat(torch, n, device, set_ext=None, set_fn=None):
    first_sizes = [512 * (i % 13 + 1) for i in range(2 * n)]
    new_sizes = [512 * ((7 * i) % 11 + 1) + 256 for i in range(n // 2)]
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        ts = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in first_sizes]
    del ts[::2]  # n live blocks, n holes
    torch.cuda.synchronize()

    t = time.perf_counter()
    state = torch._C._cuda_getCheckpointState(device, pool.id)
    get_us = (time.perf_counter() - t) * 1e6

    dead = ts[::2]  # half of the checkpoint's tensors die
    survivors = ts[1::2]
    dead_ptrs = [x.data_ptr() for x in dead]
    del dead, ts
    with torch.cuda.use_mem_pool(pool):
        new = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in new_sizes]
    stale = [x.untyped_storage()._cdata for x in new]
    torch.cuda.synchronize()

    alloc_us = None
    flt, cpu = minor_faults(), time.thread_time()
    t = time.perf_counter()
    if set_ext is None:
        (set_fn or torch._C._cuda_setCheckpointPoolState)(device, state, stale, [])
    else:
        alloc_us = set_ext.set_state_timed(device, state, stale)[0]
    t_set = time.perf_counter()
    flt, cpu = minor_faults() - flt, time.thread_time() - cpu
    steps = {}
    if set_fn is None and set_ext is None:
        # The binding's own steps, when slotpool_torch was built with SLOTPOOL_TORCH_PHASES=1.
        spt = sys.modules.get("slotpool_torch")
        ext = getattr(spt, "_ext", None)
        if ext is not None and hasattr(ext, "graph_state_phases"):
            steps = {f"phase_{k}_us": v for k, v in ext.graph_state_phases()}
    for p in dead_ptrs:
        torch._C._cuda_cudaCachingAllocator_raw_delete(p)
    t_switch = time.perf_counter()

    del new, stale  # their deleters were removed: dropping them frees nothing
    ok = torch._C._cuda_checkPoolLiveAllocations(device, pool.id, {x.data_ptr() for x in survivors})
    del survivors, state
    torch.cuda.synchronize()
    del pool
    return {"get_us": get_us, "set_us": (t_set - t) * 1e6, "switch_us": (t_switch - t) * 1e6,
            "alloc_us": alloc_us, "set_faults": flt, "set_cpu_us": cpu * 1e6,
            "live_check": bool(ok), **steps}


def one_repeat_graph_trees(torch, n, device, set_fn=None):
    """Graph trees' own call at a branch switch (torch/_inductor/cudagraph_trees.py): no stale
    storages; the path's live storages, made over their blocks without a deleter
    (_construct_storage_from_data_pointer), in storages_to_add_deleters_to. N live blocks at the
    checkpoint (raw allocations, every other one of 2N freed), half of them dead since; the
    other half take their deleters from the call; the dead ones are re-created and freed with
    raw_delete, as graph trees do."""
    sizes = [512 * (i % 13 + 1) for i in range(2 * n)]
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        ptrs = [torch.cuda.caching_allocator_alloc(sz, device) for sz in sizes]
    for p in ptrs[::2]:
        torch.cuda.caching_allocator_delete(p)
    live, live_sizes = ptrs[1::2], sizes[1::2]
    torch.cuda.synchronize()
    state = torch._C._cuda_getCheckpointState(device, pool.id)
    dead = live[::2]
    for p in dead:
        torch.cuda.caching_allocator_delete(p)
    survivors = list(zip(live[1::2], live_sizes[1::2]))
    where = torch.device("cuda", device)
    owners = [torch._C._construct_storage_from_data_pointer(p, where, sz) for p, sz in survivors]
    add = [o._cdata for o in owners]
    torch.cuda.synchronize()
    t = time.perf_counter()
    (set_fn or torch._C._cuda_setCheckpointPoolState)(device, state, [], add)
    t_set = time.perf_counter()
    for p in dead:
        torch._C._cuda_cudaCachingAllocator_raw_delete(p)
    t_switch = time.perf_counter()
    ok = torch._C._cuda_checkPoolLiveAllocations(device, pool.id, {p for p, _ in survivors})
    del owners, add  # they took the allocator's deleter: this frees the survivors
    ok = ok and torch._C._cuda_checkPoolLiveAllocations(device, pool.id, set())
    del state
    torch.cuda.synchronize()
    del pool
    return {"set_us": (t_set - t) * 1e6, "switch_us": (t_switch - t) * 1e6, "live_check": bool(ok)}


def child(alloc, sizes, repeats, only_set=False):
    """Every size's samples under one allocator: per key, one value per timed repeat (the first
    repeat of each kind warms up and is left out). only_set: the stale storages' call alone."""
    slotpool_torch = None
    if alloc == "slotpool":
        sys.path.insert(0, PLUGIN)
        import slotpool_torch

        slotpool_torch.install(conf=os.environ.get("SLOTPOOL_TORCH_CONF"))
    import torch

    torch.empty(1, device="cuda")
    device = torch.cuda.current_device()
    out = {"alloc": alloc, "backend": torch.cuda.get_allocator_backend(), "sizes": {}}
    set_ext = None if only_set else build_set_ext()
    if isinstance(set_ext, str):
        out["alloc_us_error"] = set_ext
        set_ext = None

    def samples(fn, keys):
        """`keys`: each repeat's key, or (key, the name its samples take)."""
        runs = [fn() for _ in range(repeats + 1)][1:]
        keys = [*keys, *sorted({k for r in runs for k in r if k.startswith("phase_")})]
        named = [k if isinstance(k, tuple) else (k, k) for k in keys]
        got = {name: [r.get(k, 0.0) for r in runs] for k, name in named}
        return got, all(r["live_check"] for r in runs)

    for n in sizes:
        res, ok = samples(lambda: one_repeat(torch, n, device),
                          ("get_us", "set_us", "switch_us", "set_faults", "set_cpu_us"))
        more = []
        if not only_set:
            if alloc == "slotpool":
                # PyTorch's own binding over slotpool's allocator (install() replaced torch._C's).
                theirs = slotpool_torch.torch_set_checkpoint_pool_state
                more.append(samples(lambda: one_repeat(torch, n, device, set_fn=theirs),
                                    (("set_us", "pytorch_binding_us"),)))
            # Graph trees' own pattern, through torch._C (and, under slotpool, PyTorch's binding).
            more.append(samples(lambda: one_repeat_graph_trees(torch, n, device),
                                (("set_us", "gt_set_us"), ("switch_us", "gt_switch_us"))))
            if alloc == "slotpool":
                more.append(samples(lambda: one_repeat_graph_trees(torch, n, device, theirs),
                                    (("set_us", "gt_pytorch_binding_us"),)))
            if set_ext is not None:
                more.append(samples(lambda: one_repeat(torch, n, device, set_ext), ("alloc_us",)))
        for got, good in more:
            res.update(got)
            ok = ok and good
        res["live_check"] = ok
        out["sizes"][str(n)] = res
        print(json.dumps({"alloc": alloc, "live_blocks": n, **medians(res)}), file=sys.stderr,
              flush=True)
    out["ok"] = all(r["live_check"] for r in out["sizes"].values())
    return out


def medians(res):
    """A size's samples as medians (`<key>`) and minimums (`<key>_min`), and the set call's
    samples as they came (`set_us_all`)."""
    out = {"live_check": res["live_check"]}
    for k, v in res.items():
        if isinstance(v, list) and v:
            out[k] = statistics.median(v)
            out[k + "_min"] = min(v)
    if "set_us" in res:
        out["set_us_all"] = [round(x, 1) for x in res["set_us"]]
    return out


# =================================================================================================
# Parent: one child per allocator, the table, the JSON file.

def run_child(alloc, sizes, repeats, timeout, only_set=False, cpus=None, phases=False):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if phases and alloc == "slotpool":
        # The binding's steps timed (phases.h), in a build of the extension of its own.
        env["SLOTPOOL_TORCH_PHASES"] = "1"
        if env.get("SLOTPOOL_TORCH_BUILD_DIR"):
            env["SLOTPOOL_TORCH_BUILD_DIR"] += "-phases"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", alloc,
           "--sizes", ",".join(map(str, sizes)), "--repeats", str(repeats)]
    if only_set:
        cmd.append("--only-set")
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                           preexec_fn=pin)
    except subprocess.TimeoutExpired:
        return {"alloc": alloc, "ok": False, "error": f"timed out after {timeout} s"}
    sys.stderr.write(p.stderr[-4000:])
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"alloc": alloc, "ok": False, "error": f"no result (exit code {p.returncode})",
            "stderr_tail": p.stderr[-2000:]}


def pooled(runs):
    """One allocator's children (one per round) as one result: each size's samples pooled over
    the rounds, as medians and minimums, with each round's median of the set call."""
    out = {"alloc": runs[0]["alloc"], "ok": all(r.get("ok") for r in runs), "sizes": {},
           "rounds": len(runs)}
    for k in ("backend", "alloc_us_error", "error", "traceback", "stderr_tail"):
        for r in runs:
            if k in r:
                out[k] = r[k]
    for n in runs[0].get("sizes", {}):
        per = [r["sizes"][n] for r in runs if n in r.get("sizes", {})]
        res = {"live_check": all(x["live_check"] for x in per)}
        for k, v in per[0].items():
            if isinstance(v, list):
                res[k] = [y for x in per for y in x.get(k, [])]
        med = medians(res)
        med["set_us_rounds"] = [round(statistics.median(x["set_us"]), 1) for x in per]
        out["sizes"][n] = med
    return out


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sizes", default="100,1000,10000")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=1,
                    help="children per allocator, alternated (native, slotpool, slotpool, "
                         "native, ...); samples are pooled over the rounds")
    ap.add_argument("--only-set", action="store_true",
                    help="the stale storages' call alone (no graph trees' pattern, no PyTorch "
                         "binding over slotpool, no allocator-alone figures)")
    ap.add_argument("--phases", action="store_true",
                    help="under slotpool, the binding's steps timed too (phase_<step>_us; a "
                         "build of the extension with SLOTPOOL_TORCH_PHASES=1)")
    ap.add_argument("--cpus", default="",
                    help="pin every child to these CPUs (e.g. 2-5), the same for both allocators")
    ap.add_argument("--alloc", default="native,slotpool")
    ap.add_argument("--timeout", type=int, default=int(os.environ.get("CHILD_TIMEOUT", "540")))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.child:
        try:
            res = child(args.child, sizes, args.repeats, args.only_set)
        except Exception as e:  # noqa: BLE001
            res = {"alloc": args.child, "ok": False, "error": f"{type(e).__name__}: {e}"[:2000],
                   "traceback": traceback.format_exc()[-3000:]}
        print(json.dumps(res), flush=True)
        return 0

    cpus = set()
    for part in filter(None, args.cpus.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    allocs = [a for a in args.alloc.split(",") if a]
    runs = {a: [] for a in allocs}
    for r in range(args.rounds):
        # Alternated, and each round in the other order: a drift of the host over the run
        # falls on both allocators alike.
        for a in (allocs if r % 2 == 0 else allocs[::-1]):
            runs[a].append(run_child(a, sizes, args.repeats, args.timeout, args.only_set, cpus,
                                     args.phases))
    results = {a: pooled(rs) for a, rs in runs.items()}
    import torch  # only for the record of what ran

    report = {
        "bench": "ckpt_state_bench",
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "command": " ".join([os.path.relpath(__file__, REPO)] + argv),
        "repeats": args.repeats,
        "rounds": args.rounds,
        "phases": args.phases,
        "cpus": sorted(cpus),
        "results": results,
        "ratio": {},        # native / slotpool, set_us (the torch._C call)
        "ratio_alone": {},  # native / slotpool, alloc_us (the allocator's call alone)
    }
    for n in sizes:
        for key, field in (("ratio", "set_us"), ("ratio_alone", "alloc_us")):
            try:
                report[key][str(n)] = (results["native"]["sizes"][str(n)][field] /
                                       results["slotpool"]["sizes"][str(n)][field])
            except (KeyError, ZeroDivisionError):
                pass
    big = str(max(sizes)) if sizes else None
    if big in report["ratio"] and int(big) >= 10000:
        report["target"] = {"live_blocks": int(big), "ratio_at_least": TARGET_RATIO,
                            "met": report["ratio"][big] >= TARGET_RATIO}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ckpt_state_bench.json"), "w") as f:
        json.dump(report, f, indent=1)

    for a, r in results.items():
        for n, v in r.get("sizes", {}).items():
            def r1(k):
                return round(v[k], 1) if k in v else None
            print(json.dumps({"alloc": a, "live_blocks": int(n), "set_us": r1("set_us"),
                              "set_us_min": r1("set_us_min"), "set_cpu_us": r1("set_cpu_us"),
                              "set_faults": v.get("set_faults"),
                              "set_us_rounds": v.get("set_us_rounds"),
                              "switch_us": r1("switch_us"), "get_us": r1("get_us"),
                              "alloc_us": r1("alloc_us"), "pytorch_binding_us": r1("pytorch_binding_us"),
                              "gt_set_us": r1("gt_set_us"),
                              **{k: r1(k) for k in v
                                 if k.startswith("phase_") and not k.endswith("_min")},
                              "live_check": v["live_check"]}))
        if r.get("alloc_us_error"):
            print(json.dumps({"alloc": a, "alloc_us_error": r["alloc_us_error"]}))
        if not r.get("ok"):
            print(json.dumps({"alloc": a, "ok": False, "error": r.get("error", "live check failed")}))
    print(f"\nsetCheckpointPoolState, half of the live blocks changed (median of {args.repeats} "
          f"repeats x {args.rounds} rounds, us)")
    print(f"{'live blocks':>11}  {'native set':>11}  {'slotpool set':>12}  {'ratio':>7}  "
          f"{'native switch':>13}  {'slotpool switch':>15}  {'native alone':>12}  "
          f"{'slotpool alone':>14}  {'slotpool, torch binding':>23}")
    def value(a, n, k):
        return results.get(a, {}).get("sizes", {}).get(str(n), {}).get(k)

    def cell(a, n, k):
        v = value(a, n, k)
        return f"{v:.1f}" if v is not None else "-"

    for n in sizes:
        ratio = report["ratio"].get(str(n))
        print(f"{n:>11}  {cell('native', n, 'set_us'):>11}  {cell('slotpool', n, 'set_us'):>12}  "
              f"{(f'{ratio:.0f}x' if ratio else '-'):>7}  {cell('native', n, 'switch_us'):>13}  "
              f"{cell('slotpool', n, 'switch_us'):>15}  {cell('native', n, 'alloc_us'):>12}  "
              f"{cell('slotpool', n, 'alloc_us'):>14}  "
              f"{cell('slotpool', n, 'pytorch_binding_us'):>23}")
    print(f"\ngraph trees' own pattern (no stale storages, the live ones take deleters; median, us)")
    print(f"{'live blocks':>11}  {'native set':>11}  {'slotpool set':>12}  {'ratio':>7}  "
          f"{'native switch':>13}  {'slotpool switch':>15}  {'slotpool, torch binding':>23}")
    for n in sizes:
        ns, ss = value("native", n, "gt_set_us"), value("slotpool", n, "gt_set_us")
        ratio = f"{ns / ss:.0f}x" if ns and ss else "-"
        print(f"{n:>11}  {cell('native', n, 'gt_set_us'):>11}  {cell('slotpool', n, 'gt_set_us'):>12}  "
              f"{ratio:>7}  {cell('native', n, 'gt_switch_us'):>13}  "
              f"{cell('slotpool', n, 'gt_switch_us'):>15}  "
              f"{cell('slotpool', n, 'gt_pytorch_binding_us'):>23}")
    print("set: the torch._C call (under slotpool: slotpool's, put there by install()); switch: "
          "set + graph trees' raw_delete of the re-created blocks; alone: the allocator's "
          "setCheckpointPoolState timed in C++; torch binding: PyTorch's own torch._C function over "
          "slotpool's allocator")
    if "target" in report:
        t = report["target"]
        print(f"target: slotpool >= {t['ratio_at_least']}x faster at {t['live_blocks']} blocks: "
              f"{'met' if t['met'] else 'NOT met'}")
    return 0 if all(r.get("ok") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
