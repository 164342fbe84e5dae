"""Run a real PyTorch workload, record its allocator event stream and peak memory.

usage: trace_workloads.py WORKLOAD [--record]
PYTORCH_CUDA_ALLOC_CONF picks the native allocator's configuration.
Writes $OUT/<workload>.<conf>.json (stats) and, with --record, $OUT/<workload>.trace.csv.gz
(one line per allocator event: action,addr,size,stream).

This script recorded benches/traces/{gpt2_train,llama_train,llama_generate}.trace.csv.gz. The
workloads are importable (build_workload) so that torch_scenarios.py runs the same gpt2_train
under slotpool and native.
"""
import os, sys, json, time, gzip, random
import torch

WORKLOADS = ("gpt2_train", "llama_train", "llama_generate", "resnet50_train")


def build_workload(wl, dev="cuda"):
    """(step, n_steps) for a workload; step() runs one step and returns its loss tensor (or None).
    Seeds: the caller seeds torch and random before calling."""
    if wl == "gpt2_train":
        from transformers import GPT2Config, GPT2LMHeadModel
        m = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024)).to(dev)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        x = torch.randint(0, 50257, (8, 1024), device=dev)
        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = m(input_ids=x, labels=x).loss
            loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
            return loss.detach()
        return step, 5
    if wl in ("llama_train", "llama_generate"):
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                          num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096)
        m = LlamaForCausalLM(cfg).to(dev, dtype=torch.bfloat16)
        if wl == "llama_train":
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
            x = torch.randint(0, 32000, (4, 2048), device=dev)
            def step():
                loss = m(input_ids=x, labels=x).loss
                loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
                return loss.detach()
            return step, 4
        m.eval()
        rng = random.Random(1)
        reqs = [(rng.randint(1, 16), rng.randint(32, 2048), rng.randint(16, 64)) for _ in range(12)]
        it = iter(reqs)
        def serve():
            from transformers import DynamicCache
            b, plen, ntok = next(it)
            with torch.no_grad():
                ids = torch.randint(0, 32000, (b, plen), device=dev)
                cache = DynamicCache()
                o = m(input_ids=ids, past_key_values=cache, use_cache=True)
                nxt = o.logits[:, -1:].argmax(-1)
                for _ in range(ntok):
                    o = m(input_ids=nxt, past_key_values=cache, use_cache=True)
                    nxt = o.logits[:, -1:].argmax(-1)
            return None
        return serve, len(reqs)
    if wl == "resnet50_train":
        import torchvision
        m = torchvision.models.resnet50().to(dev, memory_format=torch.channels_last)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        x = torch.randn(64, 3, 224, 224, device=dev).to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (64,), device=dev)
        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(m(x), y)
            loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
            return loss.detach()
        return step, 6
    raise ValueError(f"unknown workload {wl}")


def main():
    wl = sys.argv[1]
    record = "--record" in sys.argv
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default").replace(":", "-").replace(",", "_") or "default"
    out = os.environ.get("OUT", ".")
    torch.manual_seed(0); random.seed(0)
    dev = "cuda"
    torch.empty(1, device=dev)
    if record:
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=3_000_000)

    step_times = []
    def timed(fn, n):
        for _ in range(n):
            torch.cuda.synchronize(); t = time.perf_counter(); fn(); torch.cuda.synchronize()
            step_times.append(time.perf_counter() - t)

    try:
        step, n = build_workload(wl, dev)
    except ValueError as e:
        sys.exit(str(e))
    timed(step, n)

    st = torch.cuda.memory_stats()
    res = {"workload": wl, "conf": conf, "step_s": step_times,
           "peak_allocated": st.get("allocated_bytes.all.peak"), "peak_reserved": st.get("reserved_bytes.all.peak"),
           "num_alloc_retries": st.get("num_alloc_retries"), "num_ooms": st.get("num_ooms"),
           "num_device_alloc": st.get("num_device_alloc"), "num_device_free": st.get("num_device_free"),
           "segment_peak": st.get("segment.all.peak"), "alloc_requests": st.get("allocation.all.allocated")}
    if record:
        snap = torch.cuda.memory._snapshot()
        tr = snap["device_traces"][0]
        with gzip.open(os.path.join(out, f"{wl}.trace.csv.gz"), "wt") as f:
            f.write("action,addr,size,stream\n")
            for e in tr:
                f.write(f"{e['action']},{e['addr']},{e['size']},{e['stream']}\n")
        res["trace_events"] = len(tr)
        torch.cuda.memory._record_memory_history(enabled=None)
    json.dump(res, open(os.path.join(out, f"{wl}.{conf}.json"), "w"), indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "step_s"}), "median step", sorted(step_times)[len(step_times)//2])


if __name__ == "__main__":
    main()
