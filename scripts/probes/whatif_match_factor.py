"""Probe: das drafts cut to factor x match length (arctic's max_spec_factor rule) or by path probability
(ConfidencePolicy, made to trim) on a GPU profile.
CHAMP, one model's first N problems, priced on qwen2.5-7b-h100 (mean s/step from step 2).

    python scripts/probes/whatif_match_factor.py MODEL PROBLEMS     e.g. GPT-4 20
"""
import sys

from dasrl.drafter.base import Draft
from dasrl.policy.base import FixedBudget, NoSpeculation
from dasrl.policy.budget import ConfidencePolicy
from dasrl.sim import profiles, sources, whatif
from dasrl.sim.simulator import group_steps


class MatchFactor(FixedBudget):
    """Fixed cap, each draft cut to its first factor * match_len nodes."""

    trims = True  # PolicyBase says False, and propose() then skips trim()

    def __init__(self, k, factor):
        super().__init__(k)
        self.factor = factor

    def trim(self, states, drafts):
        out = []
        for d in drafts:
            n = min(len(d), int(self.factor * d.match_len))
            out.append(Draft(d.tokens[:n], d.parents[:n], d.probs[:n], d.match_len) if n < len(d) else d)
        return out


class Confidence(ConfidencePolicy):
    trims = True  # ConfidencePolicy inherits PolicyBase's trims = False: its trim never runs in propose()


tok = sources.hf_tokenizer(None)
rs = sources.load("champ", sources.tokenize_with(tok), champ=sources.ChampSource(model=sys.argv[1], problems=int(sys.argv[2])))
steps, cfg, prof = group_steps(rs), whatif.WhatifConfig(), profiles.derive("qwen2.5-7b", "h100")
runs = [("none", "none", NoSpeculation()), ("suffix", "suffix@24", FixedBudget(24))]
runs += [("das", f"das factor{f}@{c}", MatchFactor(c, f)) for f in (0.25, 0.5, 1.0) for c in (24, 32)]
runs += [("das", f"das conf{t}@{c}", Confidence(t, c)) for t in (0.1, 0.3, 0.5) for c in (24, 32)]
base = None
for method, label, pol in runs:
    rep = whatif.replay(steps, method=method, policy=pol, cfg=cfg, tokenizer=tok, label=label)
    s = rep.price(prof)[1:]
    t = sum(s) / len(s)
    base = base or t
    f = rep.figures()
    print(f"{label:22s} s/step {t:7.3f}  x none {t / base:.3f}  tok/fwd {f['tokens_per_forward']:.2f}  "
          f"crit {f['critical_tokens_per_forward']:.2f}  acc {f['acceptance']:.2f}", flush=True)
