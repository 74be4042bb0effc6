"""`das-vllm` in a replay: the vLLM proposer's own tracker (BatchDrafter) driven as vLLM's model runner drives it.

One call after every forward with the batch's token rows, the tokens each row just got, and no word of finished
requests (an absent row has departed), so the replay runs the proposer's code path: its policy (priced by the
profile, `latency_floor` off), its match cap, its counting drafts read in the token rows, and its host seconds,
timed around the call alone. The one change: a request's problem is the replay's, where vLLM keys it by its
prompt (CHAMP's steps are prompt variants of one problem; RL re-samples one prompt).
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Hashable, Sequence

import numpy as np

from dasrl.drafter import DraftBatch, budget_array
from dasrl.integrations.vllm import BatchDrafter, VLLMDrafterConfig
from dasrl.policy import LatencyModel


class _Tracker(BatchDrafter):
    """BatchDrafter whose requests belong to the problems the replay names (by request id)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.problems: dict[str, Hashable] = {}

    def _state(self, rid, problem, prompt_len, max_new, generated=0):
        return super()._state(rid, self.problems.get(rid, problem), prompt_len, max_new, generated)


class ProposerReplay:
    """Implements the Drafter protocol for `simulator.replay_step` (under FixedBudget(k): the proposer sets its
    own budgets). Every request asks `max_new` tokens at most (its max_tokens); `latency`: what prices the das
    policy (None with config.policy "fixed")."""

    def __init__(self, config: VLLMDrafterConfig, *, k: int, max_prompt: int, max_new: int,
                 latency: LatencyModel | None, digits: np.ndarray | None) -> None:
        if (latency is None) != (config.policy == "fixed"):
            raise ValueError(f"policy {config.policy!r} needs {'no' if config.policy == 'fixed' else 'a'} latency model")
        self.max_new, self.max_len = max_new, max_prompt + max_new + 1  # a row: prompt, response, pending token
        with tempfile.TemporaryDirectory(prefix="dasrl-replay-") as tmp:  # the config names a file: read at init
            path = None if latency is None else str(Path(tmp) / "latency.json")
            if path is not None:
                latency.save(path)
            self.tracker = _Tracker(replace(config, latency=path, latency_floor=False), num_speculative_tokens=k,
                                    max_model_len=self.max_len, device="cuda", digits=digits)
        self._taken = 0.0  # propose_s at the last take_host_s()
        self._ids: dict[Hashable, str] = {}  # replay id -> vLLM-style string id
        self._prompts: dict[str, np.ndarray] = {}  # started, not yet in the table
        self._order: list[str] = []  # the table's rows, in batch order
        self._table = np.zeros((0, self.max_len), np.int32)  # [B, max_len] token rows, as vLLM's input batch
        self._plen = np.zeros(0, np.int64)  # [B]
        self._ntok = np.zeros(0, np.int64)  # [B]
        self._sampled: list[list[int]] = []  # [B] each row's tokens of the last forward
        self._drafts: dict[str, list[int]] = {}  # the proposer's drafts for the next forward, by id

    def start(self, req_id: Hashable, problem_id: Hashable | None, prompt_ids: Sequence[int]) -> None:
        rid = self._ids[req_id] = f"{req_id}"
        self.tracker.problems[rid] = problem_id
        self._prompts[rid] = np.asarray(prompt_ids, np.int32)

    def _sync(self, rids: list[str]) -> None:
        """The table's rows in the order of `rids` (finished rows dropped, started ones added): as the engine's
        batch after its swap-removes."""
        if rids == self._order:
            return
        at = {r: i for i, r in enumerate(self._order)}
        old = np.fromiter((at.get(r, -1) for r in rids), np.int64, len(rids))  # [B] -1: new
        table = np.zeros((len(rids), self.max_len), np.int32)
        keep = np.flatnonzero(old >= 0)
        table[keep] = self._table[old[keep]]
        plen, ntok = np.zeros(len(rids), np.int64), np.zeros(len(rids), np.int64)
        plen[keep], ntok[keep] = self._plen[old[keep]], self._ntok[old[keep]]
        sampled = [self._sampled[j] if j >= 0 else [] for j in old.tolist()]
        for i in np.flatnonzero(old < 0).tolist():
            p = self._prompts.pop(rids[i])
            table[i, :p.size] = p
            plen[i] = ntok[i] = p.size
        self._order, self._table, self._plen, self._ntok, self._sampled = list(rids), table, plen, ntok, sampled

    def propose_flat(self, req_ids: Sequence[Hashable], budgets: Sequence[int]) -> DraftBatch:
        """The drafts the proposer made after the last forward, capped by `budgets` (the room the replay leaves)."""
        b = budget_array(req_ids, budgets)  # [B]
        return DraftBatch.chains([self._drafts.get(self._ids[r], ()) for r in req_ids]).capped(b)

    def propose(self, req_ids, budgets):
        return self.propose_flat(req_ids, budgets).drafts()

    def observe_batch(self, req_ids: Sequence[Hashable], token_lists: Sequence[Sequence[int]]) -> None:
        """A forward's tokens into the rows, then the proposer's call, as vLLM makes it after every forward (the
        rows that just finished included: their last tokens reach its history)."""
        self._sync([self._ids[r] for r in req_ids])
        for i, t in enumerate(token_lists):
            a = int(self._ntok[i])
            if a + len(t) > self.max_len:
                raise ValueError(f"request {self._order[i]!r}: {a + len(t)} tokens, more than max_len {self.max_len}")
            self._table[i, a:a + len(t)] = t
            self._ntok[i] = a + len(t)
            self._sampled[i] = list(t)
        drafts = self.tracker.propose(req_ids=self._order, prompt_lens=self._plen, token_rows=self._table,
                                      num_tokens=self._ntok, sampled=self._sampled,
                                      max_new_tokens=lambda rid: self.max_new)
        self._drafts = dict(zip(self._order, drafts))

    def finish(self, req_id: Hashable) -> None:  # vLLM says nothing: the proposer finds the row gone
        self.tracker.problems.pop(self._ids.pop(req_id))

    abort = finish

    def end_step(self) -> None:
        self.tracker.end_step()

    def take_host_s(self) -> float:
        """Seconds inside the proposer's calls since the last take (its own DrafterStats.propose_s)."""
        total = self.tracker.stats.propose_s
        out, self._taken = total - self._taken, total
        return out
