"""What PyTorch's own allocator puts in a CUDA IPC handle of expandable-segment memory ('e'), and
whether a spawned process can open it on this machine (pidfd_getfd needs ptrace permission).

Run on the GPU machine: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 benches/gpu/ipc_probe.py
"""
import json
import os
import struct

import torch
import torch.multiprocessing as tmp


def child(q_in, q_out):
    try:
        t = q_in.get(timeout=120)
        want = torch.arange(t.numel(), dtype=torch.float32, device=t.device)
        q_out.put("ok" if bool(torch.equal(t, want)) else "different values")
        del t
    except Exception as e:  # noqa: BLE001
        q_out.put(f"{type(e).__name__}: {e}")
    q_in.get(timeout=120)


def main():
    out = {"torch": torch.__version__, "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    try:
        out["ptrace_scope"] = open("/proc/sys/kernel/yama/ptrace_scope").read().strip()
    except OSError as e:
        out["ptrace_scope"] = str(e)
    for mib in (64, 3):
        t = torch.arange(mib * 1024 * 256, dtype=torch.float32, device="cuda")
        share = t.untyped_storage()._share_cuda_()
        h = share[1]
        rec = {"bytes": len(h), "hex": h[:96].hex(), "offset": share[3], "size": share[2]}
        if len(h) >= 2:
            rec["version"], rec["type"] = h[0], chr(h[1])
        if len(h) >= 26:
            rec["header_i32_i32_u64_u64"] = struct.unpack_from("<iiQQ", h, 2)
            rec["tail_i32"] = list(struct.unpack_from(f"<{(len(h) - 26) // 4}i", h, 26))
        rec["pid"] = os.getpid()
        rec["fds"] = sorted(int(f) for f in os.listdir("/proc/self/fd"))[-8:]
        ctx = tmp.get_context("spawn")
        q_in, q_out = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=child, args=(q_in, q_out))
        p.start()
        q_in.put(t)
        rec["child"] = q_out.get(timeout=180)
        q_in.put("done")
        p.join(timeout=60)
        out[f"{mib}MiB"] = rec
    print(json.dumps(out))


if __name__ == "__main__":
    main()
