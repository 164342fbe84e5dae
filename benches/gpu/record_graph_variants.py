"""Record the allocation trace of benches/gpu/graph_variants.py with capture and variant markers.

usage: record_graph_variants.py MODE     (MODE as graph_variants.py: separate | shared | single:I)

Runs the same workload as the baseline script (a transformer layer, d=4096, 32 heads, FFN 16384,
bf16, graphed forward+backward with make_graphed_callables for local sequence 8192/CP, CP in
1, 2, 4, 8) under PyTorch's native allocator with memory history on, and writes
$OUT/graph_variants_<MODE>.trace.csv.gz in the format of benches/traces/ plus marker lines:
  variant_begin,0,K,0   before variant K's make_graphed_callables
  capture_begin,0,0,0   at each torch.cuda.graph __enter__ (after PyTorch began allocating to the pool)
  capture_end,0,0,0     at each torch.cuda.graph __exit__
cuBLAS workspaces are cleared after each variant (see below), in every mode.
`slotpool replay --variants separate|shared|group` replays it.
"""
import gzip, json, os, sys
import torch
import torch.cuda.graphs as G

mode = sys.argv[1]
out = os.environ.get("OUT", ".")
dev = "cuda"
torch.manual_seed(0)
torch.empty(1, device=dev)
torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=5_000_000)
markers = []  # (trace index, action, value)

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

layer = torch.nn.TransformerEncoderLayer(4096, 32, 16384, dropout=0.0, device=dev, dtype=torch.bfloat16)
class Wrap(torch.nn.Module):
    def __init__(self, inner):
        super().__init__(); self.inner = inner
    def forward(self, x):
        return self.inner(x)
seqs = [8192 // cp for cp in (1, 2, 4, 8)]
ks = list(range(4))
if mode.startswith("single:"):
    ks = [int(mode.split(":")[1])]
torch.cuda.synchronize(); torch.cuda.empty_cache()
r0 = torch.cuda.memory_reserved()
pool = torch.cuda.graph_pool_handle() if mode == "shared" else None
graphed = []
for k in ks:
    s = seqs[k]
    markers.append((trace_len(), "variant_begin", k))
    x = torch.randn(s, 1, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
    kw = {"pool": pool} if pool is not None else {}
    g = torch.cuda.make_graphed_callables(Wrap(layer), (x,), num_warmup_iters=3, **kw)
    graphed.append((g, x))
    # cuBLAS keeps a workspace per stream for the life of the process, and each
    # make_graphed_callables warms up on a stream of its own; drop them between variants as CUDA
    # graph trees do around recording (a variant group must: a workspace allocated in a variant
    # would be aliased by the next one).
    torch._C._cuda_clearCublasWorkspaces()
torch.cuda.synchronize()
r1 = torch.cuda.memory_reserved()
tr = torch.cuda.memory._snapshot()["device_traces"][0]
torch.cuda.memory._record_memory_history(enabled=None)
name = f"graph_variants_{mode.replace(':', '')}"
with gzip.open(os.path.join(out, f"{name}.trace.csv.gz"), "wt") as f:
    f.write("action,addr,size,stream\n")
    mi = 0
    for i, e in enumerate(tr):
        while mi < len(markers) and markers[mi][0] <= i:
            f.write(f"{markers[mi][1]},0,{markers[mi][2]},0\n"); mi += 1
        if e["action"] in ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map", "segment_unmap"):
            f.write(f"{e['action']},{e['addr']},{e['size']},{e['stream']}\n")
    for m in markers[mi:]:
        f.write(f"{m[1]},0,{m[2]},0\n")
res = {"mode": mode, "reserved_growth": r1 - r0, "events": len(tr), "markers": len(markers)}
print(json.dumps(res))
