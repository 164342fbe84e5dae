#!/usr/bin/env python3
"""Pausing pools on the GPU: the rollout/training cycle, and pause/resume times against the copy
bandwidth of the same run.

usage: python3 benches/gpu/pause_cycle.py [--scale F] [--sizes 1,10,40] [--out DIR]
                                         [--parts cycle,native,times,tms] [--modes discard,backup]
       (after ./benches/gpu/prepare.sh here; DIR defaults to $OUT, else /tmp/slotpool-pause)

Parts (each in its own process; results in DIR/pause_cycle.json, the table last on stdout):
  cycle    weights (10 GB x F, backed up), KV cache (20 GB x F, discarded) and the decode graph's
           memory in three pausable pools (slotpool_torch.region / cuda_graph); the decode step is
           captured as a CUDA graph. Pause all three; cudaMemGetInfo's free must rise by the pools'
           reserved bytes (within one page each); a training step that needs more than was free
           before the pause runs; resume, refill the KV cache, replay: the output must equal the
           one before the pause bit for bit.
  native   the same model and training step under PyTorch's allocator at the same memory
           fraction: the step must run out of memory.
  times    one pausable pool of each size (GB), without and with backup: pause and resume times
           (median of cycles 2-4; the first pause unmaps the pages growth mapped one by one and
           the first backup also pins its host buffer, both reported apart), the driver calls
           of each (sp.backend_calls), against pinned cudaMemcpy of the same bytes measured in
           this process; the targets (40 GB in 20 ms without backup, 1.2x the copy with) last.
  tms      the same times under torch_memory_saver, only if a wheel is in the repo's .whl/
           folder (installed into a temporary directory); skipped otherwise.

Environment: SLOTPOOL_LIB (default .gpu/ when present, else target/release).
"""
import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
GB = 10**9
MiB = 1 << 20


def env_for_child():
    env = dict(os.environ)
    if "SLOTPOOL_LIB" not in env and os.path.exists(os.path.join(REPO, ".gpu", "libslotpool.so")):
        env["SLOTPOOL_LIB"] = os.path.join(REPO, ".gpu")
    env["PYTHONPATH"] = os.path.join(REPO, "torch_plugin") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_child(part, args, extra_path=None, timeout=300):
    env = env_for_child()
    if extra_path:
        env["PYTHONPATH"] = extra_path + os.pathsep + env["PYTHONPATH"]
    cmd = [sys.executable, os.path.abspath(__file__), "--child", part] + args
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"part": part, "ok": False, "error": f"timed out after {timeout} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"part": part, "ok": False, "error": (p.stderr or p.stdout)[-3000:]}


# ------------------------------------------------------------------------------------------------
# The model: weights, a KV cache, a decode step


def build_model(torch, scale, region=None, cuda_graph=None):
    """Weights [L, D, D] bf16 (10 GB x scale) and a KV cache (20 GB x scale) bf16, in the regions
    `region` gives (or the default pool); the decode step captured as a CUDA graph. Returns the
    graph's static input x too: a replay reads it, so the caller must keep it alive (a freed x is
    reused by later allocations, and the replay then reads their bytes)."""
    D = 4096
    layer_bytes = D * D * 2
    n_layers = max(1, int(10 * GB * scale) // layer_bytes)
    kv_rows = max(1, int(20 * GB * scale) // (D * 2))
    ctx = region or (lambda *a, **k: _null())
    g = torch.Generator(device="cuda").manual_seed(7)
    with ctx("weights", enable_cpu_backup=True):
        weights = [torch.randn(D, D, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
                   for _ in range(n_layers)]
    with ctx("kv_cache", enable_cpu_backup=False):
        kv = torch.empty(kv_rows, D, device="cuda", dtype=torch.bfloat16)
    fill_kv(torch, kv)
    x = torch.randn(8, D, device="cuda", dtype=torch.bfloat16, generator=g)
    idx = torch.arange(0, kv_rows, max(1, kv_rows // 256), device="cuda")[:256]

    def decode():
        h = x
        for w in weights:
            h = torch.tanh(h @ w)
        att = torch.softmax(h @ kv[idx].T, dim=-1)
        return h + att @ kv[idx]

    for _ in range(2):
        decode()  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    if cuda_graph is not None:
        with cuda_graph(graph, tag="graph"):
            out = decode()
    else:
        with torch.cuda.graph(graph):
            out = decode()
    return weights, kv, graph, out, idx, x


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def fill_kv(torch, kv):
    """Deterministic KV contents (what a prefill would write again after a discard)."""
    rows = torch.arange(kv.shape[0], device="cuda", dtype=torch.float32).unsqueeze(1)
    step = max(1, kv.shape[0] // 64)
    for a in range(0, kv.shape[0], step):
        b = min(a + step, kv.shape[0])
        cols = torch.arange(kv.shape[1], device="cuda", dtype=torch.float32)
        kv[a:b].copy_(torch.sin(rows[a:b] * 0.001 + cols * 0.01))


def margin(model_bytes):
    """Room left under the limit for the step's transients (gradients, temporaries)."""
    return max(0.25 * model_bytes, 2 * GB)


def training_step(torch, act_bytes):
    """A training step whose activations take about `act_bytes`: chunks of [N, 4096] bf16 and their
    products with W, both saved by autograd, then backward and one SGD update."""
    D = 4096
    w = torch.randn(D, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    chunk_rows = (256 * MiB) // (D * 2)  # 256 MiB of inputs per chunk
    n_chunks = max(1, int(act_bytes // 2) // (chunk_rows * D * 2))
    loss = 0
    for _ in range(n_chunks):
        c = torch.ones(chunk_rows, D, device="cuda", dtype=torch.bfloat16)
        loss = loss + (c @ w).square().mean()
    loss.backward()
    with torch.no_grad():
        w -= 1e-3 * w.grad
    torch.cuda.synchronize()
    return n_chunks


# ------------------------------------------------------------------------------------------------
# Children


def child_cycle(scale, fraction):
    import torch

    import slotpool_torch as sp

    sp.install()
    torch.cuda.set_per_process_memory_fraction(fraction)
    weights, kv, graph, out, idx, _x = build_model(torch, scale, region=sp.region,
                                                   cuda_graph=sp.cuda_graph)
    graph.replay()
    torch.cuda.synchronize()
    before = out.clone().cpu()
    weights_copy = [w.cpu() for w in weights]
    kv_idx_before = kv[idx].clone()
    pools = {t: sp.tag_pool(t) for t in ("weights", "kv_cache", "graph")}
    reserved = {t: sp.pool_stats(p)["reserved_bytes.all.current"] for t, p in pools.items()}
    page = 16 * MiB
    torch.cuda.synchronize()
    free0, total = torch.cuda.mem_get_info()
    limit = int(total * fraction)
    avail_before = limit - torch.cuda.memory_reserved()
    t0 = time.perf_counter()
    sp.pause("weights", backup=True)
    sp.pause("kv_cache", backup=False)
    sp.pause("graph", backup=False)
    t_pause = time.perf_counter() - t0
    free1, _ = torch.cuda.mem_get_info()
    rise = free1 - free0
    want = sum(reserved.values())
    free_ok = abs(rise - want) <= page * len(pools)
    alloc_refused = False
    try:
        with sp.region("kv_cache"):
            torch.empty(1024, device="cuda")
    except RuntimeError as e:
        alloc_refused = "paused" in str(e)
    # A training step that needs more than was free before the pause (within the fraction).
    held_other = torch.cuda.memory_reserved() - sum(
        sp.pool_stats(p)["reserved_bytes.all.current"] for p in pools.values())
    act = int(limit - held_other - margin(want))
    torch.cuda.reset_peak_memory_stats()
    step_error = None
    try:
        n_chunks = training_step(torch, act)
    except Exception as e:  # noqa: BLE001 - reported
        step_error = repr(e)[:300]
        n_chunks = 0
    step_peak = torch.cuda.max_memory_allocated()
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    sp.resume("graph")
    sp.resume("kv_cache")
    sp.resume("weights")
    t_resume = time.perf_counter() - t0
    fill_kv(torch, kv)  # the KV cache was discarded: prefill again
    torch.cuda.synchronize()
    # Before the replay (a fault there poisons the context): what came back as it was.
    weights_kept = all(bool(torch.equal(w.cpu(), c)) for w, c in zip(weights, weights_copy))
    kv_refilled = bool(torch.equal(kv[idx], kv_idx_before))
    graph.replay()
    torch.cuda.synchronize()
    after = out.clone().cpu()
    equal = bool(torch.equal(before, after))
    ok = free_ok and equal and step_error is None and alloc_refused and step_peak > avail_before
    return {"part": "cycle", "ok": ok, "scale": scale, "fraction": fraction,
            "reserved": reserved, "free_rise": rise, "free_rise_ok": free_ok,
            "paused_alloc_refused": alloc_refused, "step_chunks": n_chunks,
            "step_peak_allocated": step_peak, "available_before_pause": avail_before,
            "step_error": step_error, "replay_bit_equal": equal,
            "weights_kept": weights_kept, "kv_refilled": kv_refilled,
            "pause_s": t_pause, "resume_s": t_resume}


def child_native(scale, fraction):
    import torch

    torch.cuda.set_per_process_memory_fraction(fraction)
    weights, kv, graph, out, _idx, _x = build_model(torch, scale)
    total = torch.cuda.mem_get_info()[1]
    want = sum(w.numel() * 2 for w in weights) + kv.numel() * 2
    limit = int(total * fraction)
    act = int(limit - margin(want) - (torch.cuda.memory_reserved() - want))
    try:
        training_step(torch, act)
        oom = False
        err = None
    except torch.cuda.OutOfMemoryError as e:
        oom = True
        err = str(e)[:200]
    return {"part": "native", "ok": oom, "oom": oom, "error": err, "fraction": fraction}


def median_time(fn, reps=3):
    ts = []
    for _ in range(reps):
        ts.append(fn())
    return statistics.median(ts)


def copy_bandwidth(torch, nbytes):
    """Pinned cudaMemcpy both ways, bytes per second (a buffer of at most 4 GB, timed 3 times)."""
    n = min(nbytes, 4 * GB)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")

    def once(src, dst):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    dtoh = n / median_time(lambda: once(dev, host))
    htod = n / median_time(lambda: once(host, dev))
    del host, dev
    return dtoh, htod


def child_times(sizes, modes=(False, True)):
    import torch

    import slotpool_torch as sp

    sp.install()
    rows = []
    for gb in sizes:
        nbytes = int(gb * GB)
        dtoh, htod = copy_bandwidth(torch, nbytes)
        pool = sp.named_pool(f"bench_{gb}", pausable=True)
        with sp.use_pool(pool):
            parts = [torch.ones(min(nbytes - i, 1 << 30), dtype=torch.uint8, device="cuda")
                     for i in range(0, nbytes, 1 << 30)]
        torch.cuda.synchronize()
        for backup in modes:
            for p in parts:  # a discard cycle before this one left its pages undefined
                p.fill_(1)
            pauses, resumes, calls = [], [], []
            for _ in range(4):
                torch.cuda.synchronize()
                c0 = sp.backend_calls()
                t0 = time.perf_counter()
                sp.pause(pool, backup=backup)
                t1 = time.perf_counter()
                c1 = sp.backend_calls()
                sp.resume(pool)
                t2 = time.perf_counter()
                c2 = sp.backend_calls()
                pauses.append(t1 - t0)
                resumes.append(t2 - t1)
                # Driver calls of the pause and of the resume (a physical run counts one
                # create_page and one map; the first pause unmaps pages mapped one by one).
                calls.append({"pause": {k: c1[k] - c0[k] for k in c1 if c1[k] != c0[k]},
                              "resume": {k: c2[k] - c1[k] for k in c2 if c2[k] != c1[k]}})
            ok = True
            if backup:
                ok = all(bool((p[:: max(1, p.numel() // 4096)] == 1).all()) for p in parts)
            # The first backup pins its buffer; later ones reuse it (median of the last 3 of 4).
            # The pool's first pause unmaps pages mapped one by one by growth; its resumes map
            # physical runs, which the later pauses unmap.
            rows.append({"gb": gb, "backup": backup,
                         "pause_ms": statistics.median(pauses[1:]) * 1e3,
                         "resume_ms": statistics.median(resumes[1:]) * 1e3,
                         "first_pause_ms": pauses[0] * 1e3, "first_resume_ms": resumes[0] * 1e3,
                         "pauses_ms": [t * 1e3 for t in pauses],
                         "resumes_ms": [t * 1e3 for t in resumes], "calls": calls,
                         "copy_dtoh_ms": nbytes / dtoh * 1e3, "copy_htod_ms": nbytes / htod * 1e3,
                         "bytes_kept": ok})
        del parts
        sp.empty_pool_cache(pool)
        sp.release_pool(pool)
        torch.cuda.empty_cache()  # the pool released: frees its pinned buffer and forgets it
    ok = all(r["bytes_kept"] for r in rows)
    return {"part": "times", "ok": ok, "rows": rows}


def child_tms(sizes, modes=(False, True)):
    import torch
    import torch_memory_saver as tms_mod

    saver = getattr(tms_mod, "torch_memory_saver", None) or tms_mod.TorchMemorySaver()
    # Its default hook mode needs the process started under LD_PRELOAD; the in-process pluggable
    # allocator mode serves regions the same way (graphs are not timed here).
    saver.hook_mode = "torch"
    rows = []
    for gb in sizes:
        nbytes = int(gb * GB)
        for backup in modes:
            tag = f"t{gb}_{int(backup)}"
            with saver.region(tag=tag, enable_cpu_backup=backup):
                parts = [torch.ones(min(nbytes - i, 1 << 30), dtype=torch.uint8, device="cuda")
                         for i in range(0, nbytes, 1 << 30)]
            pauses, resumes = [], []
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                saver.pause(tag)
                t1 = time.perf_counter()
                saver.resume(tag)
                t2 = time.perf_counter()
                pauses.append(t1 - t0)
                resumes.append(t2 - t1)
            rows.append({"gb": gb, "backup": backup, "pause_ms": statistics.median(pauses) * 1e3,
                         "resume_ms": statistics.median(resumes) * 1e3})
            del parts
    return {"part": "tms", "ok": True, "rows": rows}


def child_main(argv):
    part = argv[0]
    try:
        if part == "cycle":
            res = child_cycle(float(argv[1]), float(argv[2]))
        elif part == "native":
            res = child_native(float(argv[1]), float(argv[2]))
        elif part in ("times", "tms"):
            sizes = [float(s) for s in argv[1].split(",")]
            modes = tuple(m == "backup" for m in argv[2].split(","))
            res = (child_times if part == "times" else child_tms)(sizes, modes)
        else:
            res = {"part": part, "ok": False, "error": "unknown part"}
    except Exception as e:  # noqa: BLE001 - reported, never fatal
        import traceback

        res = {"part": part, "ok": False, "error": repr(e), "trace": traceback.format_exc()[-3000:]}
    print(json.dumps(res), flush=True)


# ------------------------------------------------------------------------------------------------


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="model sizes x this (1: 20+10 GB)")
    ap.add_argument("--sizes", default="1,10,40", help="pool sizes for the times, GB")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/slotpool-pause"))
    ap.add_argument("--parts", default="cycle,native,times,tms", help="which parts to run")
    ap.add_argument("--modes", default="discard,backup", help="times and tms: without / with backup")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    os.makedirs(args.out, exist_ok=True)
    # The memory limit: twice the model, so that the training step needs the paused memory.
    import torch

    total = torch.cuda.mem_get_info()[1]
    fraction = min(0.95, 2 * 30 * GB * args.scale / total)
    def part(name, argv, **kw):
        r = run_child(name, argv, **kw)
        print(json.dumps(r)[:4000], flush=True)  # as each part ends: a cut-off run keeps these
        return r

    results = []
    for name in ("cycle", "native"):
        if name in parts:
            results.append(part(name, [str(args.scale), str(fraction)]))
    if "times" in parts:
        results.append(part("times", [args.sizes, args.modes]))
    wheels = sorted(glob.glob(os.path.join(REPO, ".whl", "torch_memory_saver*.whl")))
    if "tms" not in parts:
        pass
    elif wheels:
        target = tempfile.mkdtemp(prefix="tms_")
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                              "--target", target, wheels[-1]], capture_output=True, text=True)
        if pip.returncode == 0:
            results.append(part("tms", [args.sizes, args.modes], extra_path=target))
        else:
            results.append({"part": "tms", "ok": False, "error": pip.stderr[-2000:]})
    else:
        results.append({"part": "tms", "ok": True, "skipped": "no torch_memory_saver wheel in .whl/"})
    with open(os.path.join(args.out, "pause_cycle.json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                   "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                   "results": results}, f, indent=1)
    for r in results:
        brief = {k: v for k, v in r.items() if k not in ("rows", "trace")}
        print(json.dumps(brief))
        if "trace" in r:
            print(r["trace"])
    print()
    print(f"{'part':<8} {'GB':>5} {'backup':>6} {'pause ms':>10} {'resume ms':>10} "
          f"{'copy d2h ms':>12} {'copy h2d ms':>12} {'vs copy':>8} {'1st pause ms':>13} "
          f"{'1st resume ms':>14} {'calls pause/resume':>20}")
    nan = float("nan")
    for r in results:
        for row in r.get("rows", []):
            ratio = ""
            if row["backup"] and "copy_dtoh_ms" in row:
                total_ms = row["pause_ms"] + row["resume_ms"]
                ratio = f"{total_ms / (row['copy_dtoh_ms'] + row['copy_htod_ms']):.2f}x"
            last = (row.get("calls") or [{}])[-1]
            ncalls = ""
            if last:
                ncalls = (f"{sum(last['pause'].get(k, 0) for k in ('unmap', 'release_page'))}/"
                          f"{sum(last['resume'].get(k, 0) for k in ('create_page', 'map'))}")
            print(f"{r['part']:<8} {row['gb']:>5g} {str(row['backup']):>6} {row['pause_ms']:>10.2f} "
                  f"{row['resume_ms']:>10.2f} {row.get('copy_dtoh_ms', nan):>12.2f} "
                  f"{row.get('copy_htod_ms', nan):>12.2f} {ratio:>8} "
                  f"{row.get('first_pause_ms', nan):>13.2f} {row.get('first_resume_ms', nan):>14.2f} "
                  f"{ncalls:>20}")
    # The targets: pause + resume of 40 GB without backup in 20 ms, with backup within 1.2x of
    # the copy both ways.
    for row in next((r.get("rows", []) for r in results if r["part"] == "times"), []):
        total_ms = row["pause_ms"] + row["resume_ms"]
        if row["backup"]:
            ratio = total_ms / (row["copy_dtoh_ms"] + row["copy_htod_ms"])
            print(f"target {row['gb']:g} GB with backup: {ratio:.2f}x the copy "
                  f"({'met' if ratio <= 1.2 else 'not met'}, 1.2x)")
        elif row["gb"] == 40:
            print(f"target 40 GB without backup: {total_ms:.1f} ms "
                  f"({'met' if total_ms <= 20 else 'not met'}, 20 ms)")
    print("ok: " + ", ".join(f"{r['part']}={r['ok']}" for r in results))


if __name__ == "__main__":
    main()
