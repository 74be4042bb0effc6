"""The one acceptance estimate of the speculation policy: a per-token acceptance rate per row and problem.

A verified chain gives its accepted tokens and, unless it was accepted whole, one rejection, so the rate
is p = accepted / (accepted + rejections), a geometric rate (accepted / drafted would understate it badly
for long drafts: 0.39 for p = 0.9 at 20 tokens). A row's own counts are pulled to its problem's, the
problem's to the run's (every problem's counts pooled), and the run's to a prior, by `prior_tokens`
pseudo-tokens each: a problem never drafted starts from what drafting has been worth in this run (at
temperature 1.0 on real text that is low within a few drafts, and speculation stops there too). A problem's counts are multiplied by `decay`
at every step end, so a problem whose drafts stopped paying (and so stopped drafting) drifts back to the
prior and is probed again a few steps later: the policy being trained changes what it writes. Within a
step, a row's own counts shrink by `row_decay` at every forward it does not draft in, so a row that
stopped drafting drifts back to its problem's rate and probes again (text turns repetitive late in a
long sample: on the math preset at T = 0.6 the row that set a step stopped at p = 0.34 after 155 tokens
and never drafted again, though a zero-waste replay drafts it 16 at a time).
"""

from __future__ import annotations

import math
from typing import Hashable


class AcceptanceRate:
    """Per-token acceptance rates of live rows and of problems (at most `max_problems`, the most recently
    updated kept)."""

    def __init__(self, *, prior_p: float = 0.6, prior_tokens: float = 8.0, decay: float = 0.5,
                 row_decay: float = 0.99, max_problems: int = 65536) -> None:
        if not 0.0 < prior_p < 1.0 or prior_tokens < 0:
            raise ValueError(f"need 0 < prior_p < 1 and prior_tokens >= 0, got {prior_p}, {prior_tokens}")
        if not 0.0 <= decay <= 1.0 or not 0.0 <= row_decay <= 1.0:
            raise ValueError(f"acceptance decays must be in [0, 1], got decay={decay}, row_decay={row_decay}")
        if max_problems < 1:
            raise ValueError(f"max_problems must be >= 1, got {max_problems}")
        self.prior_p, self.prior_tokens, self.decay, self.max_problems = prior_p, prior_tokens, decay, max_problems
        self.row_decay = row_decay
        self._row: dict[Hashable, tuple[float, float]] = {}  # req -> (accepted, rejections), decayed while idle
        self._problem: dict[Hashable, tuple[float, float]] = {}  # problem -> (accepted, rejections), decayed;
        # in order of last update (the first is forgotten past max_problems)
        self._run = [0.0, 0.0]  # every problem's (accepted, rejections), decayed alike

    def rate(self, req_id: Hashable, problem_id: Hashable) -> float:
        w = self.prior_tokens
        a, r = self._run
        run = (a + self.prior_p * w) / (a + r + w) if a + r + w > 0 else self.prior_p
        a, r = self._problem.get(problem_id, (0, 0))
        problem = (a + run * w) / (a + r + w) if a + r + w > 0 else run
        a, r = self._row.get(req_id, (0, 0))
        return (a + problem * w) / (a + r + w) if a + r + w > 0 else problem

    def record(self, req_id: Hashable, problem_id: Hashable, *, drafted: int, accepted: int) -> None:
        """A verified draft of `drafted` tokens of which the first `accepted` were kept."""
        if drafted <= 0:
            return
        rejected = int(accepted < drafted)
        ra, rr = self._row.get(req_id, (0, 0))
        self._row[req_id] = (ra + accepted, rr + rejected)
        pa, pr = self._problem.pop(problem_id, (0, 0))
        self._problem[problem_id] = (pa + accepted, pr + rejected)  # now the most recent
        self._run = [self._run[0] + accepted, self._run[1] + rejected]
        if len(self._problem) > self.max_problems:
            del self._problem[next(iter(self._problem))]

    def idle(self, req_id: Hashable) -> None:
        """The row drafts nothing this forward: its own evidence ages (it will probe again)."""
        c = self._row.get(req_id)
        if c is not None:
            self._row[req_id] = (c[0] * self.row_decay, c[1] * self.row_decay)

    def forget_row(self, req_id: Hashable) -> None:
        self._row.pop(req_id, None)

    def end_step(self) -> None:
        """Rows are gone; every problem's counts decay."""
        self._row.clear()
        self._problem = {k: (a * self.decay, r * self.decay) for k, (a, r) in self._problem.items()}
        self._run = [c * self.decay for c in self._run]

    def state_dict(self) -> dict:
        return {"problems": [[pid, [a, r]] for pid, (a, r) in self._problem.items()], "run": list(self._run)}

    def load_state_dict(self, state: dict) -> None:
        problems = {}
        for i, entry in enumerate(state.get("problems", [])):
            try:
                pid, (a, r) = entry
                a, r = float(a), float(r)
            except (TypeError, ValueError):
                raise ValueError(f"acceptance state: problems[{i}] must be [problem_id, [accepted, rejections]]") from None
            if isinstance(pid, bool) or not isinstance(pid, (int, str)):
                raise ValueError(f"acceptance state: problems[{i}] problem id must be an int or a string, got {pid!r}")
            if not (math.isfinite(a) and math.isfinite(r) and a >= 0 and r >= 0):
                raise ValueError(f"acceptance state: problems[{i}] counts must be finite and >= 0, got {[a, r]}")
            problems[pid] = (a, r)
        run = state.get("run", [0.0, 0.0])
        try:
            run = [float(run[0]), float(run[1])] if len(run) == 2 else None
        except (TypeError, ValueError):
            run = None
        if run is None or not all(math.isfinite(c) and c >= 0 for c in run):
            raise ValueError(f"acceptance state: run must be [accepted, rejections] >= 0, got {state.get('run')!r}")
        self._problem, self._row = dict(list(problems.items())[-self.max_problems:]), {}
        self._run = run
