"""The one `propose -> cap -> trim` path, shared by the engine and the simulator, so that a replay prices
exactly the drafts a real run verifies."""

from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np

from dasrl.drafter.base import DraftBatch, Drafter
from dasrl.policy.base import BudgetPolicy, RequestState


def propose(drafter: Drafter | None, policy: BudgetPolicy, states: Sequence[RequestState],
            req_ids: Sequence[Hashable], room: Sequence[int] | np.ndarray, vocab_size: int | None = None) -> DraftBatch:
    """The batch's drafts: the policy's budgets capped by `room` ([B] most draft tokens each row may take: its
    context or length limit minus the pending token), proposed, trimmed (a drafter or a trim may not exceed its
    cap) and checked to lie in [0, vocab_size) (None: not checked; a replay of recorded tokens has no vocabulary)."""
    n = len(states)
    if len(req_ids) != n or len(room) != n:
        raise ValueError(f"propose needs one req_id and one room per state: {n} states, {len(req_ids)} req_ids, "
                         f"{len(room)} rooms")
    if drafter is None or n == 0:
        return DraftBatch.empty(n)
    budgets = list(policy.budgets(states))
    if len(budgets) != n:
        raise ValueError(f"policy {type(policy).__name__} returned {len(budgets)} budgets for {n} live requests")
    caps = np.minimum(np.asarray(budgets, np.int64), np.asarray(room, np.int64)).clip(min=0)  # [B]
    if not caps.any():
        return DraftBatch.empty(n)
    drafts = drafter.propose_flat(req_ids, caps.tolist())
    if policy.trims:
        drafts = policy.trim(states, drafts)
    if len(drafts) != n:
        raise ValueError(f"drafter/policy returned {len(drafts)} drafts for {n} live requests")
    drafts = drafts.capped(caps)
    if vocab_size is not None and len(drafts.tokens) and (
            int(drafts.tokens.min()) < 0 or int(drafts.tokens.max()) >= vocab_size):
        bad = np.flatnonzero((drafts.tokens < 0) | (drafts.tokens >= vocab_size))[0]
        b = int(np.searchsorted(drafts.offsets, bad, side="right")) - 1
        raise ValueError(f"draft for request {req_ids[b]!r} has token ids outside [0, {vocab_size}) "
                         f"(token {int(drafts.tokens[bad])})")
    return drafts
