"""Offline acceptance: replay the recorded trace through a drafter in the simulator (its batched replay:
siblings in flight, the drafter's window rolling per step). With the lossless position-keyed sampler a draft
is accepted exactly up to its longest prefix matching the recorded continuation, so this is the acceptance
the engine would see. Speculation latency is the measured time of the drafter's propose calls."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np

from dasrl.drafter import Draft, Drafter, DrafterBase, DraftStore
from dasrl_lab.sim.simulator import SimConfig, Simulator, group_steps
from dasrl_lab.trace import Response

REPLAY_BUDGET = 16
"""Draft tokens per request per verification round in every replay (a fixed budget: drafters compared
at equal budget, so acceptance differences are the drafter's)."""


class TimedDrafter(DrafterBase):
    """A Drafter that hands every call to `inner` and times its propose calls, per step (one entry per end_step)."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.propose_s, self.calls, self.rows = 0.0, 0, 0
        self.per_step: list[dict] = []  # {propose_s, calls, rows} per finished step

    def start(self, req_id: Hashable, problem_id: Hashable | None, prompt_ids: Sequence[int]) -> None:
        self.inner.start(req_id, problem_id, prompt_ids)

    def propose(self, req_ids: Sequence[Hashable], budgets: Sequence[int]) -> list[Draft]:
        t0 = time.perf_counter()
        out = self.inner.propose(req_ids, budgets)
        self.propose_s += time.perf_counter() - t0
        self.calls += 1
        self.rows += len(req_ids)
        return out

    def observe(self, req_id: Hashable, tokens: Sequence[int]) -> None:
        self.inner.observe(req_id, tokens)

    def finish(self, req_id: Hashable) -> None:
        self.inner.finish(req_id)

    def abort(self, req_id: Hashable) -> None:
        self.inner.abort(req_id)

    def end_step(self) -> None:
        self.inner.end_step()
        self.per_step.append({"propose_s": self.propose_s, "calls": self.calls, "rows": self.rows})
        self.propose_s, self.calls, self.rows = 0.0, 0, 0


class StaticDrafter(DraftStore):
    """A DraftStore frozen after its first step (later ones: DraftStore.discard_step), so it drafts from a
    fixed index while the policy drifts; live requests are indexed as the store's mode says."""

    def end_step(self) -> None:
        if self.step == 0:
            super().end_step()
        else:
            self.discard_step()


@dataclass
class ReplayStep:
    """One replayed step of one drafter."""

    step: int
    accepted_per_round: float
    """Draft tokens accepted per verification round (per request per forward)."""
    tokens_per_round: float
    """Output tokens per verification round (accepted + the target's own; 1.0 without drafts)."""
    proposed: int
    accepted: int
    tokens: int
    propose_us_per_token: float
    """Propose time per output token (µs): the speculation latency each generated token paid."""
    propose_us_per_row: float
    """Propose time per request per call (µs)."""

    def to_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def replay(responses: Sequence[Response], drafter: Drafter, *, label: str,
           budget: int = REPLAY_BUDGET, on_step=None) -> list[ReplayStep]:
    """Replay the trace's steps through `drafter` at a fixed budget; the acceptance and propose time of each."""
    timed = TimedDrafter(drafter)
    max_new = max((len(r.response_ids) for r in responses), default=1)
    sim = Simulator(drafter=timed, policy="fixed", policy_kw={"k": budget}, config=SimConfig(), label=label)
    out = []
    for i, (step, rs) in enumerate(group_steps(responses)):
        st = sim.run_step(step, rs, max_new_tokens=max_new + 1)
        t = timed.per_step[-1]
        out.append(ReplayStep(step=step, accepted_per_round=st.accepted_per_row_forward,
                              tokens_per_round=st.tokens / max(st.row_forwards, 1), proposed=st.proposed,
                              accepted=st.accepted, tokens=st.tokens,
                              propose_us_per_token=t["propose_s"] / max(st.tokens, 1) * 1e6,
                              propose_us_per_row=t["propose_s"] / max(t["rows"], 1) * 1e6))
        if on_step is not None:
            on_step(i)
    return out


def replay_each(ctx, description: str, drafters: dict[str, Drafter]) -> dict[str, list[ReplayStep]]:
    """Each drafter replayed over the experiments' recorded rollouts (ctx.responses()), under one progress bar."""
    responses = ctx.responses()
    with ctx.progress(description, len({int(r.step) for r in responses}) * len(drafters)) as advance:
        return {k: replay(responses, d, label=k, on_step=lambda i: advance()) for k, d in drafters.items()}


def totals(steps: Sequence[ReplayStep], *, skip_first: bool = True) -> dict:
    """Over the steps (step 0 left out by default: no history yet): acceptance pooled over all rounds;
    propose times as the median over steps (the machine is shared: a median resists load spikes)."""
    use = list(steps[1:] if skip_first and len(steps) > 1 else steps)
    tokens = sum(s.tokens for s in use)
    rounds = sum(s.tokens / s.tokens_per_round for s in use if s.tokens_per_round)
    return {"accepted_per_round": round(sum(s.accepted for s in use) / max(rounds, 1), 4),
            "tokens_per_round": round(tokens / max(rounds, 1), 4),
            "propose_us_per_token": round(float(np.median([s.propose_us_per_token for s in use])), 3) if use else 0.0,
            "propose_us_per_row": round(float(np.median([s.propose_us_per_row for s in use])), 3) if use else 0.0,
            "steps": len(use)}
