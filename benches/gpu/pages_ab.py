#!/usr/bin/env python3
"""Memory at the program defaults on the GPU: slotpool_torch as it comes against PyTorch's allocator.

usage: pages_ab.py                       everything below; results in $OUT (default /tmp/slotpool-pages)
       pages_ab.py --child ALLOC FRACTION STEPS WORKLOAD...   (internal: one process, one JSON line)

1. gpt2_train and llama_train (trace_workloads.py), PAGES_RUNS runs (default 5) of each allocator,
   alternating native / slotpool: peak reserved / peak allocated, median step time of the steps
   after the second, and the driver calls per step after the second step (slotpool: its own
   counters, slotpool_torch.backend_calls(): segment, reservation, page and map calls; PyTorch:
   num_device_alloc + num_device_free of memory_stats()).
2. The memory fraction (torch.cuda.set_per_process_memory_fraction) at which gpt2_train runs out of
   memory under PyTorch's expandable segments, by bisection, and slotpool at that fraction and at a
   lower one (halfway down to the peak of allocated bytes).

ALLOC is native, expandable (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) or slotpool (the
library's defaults: SLOTPOOL_CONF is cleared). Env: OUT, PAGES_RUNS, PAGES_STEPS (default 6),
SEARCH_STEPS (steps of a fraction probe, default 3), SEARCH_ITERS (bisection steps, default 5),
SLOTPOOL_LIB (libslotpool.so), CHILD_TIMEOUT (s, default 240).
"""
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PLUGIN = os.path.join(os.path.dirname(os.path.dirname(HERE)), "torch_plugin")
WORKLOADS = ("gpt2_train", "llama_train")
MEMORY_KINDS = ("alloc_segment", "free_segment", "reserve", "release_reservation",
                "create_page", "release_page", "map", "unmap")


def child(alloc, fraction, steps, workloads):
    ext = None
    if alloc == "slotpool":
        sys.path.insert(0, PLUGIN)
        import slotpool_torch
        slotpool_torch.install()
        ext = slotpool_torch
    import random
    import torch
    sys.path.insert(0, HERE)
    from trace_workloads import build_workload

    torch.empty(1, device="cuda")
    if fraction > 0:
        torch.cuda.set_per_process_memory_fraction(fraction)

    def torch_calls():
        st = torch.cuda.memory_stats()
        return st.get("num_device_alloc", 0) + st.get("num_device_free", 0)

    def calls():
        if ext is not None:
            c = ext.backend_calls()
            return sum(c[k] for k in MEMORY_KINDS)
        return torch_calls()

    for wl in workloads:
        torch.manual_seed(0)
        random.seed(0)
        torch.cuda.reset_peak_memory_stats()
        out = {"alloc": alloc, "workload": wl, "fraction": fraction, "ok": False}
        try:
            step, _ = build_workload(wl)
            times, per_step, torch_per_step = [], [], []
            for _ in range(steps):
                c0, d0 = calls(), torch_calls()
                torch.cuda.synchronize()
                t = time.perf_counter()
                step()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
                per_step.append(calls() - c0)
                torch_per_step.append(torch_calls() - d0)
            st = torch.cuda.memory_stats()
            steady = sorted(times[2:]) or sorted(times)
            out.update(ok=True, step_ms=[round(x * 1e3, 2) for x in times],
                       median_step_ms=round(steady[len(steady) // 2] * 1e3, 2),
                       calls_per_step=per_step,
                       calls_after_second=per_step[2:],
                       num_device_alloc_free_per_step=torch_per_step,
                       peak_allocated=st["allocated_bytes.all.peak"],
                       peak_reserved=st["reserved_bytes.all.peak"])
            out["ratio"] = round(out["peak_reserved"] / max(1, out["peak_allocated"]), 4)
        except torch.cuda.OutOfMemoryError as e:
            out["oom"] = True
            out["error"] = str(e).splitlines()[0][:300]
        except Exception as e:  # noqa: BLE001 - reported, never fatal
            out["error"] = (type(e).__name__ + ": " + str(e))[:500]
        print(json.dumps(out), flush=True)
        step = None
        import gc
        gc.collect()
        torch.cuda.empty_cache()


def run(alloc, fraction, steps, workloads, log):
    env = dict(os.environ)
    env.pop("SLOTPOOL_CONF", None)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if alloc == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", alloc, str(fraction), str(steps)]
    cmd += list(workloads)
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True,
                           timeout=int(os.environ.get("CHILD_TIMEOUT", "240")))
        lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
        err = p.stderr[-2000:]
    except subprocess.TimeoutExpired:
        lines, err = [], "timeout"
    got = {r["workload"] for r in lines}
    for wl in workloads:
        if wl not in got:
            lines.append({"alloc": alloc, "workload": wl, "fraction": fraction, "ok": False,
                          "error": "no result: " + err[-300:]})
    for r in lines:
        log.write(json.dumps(r) + "\n")
        log.flush()
    return lines


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])
        return
    out = os.environ.get("OUT", "/tmp/slotpool-pages")
    os.makedirs(out, exist_ok=True)
    runs = int(os.environ.get("PAGES_RUNS", "5"))
    steps = int(os.environ.get("PAGES_STEPS", "6"))
    log = open(os.path.join(out, "pages_ab.jsonl"), "w")
    t0 = time.time()

    # 1. Alternating runs at the defaults.
    results = {(a, w): [] for a in ("native", "slotpool") for w in WORKLOADS}
    for i in range(runs):
        for alloc in (("native", "slotpool") if i % 2 == 0 else ("slotpool", "native")):
            for r in run(alloc, 0, steps, WORKLOADS, log):
                results[(alloc, r["workload"])].append(r)
        print(f"run {i + 1}/{runs} done at {time.time() - t0:.0f} s", flush=True)

    # 2. The fraction at which gpt2_train runs out of memory under expandable segments.
    total = json.loads(subprocess.run(
        [sys.executable, "-c", "import torch, json; print(json.dumps("
         "torch.cuda.get_device_properties(0).total_memory))"],
        capture_output=True, text=True).stdout)
    ok_runs = [r for r in results[("native", "gpt2_train")] if r["ok"]]
    alloc_peak = median([r["peak_allocated"] for r in ok_runs]) if ok_runs else 13.6e9
    sstep = int(os.environ.get("SEARCH_STEPS", "3"))
    lo, hi = alloc_peak * 0.99 / total, alloc_peak * 1.12 / total  # lo fails, hi passes
    probes = []
    for _ in range(int(os.environ.get("SEARCH_ITERS", "5"))):
        mid = (lo + hi) / 2
        r = run("expandable", round(mid, 5), sstep, ["gpt2_train"], log)[0]
        probes.append((mid, r["ok"]))
        if r["ok"]:
            hi = mid
        else:
            lo = mid
    oom_fraction = round(lo, 5)
    lower = round((oom_fraction + alloc_peak / total) / 2, 5)
    at_oom = run("slotpool", oom_fraction, sstep, ["gpt2_train"], log)[0]
    at_lower = run("slotpool", lower, sstep, ["gpt2_train"], log)[0]
    exp_at_oom = run("expandable", oom_fraction, sstep, ["gpt2_train"], log)[0]

    # The table, last.
    lines = ["", f"pages_ab: {runs} alternating runs of {steps} steps, H200, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {time.time() - t0:.0f} s", "",
             "| workload | allocator | peak reserved / allocated | median step ms (min-max of runs) "
             "| driver calls per step after the 2nd (max) | runs ok |",
             "|---|---|---|---|---|---|"]
    for wl in WORKLOADS:
        for alloc in ("native", "slotpool"):
            rs = [r for r in results[(alloc, wl)] if r["ok"]]
            meds = [r["median_step_ms"] for r in rs]
            ratio = median([r["ratio"] for r in rs])
            calls = max((max(r["calls_after_second"] or [0]) for r in rs), default=float("nan"))
            spread = f"{min(meds):.1f}-{max(meds):.1f}" if meds else "-"
            lines.append(f"| {wl} | {alloc} | {ratio:.4f} | {median(meds):.1f} ({spread}) | {calls} "
                         f"| {len(rs)}/{len(results[(alloc, wl)])} |")
    lines += ["", "gpt2_train, expandable segments, fraction probes (fraction, trained): "
              + ", ".join(f"({f:.4f}, {ok})" for f, ok in probes),
              f"largest fraction that OOMs under expandable segments: {oom_fraction:.4f} "
              f"({oom_fraction * total / 1e9:.2f} GB); expandable again there: ok={exp_at_oom['ok']}",
              f"slotpool at {oom_fraction:.4f}: ok={at_oom['ok']} ratio={at_oom.get('ratio')} "
              f"step {at_oom.get('median_step_ms')} ms {at_oom.get('error', '')}",
              f"slotpool at {lower:.4f} ({lower * total / 1e9:.2f} GB): ok={at_lower['ok']} "
              f"ratio={at_lower.get('ratio')} step {at_lower.get('median_step_ms')} ms "
              f"{at_lower.get('error', '')}"]
    text = "\n".join(lines)
    open(os.path.join(out, "pages_ab.md"), "w").write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
