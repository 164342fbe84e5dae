"""Print the short table of a benches/gpu/run.sh run from $OUT/results.jsonl and the logs."""
import json, os, re, sys

out = sys.argv[1]
rows = []
def row(what, value, note=""):
    rows.append((what, value, note))

res = []
for line in open(os.path.join(out, "results.jsonl")):
    try:
        res.append(json.loads(line))
    except ValueError:
        pass

for r in res:
    if r.get("step") == "gpu_suite" and "test" in r:
        extra = {k: v for k, v in r.items() if k not in ("step", "test", "ok")}
        row(f"gpu_suite/{r['test']}", "ok" if r.get("ok", True) else "FAIL", json.dumps(extra)[:90])
    elif r.get("step", "").startswith("preload_") and "size" in r:
        api = "async" if "Async" in r.get("api", "") else "sync"
        row(f"{r['step']}/{api}/{r['size']}", f"{r.get('ns_per_pair', '?')} ns/pair",
            f"batch {r.get('ns_per_pair_batch', '?')} ns/pair")
    elif r.get("step") == "runtime_calls" and "call" in r:
        row(f"runtime_calls/{r['call']}", f"{r['ns']} ns")
    elif r.get("step") == "torch" and "scenario" in r:
        row(f"torch/{r['scenario']}", "ok" if r.get("ok") else "FAIL", json.dumps({k: v for k, v in r.items() if k not in ('step', 'scenario', 'ok')})[:90])
    elif r.get("step") == "ckpt_state" and "live_blocks" in r:
        row(f"ckpt_state/{r['alloc']}/{r['live_blocks']}", f"{r['set_us']} us/set",
            f"switch {r['switch_us']} us, get {r['get_us']} us, live check {r['live_check']}")
    elif r.get("step") == "ckpt_state_phases" and "live_blocks" in r:
        steps = {k[len("phase_"):-len("_us")]: v for k, v in r.items() if k.startswith("phase_")}
        row(f"ckpt_state_phases/{r['live_blocks']}", f"{r['set_us']} us/set",
            ", ".join(f"{k} {v}" for k, v in steps.items())[:90])
    elif "rc" in r and r.get("rc") != 0:
        row(r["step"], f"rc={r['rc']}")

ab = os.path.join(out, "alloc_bench.json")
if os.path.exists(ab):
    a = json.load(open(ab))
    for k in sorted(a):
        if "/same/1048576/" in k or "mixed" in k or "/same/4096/t1" in k or "/same/67108864/t1" in k:
            row(f"alloc_bench/{k}", f"{a[k]:.1f} ns/pair")

for name in ("gpt2_train.default.json",):
    pass
for f in sorted(os.listdir(out)):
    if f.startswith("gpt2") and f.endswith(".log"):
        txt = open(os.path.join(out, f)).read()
        m = re.search(r"median step ([0-9.e-]+)", txt)
        pk = re.search(r'"peak_reserved": (\d+)', txt)
        row(f"{f[:-4]}", f"{float(m.group(1))*1e3:.1f} ms/step" if m else "?", f"peak_reserved={pk.group(1) if pk else '?'}")
    if f.startswith("record_") and f.endswith(".log"):
        txt = open(os.path.join(out, f)).read().strip().splitlines()
        row(f[:-4], txt[-1][:100] if txt else "?")

w = max(len(r[0]) for r in rows) if rows else 10
for what, value, note in rows:
    print(f"{what:<{w}}  {value:<18} {note}")
