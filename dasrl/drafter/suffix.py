"""The native suffix index, wrapped: validation with errors that name the bad value, Draft objects out.

Every check runs before the native call, so bad input leaves the index exactly as it was.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np

from dasrl import _core
from dasrl.drafter.base import Draft, DraftParams

MAX_TOKEN = 2**31 - 1


def as_tokens(tokens: Sequence[int] | np.ndarray, *, what: str = "tokens") -> np.ndarray:
    """int32 C-contiguous array of token ids, or a clear error naming the offending value."""
    if isinstance(tokens, np.ndarray):
        arr = tokens
        if arr.ndim != 1:
            raise ValueError(f"{what} must be one-dimensional, got shape {arr.shape}")
        if arr.size and arr.dtype.kind not in "iu":
            raise TypeError(f"{what} must be an integer array, got dtype {arr.dtype}")
        if not arr.flags.c_contiguous:
            raise ValueError(f"{what} must be a contiguous array (got a strided view; use np.ascontiguousarray)")
    else:
        if isinstance(tokens, (str, bytes)):
            raise TypeError(f"{what} must be a sequence of ints, got {type(tokens).__name__}")
        seq = list(tokens)
        bad = next((t for t in seq if not isinstance(t, (int, np.integer)) or isinstance(t, bool)), None)
        if bad is not None:
            raise TypeError(f"{what} must hold ints, got {bad!r} ({type(bad).__name__})")
        arr = np.asarray(seq, dtype=np.int64) if seq else np.zeros(0, np.int64)
    if arr.size:
        small = arr.tolist() if arr.size <= 64 else None  # python min/max beat numpy's on a few tokens
        lo, hi = (min(small), max(small)) if small is not None else (int(arr.min()), int(arr.max()))
        if lo < 0:
            raise ValueError(f"{what}: negative token id {lo} at position {int(np.argmin(arr))}")
        if hi > MAX_TOKEN:
            raise ValueError(f"{what}: token id {hi} at position {int(np.argmax(arr))} is >= 2^31")
    return np.ascontiguousarray(arr, dtype=np.int32)


def _check_weight(weight: float) -> float:
    w = float(weight)
    if not (w > 0.0 and np.isfinite(w)):
        raise ValueError(f"weight must be positive and finite, got {weight!r}")
    return w


def _check_budget(budget: int) -> int:
    if int(budget) < 0:
        raise ValueError(f"draft budget must be >= 0, got {budget}")
    return int(budget)


class SuffixIndex:
    """Weighted token sequences (int64 ids) that propose drafts; see src/core/suffix_index.hpp."""

    def __init__(self) -> None:
        self._ix = _core.SuffixIndex()

    def _known(self, seq_id: int) -> int:
        if seq_id not in self._ix:
            raise KeyError(f"unknown sequence id {seq_id!r}")
        return seq_id

    def add(self, seq_id: int, tokens: Sequence[int] | np.ndarray, weight: float = 1.0) -> None:
        if not isinstance(seq_id, (int, np.integer)) or not 0 <= int(seq_id) < 2**63:
            raise ValueError(f"sequence id must be an int in [0, 2^63), got {seq_id!r}")
        if int(seq_id) in self._ix:
            raise KeyError(f"sequence id {seq_id!r} is already indexed")
        self._ix.add(int(seq_id), as_tokens(tokens), _check_weight(weight))

    def append(self, seq_id: int, tokens: Sequence[int] | np.ndarray) -> None:
        arr = as_tokens(tokens)
        self._ix.append(self._known(seq_id), arr)

    def remove(self, seq_id: int) -> None:
        self._ix.remove(self._known(seq_id))

    def set_weight(self, seq_id: int, weight: float) -> None:
        self._ix.set_weight(self._known(seq_id), _check_weight(weight))

    def scale_weights(self, factor: float) -> None:
        self._ix.scale_weights(_check_weight(factor))

    def weight(self, seq_id: int) -> float:
        return self._ix.weight(self._known(seq_id))

    def tokens(self, seq_id: int) -> np.ndarray:
        return self._ix.tokens(self._known(seq_id))

    def ids(self) -> list[int]:
        return list(self._ix.ids())

    def __contains__(self, seq_id: Hashable) -> bool:
        return isinstance(seq_id, (int, np.integer)) and int(seq_id) in self._ix

    def __len__(self) -> int:
        return self._ix.num_sequences

    @property
    def num_tokens(self) -> int:
        return self._ix.num_tokens

    def bytes_used(self) -> int:
        return self._ix.bytes_used()

    def check_integrity(self) -> None:
        self._ix.check_integrity()

    def propose(self, context: Sequence[int] | np.ndarray, budget: int, params: DraftParams = DraftParams()) -> Draft:
        """Stateless: match the tail of `context` and draft up to `budget` tokens."""
        toks, parents, probs, m = self._ix.propose(
            as_tokens(context, what="context"), _check_budget(budget), params.max_match, params.min_prob, params.branching)
        return Draft(toks, parents, probs, int(m))

    def cursor(self, max_match: int = DraftParams.max_match) -> "Cursor":
        return Cursor(self, max_match)


class Cursor:
    """A request's context tail and its match, carried across steps (re-matched only when needed)."""

    def __init__(self, index: SuffixIndex, max_match: int) -> None:
        if max_match < 1:
            raise ValueError(f"max_match must be >= 1, got {max_match}")
        self.index = index
        self._c = _core.Cursor(index._ix, int(max_match))

    def extend(self, tokens: Sequence[int] | np.ndarray) -> None:
        self._c.extend(as_tokens(tokens))

    @property
    def context_len(self) -> int:
        return self._c.context_len

    @property
    def cache_hits(self) -> int:
        return self._c.cache_hits

    @property
    def cache_misses(self) -> int:
        return self._c.cache_misses


def propose_batch(cursors: Sequence[Cursor], budgets: Sequence[int], *, min_prob: float = 0.0,
                  branching: int = 1) -> list[Draft]:
    """One native call (GIL released) for the whole batch; drafts[i] is capped at budgets[i]."""
    if len(cursors) != len(budgets):
        raise ValueError(f"{len(cursors)} cursors but {len(budgets)} budgets")
    b = [min(int(x), MAX_TOKEN) for x in budgets]
    if b and min(b) < 0:
        raise ValueError(f"draft budget must be >= 0, got {min(b)} at position {b.index(min(b))}")
    if branching < 1:
        raise ValueError(f"branching must be >= 1, got {branching}")
    toks, parents, probs, offsets, match_lens = _core.propose_batch(
        [c._c for c in cursors], np.array(b, dtype=np.int32), float(min_prob), int(branching))
    bounds = offsets.tolist()
    return [Draft(toks[s:e], parents[s:e], probs[s:e], m)
            for s, e, m in zip(bounds[:-1], bounds[1:], match_lens.tolist())]
