"""StepClock: vLLM's forward cost as the engine's LatencyModel, fitted from inside the proposer.

vLLM calls the proposer once per engine step, right after that step's forward and sampling. So the
wall time between two calls is one step, and what that step computed is known to the proposer: one
token per row it drafted for plus that row's draft (`tokens`), and the rows' context lengths (`kv`, the
KV-read term). That is enough to fit `t = c_base + c_tok * tokens + c_other * kv` on the machine, model
and vLLM build at hand -- a GPU (c_tok / c_base ~ 1e-3) and a CPU (~0.04) want very different drafts,
and this is how the priced allowance (dasrl/policy/allowance.py) tells them apart.

Intervals in which new requests were prefilled are not recorded (their prompt tokens may be served
from vLLM's prefix cache, so their count is unknown), nor the gap across an RL step boundary. The fit is
the session's own (dasrl.policy.OnlineLatency: windowed, outliers dropped, refitted every `refit_every`
recorded steps, the prior scaled to the measured speed while the steps cannot separate the terms): between
refits the policy prices with one model, so its drafts are a function of the batch alone.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

from dasrl.policy.latency import LatencyModel, OnlineLatency


class StepClock:
    """Times vLLM's engine steps from inside the proposer and feeds them to an OnlineLatency over `prior`."""

    def __init__(self, prior: LatencyModel, *, window: int = 256, min_samples: int = 32, refit_every: int = 32,
                 now: Callable[[], float] = time.perf_counter) -> None:
        # vLLM's drafting rows cost their tokens only: no second KV group, no per-forward drafting term (those
        # are the dasrl engine's). The prior's drafting terms would otherwise be scaled into every fit.
        prior = replace(prior, c_draft_kv=0.0, c_draft=0.0)
        self.fit = OnlineLatency(prior, window=window, min_samples=min_samples, refit_every=refit_every)
        """The fit of vLLM's step cost (its report() is the proposer's latency statistics)."""
        self._now = now
        self._pending: tuple[float, int, int, int] | None = None
        """(time of the last call, rows, draft tokens and kv of the step after it), or None: not recorded."""

    def tick(self, rows_next: int | None, drafted_next: int = 0, kv_next: int = 0) -> None:
        """A proposer call: closes the step since the last call, opens the next one, whose forward will
        compute `rows_next` rows' tokens plus `drafted_next` draft tokens over rows of `kv_next` context
        tokens in all (rows_next None = unknown: the next step is not recorded)."""
        t = self._now()
        if self._pending is not None:
            t0, rows, drafted, kv = self._pending
            # vLLM's drafting rows read no second KV group: no draft term
            self.fit.record(rows + drafted, kv, 0, t - t0, rows=rows)
        self._pending = None if rows_next is None else (t, int(rows_next), int(drafted_next), int(kv_next))

    def skip(self) -> None:
        """The step since the last call is not to be recorded (prefill, step boundary)."""
        self._pending = None

    @property
    def num_samples(self) -> int:
        return self.fit.num_samples

    def model(self) -> LatencyModel:
        """The model to price with: the prior until the fit is trusted, then the fit (OnlineLatency.model)."""
        return self.fit.model()
