"""ArcticDrafter: arctic-inference's SuffixDecodingCache (vLLM's `suffix` method) behind our protocol.

Optional: `pip install dasrl[arctic]` (arctic-inference==0.3.0, built from source). One global tree of
all responses (finished and active) plus a tree per request over its prompt, as vLLM uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np

from dasrl.drafter import Draft, DrafterBase, check_budgets


def arctic_status() -> str | None:
    """None when arctic-inference imports, else why it does not (it is an optional, source-built extra)."""
    try:
        import arctic_inference.suffix_decoding  # noqa: F401
    except Exception as e:  # a broken build fails in other ways than ImportError
        return f"{type(e).__name__}: {e}"
    return None


def arctic_available() -> bool:
    return arctic_status() is None


@dataclass(frozen=True)
class ArcticConfig:
    """SuffixDecodingCache settings; the defaults are vLLM's `suffix` method's."""

    max_tree_depth: int = 64
    """Deepest match + draft the trees hold."""
    max_spec_factor: float = 1.0
    """Draft length is capped at max_spec_factor * match length."""
    min_token_prob: float = 0.1
    """Stop drafting below this estimated token probability."""
    max_cached_requests: int = -1
    """Finished responses kept in the global tree (-1 = all)."""


class ArcticDrafter(DrafterBase):
    def __init__(self, config: ArcticConfig = ArcticConfig()) -> None:
        try:
            from arctic_inference.suffix_decoding import SuffixDecodingCache
        except ImportError as e:
            raise ImportError("ArcticDrafter needs arctic-inference: pip install 'dasrl[arctic]' "
                              "(arctic-inference==0.3.0)") from e
        self.config = config
        self._cache = SuffixDecodingCache(config.max_tree_depth, config.max_cached_requests)
        self._ctx: dict[Hashable, list[int]] = {}
        self._hist = 0

    def start(self, req_id: Hashable, problem_id: Hashable | None, prompt_ids: Sequence[int]) -> None:
        # np.array, a writable copy: arctic's binding refuses read-only arrays, and a trace's token ids
        # (read_trace) are read-only views of Arrow buffers
        self._cache.start_request(req_id, np.array(prompt_ids, dtype=np.int32))
        self._ctx[req_id] = [int(t) for t in prompt_ids]

    def propose(self, req_ids: Sequence[Hashable], budgets: Sequence[int]) -> list[Draft]:
        check_budgets(req_ids, budgets)
        c, out = self.config, []
        for rid, b in zip(req_ids, budgets):
            if b == 0:
                out.append(Draft.empty())
                continue
            ctx = np.asarray(self._ctx[rid][-c.max_tree_depth:], dtype=np.int32)
            d = self._cache.speculate(rid, ctx, max_spec_tokens=int(b), max_spec_factor=c.max_spec_factor,
                                      min_token_prob=c.min_token_prob)
            out.append(Draft(np.asarray(d.token_ids, np.int32), np.asarray(d.parents, np.int32),
                             np.asarray(d.probs, np.float64), int(d.match_len)))
        return out

    def observe(self, req_id: Hashable, tokens: Sequence[int]) -> None:
        self._cache.add_active_response(req_id, np.array(tokens, dtype=np.int32))
        self._ctx[req_id].extend(int(t) for t in tokens)

    def finish(self, req_id: Hashable) -> None:
        self._cache.stop_request(req_id)
        del self._ctx[req_id]

    def abort(self, req_id: Hashable) -> None:
        self.finish(req_id)
        if req_id in self._cache.cached_requests:  # its partial response leaves the global tree too
            self._cache.evict_cached_response(req_id)

    def add_rollout(self, problem_id: Hashable | None, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> None:
        rid = ("history", self._hist)
        self._hist += 1
        self._cache.start_request(rid, np.array(prompt_ids, dtype=np.int32))
        self._cache.add_active_response(rid, np.array(response_ids, dtype=np.int32))
        self._cache.stop_request(rid)

    def end_step(self) -> None:
        pass

    def bytes_used(self) -> int | None:
        return None  # arctic-inference exposes no memory accounting
