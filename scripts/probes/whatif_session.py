"""Probe: what limits das under the session policy (ForwardAllowance, priced) against vLLM's suffix on a GPU
profile, and drafter / policy variants measured on the replay (docs/whatif.md "Probes").
CHAMP, one model's first N problems, priced on qwen2.5-7b-h100 (or LATENCY=file.json); figures from step 2 (index 1) on.

    python scripts/probes/whatif_session.py MODEL PROBLEMS [VARIANT ...]     e.g. GPT-4 20 das das-b4

Per variant: s/step and x none / x suffix, tok/fwd, acceptance, forwards per step, drafted tokens per
forward in the full-batch phase (rows > half the step's) and in the tail (<= 4 rows), and the step's time
split into c_base (forwards), c_tok (tokens) and KV.
"""
import os
import sys
import time
from dataclasses import replace

import numpy as np

from dasrl.drafter.base import DraftParams
from dasrl.drafter.store import DraftStore
from dasrl.policy.allowance import ForwardAllowance, _Prices, allowance_for, pace_draft, tokens_per_forward
from dasrl.policy.base import FixedBudget, NoSpeculation
from dasrl.policy.budget import ClassCaps, DASPolicy
from dasrl.policy.latency import LatencyModel
from dasrl.rollout.session import SessionConfig, history_drafter
from dasrl.sim import fastreplay, profiles, sources, whatif
from dasrl.sim.simulator import group_steps


class Fallback:
    """The per-problem drafter's draft, unless the global index matched longer (or it has none)."""

    def __init__(self, a, b):
        self.a, self.b = a, b

    def start(self, r, p, ids):
        self.a.start(r, p, ids)
        self.b.start(r, p, ids)

    def propose(self, rids, budgets):
        da, db = self.a.propose(rids, budgets), self.b.propose(rids, budgets)
        return [y if (len(y) and y.match_len > x.match_len) or not len(x) else x for x, y in zip(da, db)]

    def observe(self, r, t):
        self.a.observe(r, t)
        self.b.observe(r, t)

    def finish(self, r):
        self.a.finish(r)
        self.b.finish(r)

    def end_step(self):
        self.a.end_step()
        self.b.end_step()


class Spread(ForwardAllowance):
    """Policy variant (probe only, not shipped): rows whose predicted length puts them within `tol` of the
    critical path join the group (tol 1 = the shipped rule), and rows off the group carry `floor` x c_base / B
    (B live rows) instead of nothing: the prediction of which row is critical is noisy."""

    def __init__(self, inner, max_tokens, *, latency, floor=0.0, tol=1.0):
        super().__init__(inner, max_tokens, latency=latency)
        self.floor, self.tol = floor, tol

    def _priced(self, states, caps, p, remaining):
        lat, n = self.latency, len(states)
        ctx = np.array([s.prompt_len + s.generated for s in states], np.float64)
        row, kv = lat.c_tok + lat.c_other * ctx, lat.c_draft_kv * ctx
        prices = _Prices(p, caps, row=row, kv=kv, c_tok=lat.c_tok)
        off_share = self.floor * lat.c_base / n
        solo = prices.best(off_share)
        at_solo = remaining / tokens_per_forward(solo, p)
        m = 1
        while True:
            crit = prices.best(lat.c_base / m)
            horizon = float((remaining / tokens_per_forward(crit, p)).max())
            group = at_solo > self.tol * horizon * (1 + 1e-9)
            if max(int(group.sum()), 1) <= m:
                share = np.where(group, lat.c_base / m, off_share)
                self._price = {st.req_id: (float(a), float(b), float(c)) for st, a, b, c in zip(states, share, row, kv)}
                best = np.where(group, crit, solo)
                return best, np.where(group, pace_draft(remaining, p, horizon=horizon, most=crit) if self.tol >= 1
                                      else crit, solo)
            m = int(group.sum())


tok = sources.hf_tokenizer(None)
MODEL, N = sys.argv[1], int(sys.argv[2])
rs = sources.load("champ", sources.tokenize_with(tok), champ=sources.ChampSource(model=MODEL, problems=N))
steps, prof = group_steps(rs), profiles.derive("qwen2.5-7b", "h100")
if os.environ.get("LATENCY"):  # a measured profile instead (e.g. benchmarks/latency_2threads_quick.json)
    prof = profiles.measured("measured", LatencyModel.load(os.environ["LATENCY"]), os.environ["LATENCY"])
lat = prof.latency
store = SessionConfig().store


def das_store(params=DraftParams(), **kw):
    return history_drafter(replace(SessionConfig(), store=replace(store, params=params, **kw)), tok)


def glob(params=DraftParams()):
    return DraftStore(replace(store, mode="global", window=0, decay=1.0, params=params))


def session(caps=ClassCaps(), allowance=None, **spread):
    if spread:
        return Spread(DASPolicy(caps), allowance or allowance_for(lat), latency=lat, **spread)
    return ForwardAllowance(DASPolicy(caps), allowance or allowance_for(lat), latency=lat)


VARIANTS = {  # name -> (drafter factory, policy factory)
    "none": (lambda: None, NoSpeculation),
    "suffix": (lambda: whatif.make_drafter("suffix", whatif.WhatifConfig(), tok), lambda: FixedBudget(24)),
    "das": (das_store, session),
    "das@16": (das_store, lambda: FixedBudget(16)),
    "das-b2": (lambda: das_store(DraftParams(branching=2)), session),
    "das-b4": (lambda: das_store(DraftParams(branching=4)), session),
    "das-fb": (lambda: Fallback(das_store(), glob()), session),
    "das-fb-b4": (lambda: Fallback(das_store(DraftParams(branching=4)), glob(DraftParams(branching=4))), session),
    "das-nowin": (lambda: das_store(window=0, decay=1.0), session),
    "das-d05": (lambda: das_store(decay=0.5), session),
    "das-live4": (lambda: das_store(live_weight=4.0), session),
    "das-long64": (das_store, lambda: session(ClassCaps(long=64))),
    "das-all24": (das_store, lambda: session(ClassCaps(short=24, medium=24, long=24))),
    "das-all64": (das_store, lambda: session(ClassCaps(short=64, medium=64, long=64))),
    "das-all64-b4": (lambda: das_store(DraftParams(branching=4)), lambda: session(ClassCaps(short=64, medium=64, long=64))),
    "das-spread-id": (das_store, lambda: session(floor=0.0, tol=1.0)),
    "das-floor1": (das_store, lambda: session(floor=1.0)),
    "das-floor4": (das_store, lambda: session(floor=4.0)),
    "das-tol.5": (das_store, lambda: session(tol=0.5)),
    "das-tol.5-floor1": (das_store, lambda: session(tol=0.5, floor=1.0)),
    "das-all24-floor1": (das_store, lambda: session(ClassCaps(short=24, medium=24, long=24), floor=1.0)),
    "das-all24-floor1-b4": (lambda: das_store(DraftParams(branching=4)),
                            lambda: session(ClassCaps(short=24, medium=24, long=24), floor=1.0)),
    "das-all24-floor1-fb-b4": (lambda: Fallback(das_store(DraftParams(branching=4)), glob(DraftParams(branching=4))),
                               lambda: session(ClassCaps(short=24, medium=24, long=24), floor=1.0)),
    "das-floor1-b4": (lambda: das_store(DraftParams(branching=4)), lambda: session(floor=1.0)),
    "das-floor1-fb-b4": (lambda: Fallback(das_store(DraftParams(branching=4)), glob(DraftParams(branching=4))),
                         lambda: session(floor=1.0)),
}

max_new = max(len(r.response_ids) for r in rs)
names = sys.argv[3:] or ["none", "suffix", "das"]
base = {}
for name in names:
    make_d, make_p = VARIANTS[name]
    d, pol = make_d(), make_p()
    t0 = time.perf_counter()
    sts = [fastreplay.run_step(d, pol, s, r, max_new_tokens=max_new) for s, r in steps]
    rep = whatif.Replay(name, name, sts, [max(len(x.response_ids) for x in r) for _, r in steps])
    sec = rep.price(prof)[1:]
    t = float(np.mean(sec))
    base.setdefault(name, t)
    f = rep.figures(1)
    later = sts[1:]
    shp = [np.asarray(s.shapes[1:], np.float64).reshape(-1, 4) for s in later]  # decode forwards
    full = np.concatenate([s[s[:, 0] > s[0, 0] / 2] for s in shp])
    tail = np.concatenate([s[s[:, 0] <= 4] for s in shp])
    fwd = np.mean([s.forwards for s in later])
    split = [np.mean([len(s) * lat.c_base for s in shp]), np.mean([s[:, 1].sum() * lat.c_tok for s in shp]),
             np.mean([(s[:, 2] * lat.c_other + s[:, 3] * lat.c_draft_kv).sum() for s in shp])]
    rel = "  ".join(f"x {k} {t / v:.3f}" for k, v in base.items() if k in ("none", "suffix") and k != name)
    print(f"{name:13s} s/step {t:6.3f}  {rel}  tok/fwd {f['tokens_per_forward']:.2f} acc {f['acceptance']:.2f} "
          f"fwd/step {fwd:6.1f}  draft/row full {(full[:, 1] / full[:, 0] - 1).mean():5.2f} "
          f"tail {(tail[:, 1] / tail[:, 0] - 1).mean():5.2f}  split base/tok/kv {split[0]:.2f}/{split[1]:.2f}/"
          f"{split[2]:.2f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
