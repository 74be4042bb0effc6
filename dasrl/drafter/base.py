"""The drafter protocol and the Draft a drafter returns.

A drafter proposes, for each live request, a few tokens that the target model will probably emit next.
Drafts are deterministic proposals: the engine verifies them, so a bad draft only costs time, never
changes an output token.

Lifecycle of a request, as the engine drives it::

    drafter.start(req_id, problem_id, prompt_ids)     # once, before the first step
    drafts = drafter.propose(req_ids, budgets)        # once per step, for the whole batch
    drafter.observe(req_id, emitted_tokens)           # after verification: the tokens now in the output
    drafter.finish(req_id)                            # the request left the batch (its rollout is done)
    drafter.end_step()                                # the RL step is over: fold rollouts, roll window
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Hashable, Protocol, Sequence, runtime_checkable

import numpy as np

ROOT = -1
"""Parent index of a draft token that follows the context's last token directly."""


@dataclass(frozen=True)
class Draft:
    """A proposal for one request: a chain or a tree of draft tokens.

    Nodes are in topological order (a parent always comes before its children). A chain is the tree in
    which every node's parent is the node before it.
    """

    tokens: np.ndarray
    """[n] int32: draft token ids."""
    parents: np.ndarray
    """[n] int32: index of each token's parent node, ROOT (-1) for a child of the context."""
    probs: np.ndarray
    """[n] float64: path probability of each node (product of count ratios from the root to it)."""
    match_len: int = 0
    """Length of the context suffix the draft was matched on (0 = no match, empty draft)."""

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def is_chain(self) -> bool:
        return bool(np.array_equal(self.parents, np.arange(-1, len(self) - 1, dtype=np.int32)))

    @staticmethod
    def empty() -> "Draft":
        return EMPTY_DRAFT

    @staticmethod
    def chain(tokens: Sequence[int], probs: Sequence[float] | None = None, match_len: int = 0) -> "Draft":
        toks = np.asarray(tokens, dtype=np.int32)
        p = np.ones(len(toks)) if probs is None else np.asarray(probs, dtype=np.float64)
        return Draft(toks, np.arange(-1, len(toks) - 1, dtype=np.int32), p, match_len)


EMPTY_DRAFT = Draft(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float64), 0)


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
        if self.max_match < 1:
            raise ValueError(f"max_match must be >= 1, got {self.max_match}")
        if not 0.0 <= self.min_prob <= 1.0:
            raise ValueError(f"min_prob must be in [0, 1], got {self.min_prob}")
        if self.branching < 1:
            raise ValueError(f"branching must be >= 1, got {self.branching}")


@runtime_checkable
class Drafter(Protocol):
    """What the engine needs from a drafter. One object serves a whole batch."""

    def start(self, req_id: Hashable, problem_id: Hashable | None, prompt_ids: Sequence[int]) -> None:
        """Register a new request; problem_id None means problem_key(prompt_ids)."""

    def propose(self, req_ids: Sequence[Hashable], budgets: Sequence[int]) -> list[Draft]:
        """One draft per request, each at most budgets[i] tokens (0 = no draft)."""

    def observe(self, req_id: Hashable, tokens: Sequence[int]) -> None:
        """Tokens just appended to the request's output (accepted drafts plus the target's own)."""

    def finish(self, req_id: Hashable) -> None:
        """The request is complete; its rollout may feed the history."""

    def end_step(self) -> None:
        """The RL step is over."""


def problem_key(prompt_ids: Sequence[int]) -> int:
    """Stable 63-bit key of a prompt: the same prompt gets the same key in every process and run."""
    arr = np.ascontiguousarray(np.asarray(prompt_ids, dtype=np.int64))
    return int.from_bytes(hashlib.blake2b(arr.tobytes(), digest_size=8).digest(), "little") >> 1


def check_budgets(req_ids: Sequence[Hashable], budgets: Sequence[int]) -> None:
    if len(req_ids) != len(budgets):
        raise ValueError(f"{len(req_ids)} request ids but {len(budgets)} budgets")
    for rid, b in zip(req_ids, budgets):
        if int(b) < 0:
            raise ValueError(f"draft budget must be >= 0, got {b} for request {rid!r}")
