"""DraftStore settings on CHAMP at cap 16 (docs/whatif.md): trees (branching 2, 4), no window, min_prob.

    python scripts/probes/whatif_store_params.py MODEL PROBLEMS     e.g. GPT-4 30
"""
import time, sys
from dataclasses import replace
from dasrl.sim import sources, whatif
from dasrl.sim.simulator import group_steps
from dasrl.policy.base import FixedBudget
from dasrl.drafter.base import DraftParams
tok=sources.hf_tokenizer(None)
rs=sources.load("champ", sources.tokenize_with(tok), champ=sources.ChampSource(model=sys.argv[1], problems=int(sys.argv[2])))
steps=group_steps(rs)
base=whatif.WhatifConfig().store
for name, store in [("default", base), ("branch2", replace(base, params=DraftParams(branching=2))),
                    ("branch4", replace(base, params=DraftParams(branching=4))),
                    ("window0-decay1", replace(base, window=0, decay=1.0)),
                    ("minprob.1", replace(base, params=DraftParams(min_prob=0.1)))]:
    cfg=whatif.WhatifConfig(store=store)
    t0=time.perf_counter()
    rep=whatif.replay(steps, method="das-suffix", policy=FixedBudget(16), cfg=cfg, tokenizer=tok, label=name)
    f=rep.figures(); f1=rep.figures(1)
    print(f"{name:16s} tpf {f['tokens_per_forward']:.3f} from2 {f1['tokens_per_forward']:.3f} crit {f['critical_tokens_per_forward']:.3f} acc {f['acceptance']:.3f} step0 {rep.steps[0].tokens/rep.steps[0].row_forwards:.3f} {time.perf_counter()-t0:.0f}s", flush=True)
