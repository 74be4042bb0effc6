"""StepClock: vLLM's forward cost as the engine's LatencyModel, fitted from inside the proposer.

vLLM calls the proposer once per engine step, right after that step's forward and sampling. So the
wall time between two calls is one step, and what that step computed is known to the proposer: one
token per row it drafted for plus that row's draft (`tokens`), and the rows' context lengths (`kv`, the
KV-read term). That is enough to fit `t = c_base + c_tok * tokens + c_other * kv` on the machine, model
and vLLM build at hand -- a GPU (c_tok / c_base ~ 1e-3) and a CPU (~0.04) want very different drafts,
and this is how the priced allowance (dasrl/policy/allowance.py) tells them apart.

Intervals in which new requests were prefilled are not recorded (their prompt tokens may be served
from vLLM's prefix cache, so their count is unknown), nor the gap across an RL step boundary. The fit is
redone only every `refit_every` recorded steps: between refits the policy prices with one model, so
its drafts are a function of the batch alone.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

import numpy as np

from dasrl.policy.latency import LatencyModel


class StepClock:
    """Sliding-window fit of step seconds against step tokens and context tokens (LatencyModel.fit)."""

    def __init__(self, *, window: int = 256, min_samples: int = 32, refit_every: int = 32,
                 now: Callable[[], float] = time.perf_counter) -> None:
        if window < 2 or not 2 <= min_samples <= window or refit_every < 1:
            raise ValueError(f"StepClock needs 2 <= min_samples <= window and refit_every >= 1, got "
                             f"min_samples={min_samples}, window={window}, refit_every={refit_every}")
        self._samples: deque[tuple[int, int, float]] = deque(maxlen=window)  # (tokens, kv, seconds)
        self._min, self._every = min_samples, refit_every
        self._now = now
        self._pending: tuple[float, int, int] | None = None
        """(time of the last call, tokens and kv of the step after it), or None: that step is not recorded."""
        self._new = 0  # samples recorded since the last fit
        self._model: LatencyModel | None = None

    def tick(self, tokens_next: int | None, kv_next: int = 0) -> None:
        """A proposer call: closes the step since the last call, opens the next one, whose forward will
        compute `tokens_next` tokens over rows of `kv_next` context tokens in all (None = unknown: the
        next step is not recorded)."""
        t = self._now()
        if self._pending is not None:
            t0, n, kv = self._pending
            self._samples.append((n, kv, t - t0))
            self._new += 1
        self._pending = None if tokens_next is None else (t, int(tokens_next), int(kv_next))

    def skip(self) -> None:
        """The step since the last call is not to be recorded (prefill, step boundary)."""
        self._pending = None

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    def model(self) -> LatencyModel | None:
        """The current fit: refitted once `refit_every` steps were recorded since the last fit, else the
        last one. None while there are too few steps, too little spread in tokens, or the fit has no
        positive c_base or c_tok. Steps over 5x the median time (a pause of the caller) are left out."""
        if self._new >= self._every or (self._model is None and self._new and len(self._samples) >= self._min):
            self._new = 0
            self._model = self._fit() or self._model
        return self._model

    def _fit(self) -> LatencyModel | None:
        if len(self._samples) < self._min:
            return None
        n, kv, s = (np.array(x, dtype=np.float64) for x in zip(*self._samples))  # [samples]
        keep = (s > 0) & (s <= 5 * np.median(s))
        n, kv, s = n[keep], kv[keep], s[keep]
        if n.size < self._min or np.ptp(n) < 2:
            return None
        lat = LatencyModel.fit(n, s, kv)
        return lat if lat.c_base > 0 and lat.c_tok > 0 else None
