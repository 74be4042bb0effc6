"""CPU matrix products of the engine's linear layers: the faster kernel per row count, and row padding.

A packed forward multiplies M = (live rows + draft tokens) activations by each weight. torch's float32
F.linear (MKL, weight [N, K] read transposed) is fast at M = 1-3 and at large M, but 2-3x slower than
it needs to be at M = 4-16 on these CPUs: SmolLM2's MLP at one thread costs 124 us at M = 1-3, 243 us
at M = 4 and 363 us at M = 8, where a oneDNN product over a weight reordered once costs 148 and 188 us
(docs/benchmarks.md "Engine: the kernel per row count"). That band is where drafting lives (a few rows,
each with a draft), so MKL's band looked like a fixed tax on every forward in which a row drafts.
`LinearKernels` keeps a oneDNN-reordered copy of each linear weight and, per weight shape and row count,
the kernel measured faster on this machine; every product goes through it inside the engine's forwards.

Row padding: the float32 GEMM torch calls takes a slow path for a band of small M: with SmolLM2's shapes at one thread,
a forward of 10-15 tokens costs more than one of 16 (docs/benchmarks.md, "Engine: row padding"), and that band is exactly where
a collapsed batch with drafts lives (a few rows, each with a draft). Padding such an M with zero rows up
to the fast shape computes the same products for the real rows, only faster. Rows are independent in a
GEMM, so padding changes no row's result beyond the last-bit differences any change of M already brings
(the ones docs/sampling.md budgets for); the exactness ladder holds as before (tests/test_gemm.py).
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
    """Smallest row count that is padded (0 = padding off): 10-15 rows cost 7-23% more than 16 on
    SmolLM2 at one thread; 8-9 about the same as 16 (docs/benchmarks.md, "Engine: row padding")."""
    to: int = 16
    """Row count the band [low, to) is padded up to."""

    def __post_init__(self) -> None:
        if self.low < 0 or (self.low and not 1 <= self.low < self.to):
            raise ValueError(f"row padding needs 1 <= low < to (or low = 0: off), got low={self.low}, to={self.to}")

    def target(self, rows: int) -> int:
        """Rows to compute for `rows` real ones (rows itself when not padded)."""
        return self.to if self.low and self.low <= rows < self.to else rows


NO_PADDING = RowPadding(low=0)
INVARIANT_PADDING = RowPadding(low=1, to=16)
"""Batch-invariant mode: every row count below 16 computed as 16. MKL's float32 GEMM gives a row the same
bits for every M >= 16 and other ones in the bands M = 1 and 2-15 (SmolLM2's shapes, M up to 2,000, one
thread; docs/sampling.md "Batch invariance")."""


HEAD_PADDING = RowPadding(low=2, to=4)
"""The lm_head's band: 2 or 3 rows against a vocabulary-sized weight take MKL's slow path (slower than 4 rows;
docs/benchmarks.md, "Engine: the kernel per row count")."""


def padded(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, padding: RowPadding) -> torch.Tensor:
    """f(x) for a row-wise f (a linear layer) over x [..., K], computed on the rows padded as `padding` says
    (CPU only): [..., N]."""
    rows = x.numel() // x.shape[-1]
    target = padding.target(rows)
    if target == rows or x.device.type != "cpu":
        return f(x)
    flat = x.reshape(rows, x.shape[-1])  # [M, K]
    out = f(torch.cat([flat, flat.new_zeros(target - rows, flat.shape[1])]))[:rows]  # [M, N]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, padding: RowPadding) -> torch.Tensor:
    """F.linear(x, weight, bias) with the rows of x [..., K] padded as `padding` says (CPU only)."""
    return padded(lambda t: F.linear(t, weight, bias), x, padding)


_ROW_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
"""Row counts at which LinearKernels times both kernels; a row count uses the choice of the largest bucket
at or below it (the kernels' costs change in steps: MKL at 1-3 / 4-7 / 8-15 / 16+ rows here)."""

_CHOICES: dict[tuple, np.ndarray] = {}
"""Per (in, out, bias, threads, buckets): which kernel wins at each bucket (True = oneDNN), measured once
per process (an engine is built per session; tests build many on the same shapes)."""


_SHARED: "weakref.WeakKeyDictionary[torch.nn.Module, LinearKernels]" = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


def onednn_available() -> bool:
    """torch's oneDNN linear over a reordered weight (CPU builds with mkldnn; the ops inductor uses)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise") \
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    """The oneDNN-blocked copy of weight [N, K] (any row count may use it; 16 is only the layout's hint)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16)


def _onednn(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # [M, K] -> [M, N]


def _median_seconds(f: Callable[[], object], repeats: int) -> float:
    t0 = time.perf_counter()
    f()  # warm-up: first-touch allocations, oneDNN primitive creation
    if time.perf_counter() - t0 > 0.05:  # a large weight (a 1.5B model's vocabulary head): one timing will do
        repeats = 1
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class LinearKernels:
    """A model's float32 CPU linear layers, each computed by the kernel measured faster at its row count.

    oneDNN computes over a reordered copy of a weight. A trainer may change the weights between two
    generate() calls by means no cheap signal sees (a write through `.data`, as peft's LoRA merge does,
    bumps no version counter), so no copy outlives one forward context: `refresh(model)`, called as each
    context opens, starts a new epoch, and a weight is reordered again at its first oneDNN product in the
    epoch (a layer the row counts never send to oneDNN is never copied). The cost is one pass over the
    weights per generate() (docs/engine.md "Weights the trainer changed"); in an RL loop every weight
    changes between two calls anyway. Per weight shape, both kernels are timed at _ROW_BUCKETS (medians of
    `repeats`) the first time this process sees that shape at that thread count. The two kernels differ in
    the last bits of a row, as any change of M already does with MKL; plain and speculative decoding use
    the same table, and batch-invariant mode does not use it (gemm.INVARIANT_PADDING)."""

    def __init__(self, *, repeats: int = 3, buckets: tuple[int, ...] = _ROW_BUCKETS) -> None:
        self.buckets = np.asarray(buckets, np.int64)  # [K] ascending
        self.repeats = repeats
        self.choice: dict[int, np.ndarray] = {}  # id(module) -> [K] bool (True = oneDNN), this epoch's modules
        self._epoch = 0
        self._packed: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}  # id(module) -> (weight, epoch, copy)

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> "LinearKernels":
        """The model's one LinearKernels: engines on one model (a baseline and a speculative session, a
        trainer's several rollouts) share its reordered weights instead of each holding a copy."""
        with _SHARED_LOCK:
            kernels = _SHARED.get(model)
            if kernels is None:
                kernels = _SHARED[model] = cls()
            return kernels

    def refresh(self, model: torch.nn.Module) -> None:
        """A new epoch: the model's float32 CPU nn.Linear layers as they are now (modules replaced, dtypes
        or devices moved), every reordered copy stale."""
        self._epoch += 1
        modules = [m for m in model.modules() if type(m) is torch.nn.Linear
                   and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"]
        self.choice = {id(m): self._choice(m) for m in modules}
        self._packed = {k: v for k, v in self._packed.items() if k in self.choice}  # drop removed layers' copies

    def _copy(self, m: torch.nn.Linear) -> torch.Tensor:
        """m's reordered weight as of this epoch (reordered now if it is not)."""
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
        """m(x) for x [..., K]: [..., N], by the kernel chosen for x's row count."""
        rows = x.numel() // x.shape[-1]
        at = int(np.searchsorted(self.buckets, rows, side="right")) - 1
        if at < 0 or not self.choice[id(m)][at]:
            return F.linear(x, m.weight, m.bias)
        out = _onednn(x.reshape(rows, x.shape[-1]), self._copy(m), m.bias)  # [M, N]
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _engine_linear(m: torch.nn.Linear, padding: RowPadding,
                   kernels: LinearKernels | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """m's forward inside the engine's forwards: rows padded, by `kernels`' choice (None: F.linear); a call
    from another thread is refused (its autograd and its shapes are not the engine's)."""
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
    `kernels`' choice (None: F.linear); restored after. Linears whose forward is already replaced on the
    instance (hooks of other libraries) are left alone."""
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
