"""Row padding for CPU matrix products: keep the engine's linear layers out of BLAS's slow small-M path.

A packed forward multiplies M = (live rows + draft tokens) activations by each weight. On a CPU, the
float32 GEMM torch calls takes a slow path for a band of small M: with SmolLM2's shapes at one thread,
a forward of 10-15 tokens costs more than one of 16 (docs/benchmarks.md, "Engine: row padding"), and that band is exactly where
a collapsed batch with drafts lives (a few rows, each with a draft). Padding such an M with zero rows up
to the fast shape computes the same products for the real rows, only faster. Rows are independent in a
GEMM, so padding changes no row's result beyond the last-bit differences any change of M already brings
(the ones docs/sampling.md budgets for); the exactness ladder holds as before (tests/test_gemm.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F


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
"""The lm_head's band: 2 or 3 rows against a vocabulary-sized weight take the slow path (one thread: 26 / 40 ms
against 23 ms for 4 rows)."""


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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, padding: RowPadding) -> torch.Tensor:
    """F.linear(x, weight, bias) with the rows of x [..., K] padded as `padding` says (CPU only)."""
    return padded(lambda t: F.linear(t, weight, bias), x, padding)


@contextlib.contextmanager
def padded_linears(model: torch.nn.Module, padding: RowPadding) -> Iterator[None]:
    """Inside the block, every plain nn.Linear of `model` pads its rows as `padding` says; restored after.
    Linears whose forward is already replaced on the instance (hooks of other libraries) are left alone."""
    if not padding.low:
        yield
        return
    patched = [m for m in model.modules() if type(m) is torch.nn.Linear and "forward" not in m.__dict__]
    for m in patched:
        m.forward = lambda x, m=m: linear(x, m.weight, m.bias, padding)
    try:
        yield
    finally:
        for m in patched:
            del m.forward
