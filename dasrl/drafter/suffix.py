"""The native suffix index, wrapped: validation with errors that name the bad value, Draft objects out.

Checked entry points (`SuffixIndex.add/append/propose`, `Cursor.extend`, `propose_batch`) check everything
before the native call, so bad input changes nothing. The unchecked fast paths serve a caller that validates
at its own boundary (DraftStore): `Cursor.feed` and `extend_batch` report the first out-of-range token
(changing nothing) instead of raising; `propose_flat` takes validated int64 budgets.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np

from dasrl import _core
from dasrl.drafter.base import TOKEN_LIMIT, Draft, DraftBatch, DraftParams, budget_array


def token_array(tokens: Sequence[int] | np.ndarray, *, what: str = "tokens") -> np.ndarray:
    """A 1-D contiguous integer array of `tokens` (values not range-checked), or a clear type error."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise ValueError(f"{what} must be one-dimensional, got shape {tokens.shape}")
        if tokens.dtype.kind not in "iu":
            if tokens.size:
                raise TypeError(f"{what} must be an integer array, got dtype {tokens.dtype}")
            return np.zeros(0, np.int32)
        if not tokens.flags.c_contiguous:
            raise ValueError(f"{what} must be a contiguous array (got a strided view; use np.ascontiguousarray)")
        return tokens
    if isinstance(tokens, (str, bytes)):
        raise TypeError(f"{what} must be a sequence of ints, got {type(tokens).__name__}")
    seq = tokens if isinstance(tokens, list) else list(tokens)
    if all(type(t) is int for t in seq):
        try:
            return np.array(seq, dtype=np.int64) if seq else np.zeros(0, np.int32)
        except OverflowError:
            pos, bad = next((i, t) for i, t in enumerate(seq) if not -2**63 <= t < 2**63)
            raise ValueError(f"{what}: token id {bad} at position {pos} is >= 2^31") from None
    bad = next((t for t in seq if not isinstance(t, (int, np.integer)) or isinstance(t, (bool, np.bool_))), None)
    if bad is not None:
        raise TypeError(f"{what} must hold ints, got {bad!r} ({type(bad).__name__})")
    return token_array([int(t) for t in seq], what=what)


class TokenError(ValueError):
    """A token id outside [0, vocab_size or 2^31) at `position`; `row`: the request's index in a batch call."""

    def __init__(self, message: str, token: int, position: int, row: int | None = None) -> None:
        super().__init__(message)
        self.token, self.position, self.row = token, position, row


def token_error(arr: np.ndarray, pos: int, *, what: str = "tokens", vocab_size: int | None = None,
                row: int | None = None) -> TokenError:
    """The error for arr[pos], a token outside [0, vocab_size or 2^31)."""
    t = int(arr[pos])
    if t < 0:
        return TokenError(f"{what}: negative token id {t} at position {pos}", t, pos, row)
    if vocab_size is not None and t < TOKEN_LIMIT:
        return TokenError(f"{what}: token id {t} at position {pos} is outside the vocabulary (size {vocab_size})",
                          t, pos, row)
    return TokenError(f"{what}: token id {t} at position {pos} is >= 2^31", t, pos, row)


def first_bad(arr: np.ndarray, limit: int = TOKEN_LIMIT) -> int:
    """Position of the first token of an integer array outside [0, limit), or -1."""
    return _core.first_out_of_range(arr, limit) if arr.size else -1


def _as_tokens(tokens: Sequence[int] | np.ndarray, *, what: str = "tokens",
               vocab_size: int | None = None) -> np.ndarray:
    """int32 C-contiguous array of token ids in [0, vocab_size or 2^31), or a clear error naming the value."""
    arr = token_array(tokens, what=what)
    bad = first_bad(arr, TOKEN_LIMIT if vocab_size is None else vocab_size)
    if bad >= 0:
        raise token_error(arr, bad, what=what, vocab_size=vocab_size)
    return np.ascontiguousarray(arr, dtype=np.int32)


def _check_weight(weight: float) -> float:
    w = float(weight)
    if not (0.0 < w <= 1e300):
        raise ValueError(f"weight must be positive and finite, got {weight!r}")
    return w


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
        self._ix.add(int(seq_id), _as_tokens(tokens), _check_weight(weight))

    def add_unchecked(self, seq_id: int, tokens: np.ndarray, weight: float) -> None:
        """add() for a caller that has validated the id, the tokens and the weight."""
        self._ix.add(seq_id, tokens, weight)

    def append(self, seq_id: int, tokens: Sequence[int] | np.ndarray) -> None:
        arr = _as_tokens(tokens)
        self._ix.append(self._known(seq_id), arr)

    def remove(self, seq_id: int) -> None:
        self._ix.remove(self._known(seq_id))

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
        budget = int(budget_array([None], [budget])[0])
        toks, parents, probs, m = self._ix.propose(_as_tokens(context, what="context"), budget, params.max_match,
                                                   params.min_prob, params.branching)
        return Draft(toks, parents, probs, int(m))

    def cursor(self, max_match: int = DraftParams.max_match, seq_id: int | None = None) -> "Cursor":
        """A request's context on this index; extending it also appends to sequence `seq_id` if given."""
        if seq_id is not None:
            self._known(seq_id)
        return Cursor(self, max_match, seq_id)


class Cursor:
    """A request's context (natively held) on one index, and optionally its live sequence there."""

    __slots__ = ("index", "_c", "feed")

    def __init__(self, index: SuffixIndex, max_match: int, seq_id: int | None = None) -> None:
        DraftParams(max_match=max_match)  # the same bounds as the params
        self.index = index
        self._c = _core.Cursor(index._ix, int(max_match), -1 if seq_id is None else int(seq_id))
        self.feed = self._c.extend
        """feed(tokens, limit=2^31) -> int: the unchecked extend (the native method, no Python frame) of a 1-D
        integer array: -1 when all were appended, else the first position outside [0, limit) (nothing changed)."""

    @property
    def native(self):
        """The native cursor (what the native batch calls take)."""
        return self._c

    def extend(self, tokens: Sequence[int] | np.ndarray) -> None:
        self._c.extend(_as_tokens(tokens))

    def add_source(self, index: SuffixIndex, seq_id: int | None = None) -> None:
        """Draft also from `index` (extending the cursor also appends to its `seq_id`, which must hold the
        context so far). The draft with the highest score (the sum of its path probabilities) wins, ties to
        the earlier source (the cursor's own index first)."""
        if not isinstance(index, SuffixIndex):
            raise TypeError(f"a source must be a SuffixIndex, got {type(index).__name__}")
        if index is self.index or any(index._ix is s for s in self._c.sources):
            raise ValueError("this index is already a source of the cursor")
        if seq_id is not None:
            index._known(seq_id)
            if index._ix.seq_len(seq_id) != self.context_len:
                raise ValueError(f"sequence {seq_id} holds {index._ix.seq_len(seq_id)} tokens, the cursor's "
                                 f"context {self.context_len}: a source's live sequence must hold the context")
        self._c.add_source(index._ix, -1 if seq_id is None else int(seq_id))

    def context(self) -> np.ndarray:
        """[n] int32: everything this cursor was extended with."""
        return self._c.context()

    @property
    def context_len(self) -> int:
        return self._c.context_len


def propose_flat(cursors: Sequence[Cursor], budgets: np.ndarray, *, min_prob: float = 0.0,
                 branching: int = 1) -> DraftBatch:
    """Unchecked: one native call (GIL released) for the whole batch; `budgets` [n] int64 from budget_array."""
    return DraftBatch(*_core.propose_batch([c._c for c in cursors], budgets, min_prob, branching))


def propose_batch(cursors: Sequence[Cursor], budgets: Sequence[int], *, min_prob: float = 0.0,
                  branching: int = 1) -> list[Draft]:
    """Checked: drafts[i] is capped at budgets[i]."""
    if len(cursors) != len(budgets):
        raise ValueError(f"{len(cursors)} cursors but {len(budgets)} budgets")
    DraftParams(min_prob=min_prob, branching=branching)  # the same bounds as the params
    return propose_flat(cursors, budget_array(range(len(cursors)), budgets), min_prob=min_prob,
                        branching=branching).drafts()


def best_continuation_batch(cursors: Sequence[Cursor], targets: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """[n] int64: for cursors[i], the longest prefix of targets[offsets[i]:offsets[i+1]] that follows an
    occurrence of its longest match in one of its sources: the best any draft could hold (the lab's oracle
    bound, dasrl_lab.sim.oracle)."""
    return _core.best_continuation_batch([c._c for c in cursors], _as_tokens(targets, what="targets"), offsets)


def extend_batch(cursors: Sequence[Cursor], tokens: np.ndarray, offsets: np.ndarray, limit: int = TOKEN_LIMIT) -> int:
    """Unchecked: cursors[i] takes tokens[offsets[i]:offsets[i+1]]; -1 when all were appended, else the first
    position outside [0, limit) (nothing changed)."""
    return _core.extend_batch([c._c for c in cursors], tokens, offsets, limit)
