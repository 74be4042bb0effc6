#!/usr/bin/env python3
"""What a drafting row's cached tokens cost the engine's packed forward (issue 45 item 2).

Times forwards of 8 rows at contexts 64 / 320 / 768 (one thread, medians of REPS after a warm-up,
dasrl_lab.bench.engine.time_forward): all plain, 4 or 8 rows drafting 4 tokens, one row drafting 8, and 40
plain rows (the 8x5 forward's token count). The slope in the context of a drafting batch minus the plain
batch's, per drafting row, is what LatencyModel.c_draft_kv prices; the script also prints the latency model
fitted to all 15 shapes with and without that term.

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python scripts/probe_draft_kv.py MODEL_DIR OUT.json
"""
import json
import os
import sys

import numpy as np
import torch

from dasrl.engine import EngineConfig, SpecEngine
from dasrl.policy import LatencyModel
from dasrl_lab.bench.engine import time_forward
from dasrl_lab.models import load_model

path, out = sys.argv[1], sys.argv[2]
reps = int(os.environ.get("REPS", "3"))
model, tok = load_model(path, dtype=torch.float32)
engine = SpecEngine(model, tok, EngineConfig(num_threads=1))
B = 8
configs = {"plain": [1] * B, "4x5": [5] * 4 + [1] * 4, "8x5": [5] * B, "1x9": [9] + [1] * (B - 1), "plain40": [1] * 40}
rows = []
for ctx in (64, 320, 768):
    for name, qs in configs.items():
        s = time_forward(engine, batch=len(qs), q=qs, context=ctx, repeats=reps)
        rows.append({"config": name, "context": ctx, "rows": len(qs), "n_tokens": sum(qs),
                     "drafting_rows": sum(q > 1 for q in qs), "seconds": s})
        print(rows[-1], flush=True)
with open(out, "w") as f:
    json.dump(rows, f, indent=1)
for name in configs:
    r = [x for x in rows if x["config"] == name]
    slope = np.polyfit([x["context"] for x in r], [x["seconds"] for x in r], 1)[0]
    print(f"{name}: {slope * 1e6:.1f} us per context token of every row")
n = [x["n_tokens"] for x in rows]
kv = [x["rows"] * x["context"] for x in rows]
dkv = [x["drafting_rows"] * x["context"] for x in rows]
s = [x["seconds"] for x in rows]
for m in (LatencyModel.fit(n, s, kv, dkv), LatencyModel.fit(n, s, kv)):
    print(m, f"mean relative error {m.mean_rel_error(n, s, kv, dkv):.1%}")
