"""The cost model of one verification forward (docs/policy.md "Latency model"):
`t = c_base + c_tok * n_tokens + c_other * kv_tokens + c_draft_kv * draft_kv_tokens + c_draft * [any row drafts]`,
fitted from measured forwards (`dasrl calibrate`, or online by a session) and saved as JSON.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections import deque
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from dasrl.atomic import read_regular, write_json

_MAX_LATENCY_BYTES = 2**20
"""Largest latency.json read (a few hundred bytes are written)."""

_FORMAT = "dasrl.latency/1"


@dataclass(frozen=True)
class LatencyModel:
    """Linear forward cost in seconds."""

    c_base: float
    """Fixed seconds per forward (weights read, kernel launches), independent of the tokens in it."""
    c_tok: float
    """Seconds per token in the forward (rows plus draft tokens)."""
    c_other: float = 0.0
    """Seconds per row-context token read from the KV cache (sum over rows of their context length)."""
    c_draft_kv: float = 0.0
    """Seconds per context token of the rows that feed more than one token (their attention group)."""
    c_draft: float = 0.0
    """Seconds a forward pays once when any row feeds more than one token (the group's calls per layer)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"LatencyModel.{f.name} must be a finite number, got {v!r}")
            if v < 0:
                raise ValueError(f"LatencyModel.{f.name} must be >= 0, got {v!r}")
            object.__setattr__(self, f.name, float(v))

    def predict(self, n_tokens, kv_tokens=0, draft_kv_tokens=0):
        """Predicted seconds of a forward with n_tokens tokens (scalars or arrays broadcast)."""
        n, kv, dkv = (np.asarray(x, dtype=np.float64) for x in (n_tokens, kv_tokens, draft_kv_tokens))
        out = self.c_base + self.c_tok * n + self.c_other * kv + self.c_draft_kv * dkv + self.c_draft * (dkv > 0)
        return float(out) if out.ndim == 0 else out

    def price(self, shape: Sequence[float]) -> float:
        """Seconds of a recorded forward shape (rows, tokens, kv_tokens[, draft_kv_tokens]): the engine's
        StepInfo and the simulator record them; shapes recorded before draft_kv_tokens have three fields."""
        return float(self.predict(shape[1], shape[2], shape[3] if len(shape) > 3 else 0))

    def mean_rel_error(self, n_tokens: Sequence[float], seconds: Sequence[float],
                       kv_tokens: Sequence[float] | None = None,
                       draft_kv_tokens: Sequence[float] | None = None) -> float:
        """Mean of |predicted - measured| / measured over the samples."""
        n, s, kv, dkv = _arrays(n_tokens, seconds, kv_tokens, draft_kv_tokens)
        pred = self.predict(n, 0 if kv is None else kv, 0 if dkv is None else dkv)
        return float(np.mean(np.abs(pred - s) / s))

    @classmethod
    def fit(cls, n_tokens: Sequence[float], seconds: Sequence[float], kv_tokens: Sequence[float] | None = None,
            draft_kv_tokens: Sequence[float] | None = None) -> "LatencyModel":
        """Least-squares fit (relative error weighted: each sample counts by 1/seconds), coefficients
        clipped at 0; c_other and c_draft_kv are fitted only when their token counts are given, c_draft
        with c_draft_kv."""
        n, s, kv, dkv = _arrays(n_tokens, seconds, kv_tokens, draft_kv_tokens)
        extra = [a for a in (kv, dkv, None if dkv is None else (dkv > 0).astype(np.float64)) if a is not None]
        cols = [np.ones_like(n), n, *extra]
        if len(s) < len(cols):
            raise ValueError(f"need at least {len(cols)} samples to fit {len(cols)} coefficients, got {len(s)}")
        coef = iter(float(c) for c in nonnegative_lstsq(np.stack(cols, axis=1) / s[:, None], np.ones_like(s)))
        c_base, c_tok = next(coef), next(coef)
        c_other = next(coef) if kv is not None else 0.0
        c_draft_kv, c_draft = (next(coef), next(coef)) if dkv is not None else (0.0, 0.0)
        return cls(c_base, c_tok, c_other, c_draft_kv, c_draft)

    def to_dict(self) -> dict:
        return {"format": _FORMAT, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict, *, source: str = "latency model") -> "LatencyModel":
        if not isinstance(d, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(d).__name__}")
        if d.get("format", _FORMAT) != _FORMAT:
            raise ValueError(f"{source}: field 'format' is {d.get('format')!r}, expected {_FORMAT!r}")
        missing = [k for k in ("c_base", "c_tok") if k not in d]
        if missing:
            raise ValueError(f"{source}: missing field(s) {', '.join(missing)}")
        kw = {}
        for k in (f.name for f in fields(cls) if f.name in d):
            v = d[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{source}: field {k!r} must be a finite number >= 0, got {v!r}")
            kw[k] = float(v)
        return cls(**kw)

    def save(self, path: str | os.PathLike) -> None:
        """Write JSON atomically (temporary file in the same folder, then rename)."""
        write_json(Path(path), self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "LatencyModel":
        """Read JSON written by save(); a file that is not one (truncated, binary, pickled, wrong types)
        raises one ValueError naming the path (a missing file: the OSError as it is)."""
        path = Path(path)
        raw = read_regular(path, _MAX_LATENCY_BYTES, follow_symlinks=True)  # a FIFO or /dev/zero: ValueError
        try:
            d = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"{path}: not valid JSON, so not a latency model ({type(e).__name__}: {e})") from None
        try:
            return cls.from_dict(d, source=str(path))
        except OverflowError:  # an int too large for a float (1e400 written as digits)
            raise ValueError(f"{path}: a coefficient is too large for a float") from None


CPU_LATENCY = LatencyModel(c_base=0.0469, c_tok=2.43e-3, c_other=2.10e-5, c_draft_kv=0.0, c_draft=0.0084)
"""The prior of a session on a CPU: SmolLM2-135M fp32 packed-engine forwards as the session's online fit measured
them here (docs/benchmarks.md, "Engine: the kernel per row count"). A prior whose drafting terms were too dear
would never let the session draft, so never let it measure them."""


GPU_LATENCY = LatencyModel(c_base=6.28e-3, c_tok=2.38e-5, c_other=2.14e-8)
"""The prior of a session on a CUDA device: the assumed Qwen2.5-7B bf16 / H100 profile (`dasrl_lab.sim.profiles`
derive("qwen2.5-7b", "h100"): weights streamed at 80% of HBM bandwidth + 1 ms per step, matmuls at 60% of
dense bf16 peak), replaced by the session's OnlineLatency after its first forwards."""


def prior_for(device: str) -> LatencyModel:
    """The shipped prior for a device type ("cpu", "cuda", ...): CPU_LATENCY on a CPU, GPU_LATENCY elsewhere."""
    return CPU_LATENCY if str(device).split(":")[0] == "cpu" else GPU_LATENCY


class OnlineLatency:
    """The latency model fitted from the forwards actually run, on the machine, model and device at hand; `prior`
    prices until the fit is trusted (docs/policy.md "Latency model").

    A sliding window of the last `window` forwards, refitted every `refit_every` new ones; each fit drops the
    forwards over 1.5x or under 0.67x its first prediction (another process took the core) and refits. The token
    term is fitted only once `min_samples` // 2 forwards verified drafts (plain forwards price a token only
    across batch sizes, a staircase on a CPU); until then, or when a fit leaves c_base or c_tok at 0, the model
    is the prior at the measured speed. The drafting terms are fitted once `min_samples` // 2 forwards had a
    drafting row; until then they are the prior's, scaled by fitted c_base / the prior's."""

    def __init__(self, prior: LatencyModel, *, window: int = 512, min_samples: int = 24,
                 refit_every: int = 32) -> None:
        if not isinstance(prior, LatencyModel):
            raise TypeError(f"OnlineLatency: prior must be a LatencyModel, got {type(prior).__name__}")
        if window < 2 or not 4 <= min_samples <= window or refit_every < 1:
            raise ValueError(f"OnlineLatency needs 4 <= min_samples <= window and refit_every >= 1, got "
                             f"min_samples={min_samples}, window={window}, refit_every={refit_every}")
        self.prior = prior
        self._samples: deque[tuple[float, float, float, float, float]] = deque(maxlen=window)  # (n, kv, dkv, s, rows)
        self._min, self._every, self._new = min_samples, refit_every, 0
        self.fitted: LatencyModel | None = None  # the last trusted fit (None: the prior prices)
        self.kept = 0  # forwards the last fit kept (the rest were outliers)

    def record(self, tokens: int, kv_tokens: int, draft_kv_tokens: int, seconds: float, *, rows: int) -> None:
        """One forward: `tokens` in it fed by `rows` rows (tokens > rows: it verified drafts), `kv_tokens` context
        read by its rows, `draft_kv_tokens` by its drafting rows, and its wall seconds."""
        for name, v, low in (("tokens", tokens, 1), ("kv_tokens", kv_tokens, 0),
                             ("draft_kv_tokens", draft_kv_tokens, 0), ("rows", rows, 1)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low:
                raise ValueError(f"OnlineLatency.record: {name} must be an int >= {low}, got {v!r}")
        if not (isinstance(seconds, numbers.Real) and math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"OnlineLatency.record: seconds must be a finite number > 0, got {seconds!r}")
        if draft_kv_tokens > kv_tokens:
            raise ValueError(f"OnlineLatency.record: draft_kv_tokens={draft_kv_tokens} exceeds kv_tokens={kv_tokens} "
                             f"(the drafting rows' context is part of the whole)")
        if rows > tokens:
            raise ValueError(f"OnlineLatency.record: rows={rows} exceeds tokens={tokens} (each row feeds one at least)")
        self._samples.append((float(tokens), float(kv_tokens), float(draft_kv_tokens), float(seconds), float(rows)))
        self._new += 1

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    def model(self) -> LatencyModel:
        """The model to price with now: refitted once `refit_every` forwards came since the last fit."""
        if self._new >= self._every or (self.fitted is None and self._new and len(self._samples) >= self._min):
            self._new = 0
            self.fitted = self._fit() or self.fitted
        return self.fitted or self.prior

    def _fit(self) -> LatencyModel | None:
        if len(self._samples) < self._min:
            return None
        n, kv, dkv, s, rows = (np.array(x) for x in zip(*self._samples))  # [samples] each
        verified = n > rows  # [samples] forwards that verified drafts: they price a draft token
        if np.ptp(n) < 2 or np.count_nonzero(verified) < self._min // 2:  # no draft token's cost measured yet
            return self._scaled(n, kv, dkv, s)
        drafts = int(np.count_nonzero(dkv)) >= self._min // 2
        fit = self._solve(n, kv, dkv, s, drafts)
        ratio = s / fit.predict(n, kv, dkv)  # [samples]
        keep = (ratio < 1.5) & (ratio > 1 / 1.5)
        if keep.sum() >= self._min and not keep.all():
            if np.count_nonzero(verified[keep]) < self._min // 2:  # the drafting forwards were the outliers
                return self._scaled(n, kv, dkv, s)
            drafts = drafts and int(np.count_nonzero(dkv[keep])) >= self._min // 2
            fit = self._solve(n[keep], kv[keep], dkv[keep], s[keep], drafts)
        self.kept = int(keep.sum())
        if fit.c_base > 0 and fit.c_tok > 0:
            return fit
        return self._scaled(n, kv, dkv, s)  # noise left a term at 0 (a loaded machine): keep the prior's shape

    def _scaled(self, n, kv, dkv, s) -> LatencyModel:
        """The prior scaled by the median of measured / predicted seconds: this machine's speed, the prior's
        shape (forwards that all fed the same tokens cannot tell c_base from c_tok)."""
        k = float(np.median(s / self.prior.predict(n, kv, dkv)))
        self.kept = len(s)
        p = self.prior
        return LatencyModel(p.c_base * k, p.c_tok * k, p.c_other * k, p.c_draft_kv * k, p.c_draft * k)

    def _solve(self, n, kv, dkv, s, drafts: bool) -> LatencyModel:
        if drafts:
            return LatencyModel.fit(n, s, kv, dkv)
        own = np.maximum(s - self.prior.c_draft_kv * dkv - self.prior.c_draft * (dkv > 0), 1e-9)  # [samples]
        base = LatencyModel.fit(n, own, kv)
        k = base.c_base / self.prior.c_base if self.prior.c_base > 0 else 1.0  # the prior's terms at this speed
        return LatencyModel(base.c_base, base.c_tok, base.c_other, self.prior.c_draft_kv * k, self.prior.c_draft * k)

    def timer(self, policy) -> Callable[[object], None]:
        """An engine `on_step` callback: records each decoding forward (an engine StepInfo: step, tokens,
        kv_tokens, draft_kv_tokens, elapsed_s since generate() began; the prefill is not one) and sets
        `policy.latency` to the model to price with. One per generate() call (it times step to step)."""
        last = [0.0]

        def on_step(info) -> None:
            if info.step > 0:
                self.record(info.tokens, info.kv_tokens, info.draft_kv_tokens, info.elapsed_s - last[0],
                            rows=info.batch_size)
                policy.latency = self.model()
            last[0] = info.elapsed_s

        return on_step

    def error(self) -> float | None:
        """Median |predicted - measured| / measured of the current model over the window (None: empty)."""
        if not self._samples:
            return None
        n, kv, dkv, s, _ = (np.array(x) for x in zip(*self._samples))
        return float(np.median(np.abs(self.model().predict(n, kv, dkv) - s) / s))

    def report(self) -> dict:
        """What stats() shows: the model in use, whether it is fitted, its median error, the samples."""
        lat = self.model()
        return {"fitted": self.fitted is not None, "samples": self.num_samples, "kept": self.kept,
                "median_rel_error": self.error(), **asdict(lat)}


def _arrays(n_tokens, seconds, kv_tokens, draft_kv_tokens=None):
    n, s = (np.asarray(x, dtype=np.float64).ravel() for x in (n_tokens, seconds))
    kv, dkv = (None if x is None else np.asarray(x, dtype=np.float64).ravel() for x in (kv_tokens, draft_kv_tokens))
    if len(n) != len(s) or any(a is not None and len(a) != len(s) for a in (kv, dkv)):
        raise ValueError(f"sample arrays differ in length: n_tokens={len(n)}, seconds={len(s)}"
                         + ("" if kv is None else f", kv_tokens={len(kv)}")
                         + ("" if dkv is None else f", draft_kv_tokens={len(dkv)}"))
    if len(s) == 0:
        raise ValueError("no samples")
    for name, a in (("n_tokens", n), ("kv_tokens", kv), ("draft_kv_tokens", dkv)):
        if a is not None and (not np.all(np.isfinite(a)) or np.any(a < 0)):
            i = int(np.flatnonzero(~np.isfinite(a) | (a < 0))[0])
            raise ValueError(f"{name}[{i}] = {a[i]!r} must be a finite number >= 0")
    if not np.all(np.isfinite(s)) or np.any(s <= 0):
        i = int(np.flatnonzero(~np.isfinite(s) | (s <= 0))[0])
        raise ValueError(f"seconds[{i}] = {s[i]!r} must be a finite number > 0")
    return n, s, kv, dkv


def nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0 (tiny problems: try every active set, keep the best)."""
    k = a.shape[1]
    best, best_res = np.zeros(k), float(np.sum(b * b))
    for mask in range(1, 1 << k):
        idx = [j for j in range(k) if mask >> j & 1]
        x, *_ = np.linalg.lstsq(a[:, idx], b, rcond=None)
        if np.any(x < 0):
            continue
        full = np.zeros(k)
        full[idx] = x
        res = float(np.sum((a @ full - b) ** 2))
        if res < best_res - 1e-15:
            best, best_res = full, res
    return best
