"""Record the allocation trace of the shared-capture-pool scenario (torch_scenarios.py seed,
benches/gpu/seed_shared_pools.py) under PyTorch's native allocator.

usage: record_seed.py [MODE]     MODE: shared (default; one make_graphed_callables over all layers)

Writes $OUT/seed_<MODE>.trace.csv.gz in the format of benches/traces/ plus the marker lines of
record_graph_variants.py: `variant_begin,0,0,0` where the scenario resets its peaks (its figures
count from there), `capture_begin` / `capture_end` around each torch.cuda.graph. SEED_LAYERS
(default 12) as the scenario. `slotpool replay --variants shared` replays it.
"""
import gzip, json, os, sys
import torch
import torch.cuda.graphs as G

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import seed_model  # noqa: E402

mode = sys.argv[1] if len(sys.argv) > 1 else "shared"
assert mode == "shared", "only the shared mode is recorded"
out = os.environ.get("OUT", ".")
L = int(os.environ.get("SEED_LAYERS", "12"))
torch.manual_seed(0)
torch.empty(1, device="cuda")
torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=5_000_000)
markers = []


def trace_len():
    return len(torch.cuda.memory._snapshot()["device_traces"][0])


enter, exit_ = G.graph.__enter__, G.graph.__exit__


def patched_enter(self):
    r = enter(self)
    markers.append((trace_len(), "capture_begin", 0))
    return r


def patched_exit(self, *a):
    markers.append((trace_len(), "capture_end", 0))
    return exit_(self, *a)


G.graph.__enter__, G.graph.__exit__ = patched_enter, patched_exit
layers = seed_model.build_layers(L)
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
markers.append((trace_len(), "variant_begin", 0))
args = seed_model.inputs(L)
g = list(torch.cuda.make_graphed_callables(tuple(layers), tuple(args)))
x = torch.randn(seed_model.B, seed_model.S, seed_model.D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
y = x
for f in g:
    y = f(y)
y.float().sum().backward()
torch.cuda.synchronize()
tr = torch.cuda.memory._snapshot()["device_traces"][0]
torch.cuda.memory._record_memory_history(enabled=None)
with gzip.open(os.path.join(out, f"seed_{mode}.trace.csv.gz"), "wt") as f:
    f.write("action,addr,size,stream\n")
    mi = 0
    for i, e in enumerate(tr):
        while mi < len(markers) and markers[mi][0] <= i:
            f.write(f"{markers[mi][1]},0,{markers[mi][2]},0\n")
            mi += 1
        if e["action"] in ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
                           "segment_map", "segment_unmap"):
            f.write(f"{e['action']},{e['addr']},{e['size']},{e['stream']}\n")
    for m in markers[mi:]:
        f.write(f"{m[1]},0,{m[2]},0\n")
print(json.dumps({"mode": mode, "layers": L, "events": len(tr), "markers": len(markers),
                  "peak_allocated": torch.cuda.max_memory_allocated(),
                  "peak_reserved": torch.cuda.max_memory_reserved()}))
