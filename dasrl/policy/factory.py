"""The one place a speculation policy is assembled, for the session, the vLLM proposer, the bench and the
lab's replays: "das" is always the priced session policy.

    das    DAS's class caps (ClassCaps) under the per-row pricing of ForwardAllowance: what each row drafts
           below its cap costs no more than it saves at `latency` (docs/policy.md)
    fixed  the same cap k for every row, every step, unpriced (vLLM's suffix method drafts so)
    none   plain decoding
"""

from __future__ import annotations

from dasrl.policy.allowance import ForwardAllowance
from dasrl.policy.base import FixedBudget, NoSpeculation, PolicyBase
from dasrl.policy.budget import ClassCaps, DASPolicy
from dasrl.policy.latency import LatencyModel
from dasrl.policy.length import LengthConfig

POLICIES = ("das", "fixed", "none")
"""The library's policy names."""


def make_policy(name: str = "das", *, latency: LatencyModel | None = None, caps: ClassCaps = ClassCaps(),
                k: int = 8, max_tokens: int | None = None, length_config: LengthConfig = LengthConfig()
                ) -> ForwardAllowance | PolicyBase:
    """The policy `name` (module docstring). das: `caps` per class, priced by `latency` (None: unpriced, each
    row its cap leveled to the critical path), at most `max_tokens` draft tokens per forward (None: no cap);
    fixed: `k` per row."""
    if name == "das":
        if not isinstance(caps, ClassCaps):
            raise ValueError(f"das: caps must be a ClassCaps, got {caps!r}")
        return ForwardAllowance(DASPolicy(caps=caps, length_config=length_config), max_tokens, latency=latency)
    if name == "fixed":
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"fixed: k must be an int >= 0, got {k!r}")
        return FixedBudget(k)
    if name == "none":
        return NoSpeculation()
    raise ValueError(f"unknown policy {name!r}; valid policies: {', '.join(POLICIES)}")
