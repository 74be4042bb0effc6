"""What one drafting row costs a packed forward (docs/policy.md "Never slower"): B rows on C cached tokens,
r of them feeding 1 + d tokens, against none drafting; medians of interleaved repeats, one thread.

    OMP_NUM_THREADS=1 taskset -c 0 python scripts/probes/draft_cost.py [B] [C]
"""
import sys

import torch

from dasrl_lab.bench.engine import time_forward
from dasrl.engine.engine import EngineConfig, SpecEngine
from dasrl.models import load_model
from dasrl.policy.latency import CPU_LATENCY

B = int(sys.argv[1]) if len(sys.argv) > 1 else 16
C = int(sys.argv[2]) if len(sys.argv) > 2 else 300
torch.set_num_threads(1)
model, tok = load_model("smollm2-135m")
engine = SpecEngine(model, tok, EngineConfig())
shapes = [(0, 0)] + [(r, d) for r in (1, 2, 4, 8) for d in (1, 4, 8)]
best = {s: [] for s in shapes}
for rep in range(5):
    for r, d in shapes:
        q = [1 + d] * r + [1] * (B - r)
        best[(r, d)].append(time_forward(engine, batch=B, q=q, context=C, repeats=3))
base = sorted(best[(0, 0)])[2]
print(f"B={B} C={C}: none drafting {base * 1e3:.1f} ms")
print("rows drafting | draft tokens each | extra ms | per drafting row ms | per draft token ms | model's extra ms")
for r, d in shapes[1:]:
    t = sorted(best[(r, d)])[2]
    model_extra = (CPU_LATENCY.c_tok * r * d + CPU_LATENCY.c_draft_kv * r * C) * 1e3
    print(f"{r} | {d} | {(t - base) * 1e3:.1f} | {(t - base) / r * 1e3:.2f} | {(t - base) / (r * d) * 1e3:.2f} | {model_extra:.1f}")
