"""Drafters: proposals of draft tokens from rollout history, behind one protocol."""

from dasrl.drafter.base import (MAX_DRAFT, Draft, DraftBatch, Drafter, DrafterBase, DraftParams, budget_array,
                                check_budgets, problem_key)
from dasrl.drafter.counting import CountingDrafter, digit_tokens, with_counting
from dasrl.drafter.store import MODES, DraftStore, StoreConfig
from dasrl.drafter.suffix import (Cursor, SuffixIndex, best_continuation_batch, extend_batch, propose_flat,
                                  token_array)

__all__ = ["MAX_DRAFT", "Draft", "DraftBatch", "Drafter", "DrafterBase", "DraftParams", "budget_array",
           "check_budgets", "problem_key", "MODES", "StoreConfig",
           "CountingDrafter", "digit_tokens", "with_counting", "DraftStore", "Cursor", "SuffixIndex",
           "best_continuation_batch", "extend_batch", "propose_flat", "token_array"]
