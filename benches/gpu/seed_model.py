"""The model of benches/gpu/seed_shared_pools.py: attention + dense MoE-style layers (d=2048,
16 heads, 4 experts, sequence 2048, batch 2, bf16). Shared by torch_scenarios.py (seed) and
record_seed.py so that the recorded trace and the measured scenario run the same layers."""
import torch

D, H, E, S, B = 2048, 16, 4, 2048, 2


def build_layers(n, dev="cuda", dt=torch.bfloat16):
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = torch.nn.LayerNorm(D, device=dev, dtype=dt)
            self.attn = torch.nn.MultiheadAttention(D, H, batch_first=True, device=dev, dtype=dt)
            self.ln2 = torch.nn.LayerNorm(D, device=dev, dtype=dt)
            self.gate = torch.nn.Linear(D, E, device=dev, dtype=dt)
            self.w1 = torch.nn.Parameter(torch.randn(E, D, 2 * D, device=dev, dtype=dt) * 0.02)
            self.w2 = torch.nn.Parameter(torch.randn(E, 2 * D, D, device=dev, dtype=dt) * 0.02)

        def forward(self, x):
            h = self.ln1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            h = self.ln2(x)
            g = torch.softmax(self.gate(h).float(), -1).to(dt)
            y = torch.einsum("bsd,edf->bsef", h, self.w1).relu()
            y = torch.einsum("bsef,efd->bsed", y, self.w2)
            return x + (y * g.unsqueeze(-1)).sum(2)

    return [Layer() for _ in range(n)]


def inputs(n, dev="cuda", dt=torch.bfloat16):
    return [(torch.randn(B, S, D, device=dev, dtype=dt, requires_grad=True),) for _ in range(n)]
