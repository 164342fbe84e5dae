"""Out-of-memory under slotpool_torch, case by case, each in its own process.

Found on 2026-11-29: every OOM crashed the process while formatting the OutOfMemoryError message.
The H200 image's g++ wrapper linked a static libstdc++ into the extension whose iostreams were
never initialised; the extension now links the shared libstdc++.so.6 (_loader.SHARED_LIBSTDCXX).

usage: oom_probe.py            runs every case in a child process and prints one JSON line each
       oom_probe.py CASE       (child) runs one case

Children run with Python's faulthandler and, when $SEGV_BT names it, benches/gpu/segv_backtrace.so
preloaded, so a crash prints both the Python and the native stack.
"""
import json, os, re, subprocess, sys

HERE = os.path.dirname(os.path.abspath(__file__))
PLUGIN = os.path.join(os.path.dirname(os.path.dirname(HERE)), "torch_plugin")
CASES = ["plain_2p50", "plain_2p40", "observer_2p50", "classic_2p50", "raw_alloc_2p50",
         "limit_then_oom", "native_2p50"]


def child(case):
    import torch
    if case != "native_2p50":
        sys.path.insert(0, PLUGIN)
        import slotpool_torch
        conf = "growth:classic" if case.startswith("classic") else None
        slotpool_torch.install(conf=conf)
    print("installed", file=sys.stderr, flush=True)
    torch.empty(1, device="cuda")
    seen = []
    if case.startswith("observer"):
        torch._C._cuda_attach_out_of_memory_observer(lambda *a: seen.append(a))
    size = 1 << 40 if case.endswith("2p40") else 1 << 50
    if case == "limit_then_oom":
        torch.cuda.set_per_process_memory_fraction(0.01)
        size = 4 << 30
    print("allocating", size, file=sys.stderr, flush=True)
    try:
        if case.startswith("raw_alloc"):
            torch.cuda.caching_allocator_alloc(size)
        else:
            torch.empty(size, dtype=torch.uint8, device="cuda")
        res = "no exception"
    except torch.OutOfMemoryError as e:
        res = "OutOfMemoryError: " + str(e).splitlines()[0][:200]
    except Exception as e:  # noqa: BLE001
        res = type(e).__name__ + ": " + str(e).splitlines()[0][:200]
    print("raised", file=sys.stderr, flush=True)
    z = torch.ones(1 << 20, device="cuda")
    ok = float(z.sum().item()) == float(1 << 20)
    print(json.dumps({"case": case, "result": res, "observer_calls": len(seen), "usable_after": ok}))


def symbolize(stderr):
    """addr2line for the extension's frames of a segv_backtrace report."""
    out = []
    for line in stderr.splitlines():
        m = re.match(r"(\S+slotpool_torch_C\S*\.so)\(([^)+]*)\+(0x[0-9a-f]+)\)", line)
        if not m:
            continue
        so, sym, off = m.group(1), m.group(2), int(m.group(3), 16)
        base = 0
        if sym:
            nm = subprocess.run(["nm", "-D", "--defined-only", so], capture_output=True, text=True).stdout
            hit = [l.split()[0] for l in nm.splitlines() if l.endswith(" " + sym)]
            if not hit:
                continue
            base = int(hit[0], 16)
        a2l = subprocess.run(["addr2line", "-C", "-f", "-i", "-e", so, hex(base + off)],
                             capture_output=True, text=True).stdout.strip().replace("\n", " | ")
        out.append(f"{sym or '?'}+{off:#x}: {a2l}")
    return out


def main():
    env = dict(os.environ)
    bt = env.get("SEGV_BT")
    if bt:
        env["LD_PRELOAD"] = (bt + " " + env.get("LD_PRELOAD", "")).strip()
    for case in CASES:
        p = subprocess.run([sys.executable, "-X", "faulthandler", __file__, case], env=env,
                           capture_output=True, text=True, timeout=300)
        line = next((l for l in p.stdout.splitlines() if l.startswith("{")), None)
        out = json.loads(line) if line else {"case": case}
        out["rc"] = p.returncode
        if p.returncode != 0:
            out["stderr_tail"] = p.stderr[-3000:]
            out["frames"] = symbolize(p.stderr)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        child(sys.argv[1])
    else:
        main()
