"""Probes for a step up of the DAS drafter on CHAMP (docs/whatif.md "Where das stands"): the per-problem
DraftStore at cap 16, with a global-index fallback (the longer match wins, by a margin) and tree drafts.

    python scripts/probes/whatif_stepup.py MODEL PROBLEMS     e.g. GPT-4 30
"""
import time, sys
from dataclasses import replace
import numpy as np
from dasrl.sim import sources, whatif, fastreplay
from dasrl.sim.simulator import group_steps
from dasrl.policy.base import FixedBudget
from dasrl.drafter.base import DraftParams, Draft
from dasrl.drafter.store import DraftStore
tok=sources.hf_tokenizer(None)
rs=sources.load("champ", sources.tokenize_with(tok), champ=sources.ChampSource(model=sys.argv[1], problems=int(sys.argv[2])))
steps=group_steps(rs)
base=whatif.WhatifConfig().store

class Fallback:
    """per-problem draft unless the global index matched longer."""
    def __init__(self, a, b, margin): self.a, self.b, self.m = a, b, margin
    def start(self, r, p, ids): self.a.start(r, p, ids); self.b.start(r, p, ids)
    def propose(self, rids, budgets):
        da, db = self.a.propose(rids, budgets), self.b.propose(rids, budgets)
        return [y if (len(y) and y.match_len > x.match_len + self.m) or not len(x) else x for x, y in zip(da, db)]
    def observe(self, r, t): self.a.observe(r, t); self.b.observe(r, t)
    def finish(self, r): self.a.finish(r); self.b.finish(r)
    def end_step(self): self.a.end_step(); self.b.end_step()

max_new = max(len(r.response_ids) for r in rs)
for name, params, margin in [("fb0", DraftParams(), 0), ("fb4", DraftParams(), 4), ("fb0-b4", DraftParams(branching=4), 0)]:
    d = Fallback(DraftStore(replace(base, params=params)), DraftStore(replace(base, mode="global", window=0, decay=1.0, params=params)), margin)
    pol = FixedBudget(16); t0=time.perf_counter()
    sts=[fastreplay.run_step(d, pol, s, r, max_new_tokens=max_new) for s, r in steps]
    rep=whatif.Replay("x","x",sts,[max(len(x.response_ids) for x in r) for _, r in steps])
    f=rep.figures(); f1=rep.figures(1)
    print(f"{name:10s} tpf {f['tokens_per_forward']:.3f} from2 {f1['tokens_per_forward']:.3f} crit {f['critical_tokens_per_forward']:.3f} acc {f['acceptance']:.3f} step0 {sts[0].tokens/sts[0].row_forwards:.3f} {time.perf_counter()-t0:.0f}s", flush=True)
