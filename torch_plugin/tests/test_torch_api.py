"""PyTorch's allocator API with slotpool beneath it, on a CUDA device: statistics, MemPool,
record_stream, snapshots and memory history, CUDA graphs and graph pools, graphed callables,
torch.compile's CUDA graphs, IPC, out-of-memory errors; then slotpool's own API (named pools,
checkpoint/restore, arenas, variant groups, mark_reusable). Skipped without torch or a device.

    pytest torch_plugin/tests/test_torch_api.py
    SLOTPOOL_TORCH_TEST_ALLOCATOR=native pytest ...     (PyTorch's own allocator: the control)

The tests run in file order in one process, under one allocator installed before CUDA starts.
"""

import gc
import json
import os
import re
import subprocess
import sys
import time

import pytest

import _torch_helpers
from conftest import cuda_or_skip

pytestmark = pytest.mark.cuda
MiB = 1 << 20
dev = "cuda"
# What a few checks measured, for whoever runs the suite (benches/gpu/torch_scenarios.py reports it).
keep = {}
torch = None
sp = None  # the slotpool_torch module, None under the native control
slot = False


@pytest.fixture(autouse=True, scope="module")
def _installed(allocator):
    global torch, sp, slot
    torch = cuda_or_skip()
    sp, slot = allocator, allocator is not None
    yield


def slotpool_only():
    if not slot:
        pytest.skip("slotpool's own API (the native control has none)")


def test_backend():
    b = torch.cuda.memory.get_allocator_backend()
    want = "slotpool" if slot else "native"
    assert b == want, f"backend {b!r}, want {want!r}"


def test_alloc_basic():
    a0 = torch.cuda.memory_allocated()
    x = torch.randn(1 << 20, device=dev)
    a1 = torch.cuda.memory_allocated()
    assert a1 - a0 >= 4 * MiB, f"allocated grew by {a1 - a0}"
    keep["x"] = x
    del x


def test_registry():
    if not slot:
        return  # PyTorch's own allocator is the registry's under the control
    assert sp.load().registry_is_ours(), "c10::GetAllocator(kCUDA) is not slotpool"


def test_memory_stats_keys():
    st = torch.cuda.memory_stats()
    keep["keys"] = sorted(st.keys())
    for k in ("allocated_bytes.all.current", "reserved_bytes.all.peak", "requested_bytes.all.current",
              "active_bytes.large_pool.current", "segment.small_pool.current", "num_alloc_retries",
              "num_ooms", "max_split_size", "num_device_alloc", "oversize_allocations.current"):
        assert k in st, f"missing {k}"
    assert st["allocated_bytes.all.current"] == torch.cuda.memory_allocated()


def test_size0():
    a = torch.empty(0, device=dev)
    b = torch.empty(0, device=dev)
    c = torch.empty((0, 7), device=dev, dtype=torch.float16)
    assert a.data_ptr() == 0 and b.data_ptr() == 0, (a.data_ptr(), b.data_ptr())
    del a, b, c


def test_reset_peak():
    y = torch.empty(32 * MiB, dtype=torch.uint8, device=dev)
    del y
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated()
    torch.cuda.reset_accumulated_memory_stats()
    st = torch.cuda.memory_stats()
    assert st["allocation.all.allocated"] == 0, st["allocation.all.allocated"]


def test_memory_summary():
    assert len(torch.cuda.memory_summary()) > 100


def test_empty_cache():
    y = torch.empty(64 * MiB, dtype=torch.uint8, device=dev)
    r1 = torch.cuda.memory_reserved()
    del y
    torch.cuda.empty_cache()
    r2 = torch.cuda.memory_reserved()
    assert r2 <= r1 - 60 * MiB, f"reserved {r1} -> {r2}"


def test_raw_alloc():
    p = torch.cuda.caching_allocator_alloc(1 << 20)
    assert p != 0
    torch.cuda.caching_allocator_delete(p)


def test_mempool():
    p = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(p):
        t = torch.empty(1 << 20, device=dev)
    u = torch.empty(1 << 20, device=dev)
    assert p.use_count() == 1, p.use_count()
    segs = torch.cuda.memory_snapshot(p.id)
    addrs = {s["address"] for s in segs}
    inside = any(s["address"] <= t.data_ptr() < s["address"] + s["total_size"] for s in segs)
    assert inside, f"tensor {t.data_ptr():#x} not in pool segments {sorted(addrs)}"
    outside = any(s["address"] <= u.data_ptr() < s["address"] + s["total_size"] for s in segs)
    assert not outside, "an allocation outside use_mem_pool went to the pool"
    del t, u, p
    gc.collect()


def test_mempool_options():
    p1 = torch.cuda.MemPool(use_on_oom=True)
    p2 = torch.cuda.MemPool(no_split=True)
    with torch.cuda.use_mem_pool(p2):
        t = torch.empty(3 * MiB, dtype=torch.uint8, device=dev)
    del t, p1, p2
    gc.collect()


def test_record_stream():
    s = torch.cuda.Stream()
    t = torch.empty(1000, device=dev)
    with torch.cuda.stream(s):
        t.add_(1)
    t.record_stream(s)
    del t
    torch.cuda.synchronize()


def test_snapshot():
    t = torch.empty(5 * MiB, dtype=torch.uint8, device=dev)
    s = torch.cuda.memory._snapshot()
    assert s["segments"], "no segments"
    assert isinstance(s["device_traces"], list) and len(s["device_traces"]) >= 1
    states = {b["state"] for seg in s["segments"] for b in seg["blocks"]}
    assert states <= {"active_allocated", "active_pending_free", "inactive"}, states
    found = False
    for seg in s["segments"]:
        a = seg["address"]
        for b in seg["blocks"]:
            if a == t.data_ptr() and b["state"] == "active_allocated":
                found = True
            a += b["size"]
    assert found, "the live tensor is not an active_allocated block in _snapshot()"
    torch.cuda.memory_snapshot()
    del t


def test_record_history():
    # _record_memory_history -> _snapshot()["device_traces"] -> memory_viz, as users debug OOMs.
    from torch.cuda import _memory_viz
    torch.cuda.memory._record_memory_history(max_entries=1000)
    try:
        t = torch.empty(3 * MiB, dtype=torch.uint8, device=dev)
        addr = t.data_ptr()
        del t
        s = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = s["device_traces"][torch.cuda.current_device()]
    mine = [e for e in trace if e["addr"] == addr]
    acts = [e["action"] for e in mine]
    assert "alloc" in acts and "free_requested" in acts, f"{len(trace)} entries; at the tensor: {acts}"
    assert acts.index("alloc") < acts.index("free_requested"), acts
    a = mine[acts.index("alloc")]
    assert a["size"] == 3 * MiB, a
    assert any("test_torch_api" in f.get("filename", "") for f in a.get("frames", [])), \
        f"the alloc entry's stack lacks this script: {a.get('frames', [])[:3]}"
    assert abs(a["time_us"] / 1e6 - time.time()) < 600, f"time_us {a['time_us']} is not wall-clock microseconds"
    text = _memory_viz.trace(s)
    assert f"Device {torch.cuda.current_device()} ---" in text and "del " in text, text[:300]
    torch.cuda.memory._record_memory_history(enabled=None, clear_history=True)


def test_graph():
    x = torch.randn(1 << 20, device=dev)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = x * 2 + 1
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        y = x * 2 + 1
        w = torch.empty(3 * MiB, dtype=torch.uint8, device=dev)
        del w
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert torch.allclose(y, x * 2 + 1)
    g.reset()


def test_graph_side_stream():
    # allocations on a forked stream during capture: routed by the capture filter
    x = torch.randn(1 << 20, device=dev)
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.graph(g):
        cur = torch.cuda.current_stream()
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            z = x + 1
        cur.wait_stream(side)
        y = z * 3
    g.replay()
    torch.cuda.synchronize()
    assert torch.allclose(y, (x + 1) * 3)
    pool = g.pool()
    segs = torch.cuda.memory_snapshot(pool)
    inside = any(s["address"] <= z.data_ptr() < s["address"] + s["total_size"] for s in segs)
    assert inside, "side-stream allocation during capture is not in the graph's pool"
    del z, y
    g.reset()


def test_graph_shared_pool():
    x = torch.randn(1 << 16, device=dev)
    pool = torch.cuda.graph_pool_handle()
    gs = []
    for k in range(3):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            y = x * (k + 2)
        gs.append((g, y, k))
    for g, y, k in gs:
        g.replay()
    torch.cuda.synchronize()
    assert all(torch.allclose(y, x * (k + 2)) for _, y, k in gs)
    for g, _, _ in gs:
        g.reset()


def test_graphed_callables():
    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).to(dev)
    inp = torch.randn(64, 256, device=dev, requires_grad=True)
    gl = torch.cuda.make_graphed_callables(lin, (inp,))
    x = torch.randn(64, 256, device=dev, requires_grad=True)
    out = gl(x)
    out.sum().backward()
    gx = x.grad.clone()
    x2 = x.detach().clone().requires_grad_()
    ref = lin(x2)
    ref.sum().backward()
    torch.cuda.synchronize()
    assert torch.allclose(out, ref, atol=1e-4), (out - ref).abs().max().item()
    assert torch.allclose(gx, x2.grad, atol=1e-4)


def test_cudnn_benchmark():
    torch.backends.cudnn.benchmark = True
    conv = torch.nn.Conv2d(16, 32, 3).to(dev)
    y = conv(torch.randn(8, 16, 64, 64, device=dev))
    torch.cuda.synchronize()
    torch.backends.cudnn.benchmark = False
    assert y.shape == (8, 32, 62, 62)


def test_memory_fraction():
    torch.cuda.set_per_process_memory_fraction(0.9)
    if hasattr(torch.cuda, "get_per_process_memory_fraction"):
        f = torch.cuda.get_per_process_memory_fraction()
        assert abs(f - 0.9) < 1e-3, f
    torch.cuda.set_per_process_memory_fraction(1.0)


def test_mem_get_info():
    free, total = torch.cuda.mem_get_info()
    assert 0 < free <= total


def test_multi_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip("one device")
    # A transposed (non-contiguous) copy between devices runs a copy kernel that reads the
    # other device's memory once PyTorch has enabled peer access (enablePeerAccess, which
    # must open slotpool's vmm pages too); without it the kernel faults.
    for src, dst in ((0, 1), (1, 0)):
        a = torch.randn(3000, 2000, device=f"cuda:{src}")
        b = a.t().to(f"cuda:{dst}")
        assert b.device.index == dst
        assert torch.equal(b.cpu(), a.t().cpu()), f"copy {src} -> {dst} differs"
        # Memory mapped after peer access was enabled.
        c = torch.randn(5000, 3000, device=f"cuda:{src}")
        d = c.t().to(f"cuda:{dst}")
        assert torch.equal(d.cpu(), c.t().cpu()), f"second copy {src} -> {dst} differs"
        assert torch.cuda.memory_allocated(dst) >= 4 * (b.numel() + d.numel())
        del a, b, c, d
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)

# ---- slotpool's own API ----


def test_ipc():
    # torch.multiprocessing: CUDA tensors sent to a spawned process, which opens each handle
    # with its own allocator, checks the values and writes one that the sender must see.
    # 256 KiB lives in a classic segment ('c' handle: cudaIpcMemHandle_t). Under slotpool,
    # 3 MiB and 40 MiB live in vmm pages ('e' handle: PyTorch's expandable-segment format,
    # the pages' file descriptors), the second at an offset into its first page. Under
    # PyTorch's allocator, 64 MiB of its own expandable segments goes to a slotpool receiver.
    import torch.multiprocessing as tmp
    ctx = tmp.get_context("spawn")

    def send(t, receiver):
        q_in, q_out = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=_torch_helpers.ipc_receiver, args=(receiver, q_in, q_out))
        p.start()
        try:
            q_in.put(t)
            r = q_out.get(timeout=180)
        finally:
            q_in.put("done")
            p.join(timeout=60)
        what = f"{t.numel() * 4 >> 10} KiB to {receiver}"
        assert r == "ok", f"{what}: {r}"
        torch.cuda.synchronize()
        assert float(t[0]) == -1.0, f"{what}: the receiver's write did not arrive"

    floats = [64 * 1024]
    if slot:
        floats += [3 * MiB // 4, 10 * MiB]
    for n in floats:
        for receiver in ["native", "slotpool"]:
            send(torch.arange(n, dtype=torch.float32, device=dev), receiver)
    if slot:
        big = torch.arange(10 * MiB, dtype=torch.float32, device=dev)
        # What the handle of the 40 MiB tensor carried (libslotpool.so is loaded global).
        import ctypes
        count, page, offset = (ctypes.c_size_t() for _ in range(3))
        fds = (ctypes.c_int * 64)()  # one descriptor a page: room for 2 MiB pages
        lib = ctypes.CDLL(None)
        rc = lib.sp_ipc_export(ctypes.c_void_p(big.data_ptr()), fds, 64, ctypes.byref(count),
                               ctypes.byref(page), ctypes.byref(offset))
        assert rc == 0, rc
        for i in range(count.value):
            os.close(fds[i])
        keep["ipc"] = {"pages": count.value, "page_size": page.value,
                       "offset": offset.value}
    else:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        try:
            send(torch.arange(16 * MiB, dtype=torch.float32, device=dev), "slotpool")
        finally:
            torch.cuda.memory._set_allocator_settings("expandable_segments:False")


def test_alloc_conf():
    # PyTorch's allocator settings, in a fresh process: max_split_size_mb shows in the
    # stats, and garbage_collection_threshold (with a 1.5 GiB fraction, 0.5 of it kept)
    # releases four freed 256 MiB segments before a 300 MiB request grows the cache.
    env = dict(os.environ, PLUGIN=_torch_helpers.PLUGIN, ALLOC="slotpool" if slot else "native",
               PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:64,garbage_collection_threshold:0.5,"
                                       "expandable_segments:False")
    p = subprocess.run([sys.executable, "-c", _torch_helpers.ALLOC_CONF_PROBE], capture_output=True,
                       text=True, timeout=300, env=env)
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    assert p.returncode == 0 and lines, f"probe failed ({p.returncode}): {p.stderr[-1500:]}"
    r = json.loads(lines[-1])
    keep["alloc_conf"] = r
    assert r["max_split_size"] == 64 << 20, r
    assert r["reserved_before"] == 1024 << 20, r
    assert r["reserved_after"] == 300 << 20, r


def test_trace_tracker():
    # attachAllocatorTraceTracker (what NCCL's segment registration uses): a C++ tracker sees
    # a tensor's alloc and frees as they happen, and the memory added for a 64 MiB tensor
    # after empty_cache (a segment allocation, or page maps under slotpool).
    from torch.utils.cpp_extension import load_inline
    # with_cuda: c10's CUDA headers include cuda_runtime.h.
    ext = load_inline(name="sp_trace_tracker", cpp_sources=[_torch_helpers.TRACKER_SRC],
                      functions=["attach", "take"], with_cuda=True, verbose=False)
    ext.attach()
    x = torch.empty(3000, dtype=torch.uint8, device=dev)
    p = x.data_ptr()
    del x
    torch.cuda.synchronize()
    ev = ext.take()
    mine = [(a, s) for a, addr, s in ev if addr == p and a <= 2]
    assert mine == [(0, 3000), (1, 3000), (2, 3000)], (mine, ev[:20])
    torch.cuda.empty_cache()
    ext.take()
    y = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    q = y.data_ptr()
    ev = ext.take()
    grown = sum(s for a, addr, s in ev if a in (3, 5) and addr < q + (64 << 20) and q < addr + s)
    keep["trace_tracker"] = {"events": len(ev), "grown_under_block": grown}
    assert grown >= 64 << 20, (grown, ev[:20])
    del y


def test_sp_named_pool():
    slotpool_only()
    pid = sp.named_pool("api.named")
    assert pid[0] == 0 and pid[1] >= (1 << 63), pid
    assert sp.named_pool("api.named") == pid
    with sp.use_pool(pid):
        t = torch.empty(2 * MiB, dtype=torch.uint8, device=dev)
    st = sp.pool_stats(pid)
    assert st["allocated_bytes.all.current"] >= 2 * MiB, st["allocated_bytes.all.current"]
    del t
    assert sp.release_pool(pid) == 1
    assert sp.release_pool(pid) == 0


def test_sp_checkpoint_restore():
    slotpool_only()
    pid = sp.named_pool("api.ckpt")
    with sp.use_pool(pid):
        a = torch.empty(1 << 20, device=dev)
    cp = sp.checkpoint(pid)
    with sp.use_pool(pid):
        b = torch.empty(1 << 20, device=dev)
        c = torch.empty(3 << 20, device=dev)
    b_ptr = b.data_ptr()
    o0 = sp.orphan_count()
    r = sp.restore(pid, cp, keep_tensors=[a])
    freed = {p for p, _ in r.freed}
    assert b_ptr in freed and c.data_ptr() in freed, (freed, b_ptr)
    assert sp.orphan_count() == o0 + 2, sp.orphan_count()
    ok, why = sp.verify_live(pid, [a])
    assert ok, why
    del b, c  # stale owners: their frees are absorbed
    assert sp.orphan_count() == o0, sp.orphan_count()
    # torch's own checkpoint API on the same pool
    st = torch._C._cuda_getCheckpointState(torch.cuda.current_device(), pid)
    with sp.use_pool(pid):
        d = torch.empty(1 << 20, device=dev)
    dptr = d.untyped_storage()._cdata
    torch._C._cuda_setCheckpointPoolState(torch.cuda.current_device(), st, [dptr], [])
    assert torch._C._cuda_checkPoolLiveAllocations(torch.cuda.current_device(), pid, {a.data_ptr()})
    del d, a, cp, st
    gc.collect()
    sp.release_pool(pid)


def test_sp_arena():
    slotpool_only()
    pid = sp.named_pool("api.arena")
    with sp.Arena(pid) as ar:
        t0 = ar.empty(0, 0, (1024,), torch.float32)
        t1 = ar.empty(1, 0, (2048,), torch.float32)
        u0 = ar.empty(0, 1, (512,), torch.float32)
        assert t0.data_ptr() == t1.data_ptr(), "slot 0 of two branches differs"
        assert u0.data_ptr() != t0.data_ptr(), "two slots share an address"
        t0.fill_(1.0)
        u0.fill_(2.0)
        torch.cuda.synchronize()
        assert float(u0.sum()) == 1024.0
        del t0, t1, u0
    sp.release_pool(pid)


def test_sp_variants_small():
    slotpool_only()
    # the larger variant first: the smaller one must fit in the memory it left
    xs = [torch.randn(n, device=dev) for n in (1 << 21, 1 << 19)]
    reserved = []
    with sp.variant_group(None, 2) as grp:
        graphs = []
        for k, x in enumerate(xs):
            with grp.variant(k):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=grp.pool):
                    tmp = x.sin()
                    y = tmp * 2
                    del tmp
                graphs.append((g, y))
            reserved.append(sp.pool_stats(grp.pool)["reserved_bytes.all.current"])
    assert reserved[1] <= reserved[0], f"pool grew for the smaller variant: {reserved}"
    for order in ([0, 1], [1, 0], [1, 1, 0]):
        for k in order:
            g, y = graphs[k]
            g.replay()
            torch.cuda.synchronize()
            assert torch.allclose(y, xs[k].sin() * 2), (order, k)
    for g, _ in graphs:
        g.reset()
    del graphs
    gc.collect()


def test_sp_mark_reusable():
    slotpool_only()
    # Two mutually exclusive graphs in one pool: graph 0's output is marked reusable, so
    # graph 1's capture takes the same memory instead of growing the pool.
    pid = sp.named_pool("api.mark_reusable")
    x = torch.randn(1 << 20, device=dev)
    n0 = sp._installed_ext().orphan_count()
    g0, g1 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g0, pool=pid):
        y0 = x * 2
    size = sp.mark_reusable(y0)
    assert size >= y0.numel() * 4, size
    with torch.cuda.graph(g1, pool=pid):
        y1 = x * 3
    assert y1.data_ptr() == y0.data_ptr(), "graph 1 did not reuse graph 0's output memory"
    for g, y, m in ((g0, y0, 2), (g1, y1, 3), (g0, y0, 2)):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, x * m), m
    del y, y0  # y0's free is swallowed: the memory is y1's now
    gc.collect()
    g1.replay()
    torch.cuda.synchronize()
    assert torch.equal(y1, x * 3), "y1 lost its memory when y0 died"
    del y1
    n1 = sp._installed_ext().orphan_count()
    assert n1 == n0, f"orphans {n0} -> {n1}"
    g0.reset()
    g1.reset()
    del g0, g1
    sp.release_pool(pid)


def test_sp_snapshot_allocator_settings():
    # The snapshot names the configuration slotpool runs with, not an empty "slotpool:".
    slotpool_only()
    settings = torch.cuda.memory._snapshot()["allocator_settings"]
    conf = settings["PYTORCH_CUDA_ALLOC_CONF"]
    keys = dict(kv.split(":", 1) for kv in conf.split(",") if ":" in kv)
    assert keys.get("growth") in ("vmm", "classic"), conf
    assert "vmm_slack_percent" in keys and "large_segment_size_mb" in keys, conf
    assert settings["expandable_segments"] == (keys["growth"] == "vmm"), (settings, conf)


def test_sp_oom_message_counts_each_byte_once():
    slotpool_only()
    try:
        torch.empty(1 << 50, dtype=torch.uint8, device=dev)
    except torch.OutOfMemoryError as e:
        msg = str(e)
    else:
        pytest.fail("no OutOfMemoryError")
    m = re.search(r"([\d.]+) GiB reserved of a [\d.]+ GiB limit: ([\d.]+) GiB allocated, "
                  r"([\d.]+) GiB cached in private pools, ([\d.]+) GiB reserved but unallocated", msg)
    assert m, msg
    reserved, allocated, private, rest = map(float, m.groups())
    assert abs(allocated + private + rest - reserved) <= 0.015, msg


def test_checkpoint_state_half_changed():
    # CUDA graph trees' branch switch (setCheckpointPoolState) with half of a pool's blocks changed
    # since getCheckpointState, under either allocator: the surviving tensors keep their memory and
    # contents, the new tensors' memory goes back to the pool (their storages passed as stale), and
    # the blocks of the tensors that died come back and are freed as graph trees free them.
    d = torch.cuda.current_device()
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        ts = [torch.full((512 * (i % 5 + 1),), i, dtype=torch.uint8, device=dev) for i in range(40)]
    torch.cuda.synchronize()
    state = torch._C._cuda_getCheckpointState(d, pool.id)
    dead_ptrs = [t.data_ptr() for t in ts[::2]]
    survivors = ts[1::2]
    del ts
    with torch.cuda.use_mem_pool(pool):
        new = [torch.empty(3000 + 100 * i, dtype=torch.uint8, device=dev) for i in range(20)]
    torch.cuda.synchronize()
    torch._C._cuda_setCheckpointPoolState(d, state, [t.untyped_storage()._cdata for t in new], [])
    for p in dead_ptrs:
        torch._C._cuda_cudaCachingAllocator_raw_delete(p)
    del new  # their deleters were removed: dropping them frees nothing
    assert torch._C._cuda_checkPoolLiveAllocations(d, pool.id, {t.data_ptr() for t in survivors})
    assert [int(t[0]) for t in survivors] == list(range(1, 40, 2))
    del survivors, state
    gc.collect()
    assert torch._C._cuda_checkPoolLiveAllocations(d, pool.id, set())
    del pool
    gc.collect()


def test_checkpoint_state_half_changed_both_bindings():
    # The same branch switch through each binding, three times over on one pool with other new
    # tensors each time: the live set is the survivors' after each, and their contents stay.
    d = torch.cuda.current_device()
    for name, set_state in _set_state_fns():
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            ts = [torch.full((512 * (i % 7 + 1),), i % 251, dtype=torch.uint8, device=dev)
                  for i in range(200)]
        torch.cuda.synchronize()
        state = torch._C._cuda_getCheckpointState(d, pool.id)
        dead_ptrs = [t.data_ptr() for t in ts[::2]]  # re-created by every restore
        survivors = ts[1::2]
        del ts
        for r in range(3):
            with torch.cuda.use_mem_pool(pool):
                new = [torch.empty(3000 + 64 * i + 512 * r, dtype=torch.uint8, device=dev)
                       for i in range(100)]
            set_state(d, state, [t.untyped_storage()._cdata for t in new], [])
            for p in dead_ptrs:
                torch._C._cuda_cudaCachingAllocator_raw_delete(p)
            del new
            want = {t.data_ptr() for t in survivors}
            assert torch._C._cuda_checkPoolLiveAllocations(d, pool.id, want), (name, r)
            assert [int(t[0]) for t in survivors] == [i % 251 for i in range(1, 200, 2)], name
        del survivors, state
        gc.collect()
        assert torch._C._cuda_checkPoolLiveAllocations(d, pool.id, set()), name
        del pool
        gc.collect()


def _set_state_fns():
    """The setCheckpointPoolState functions to check: what torch._C holds now (slotpool's under
    slotpool) and, under slotpool, PyTorch's own binding over slotpool's allocator."""
    fns = [("torch._C", torch._C._cuda_setCheckpointPoolState)]
    if slot:
        fns.append(("pytorch's binding", sp.torch_set_checkpoint_pool_state))
    return fns


def test_set_checkpoint_pool_state_is_slotpools():
    slotpool_only()
    assert sp.torch_set_checkpoint_pool_state is not None
    assert torch._C._cuda_setCheckpointPoolState is sp.load().set_checkpoint_pool_state
    assert torch._C._cuda_setCheckpointPoolState is not sp.torch_set_checkpoint_pool_state


def test_set_checkpoint_pool_state_contract():
    # PyTorch's contract, checked for each binding on the same allocator: (a) a pointer the
    # restore frees for good comes with its stale storage; (b) stale storages of survivors lose their
    # deleters, and (c) storages_to_add_deleters_to get them back (CUDA graph trees' pattern:
    # stale_storages empty, the path's live storages take deleters).
    d = torch.cuda.current_device()
    for name, set_state in _set_state_fns():
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            ts = [torch.full((1024 * (i + 1),), i, dtype=torch.uint8, device=dev) for i in range(6)]
        torch.cuda.synchronize()
        state = torch._C._cuda_getCheckpointState(d, pool.id)
        ptrs = {t.data_ptr() for t in ts}
        with torch.cuda.use_mem_pool(pool):
            extra = torch.empty(5000, dtype=torch.uint8, device=dev)
        torch.cuda.synchronize()
        # (a) the extra tensor's block is freed for good, with its storage as stale. (Without it
        # the call fails only after the restore, in both bindings: PyTorch's contract.)
        set_state(d, state, [extra.untyped_storage()._cdata], [])
        del extra  # its deleter is gone: nothing is freed twice
        assert torch._C._cuda_checkPoolLiveAllocations(d, pool.id, ptrs), name
        # (b) the survivors' storages, as stale: their deleters go, the blocks stay live.
        set_state(d, state, [t.untyped_storage()._cdata for t in ts], [])
        assert torch._C._cuda_checkPoolLiveAllocations(d, pool.id, ptrs), name
        # (c) storages made over the blocks without a deleter (as graph trees make them) take
        # deleters; the old tensors free nothing, dropping the new storages frees the blocks.
        owners = [torch._C._construct_storage_from_data_pointer(
            t.data_ptr(), t.device, t.untyped_storage().nbytes()) for t in ts]
        set_state(d, state, [], [o._cdata for o in owners])
        assert [int(t[0]) for t in ts] == list(range(6)), name
        del ts
        gc.collect()
        assert torch._C._cuda_checkPoolLiveAllocations(d, pool.id, ptrs), name
        del owners
        gc.collect()
        torch.cuda.synchronize()
        assert torch._C._cuda_checkPoolLiveAllocations(d, pool.id, set()), name
        del state, pool
        gc.collect()


def test_set_checkpoint_pool_state_refuses_without_change():
    # slotpool's binding refuses what it can before the restore: a stale storage with another
    # deleter, a state that is not a checkpoint state. The pool is as it was.
    slotpool_only()
    d = torch.cuda.current_device()
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        a = torch.empty(4096, dtype=torch.uint8, device=dev)
    state = torch._C._cuda_getCheckpointState(d, pool.id)
    with torch.cuda.use_mem_pool(pool):
        b = torch.empty(8192, dtype=torch.uint8, device=dev)
    cpu = torch.empty(16, dtype=torch.uint8)  # its storage has the CPU allocator's deleter
    with pytest.raises(RuntimeError, match="deleter"):
        torch._C._cuda_setCheckpointPoolState(
            d, state, [b.untyped_storage()._cdata, cpu.untyped_storage()._cdata], [])
    with pytest.raises(TypeError):
        torch._C._cuda_setCheckpointPoolState(d, state, ["not a pointer"], [])
    live = {a.data_ptr(), b.data_ptr()}
    assert torch._C._cuda_checkPoolLiveAllocations(d, pool.id, live)
    torch._C._cuda_setCheckpointPoolState(d, state, [b.untyped_storage()._cdata], [])
    assert torch._C._cuda_checkPoolLiveAllocations(d, pool.id, {a.data_ptr()})
    del a, b, cpu, state
    gc.collect()
    del pool
    gc.collect()


def test_compile_reduce_overhead():
    import torch._inductor.config as icfg
    icfg.triton.slow_path_cudagraph_asserts = True

    def fn(a):
        return (a * 2).sin() + a.cos() * 3

    f = torch.compile(fn, mode="reduce-overhead", dynamic=False)
    xs = {n: torch.randn(n, device=dev) for n in (4096, 8192)}
    for n in (4096, 4096, 4096, 8192, 8192, 8192, 4096, 8192, 4096):
        r = f(xs[n])
        assert torch.allclose(r, fn(xs[n]), atol=1e-5), n
    torch.cuda.synchronize()


def test_oom():
    seen = []
    torch._C._cuda_attach_out_of_memory_observer(lambda *a: seen.append(a))
    n0 = torch.cuda.memory_stats().get("num_ooms", 0)
    try:
        torch.empty(1 << 50, dtype=torch.uint8, device=dev)
    except torch.OutOfMemoryError as e:
        msg = str(e)
    else:
        pytest.fail("no OutOfMemoryError")
    assert "out of memory" in msg.lower(), msg[:200]
    assert seen, "OOM observer not called"
    n1 = torch.cuda.memory_stats().get("num_ooms", 0)
    assert n1 >= n0 + 1, f"num_ooms {n0} -> {n1}"
    z = torch.empty(1 << 20, device=dev)  # still usable
    del z


def test_sp_orphan_pins_pool():
    slotpool_only()
    # A tensor whose block a restore took back keeps its pool's memory mapped: releasing the
    # pool and emptying the cache must not pull the memory from under it (it would fault).
    pid = sp.named_pool("api.orphan_pin")
    cp = sp.checkpoint(pid)
    with sp.use_pool(pid):
        t = torch.full((1 << 20,), 7.0, device=dev)
    sp.restore(pid, cp)
    del cp
    sp.release_pool(pid)
    gc.collect()
    torch.cuda.empty_cache()
    assert sp.pool_use_count(pid) >= 1, "the orphan does not pin its pool"
    assert float(t.sum()) == 7.0 * (1 << 20), "the orphan's memory changed"
    del t
    gc.collect()
    torch.cuda.empty_cache()
    assert sp.pool_use_count(pid) == 0, "the last orphan did not unpin the pool"
