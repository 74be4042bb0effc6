"""Counting drafts: continue a numbered pattern of the request's own output by incrementing its numbers.

A suffix drafter cannot propose "46" after "44, 45, " unless "45, 46" is in its history; counting can. With
one token per digit, the output is a sequence of items (a non-digit token, or a number: a run of digits).
When the last three periods of P items are alike and each number slot steps by a constant across them,
the next periods follow (docs/drafter.md, "Counting drafts"):

    ..., 43, 44, 45, 4  ->  items [.. 43 , ␣ 44 , ␣ 45 , ␣] + partial "4";  P = 3, slot steps +1
                        ->  draft "6" "," " " "4" "7" "," " " ...
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, Hashable, Sequence

import numpy as np

from dasrl import _core
from dasrl.drafter.base import MAX_DRAFT, Draft, DraftBatch, offsets_of

_NUM = -1  # the key of a number item (non-digit items are keyed by their token id)
WINDOW = 256
"""A request's last tokens a pattern is looked for in."""
MAX_PERIOD = 32
"""The most items a pattern's period may have."""


def digit_tokens(tokenizer) -> np.ndarray:
    """[10] int64: the token id of each digit 0-9; ValueError when a digit is not one token."""
    out = []
    for d in "0123456789":
        ids = tokenizer.encode(d, add_special_tokens=False)
        if len(ids) != 1 or tokenizer.decode(ids) != d:
            raise ValueError(f"digit {d!r} is not a single token of this tokenizer ({ids}): counting drafts "
                             "need one token per digit")
        out.append(int(ids[0]))
    if len(set(out)) != 10:
        raise ValueError(f"digit tokens are not distinct: {out}")
    return np.asarray(out, np.int64)


def _items(tail: np.ndarray, digits: np.ndarray) -> tuple[list[int], Callable[[int], str], str]:
    """(keys, text, partial): the tail as items (keys: token id or _NUM; text(k): item k's digits, for a
    number) and the digits the tail ends in (a number still being written; '' if none)."""
    table, value = _digit_maps(digits.astype(np.int64).tobytes())
    isd = table[np.minimum(tail, table.size - 1)]  # [n] bool: a digit token
    last = np.flatnonzero(~isd)
    body = int(last[-1]) + 1 if last.size else 0  # tokens before the trailing digit run
    partial = "".join(value[t] for t in tail[body:].tolist())
    b = isd[:body]
    start = ~b
    start[1:] |= b[1:] & ~b[:-1]  # a non-digit token, or the first digit of a run
    start[:1] |= b[:1]
    pos = np.flatnonzero(start)  # [k] first token of each item
    if pos.size and b[0]:  # a leading number: the window may have cut it
        pos = pos[1:]
    keys = np.where(b[pos], _NUM, tail[pos]).tolist()
    first = pos.tolist()
    ends = first[1:] + [body]  # a number runs up to the next item
    return keys, lambda k: "".join(value[t] for t in tail[first[k]:ends[k]].tolist()), partial


@functools.lru_cache(maxsize=8)
def _digit_maps(key: bytes) -> tuple[np.ndarray, dict[int, str]]:
    """(is-digit table, token -> its digit) of the digit tokens whose int64 bytes are `key` (np.isin sorts on
    every call)."""
    digits = np.frombuffer(key, np.int64)
    table = np.zeros(int(digits.max()) + 2, bool)  # [max digit + 2]: the last entry is "above every digit"
    table[digits] = True
    return table, {int(t): str(d) for d, t in enumerate(digits.tolist())}


def _periods(tails: Sequence[np.ndarray], digits: np.ndarray, max_period: int) -> np.ndarray:
    """[B] int64: for each tail, the shortest period P (with a number in it) whose last three windows of P
    items are alike, 0 if none: one native call tells apart the rows without a pattern, most of them."""
    offsets = offsets_of([t.size for t in tails])
    flat = np.concatenate(tails).astype(np.int64, copy=False) if len(tails) else np.zeros(0, np.int64)
    return _core.count_periods(flat, offsets, np.ascontiguousarray(digits, np.int64), int(max_period))


def _format(value: int, seen: Sequence[str]) -> str | None:
    """A slot's next number written as its earlier ones were (zero-padded to their width if they were)."""
    if value < 0:
        return None
    padded = any(len(s) > 1 and s[0] == "0" for s in seen)
    return str(value).zfill(len(seen[-1])) if padded else str(value)


def _counting_draft(tail: np.ndarray, *, digits: np.ndarray, budget: int, max_period: int = MAX_PERIOD,
                    period: int | None = None) -> np.ndarray:
    """[<= min(budget, MAX_DRAFT)] int64: the tokens that continue the numbered pattern `tail` (the request's
    last tokens) ends in; empty when there is none. `period`: its `_periods` when the caller has it."""
    budget = min(budget, MAX_DRAFT)  # a pattern never runs out: the cap bounds this loop
    if budget <= 0 or tail.size == 0:
        return np.zeros(0, np.int64)
    tail = np.asarray(tail, np.int64)
    keys, text, partial = _items(tail, digits)
    p = int(_periods([tail], digits, max_period)[0]) if period is None else period
    if p == 0:
        return np.zeros(0, np.int64)
    n = len(keys)
    slots: dict[int, tuple[list[str], int | None]] = {}  # slot -> (its texts in the last three periods, step)
    for i in range(p):
        if keys[n - p + i] == _NUM:
            seen = [text(n - (3 - c) * p + i) for c in range(3)]
            v = [int(t) for t in seen]
            slots[i] = seen, (v[2] - v[1] if v[2] - v[1] == v[1] - v[0] else None)  # None: no constant step
    out: list[int] = []
    k = 0
    while len(out) < budget:
        i, cycle = k % p, k // p + 1
        if keys[n - p + i] != _NUM:
            if partial and k == 0:
                return np.zeros(0, np.int64)  # the tail ends inside a number where the pattern has none
            out.append(keys[n - p + i])
        else:
            seen, step = slots[i]
            text = None if step is None else _format(int(seen[-1]) + cycle * step, seen)
            if text is None:
                break
            if k == 0 and partial:
                if not text.startswith(partial):
                    return np.zeros(0, np.int64)
                text = text[len(partial):]
            out.extend(int(digits[int(c)]) for c in text)
        k += 1
    return np.asarray(out[:budget], np.int64)


def counted(batch: DraftBatch, tail: Callable[[int], np.ndarray], periods: np.ndarray, budgets: Sequence[int],
            digits: np.ndarray, max_period: int = MAX_PERIOD) -> tuple[DraftBatch, int]:
    """(`batch` with the draft of each row whose tail, `tail(i)` = its request's last tokens, ends in a numbered
    pattern of period periods[i] > 0 (`_periods`; 0: none) replaced by the counting draft, how many were)."""
    drafts: list[Draft] | None = None
    n = 0
    for i in np.flatnonzero(periods).tolist():
        toks = _counting_draft(tail(i), digits=digits, budget=int(budgets[i]), max_period=max_period,
                               period=int(periods[i]))
        if toks.size:
            drafts = batch.drafts() if drafts is None else drafts
            drafts[i] = Draft.chain(toks, match_len=int(toks.size))
            n += 1
    return (batch if drafts is None else DraftBatch.from_drafts(drafts)), n


def with_counting(inner, tokenizer):
    """`inner` wrapped in counting drafts, or `inner` itself (with a warning) when digits are not one token each."""
    try:
        return CountingDrafter(inner, digit_tokens(tokenizer))
    except ValueError as e:
        warnings.warn(f"counting drafts are off: {e}", stacklevel=2)
        return inner


class CountingDrafter:
    """Wraps a drafter: counting drafts where the output is a numbered pattern, the wrapped drafter's elsewhere."""

    def __init__(self, inner, digits: np.ndarray, *, window: int = WINDOW, max_period: int = MAX_PERIOD) -> None:
        digits = np.asarray(digits, np.int64)
        if digits.shape != (10,) or len(set(digits.tolist())) != 10 or digits.min() < 0:
            raise ValueError(f"digits must be 10 distinct token ids >= 0 (digit_tokens()), got {digits.tolist()}")
        if window < 3 or max_period < 1:
            raise ValueError(f"need window >= 3 and max_period >= 1, got window={window}, max_period={max_period}")
        self.inner, self.digits, self.window, self.max_period = inner, digits, window, max_period
        self._tail: dict[Hashable, np.ndarray] = {}
        self.counted = 0  # drafts proposed by counting (not by the wrapped drafter) since construction

    def start(self, req_id: Hashable, problem_id: Hashable | None, prompt_ids: Sequence[int]) -> None:
        self.inner.start(req_id, problem_id, prompt_ids)  # validates, and refuses a live id
        self._tail[req_id] = np.asarray(prompt_ids, np.int64)[-self.window:]

    def propose(self, req_ids: Sequence[Hashable], budgets: Sequence[int]) -> list[Draft]:
        return self.propose_flat(req_ids, budgets).drafts()

    def propose_flat(self, req_ids: Sequence[Hashable], budgets: Sequence[int]) -> DraftBatch:
        batch = self.inner.propose_flat(req_ids, budgets)  # checks ids and budgets
        asked = [i for i, b in enumerate(budgets) if b > 0]
        periods = np.zeros(len(req_ids), np.int64)  # [B] 0: no pattern (or no budget)
        periods[asked] = _periods([self._tail[req_ids[i]] for i in asked], self.digits, self.max_period)
        batch, n = counted(batch, lambda i: self._tail[req_ids[i]], periods, budgets, self.digits, self.max_period)
        self.counted += n
        return batch

    def observe(self, req_id: Hashable, tokens: Sequence[int]) -> None:
        self.inner.observe(req_id, tokens)
        self._extend(req_id, tokens)

    def observe_batch(self, req_ids: Sequence[Hashable], token_lists: Sequence[Sequence[int]]) -> None:
        self.inner.observe_batch(req_ids, token_lists)
        for rid, toks in zip(req_ids, token_lists):
            self._extend(rid, toks)

    def _extend(self, req_id: Hashable, tokens: Sequence[int]) -> None:
        tail = self._tail.get(req_id)
        if tail is not None:
            self._tail[req_id] = np.concatenate([tail, np.asarray(tokens, np.int64)])[-self.window:]

    def finish(self, req_id: Hashable) -> None:
        self.inner.finish(req_id)
        self._tail.pop(req_id, None)

    def abort(self, req_id: Hashable) -> None:
        self.inner.abort(req_id)
        self._tail.pop(req_id, None)

    def end_step(self) -> None:
        self.inner.end_step()
        self._tail.clear()
