"""CPU matrix products of the engine's linear layers: the faster kernel per row count, and row padding.

torch's float32 F.linear (MKL) is 2-3x slower than it needs to be at M = 4-16 rows, the band where drafting
lives; `LinearKernels` computes each weight shape and row count by whichever of MKL and oneDNN (over a
reordered copy) it measured faster. Row padding computes an M in MKL's slow band as a faster, larger M with
zero rows: rows are independent in a GEMM, so the real rows change by no more than any change of M already
brings (docs/benchmarks.md "Engine: row padding", "Engine: the kernel per row count"; tests/test_gemm.py).
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from dasrl.engine.attention import engine_thread, require_engine_thread


@dataclass(frozen=True)
class RowPadding:
    """Which row counts are padded, and to what."""

    low: int = 10
    """Smallest row count that is padded (0 = padding off): 10-15 rows cost more than 16 (docs/benchmarks.md)."""
    to: int = 16
    """Row count the band [low, to) is padded up to."""

    def __post_init__(self) -> None:
        if self.low < 0 or (self.low and not 1 <= self.low < self.to):
            raise ValueError(f"row padding needs 1 <= low < to (or low = 0: off), got low={self.low}, to={self.to}")

    def target(self, rows: int) -> int:
        return self.to if self.low and self.low <= rows < self.to else rows


NO_PADDING = RowPadding(low=0)
INVARIANT_PADDING = RowPadding(low=1, to=16)  # MKL gives a row the same bits for every M >= 16 (docs/sampling.md)
HEAD_PADDING = RowPadding(low=2, to=4)  # 2-3 rows against a vocabulary-sized weight are slower than 4


def padded(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, padding: RowPadding) -> torch.Tensor:
    """f(x) for a row-wise f over x [..., K] -> [..., N], computed on the rows padded as `padding` says (CPU)."""
    rows = x.numel() // x.shape[-1]
    target = padding.target(rows)
    if target == rows or x.device.type != "cpu":
        return f(x)
    flat = x.reshape(rows, x.shape[-1])  # [M, K]
    out = f(torch.cat([flat, flat.new_zeros(target - rows, flat.shape[1])]))[:rows]  # [M, N]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, padding: RowPadding) -> torch.Tensor:
    return padded(lambda t: F.linear(t, weight, bias), x, padding)


_ROW_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)  # a row count takes the largest bucket at or below it
_CHOICES: dict[tuple, np.ndarray] = {}  # (in, out, bias, threads, buckets) -> oneDNN wins per bucket, per process
_SHARED: "weakref.WeakKeyDictionary[torch.nn.Module, LinearKernels]" = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise") \
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16)


def _onednn(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # [M, K] -> [M, N]


def _seconds(f: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def _median_seconds(f: Callable[[], object], repeats: int) -> float:
    warm_up = _seconds(f)  # first-touch allocations, oneDNN primitive creation
    # A large weight (a 1.5B model's vocabulary head): one timing will do.
    return statistics.median([_seconds(f) for _ in range(1 if warm_up > 0.05 else repeats)])


class LinearKernels:
    """A model's float32 CPU linear layers, each computed by the kernel measured faster at its row count.

    A trainer may change weights by means no cheap signal sees (a write through `.data`, as peft's merge
    does), so no reordered copy outlives one forward context: `refresh(model)` starts a new epoch and a weight
    is reordered again at its first oneDNN product in it (docs/engine.md "Weights the trainer changed")."""

    def __init__(self, *, repeats: int = 3) -> None:
        self.buckets = np.asarray(_ROW_BUCKETS, np.int64)  # [K] ascending
        self.repeats = repeats
        self.choice: dict[int, np.ndarray] = {}  # id(module) -> [K] bool (True = oneDNN), this epoch's modules
        self._epoch = 0
        self._packed: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}  # id(module) -> (weight, epoch, copy)

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> "LinearKernels":
        """The model's one LinearKernels: engines on one model share its reordered weights."""
        with _SHARED_LOCK:
            return _SHARED.setdefault(model, cls())

    def refresh(self, model: torch.nn.Module) -> None:
        """A new epoch: the model's float32 CPU nn.Linear layers as they are now, every reordered copy stale."""
        self._epoch += 1
        modules = [m for m in model.modules() if type(m) is torch.nn.Linear
                   and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"]
        self.choice = {id(m): self._choice(m) for m in modules}
        self._packed = {k: v for k, v in self._packed.items() if k in self.choice}  # drop removed layers' copies

    def _copy(self, m: torch.nn.Linear) -> torch.Tensor:
        held = self._packed.get(id(m))
        if held is None or held[1] != self._epoch or held[0] is not m.weight:
            held = self._packed[id(m)] = (m.weight, self._epoch, _reorder(m.weight))
        return held[2]

    def _choice(self, m: torch.nn.Linear) -> np.ndarray:
        n, k = m.weight.shape
        key = (k, n, m.bias is not None, torch.get_num_threads(), tuple(self.buckets.tolist()))
        if key not in _CHOICES:
            packed, bias = _reorder(m.weight), None if m.bias is None else m.bias.detach()
            w = m.weight.detach()
            wins = []
            with torch.no_grad():
                for rows in self.buckets.tolist():
                    x = torch.randn(rows, k)
                    mkl = _median_seconds(lambda: F.linear(x, w, bias), self.repeats)
                    dnn = _median_seconds(lambda: _onednn(x, packed, bias), self.repeats)
                    wins.append(dnn < 0.95 * mkl)  # a clear win only: measurement noise must not flip kernels
            _CHOICES[key] = np.array(wins)
        return _CHOICES[key]

    def linear(self, m: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        at = int(np.searchsorted(self.buckets, rows, side="right")) - 1
        if at < 0 or not self.choice[id(m)][at]:
            return F.linear(x, m.weight, m.bias)
        out = _onednn(x.reshape(rows, x.shape[-1]), self._copy(m), m.bias)  # [M, N]
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _engine_linear(m: torch.nn.Linear, padding: RowPadding,
                   kernels: LinearKernels | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """m's forward inside the engine's forwards (a call from another thread is refused)."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        require_engine_thread(m)
        if kernels is None:
            return _linear(x, m.weight, m.bias, padding)
        return padded(lambda t: kernels.linear(m, t), x, padding)
    return forward


@contextlib.contextmanager
def padded_linears(model: torch.nn.Module, padding: RowPadding,
                   kernels: LinearKernels | None = None) -> Iterator[None]:
    """Inside the block, every plain nn.Linear of `model` pads its rows as `padding` says and computes by
    `kernels`' choice (None: F.linear). Linears whose forward another library replaced are left alone."""
    if not padding.low and kernels is None:
        yield
        return
    if kernels is not None:
        kernels.refresh(model)
    patched = [m for m in model.modules() if type(m) is torch.nn.Linear and "forward" not in m.__dict__]
    for m in patched:
        m.forward = _engine_linear(m, padding, kernels if kernels is not None and id(m) in kernels.choice else None)
    try:
        with engine_thread():  # the patched layers serve this thread only
            yield
    finally:
        for m in patched:
            del m.forward
