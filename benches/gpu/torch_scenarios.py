#!/usr/bin/env python3
"""slotpool beneath PyTorch on the GPU machine (H200, PyTorch 2.11, CUDA 13): scenarios.

usage: torch_scenarios.py [SCENARIO ...]     run these (default: all, in the order below)
       torch_scenarios.py --list
       torch_scenarios.py --child NAME ALLOC [ARG]   (internal: one measurement in this process)

Scenarios (each runs its measurements as separate subprocesses, native and slotpool, and prints
one JSON line {"scenario": ..., "ok": ..., ...}; a failure is reported, never fatal):
  build      build/load the extension (torch.utils.cpp_extension; cached) and check it loads
             without initialising CUDA
  api        the PyTorch API checks of torch_plugin/tests/test_torch_api.py (pytest; memory_stats
             keys, MemPool, record_stream, _snapshot, OutOfMemoryError, CUDA graphs, graphed
             callables, torch.compile reduce-overhead, IPC, ...) under native (control) and
             slotpool, plus slotpool's own API (named pools, checkpoint/restore, arenas, variants)
  parity     PARITY_WORKLOADS (trace_workloads.py; gpt2_train llama_train): same seed, losses
             under slotpool and native, step time (PARITY_RUNS runs each, default 2,
             interleaved; the median of the
             steps after the first over all runs; PARITY_STEPS overrides the workload's step
             count) and peak reserved; then the same workloads on
             the math attention path, where losses must be bit-identical
             (PARITY_DETERMINISTIC=0 skips that part); PARITY_SLOTPOOL_CONFS="conf;conf" adds
             slotpool runs with other SLOTPOOL_CONF strings
  variants   dynamic-CP variants (graph_variants.py): capture growth of a slotpool variant group
             vs the largest variant alone; replay outputs equal eager in several replay orders
  seed       seed_shared_pools.py: per-layer graphs, and one shared capture into a named pool
  retention  after graph reset and pool release, empty_cache returns reserved to the
             pre-capture level (within 2 MiB)
  host_cost  torch.empty + del host time, slotpool vs native

Environment: OUT (results go to $OUT/torch_scenarios.json, merged across runs), SLOTPOOL_LIB
(libslotpool.so; default target/release), SLOTPOOL_TORCH_BUILD_DIR, CHILD_TIMEOUT (s, default
540), VARIANT_DIM / VARIANT_SEQ (variants), SEED_LAYERS (seed), HOST_ITERS (host_cost).
Each scenario takes under 10 minutes on an H200; name several to run them in one process tree.
"""
import gc
import json
import math
import os
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PLUGIN = os.path.join(REPO, "torch_plugin")
MiB = 1 << 20
SCENARIOS = ("build", "api", "parity", "variants", "seed", "retention", "host_cost")


def err_str(e):
    return (type(e).__name__ + ": " + str(e)).strip()[:2000]


# =================================================================================================
# Child side: one measurement, one JSON line on stdout.

def child_setup(alloc):
    if alloc == "slotpool":
        sys.path.insert(0, PLUGIN)
        import slotpool_torch
        slotpool_torch.install(conf=os.environ.get("SLOTPOOL_TORCH_CONF"))
        return slotpool_torch
    return None


def c_build(alloc, arg):
    import torch
    sys.path.insert(0, PLUGIN)
    import slotpool_torch
    t = time.time()
    ext = slotpool_torch.load(verbose=True)
    res = {"seconds": round(time.time() - t, 1), "built_for": ext.built_for_torch(),
           "torch": torch.__version__, "headers": ext.headers_version(),
           "lib": slotpool_torch._loader.lib_path(), "slotpool_version": list(ext.slotpool_version()),
           "header_version": list(ext.header_version()),
           "features": {f: ext.has_feature(f) for f in ("cuda", "vmm", "checkpoint", "variant_groups", "arenas")},
           "cuda_initialized_after_load": torch.cuda.is_initialized()}
    res["ok"] = not res["cuda_initialized_after_load"]
    return res


def c_api(alloc, arg):
    """The PyTorch API checks: the pytest suite torch_plugin/tests/test_torch_api.py, in this
    process, under `alloc` (native: PyTorch's own allocator, the control). Each test's outcome
    becomes one check ("ok", "skipped: why" or "FAIL: why")."""
    try:
        import pytest
    except ImportError:
        return {"ok": False, "error": "pytest is not installed (pip install pytest)"}
    os.environ["SLOTPOOL_TORCH_TEST_ALLOCATOR"] = alloc
    checks = {}

    class Collect:
        def pytest_runtest_logreport(self, report):
            name = report.nodeid.rsplit("::", 1)[-1].removeprefix("test_")
            if report.skipped and report.when in ("setup", "call"):
                reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
                checks[name] = "skipped: " + str(reason).removeprefix("Skipped: ")
            elif report.failed:
                checks[name] = "FAIL: " + str(report.longrepr)[-1500:]
            elif report.when == "call" and name not in checks:
                checks[name] = "ok"

    suite = os.path.join(PLUGIN, "tests", "test_torch_api.py")
    code = pytest.main([suite, "-q", "-p", "no:cacheprovider"],
                       plugins=[Collect()])
    mod = sys.modules.get("test_torch_api")
    keep = getattr(mod, "keep", {})
    res = {"checks": checks, "pytest_exit": int(code), "memory_stats_keys": keep.get("keys", []),
           "alloc_conf": keep.get("alloc_conf"), "trace_tracker": keep.get("trace_tracker"),
           "ipc": keep.get("ipc")}
    res["ok"] = any(v == "ok" for v in checks.values()) and all(
        v == "ok" or v.startswith("skipped") for v in checks.values())
    return res


def c_parity(alloc, arg):
    child_setup(alloc)
    import random
    import torch
    sys.path.insert(0, HERE)
    from trace_workloads import build_workload
    # "WORKLOAD:det" runs it on the math attention path instead of the fused ones (whose backward
    # passes accumulate in a racy order): then two native runs should agree bit for bit, and so
    # must slotpool, which only decides addresses. Ops with no deterministic kernel are listed.
    arg, _, det = (arg or "gpt2_train").partition(":")
    if det:
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
    torch.use_deterministic_algorithms(True, warn_only=True)
    import warnings
    nondeterministic = warnings.catch_warnings(record=True).__enter__()  # kept for the process
    warnings.simplefilter("always")
    torch.manual_seed(0)
    random.seed(0)
    torch.empty(1, device="cuda")
    step, n = build_workload(arg, "cuda")
    n = int(os.environ.get("PARITY_STEPS", n))
    losses, times = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(float(loss))
    st = torch.cuda.memory_stats()
    return {"losses": losses, "loss_hex": [float.hex(v) for v in losses], "step_s": times,
            "median_step_s": sorted(times)[len(times) // 2],
            "peak_reserved": st["reserved_bytes.all.peak"], "peak_allocated": st["allocated_bytes.all.peak"],
            "num_device_alloc": st.get("num_device_alloc"), "ok": True,
            "nondeterministic_ops": sorted({str(w.message)[:160] for w in nondeterministic
                                            if "deterministic" in str(w.message)})}


def c_variants(alloc, mode):
    sp = child_setup(alloc)
    import torch
    dev = "cuda"
    D = int(os.environ.get("VARIANT_DIM", "4096"))
    S = int(os.environ.get("VARIANT_SEQ", "8192"))
    H = max(1, D // 128)
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(D, H, 4 * D, dropout=0.0, device=dev, dtype=torch.bfloat16)

    class Wrap(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    seqs = [S // cp for cp in (1, 2, 4, 8)]
    idx = list(range(len(seqs)))
    if mode.startswith("single:"):
        idx = [int(mode.split(":")[1])]
    gen = torch.Generator(device=dev).manual_seed(1)
    inputs = {k: torch.randn(seqs[k], 1, D, device=dev, dtype=torch.bfloat16, generator=gen) for k in range(len(seqs))}
    # eager references (output and input gradient) per variant
    refs = {}
    for k in idx:
        xe = inputs[k].clone().requires_grad_()
        y = layer(xe)
        y.float().sum().backward()
        refs[k] = (y.detach().float().cpu(), xe.grad.float().cpu())
        del xe, y
    layer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    r0, a0 = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    graphed = {}
    t = time.time()
    if mode == "group":
        assert sp is not None, "group needs slotpool"
        with sp.variant_group(None, len(seqs)) as grp:
            for k in idx:
                with grp.variant(k):  # the variant's sample input belongs to it too
                    sample = inputs[k].clone().requires_grad_()
                    graphed[k] = torch.cuda.make_graphed_callables(Wrap(layer), (sample,), num_warmup_iters=3, pool=grp.pool)
    else:
        pool = torch.cuda.graph_pool_handle() if mode == "shared" else None
        for k in idx:
            sample = inputs[k].clone().requires_grad_()
            kw = {"pool": pool} if pool is not None else {}
            graphed[k] = torch.cuda.make_graphed_callables(Wrap(layer), (sample,), num_warmup_iters=3, **kw)
            # as the variant group's blocks do: each make_graphed_callables warms up on a stream
            # of its own, and cuBLAS keeps a workspace per stream for the life of the process
            torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.synchronize()
    capture_s = time.time() - t
    r1_cached = torch.cuda.memory_reserved()
    peak = torch.cuda.max_memory_reserved()
    # Graph pools are in use and stay; what the warm-ups left cached in the default pool goes.
    gc.collect()
    torch.cuda.empty_cache()
    r1, a1 = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    orders = [idx] if len(idx) == 1 else [[0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2], [2, 2, 0, 3, 1]]
    replays = []
    worst_out, worst_grad = 0.0, 0.0
    all_close = True
    for order in orders:
        for k in order:
            x = inputs[k].clone().requires_grad_()
            y = graphed[k](x)
            y.float().sum().backward()
            torch.cuda.synchronize()
            out = y.detach().float().cpu()
            grad = x.grad.float().cpu()
            d_out = (out - refs[k][0]).abs().max().item()
            d_grad = (grad - refs[k][1]).abs().max().item()
            close = bool(torch.allclose(out, refs[k][0], atol=3e-2, rtol=3e-2)
                         and torch.allclose(grad, refs[k][1], atol=3e-2, rtol=3e-2)
                         and math.isfinite(d_out) and math.isfinite(d_grad))
            all_close &= close
            worst_out, worst_grad = max(worst_out, d_out), max(worst_grad, d_grad)
            replays.append({"order": order, "k": k, "max_abs_out": d_out, "max_abs_grad": d_grad, "close": close})
            del x, y
    return {"mode": mode, "seqs": [seqs[k] for k in idx], "dim": D, "reserved_growth": r1 - r0,
            "allocated_growth": a1 - a0, "reserved_growth_with_cache": r1_cached - r0,
            "peak_reserved_during_capture": peak, "capture_s": round(capture_s, 2),
            "replays_close": all_close, "worst_out_diff": worst_out, "worst_grad_diff": worst_grad,
            "replays": replays, "ok": True}


def c_seed(alloc, mode):
    sp = child_setup(alloc)
    import torch
    sys.path.insert(0, HERE)
    import seed_model
    L = int(os.environ.get("SEED_LAYERS", "12"))
    dev, dt = "cuda", torch.bfloat16
    B, S, D = seed_model.B, seed_model.S, seed_model.D

    mode, _, fraction = mode.partition("@")
    torch.manual_seed(0)
    layers = seed_model.build_layers(L, dev, dt)
    torch.cuda.synchronize()
    if fraction:
        torch.cuda.set_per_process_memory_fraction(float(fraction))
    torch.cuda.reset_peak_memory_stats()
    r0 = torch.cuda.memory_reserved()
    args = seed_model.inputs(L, dev, dt)
    t = time.time()
    err = None
    y_sum = None
    try:
        if mode == "per_entry":
            g = [torch.cuda.make_graphed_callables(lay, a) for lay, a in zip(layers, args)]
        elif mode == "shared":
            g = list(torch.cuda.make_graphed_callables(tuple(layers), tuple(args)))
        elif mode == "shared_named":
            assert sp is not None, "shared_named needs slotpool"
            pool = sp.named_pool("seed_shared")
            g = list(torch.cuda.make_graphed_callables(tuple(layers), tuple(args), pool=pool))
        else:
            g = layers
        # Running peaks when capture ends: tells a capture-time peak from one in the graphed step.
        after_capture = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
        x = torch.randn(B, S, D, device=dev, dtype=dt, requires_grad=True)
        y = x
        for f in g:
            y = f(y)
        y.float().sum().backward()
        torch.cuda.synchronize()
        y_sum = float(y.float().sum())
    except torch.OutOfMemoryError as e:
        err = "OOM: " + str(e).splitlines()[0][:160]
        after_capture = None
    return {"mode": mode, "fraction": float(fraction) if fraction else None,
            "peaks_after_capture": after_capture,
            "total_memory": torch.cuda.get_device_properties(0).total_memory,
            "layers": L, "capture_s": round(time.time() - t, 2),
            "peak_allocated": torch.cuda.max_memory_allocated(), "peak_reserved": torch.cuda.max_memory_reserved(),
            "reserved_growth": torch.cuda.memory_reserved() - r0, "error": err, "y_sum": y_sum,
            "ok": err is None and y_sum is not None and math.isfinite(y_sum)}


def c_retention(alloc, arg):
    sp = child_setup(alloc)
    import torch
    dev = "cuda"
    x = torch.randn(1 << 20, device=dev)
    side = torch.cuda.Stream()

    def settle():
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved()

    def plain(pool=None):
        g = torch.cuda.CUDAGraph()
        kw = {"pool": pool} if pool is not None else {}
        with torch.cuda.graph(g, stream=side, **kw):
            ys = [x * i for i in range(8)]
            big = torch.empty(64 * MiB, dtype=torch.uint8, device=dev)
            big.fill_(1)
            mid = torch.empty(5 * MiB, dtype=torch.uint8, device=dev)
            del mid
        g.replay()
        torch.cuda.synchronize()
        del ys, big
        g.reset()
        del g

    class Elementwise(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(1 << 20, device=dev))

        def forward(self, a):
            return (a * self.w).sin() * 2 + a

    def graphed():
        m = Elementwise()
        a = torch.randn(1 << 20, device=dev, requires_grad=True)
        f = torch.cuda.make_graphed_callables(m, (a,))
        out = f(torch.randn(1 << 20, device=dev, requires_grad=True))
        out.sum().backward()
        torch.cuda.synchronize()
        del out, f, m, a

    def named():
        if sp is None:
            return
        pid = sp.named_pool("retention")
        plain(pid)
        sp.release_pool(pid)

    def mempool():
        p = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(p):
            t = torch.empty(32 * MiB, dtype=torch.uint8, device=dev)
        del t, p

    res = {}
    for name, fn in (("graph", plain), ("graphed_callables", graphed), ("named_pool", named), ("mempool", mempool)):
        if name == "named_pool" and sp is None:
            continue
        try:
            fn()  # warm-up pass: lazily created workspaces and streams are not retention
            settle()
            r0 = settle()
            fn()
            r1 = settle()
            res[name] = {"before": r0, "after": r1, "diff": r1 - r0, "ok": r1 - r0 <= 2 * MiB}
        except Exception as e:  # noqa: BLE001
            res[name] = {"ok": False, "error": err_str(e)}
    return {"cases": res, "ok": all(v.get("ok") for v in res.values())}


def c_host_cost(alloc, arg):
    child_setup(alloc)
    import torch
    iters = int(os.environ.get("HOST_ITERS", "100000"))
    torch.empty(1, device="cuda")
    out = {}
    for size, n in ((4096, iters), (1 << 20, iters // 5), (32 << 20, iters // 20)):
        for _ in range(1000):
            z = torch.empty(size, dtype=torch.uint8, device="cuda")
            del z
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            z = torch.empty(size, dtype=torch.uint8, device="cuda")
            del z
        out[str(size)] = (time.perf_counter() - t) / n * 1e9
    return {"ns_per_empty_del": out, "ok": True}


CHILDREN = {"build": c_build, "api": c_api, "parity": c_parity, "variants": c_variants, "seed": c_seed,
            "retention": c_retention, "host_cost": c_host_cost}


def child_main(name, alloc, arg):
    try:
        res = CHILDREN[name](alloc, arg)
    except Exception as e:  # noqa: BLE001
        res = {"ok": False, "error": err_str(e), "traceback": traceback.format_exc()[-3000:]}
    res = {"child": name, "alloc": alloc, "arg": arg, **res}
    sys.stdout.flush()
    print(json.dumps(res, default=str), flush=True)


# =================================================================================================
# Parent side: scenarios.

def child_cpus():
    """CHILD_CPUS ("2-9" or "2,3,5"): the CPUs every child process is pinned to, so that the
    launching thread of each run sits on the same cores (unset: no pinning)."""
    spec = os.environ.get("CHILD_CPUS", "").strip()
    cpus = set()
    for part in filter(None, spec.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def run_child(name, alloc, arg="", extra_env=None):
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if extra_env:
        env.update(extra_env)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, alloc, arg]
    timeout = int(os.environ.get("CHILD_TIMEOUT", "540"))
    cpus = child_cpus()
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    t = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                           preexec_fn=pin)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-1500:] if isinstance(e.stderr, bytes) else (e.stderr or "")[-1500:]
        return {"child": name, "alloc": alloc, "arg": arg, "ok": False,
                "error": f"timeout after {timeout}s", "stderr_tail": str(tail)}
    wall = round(time.time() - t, 1)
    for line in reversed(p.stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                res = json.loads(line)
            except ValueError:
                continue
            res["wall_s"] = wall
            if not res.get("ok", False):
                res["stderr_tail"] = p.stderr[-2000:]
                res["stdout_tail"] = "\n".join(l for l in p.stdout.splitlines() if l.strip() != line)[-2000:]
            return res
    return {"child": name, "alloc": alloc, "arg": arg, "ok": False, "wall_s": wall,
            "error": f"no result (exit code {p.returncode})", "stderr_tail": p.stderr[-2500:],
            "stdout_tail": p.stdout[-500:]}


def s_build():
    r = run_child("build", "slotpool")
    return {"ok": bool(r.get("ok")), "result": r}


def s_api():
    native = run_child("api", "native")
    slot = run_child("api", "slotpool")
    nk, sk = set(native.get("memory_stats_keys", [])), set(slot.get("memory_stats_keys", []))
    checks = slot.get("checks", {})
    native_checks = native.get("checks", {})
    # A PyTorch check counts if it passes under native (the control); slotpool's own always count.
    failing = {k: v for k, v in checks.items()
               if v != "ok" and (k.startswith("sp_") or native_checks.get(k) == "ok")}
    return {"ok": bool(checks) and not failing and not (nk - sk),
            "failing": failing, "missing_stats_keys": sorted(nk - sk), "extra_stats_keys": sorted(sk - nk),
            "slotpool_checks": checks, "native_checks": native_checks,
            "errors": {k: r.get("error") for k, r in (("native", native), ("slotpool", slot)) if r.get("error")},
            "details": {k: {d: r.get(d) for d in ("alloc_conf", "trace_tracker", "ipc")}
                        for k, r in (("native", native), ("slotpool", slot))}}


def pooled_median(*runs):
    """Median of the steps after the first, over all runs (None if a run has no steps)."""
    steps = sorted(t for r in runs for t in (r.get("step_s") or [None])[1:])
    if not steps or any(r.get("step_s") is None for r in runs):
        return None
    m = len(steps) // 2
    return steps[m] if len(steps) % 2 else (steps[m - 1] + steps[m]) / 2


def s_parity():
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    out = {}
    for w in os.environ.get("PARITY_WORKLOADS", "gpt2_train llama_train").split():
        runs = max(2, int(os.environ.get("PARITY_RUNS", "2")))
        ns, ss = [], []
        for _ in range(runs):
            ns.append(run_child("parity", "native", w, extra_env=env))
            ss.append(run_child("parity", "slotpool", w, extra_env=env))
        n1, n2, s1, s2 = ns[0], ns[1], ss[0], ss[1]
        ne = run_child("parity", "native", w,
                       extra_env={**env, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
        ln, ls, ln2 = n1.get("losses"), s1.get("losses"), n2.get("losses")
        res = {"native": n1, "slotpool": s1, "native_again": {"losses": ln2, "error": n2.get("error")},
               "native_expandable": {k: ne.get(k) for k in ("median_step_s", "peak_reserved", "error")}}
        if not (ln and ls):
            res["ok"] = False
            res["error"] = "a run failed"
            out[w] = res
            continue
        exact = ln == ls
        native_deterministic = ln == ln2
        diff = max(abs(a - b) for a, b in zip(ln, ls))
        noise = max((abs(a - b) for a, b in zip(ln, ln2)), default=0.0) if ln2 else None
        # Step time: the median over the steps after the first (warm-up: cuBLAS and autotuning)
        # of all runs, interleaved native, slotpool, native, slotpool, ... A whole process runs
        # gpt2_train at ~68 or at ~75-82 ms per step, under either allocator.
        ts, tn = pooled_median(*ss), pooled_median(*ns)
        t1s, t1n = s1.get("median_step_s"), n1.get("median_step_s")
        pr_s, pr_e = s1.get("peak_reserved"), ne.get("peak_reserved")
        res["slotpool_again"] = {k: s2.get(k) for k in ("step_s", "losses", "peak_reserved", "error")}
        res["native_again"]["step_s"] = n2.get("step_s")
        res["step_s_all_runs"] = {"native": [r.get("step_s") for r in ns],
                                  "slotpool": [r.get("step_s") for r in ss]}
        res.update({"losses_equal": exact, "native_deterministic": native_deterministic,
                    "max_loss_diff": diff, "native_run_to_run_diff": noise,
                    "step_s_native": tn, "step_s_slotpool": ts,
                    "step_ratio": (ts / tn) if ts and tn else None,
                    "first_runs_median_ratio": (t1s / t1n) if t1s and t1n else None,
                    "peak_reserved_native": n1.get("peak_reserved"), "peak_reserved_slotpool": pr_s,
                    "peak_reserved_expandable": pr_e,
                    "losses_ok": exact or (not native_deterministic and noise is not None
                                           and diff <= max(noise * 2, 1e-3)),
                    "step_ok": bool(ts and tn and ts <= 1.02 * tn),
                    "reserved_ok": bool(pr_s and pr_e and pr_s <= pr_e)})
        # Other slotpool configurations, for step time and peak reserved only.
        for conf in filter(None, os.environ.get("PARITY_SLOTPOOL_CONFS", "").split(";")):
            r = run_child("parity", "slotpool", w, extra_env={**env, "SLOTPOOL_CONF": conf})
            res.setdefault("slotpool_confs", {})[conf] = {
                k: r.get(k) for k in ("step_s", "median_step_s", "peak_reserved", "losses", "error")}
        if os.environ.get("PARITY_DETERMINISTIC", "1") != "0":
            # The same workload with deterministic kernels: losses must be bit-identical.
            d1 = run_child("parity", "native", w + ":det", extra_env=env)
            ds = run_child("parity", "slotpool", w + ":det", extra_env=env)
            d2 = run_child("parity", "native", w + ":det", extra_env=env)
            dn, dsl, dn2 = d1.get("loss_hex"), ds.get("loss_hex"), d2.get("loss_hex")
            res["deterministic"] = {
                "native": dn, "slotpool": dsl, "native_again": dn2,
                "native_deterministic": bool(dn) and dn == dn2,
                "losses_identical": bool(dn) and dn == dsl,
                "errors": [r.get("error") for r in (d1, ds, d2) if r.get("error")]}
            res["losses_ok"] = res["losses_ok"] and res["deterministic"]["losses_identical"]
        res["ok"] = res["losses_ok"] and res["step_ok"] and res["reserved_ok"]
        out[w] = res
    out["ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
    return out


def s_variants():
    runs = {}
    for alloc, mode in (("native", "separate"), ("native", "shared"), ("native", "single:0"),
                        ("slotpool", "group"), ("slotpool", "single:0")):
        runs[f"{alloc}:{mode}"] = run_child("variants", alloc, mode)
    g, one = runs["slotpool:group"], runs["slotpool:single:0"]
    res = {"runs": {k: {kk: v.get(kk) for kk in ("reserved_growth", "allocated_growth", "capture_s",
                                                  "replays_close", "worst_out_diff", "worst_grad_diff", "error")}
                    for k, v in runs.items()},
           "group_replays": g.get("replays")}
    if "reserved_growth" not in g or "reserved_growth" not in one:
        res["ok"] = False
        res["error"] = "a run failed"
        return res
    ratio = g["reserved_growth"] / max(1, one["reserved_growth"])
    control = runs["native:separate"]
    tol_ok = g.get("replays_close") or (
        control.get("worst_out_diff") is not None
        and g["worst_out_diff"] <= control["worst_out_diff"] * 1.01 + 1e-6
        and g["worst_grad_diff"] <= control["worst_grad_diff"] * 1.01 + 1e-6)
    res.update({"group_vs_largest_alone": ratio,
                "group_growth": g["reserved_growth"], "largest_alone_growth": one["reserved_growth"],
                "native_separate_growth": control.get("reserved_growth"),
                "native_shared_growth": runs["native:shared"].get("reserved_growth"),
                "replays_equal_eager": bool(tol_ok),
                "ok": bool(tol_ok) and g["reserved_growth"] <= 1.10 * one["reserved_growth"] + 64 * MiB})
    return res


def s_seed():
    runs = {}
    for alloc, mode in (("native", "per_entry"), ("native", "shared"), ("slotpool", "per_entry"),
                        ("slotpool", "shared_named")):
        runs[f"{alloc}:{mode}"] = run_child("seed", alloc, mode)
    sn, ns, npe = runs["slotpool:shared_named"], runs["native:shared"], runs["native:per_entry"]
    # A memory fraction between what slotpool's named pool needs and what PyTorch's per-layer pools
    # need: PyTorch should run out of memory at capture, slotpool capture and replay.
    frac = None
    if sn.get("ok") and npe.get("peak_reserved") and sn.get("total_memory"):
        lo, hi = sn["peak_reserved"] * 1.15, npe["peak_reserved"] * 0.9
        if lo < hi:
            frac = round(lo / sn["total_memory"], 4)
            for alloc, mode in (("native", "per_entry"), ("slotpool", "shared_named")):
                runs[f"{alloc}:{mode}@{frac}"] = run_child("seed", alloc, f"{mode}@{frac}")
    res = {"runs": {k: {kk: v.get(kk) for kk in ("peak_allocated", "peak_reserved", "reserved_growth",
                                                  "capture_s", "error", "y_sum", "fraction",
                                                  "peaks_after_capture")}
                    for k, v in runs.items()}}
    ratio = (sn["peak_reserved"] / sn["peak_allocated"]) if sn.get("peak_allocated") else None
    res["slotpool_reserved_over_allocated"] = ratio
    res["fraction"] = frac
    fr_ok = frac is not None and bool(runs[f"slotpool:shared_named@{frac}"].get("ok")) and \
        bool(runs[f"native:per_entry@{frac}"].get("error"))
    res["fraction_ok"] = fr_ok
    res["ok"] = bool(sn.get("ok")) and ratio is not None and ratio <= 1.05 and fr_ok
    return res


def s_retention():
    slot = run_child("retention", "slotpool")
    native = run_child("retention", "native")
    return {"ok": bool(slot.get("ok")), "slotpool": slot.get("cases", slot.get("error")),
            "native": native.get("cases", native.get("error"))}


def s_host_cost():
    native = run_child("host_cost", "native")
    slot = run_child("host_cost", "slotpool")
    nn_, sn = native.get("ns_per_empty_del", {}), slot.get("ns_per_empty_del", {})
    return {"ok": bool(slot.get("ok")) and bool(native.get("ok")), "native_ns": nn_, "slotpool_ns": sn,
            "ratio": {k: sn[k] / nn_[k] for k in sn if k in nn_ and nn_[k]},
            "errors": {k: r.get("error") for k, r in (("native", native), ("slotpool", slot)) if r.get("error")}}


SCENARIO_FNS = {"build": s_build, "api": s_api, "parity": s_parity, "variants": s_variants, "seed": s_seed,
                "retention": s_retention, "host_cost": s_host_cost}


def main(argv):
    if argv[:1] == ["--child"]:
        child_main(argv[1], argv[2], argv[3] if len(argv) > 3 else "")
        return 0
    if argv[:1] == ["--list"]:
        print("\n".join(SCENARIOS))
        return 0
    names = argv or list(SCENARIOS)
    out_dir = os.environ.get("OUT", ".")
    out_path = os.path.join(out_dir, "torch_scenarios.json")
    try:
        with open(out_path) as f:
            results = json.load(f)
    except (OSError, ValueError):
        results = {}
    for name in names:
        t = time.time()
        try:
            if name not in SCENARIO_FNS:
                raise ValueError(f"unknown scenario {name!r}; --list shows them")
            rec = SCENARIO_FNS[name]()
        except Exception as e:  # noqa: BLE001 - a scenario's failure is its result
            rec = {"ok": False, "error": err_str(e), "traceback": traceback.format_exc()[-2000:]}
        rec = {"scenario": name, "ok": bool(rec.pop("ok", False)), "seconds": round(time.time() - t, 1), **rec}
        print(json.dumps(rec, default=str), flush=True)
        results[name] = rec
        try:
            os.makedirs(out_dir, exist_ok=True)
            with open(out_path, "w") as f:
                json.dump(results, f, indent=1, default=str)
        except OSError as e:
            print(f"cannot write {out_path}: {e}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
