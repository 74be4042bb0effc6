"""The drafter protocol and the Draft a drafter returns. Drafts are deterministic proposals that the
engine verifies: a bad draft only costs time, never changes an output token.

Lifecycle of a request, as the engine drives it::

    drafter.start(req_id, problem_id, prompt_ids)     # once, before the first step
    drafts = drafter.propose(req_ids, budgets)        # once per step, for the whole batch
    drafter.observe(req_id, emitted_tokens)           # after verification: the tokens now in the output
    drafter.finish(req_id)                            # the request left the batch (its rollout is done)
    drafter.abort(req_id)                             # or: its generation failed (nothing is learnt from it)
    drafter.end_step()                                # the RL step is over: fold rollouts, roll window
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Hashable, Protocol, Sequence, runtime_checkable

import numpy as np

ROOT = -1
"""Parent index of a draft token that follows the context's last token directly."""
TOKEN_LIMIT = 2**31
"""Token ids must be below this (the index stores int32)."""
_MAX_BUDGET = 2**31 - 1  # largest draft budget per request (a larger one is refused, not clamped)
MAX_DRAFT = 1024
"""Most tokens one draft holds: a larger budget is served as this one (one verification forward could not
check more), so a budget of 2^31 - 1 costs what 1024 does. The index, the reference and counting share it."""
_MAX_MATCH = 2**20  # longest context suffix a drafter matches
_MAX_BRANCHING = 2**16  # most children per draft node


@dataclass(frozen=True)
class Draft:
    """A proposal for one request: a tree of draft tokens in topological order (a parent before its
    children); a chain is the tree in which every node's parent is the node before it."""

    tokens: np.ndarray  # [n] int32: draft token ids
    parents: np.ndarray  # [n] int32: each token's parent node, ROOT (-1) for a child of the context
    probs: np.ndarray  # [n] float64: path probability of each node (product of count ratios from the root)
    match_len: int = 0  # length of the context suffix the draft was matched on (0 = no match, empty draft)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def is_chain(self) -> bool:
        return bool(np.array_equal(self.parents, np.arange(-1, len(self) - 1, dtype=np.int32)))

    def prefix(self, n: int) -> "Draft":
        """The first n nodes (a parent comes before its children, so they form a chain or tree again)."""
        if n >= len(self):
            return self
        return Draft(self.tokens[:n], self.parents[:n], self.probs[:n], self.match_len) if n > 0 else _EMPTY_DRAFT

    @staticmethod
    def empty() -> "Draft":
        return _EMPTY_DRAFT

    @staticmethod
    def chain(tokens: Sequence[int], probs: Sequence[float] | None = None, match_len: int = 0) -> "Draft":
        toks = np.asarray(tokens, dtype=np.int32)
        p = np.ones(len(toks)) if probs is None else np.asarray(probs, dtype=np.float64)
        return Draft(toks, np.arange(-1, len(toks) - 1, dtype=np.int32), p, match_len)


_EMPTY_DRAFT = Draft(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float64), 0)


@dataclass(frozen=True)
class DraftBatch:
    """The drafts of a whole batch in flat arrays (the hot path: no Python object per request). Request i
    owns nodes [offsets[i], offsets[i+1]); its parents index its own nodes (ROOT = -1)."""

    tokens: np.ndarray  # [total] int32: every request's draft tokens, end to end
    parents: np.ndarray  # [total] int32: each node's parent within its own request's draft
    probs: np.ndarray  # [total] float64: path probability of each node
    offsets: np.ndarray  # [n+1] int64
    match_len: np.ndarray  # [n] int64: matched suffix length per request (0 = no match)

    def __len__(self) -> int:
        return int(self.offsets.shape[0]) - 1

    @property
    def lengths(self) -> np.ndarray:
        """[n] int64: draft tokens per request."""
        return np.diff(self.offsets)

    def node_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """([total] each node's request, [total] its index within that request's draft)."""
        row = np.repeat(np.arange(len(self)), self.lengths)
        return row, np.arange(len(self.tokens)) - self.offsets[row]

    def draft(self, i: int) -> Draft:
        """Request i's draft as a Draft (views into the flat arrays)."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return Draft(self.tokens[a:b], self.parents[a:b], self.probs[a:b], int(self.match_len[i]))

    def drafts(self) -> list[Draft]:
        bounds, mlen = self.offsets.tolist(), self.match_len.tolist()
        t, p, q = self.tokens, self.parents, self.probs
        return [Draft(t[a:b], p[a:b], q[a:b], m) for a, b, m in zip(bounds[:-1], bounds[1:], mlen)]

    @staticmethod
    def empty(n: int) -> "DraftBatch":
        return DraftBatch(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float64),
                          np.zeros(n + 1, np.int64), np.zeros(n, np.int64))

    @staticmethod
    def from_drafts(drafts: Sequence[Draft]) -> "DraftBatch":
        if not drafts:
            return DraftBatch.empty(0)
        cat = (lambda xs, dt: np.concatenate(xs).astype(dt, copy=False))
        return DraftBatch(cat([d.tokens for d in drafts], np.int32), cat([d.parents for d in drafts], np.int32),
                          cat([d.probs for d in drafts], np.float64), offsets_of([len(d) for d in drafts]),
                          np.array([d.match_len for d in drafts], np.int64))

    @staticmethod
    def chains(token_lists: Sequence[Sequence[int]]) -> "DraftBatch":
        """from_drafts([Draft.chain(t) ...]) built on the flat arrays, without a Draft per request."""
        if not token_lists:
            return DraftBatch.empty(0)
        offsets = offsets_of([len(t) for t in token_lists])
        batch = DraftBatch(np.concatenate([np.asarray(t, np.int32) for t in token_lists]),
                           np.zeros(int(offsets[-1]), np.int32), np.ones(int(offsets[-1])), offsets,
                           np.zeros(len(token_lists), np.int64))
        batch.parents[:] = batch.node_rows()[1] - 1  # [T] each node's parent: the node before it (ROOT first)
        return batch

    def capped(self, caps: np.ndarray) -> "DraftBatch":
        """Each request's draft cut to its first caps[i] nodes (topological order keeps it a valid tree)."""
        lens = self.lengths
        keep_n = np.minimum(lens, np.maximum(np.asarray(caps, np.int64), 0))  # [n]
        if not np.count_nonzero(keep_n != lens):
            return self
        row, rank = self.node_rows()
        keep = rank < keep_n[row]
        return DraftBatch(self.tokens[keep], self.parents[keep], self.probs[keep], offsets_of(keep_n), self.match_len)


@dataclass(frozen=True)
class DraftParams:
    """How a suffix drafter turns a match into a draft."""

    max_match: int = 64
    """Longest context suffix (tokens) matched against the index."""
    min_prob: float = 0.0
    """Stop a draft branch once its path probability falls below this."""
    branching: int = 1
    """Children per node: 1 = chain drafts, k > 1 = tree drafts (top-k continuations, best-first)."""

    def __post_init__(self) -> None:
        _check_int("max_match", self.max_match, 1, _MAX_MATCH)
        if not (isinstance(self.min_prob, (int, float)) and 0.0 <= self.min_prob <= 1.0):
            raise ValueError(f"min_prob must be in [0, 1], got {self.min_prob!r}")
        _check_int("branching", self.branching, 1, _MAX_BRANCHING)


def offsets_of(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """[n+1] int64: 0, then the running sums of the n `lengths` (where each of n rows starts and ends)."""
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if not _is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")


@runtime_checkable
class Drafter(Protocol):
    """What the engine needs from a drafter. One object serves a whole batch."""

    def start(self, req_id: Hashable, problem_id: Hashable | None, prompt_ids: Sequence[int]) -> None:
        """Register a new request; problem_id None means problem_key(prompt_ids)."""

    def propose(self, req_ids: Sequence[Hashable], budgets: Sequence[int]) -> list[Draft]:
        """One draft per request, each at most budgets[i] tokens (0 = no draft)."""

    def observe(self, req_id: Hashable, tokens: Sequence[int]) -> None:
        """Tokens just appended to the request's output (accepted drafts plus the target's own)."""

    def propose_flat(self, req_ids: Sequence[Hashable], budgets: Sequence[int]) -> DraftBatch:
        """propose() as one DraftBatch (what the engine calls)."""

    def observe_batch(self, req_ids: Sequence[Hashable], token_lists: Sequence[Sequence[int]]) -> None:
        """observe() for several requests at once (what the engine calls)."""

    def finish(self, req_id: Hashable) -> None:
        """The request is complete; its rollout may feed the history."""

    def abort(self, req_id: Hashable) -> None:
        """The request's generation failed: forget it; nothing of its partial output is indexed."""

    def end_step(self) -> None:
        """The RL step is over."""


class DrafterBase:
    """The protocol's batch calls derived from the per-request ones, for drafters without a faster batch path
    (the DraftStore and the counting drafter have one: a single native call per forward)."""

    def propose_flat(self, req_ids: Sequence[Hashable], budgets: Sequence[int]) -> DraftBatch:
        return DraftBatch.from_drafts(list(self.propose(req_ids, budgets)))

    def observe_batch(self, req_ids: Sequence[Hashable], token_lists: Sequence[Sequence[int]]) -> None:
        for rid, toks in zip(req_ids, token_lists):
            self.observe(rid, toks)


def problem_key(prompt_ids: Sequence[int]) -> int:
    """Stable 63-bit key of a prompt: the same prompt gets the same key in every process and run."""
    arr = np.ascontiguousarray(np.asarray(prompt_ids, dtype=np.int64))
    return int.from_bytes(hashlib.blake2b(arr.tobytes(), digest_size=8).digest(), "little") >> 1


def budget_array(req_ids: Sequence[Hashable], budgets: Sequence[int] | np.ndarray) -> np.ndarray:
    """[n] int64 budgets, each an int in [0, _MAX_BUDGET], or a ValueError naming the bad value and its
    request (1.9, "3" and True are refused, not truncated)."""
    if len(req_ids) != len(budgets):
        raise ValueError(f"{len(req_ids)} request ids but {len(budgets)} budgets")
    if type(budgets) is list and all(type(b) is int and 0 <= b <= _MAX_BUDGET for b in budgets):
        return np.array(budgets, dtype=np.int64)  # the common case, without numpy reductions
    if isinstance(budgets, np.ndarray) and budgets.ndim == 1 and budgets.dtype.kind in "iu":
        if budgets.size == 0 or (int(budgets.min()) >= 0 and int(budgets.max()) <= _MAX_BUDGET):
            return budgets.astype(np.int64)
    for rid, b in zip(req_ids, budgets):  # the slow path finds the first bad one and names it
        if not isinstance(b, (int, np.integer)) or isinstance(b, (bool, np.bool_)):
            raise ValueError(f"draft budget must be an int, got {b!r} ({type(b).__name__}) for request {rid!r}")
        if not 0 <= b <= _MAX_BUDGET:
            kind = "must be >= 0" if b < 0 else "must be <= 2^31 - 1"
            raise ValueError(f"draft budget {kind}, got {int(b)} for request {rid!r}")
    return np.array([int(b) for b in budgets], dtype=np.int64)


def check_budgets(req_ids: Sequence[Hashable], budgets: Sequence[int]) -> None:
    budget_array(req_ids, budgets)
