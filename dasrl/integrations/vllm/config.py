"""Settings of the vLLM proposer, read from `LLM(..., additional_config={"dasrl": {...}})`.

vLLM hands a custom proposer nothing but its VllmConfig; `additional_config` is the free-form dict that
travels with it into every engine and worker process, so the proposer's own settings live there under
the key "dasrl". Unknown keys are refused with an error naming them (a typo must not silently fall back
to a default).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from dasrl.drafter.base import DraftParams
from dasrl.drafter.store import StoreConfig

POLICIES = ("das", "fixed")


@dataclass(frozen=True)
class VLLMDrafterConfig:
    """How the DAS proposer drafts inside vLLM."""

    mode: str = "problem+request"
    """History scope of the DraftStore: problem | problem+request | global."""
    window: int = 16
    """RL steps of history kept per problem (0 = keep every step)."""
    decay: float = 0.8
    """Weight factor per step of age of a finished rollout."""
    max_match: int = 64
    """Longest context suffix matched against the index."""
    min_prob: float = 0.0
    """Stop a draft once its path probability falls below this."""
    max_spec_factor: float = 1.0
    """A draft is at most max_spec_factor x its match length (0 = no such cap); vLLM's suffix method
    uses the same rule (1.0): weak matches -- a request with no history yet -- draft little."""
    policy: str = "das"
    """Draft cap per request: das (length-class caps, clipped to num_speculative_tokens) | fixed
    (num_speculative_tokens for every request, like vLLM's own suffix method)."""
    caps: tuple[int, int, int] = (0, 4, 24)
    """das policy: caps of the short, medium and long classes (each clipped to num_speculative_tokens)."""
    step_requests: int = 0
    """When an RL step ends: 0 = when the batch drains (every request of the step has left and a new
    one arrives: one `LLM.generate` call per step); N > 0 = after every N requests that left the batch."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown dasrl vLLM policy {self.policy!r}; valid: {', '.join(POLICIES)}")
        if not self.max_spec_factor >= 0:
            raise ValueError(f"max_spec_factor must be >= 0 (0 = off), got {self.max_spec_factor}")
        if self.step_requests < 0:
            raise ValueError(f"step_requests must be >= 0 (0 = step ends when the batch drains), got "
                             f"{self.step_requests}")
        if len(self.caps) != 3 or any(int(c) < 0 for c in self.caps):
            raise ValueError(f"caps must be three ints >= 0 (short, medium, long), got {self.caps!r}")
        self.store_config()  # validates mode, window, decay, max_match, min_prob with the store's messages

    def store_config(self, vocab_size: int | None = None) -> StoreConfig:
        return StoreConfig(mode=self.mode, window=self.window, decay=self.decay, vocab_size=vocab_size,
                           params=DraftParams(max_match=self.max_match, min_prob=self.min_prob, branching=1))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> "VLLMDrafterConfig":
        """From the `additional_config["dasrl"]` dict (None or {} = the defaults)."""
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise TypeError(f'additional_config["dasrl"] must be a dict, got {type(raw).__name__}: {raw!r}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f'unknown key(s) {unknown} in additional_config["dasrl"]; valid keys: '
                             f"{', '.join(sorted(known))}")
        kw = dict(raw)
        if "caps" in kw:
            kw["caps"] = tuple(int(c) for c in kw["caps"])
        return cls(**kw)
