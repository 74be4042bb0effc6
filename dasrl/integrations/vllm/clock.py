"""StepClock: vLLM's forward cost, `t = c_base + c_tok * tokens`, fitted from inside the proposer.

vLLM calls the proposer once per engine step, right after that step's forward and sampling. So the
wall time between two calls is one step, and the tokens it computed are known to the proposer: one per
row it drafted for, plus that row's draft. Nothing else is needed to calibrate the latency model on the
machine, model and vLLM build at hand -- a GPU (c_tok / c_base ~ 1e-3) and a CPU (~0.07) want very
different draft lengths, and this is how the proposer tells them apart.

Intervals in which new requests were prefilled are not recorded (their prompt tokens may be served
from vLLM's prefix cache, so their count is unknown), nor the gap across an RL step boundary.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

import numpy as np

from dasrl.policy.latency import LatencyModel


class StepClock:
    """Sliding-window least-squares fit of step seconds against step tokens."""

    def __init__(self, *, window: int = 256, min_samples: int = 32,
                 now: Callable[[], float] = time.perf_counter) -> None:
        if window < 2 or not 2 <= min_samples <= window:
            raise ValueError(f"StepClock needs 2 <= min_samples <= window, got min_samples={min_samples}, "
                             f"window={window}")
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._min = min_samples
        self._now = now
        self._pending: tuple[float, int] | None = None
        """(time of the last call, tokens the step after it computes), or None: that step is not recorded."""

    def tick(self, tokens_next: int | None) -> None:
        """A proposer call: closes the step since the last call, opens the next one, whose forward will
        compute `tokens_next` tokens (None = unknown: the next step is not recorded)."""
        t = self._now()
        if self._pending is not None:
            t0, n = self._pending
            self._samples.append((n, t - t0))
        self._pending = None if tokens_next is None else (t, int(tokens_next))

    def skip(self) -> None:
        """The step since the last call is not to be recorded (prefill, step boundary)."""
        self._pending = None

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    def model(self) -> LatencyModel | None:
        """The fit, or None while there are too few steps, too little spread in tokens, or the fit has a
        non-positive term. Steps over 5x the median time (a pause of the caller) are left out."""
        if len(self._samples) < self._min:
            return None
        n, s = (np.array(x, dtype=np.float64) for x in zip(*self._samples))  # [samples]
        keep = s <= 5 * np.median(s)
        n, s = n[keep], s[keep]
        if n.size < self._min or np.ptp(n) < 2:
            return None
        slope, intercept = np.polyfit(n, s, 1)
        if not (slope > 0 and intercept > 0):
            return None
        return LatencyModel(float(intercept), float(slope))
