"""Settings of the vLLM proposer, read from `LLM(..., additional_config={"dasrl": {...}})` (docs/vllm.md).

`additional_config` is the free-form part of the VllmConfig, the only thing vLLM hands a custom proposer. An
unknown key is refused by name: a typo must not silently fall back to a default.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

from dasrl.drafter.base import DraftParams
from dasrl.drafter.store import StoreConfig
from dasrl.policy.allowance import ClassCaps

_POLICIES = ("das", "fixed")
_ON_SEEDED = ("warn", "error", "ignore")
_STORE_KEYS = ("mode", "window", "decay", "cross_problem")  # flat keys that set the StoreConfig's fields
_PARAM_KEYS = ("max_match", "min_prob")  # and its DraftParams


@dataclass(frozen=True)
class VLLMDrafterConfig:
    """How the DAS proposer drafts inside vLLM."""

    store: StoreConfig = StoreConfig(params=DraftParams(branching=1))
    """The history drafter (keys mode, window, decay, cross_problem, max_match, min_prob); chains: vLLM verifies one."""
    policy: str = "das"
    """das: the session's priced policy (dasrl.policy.make_policy) | fixed: num_speculative_tokens for every request."""
    caps: ClassCaps = ClassCaps()
    """das: caps of the short, medium and long classes' drafts (each clipped to num_speculative_tokens), then priced."""
    latency_floor: bool = True
    """das: price with vLLM's own step cost (StepClock), `latency`'s model until 32 steps are in; False: `latency`'s."""
    latency: str | None = None
    """das: latency.json from `dasrl calibrate` (SessionConfig.latency); None = the prior of vLLM's device type."""
    latency_window: int = 256
    """Engine steps the latency fit looks back over (it needs 32; refitted every 32)."""
    max_spec_factor: float = 1.0
    """A draft is at most this x its match length (0 = no such cap), as in vLLM's suffix method (1.0)."""
    counting: bool = True
    """Draft numbered patterns of a request's own output by counting (needs one token per digit in vLLM's tokenizer)."""
    step_requests: int = 0
    """Without the caller's dasrl_end_step a step ends: 0 = when the batch drains; N > 0 = every N finished requests."""
    explicit_steps: bool = False
    """True: RL steps end only at the caller's dasrl_end_step, from the first; False: inferred until its first."""
    max_step_requests: int = 4096
    """With step_requests = 0, a step also ends after this many finished requests (0 = only when it drains)."""
    on_seeded: str = "warn"
    """Requests with a per-request seed in the batch: warn (once) | error | ignore (docs/vllm.md, "Seeded sampling")."""

    def __post_init__(self) -> None:
        if not isinstance(self.store, StoreConfig) or self.store.params.branching != 1:
            raise ValueError(f"store must be a StoreConfig with params.branching == 1 (vLLM verifies chains), "
                             f"got {self.store!r}")
        if not isinstance(self.caps, ClassCaps):
            raise ValueError(f"caps must be a ClassCaps, got {self.caps!r}")
        if self.policy not in _POLICIES:
            raise ValueError(f"unknown dasrl vLLM policy {self.policy!r}; valid: {', '.join(_POLICIES)}")
        if self.latency is not None and not isinstance(self.latency, str):
            raise ValueError(f"latency must be a path (str) or None, got {self.latency!r}")
        if not self.max_spec_factor >= 0:
            raise ValueError(f"max_spec_factor must be >= 0 (0 = off), got {self.max_spec_factor}")
        if self.step_requests < 0:
            raise ValueError(f"step_requests must be >= 0 (0 = step ends when the batch drains), got "
                             f"{self.step_requests}")
        if self.max_step_requests < 0:
            raise ValueError(f"max_step_requests must be >= 0 (0 = no bound), got {self.max_step_requests}")
        if self.on_seeded not in _ON_SEEDED:
            raise ValueError(f"unknown on_seeded {self.on_seeded!r}; valid: {', '.join(_ON_SEEDED)}")
        if self.latency_window < 32:
            raise ValueError(f"latency_window must be >= 32 (the fit needs 32 steps), got {self.latency_window}")

    def store_config(self, vocab_size: int | None = None) -> StoreConfig:
        return replace(self.store, vocab_size=vocab_size)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> "VLLMDrafterConfig":
        """From the `additional_config["dasrl"]` dict (None or {} = the defaults)."""
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise TypeError(f'additional_config["dasrl"] must be a dict, got {type(raw).__name__}: {raw!r}')
        known = {f.name for f in fields(cls)} - {"store"} | set(_STORE_KEYS) | set(_PARAM_KEYS)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f'unknown key(s) {unknown} in additional_config["dasrl"]; valid keys: '
                             f"{', '.join(sorted(known))}")
        kw = {k: v for k, v in raw.items() if k not in _STORE_KEYS + _PARAM_KEYS}
        default = cls.__dataclass_fields__["store"].default
        params = replace(default.params, **{k: raw[k] for k in _PARAM_KEYS if k in raw})
        kw["store"] = replace(default, params=params, **{k: raw[k] for k in _STORE_KEYS if k in raw})
        if "caps" in kw:
            caps = kw["caps"]
            if isinstance(caps, (str, bytes)) or not hasattr(caps, "__len__") or len(caps) != 3:
                raise ValueError(f"caps must be three ints >= 0 (short, medium, long), got {caps!r}")
            kw["caps"] = ClassCaps(*(int(c) for c in caps))
        return cls(**kw)
