"""The one place a speculation policy is assembled, for the session, the vLLM proposer, the bench and the
lab's replays (the names: docs/policy.md "Policies")."""

from __future__ import annotations

import numbers

from dasrl.policy.allowance import ClassCaps, ForwardAllowance
from dasrl.policy.base import FixedBudget
from dasrl.policy.latency import LatencyModel
from dasrl.policy.length import LengthConfig

POLICIES = ("das", "fixed", "none")


def make_policy(name: str = "das", *, latency: LatencyModel | None = None, caps: ClassCaps | None = None,
                k: int | None = None, max_tokens: int | None = None, length_config: LengthConfig | None = None
                ) -> ForwardAllowance | FixedBudget:
    """das: `caps` per class (default ClassCaps()), priced by `latency` (None: unpriced, each row its cap leveled
    to the critical path), at most `max_tokens` draft tokens per forward (None: no cap); fixed: `k` per row
    (default 8); none: plain decoding. A setting the named policy does not take is refused, not ignored (but
    `latency`, which callers pass whatever the policy)."""
    given = {n for n, v in (("caps", caps), ("k", k), ("max_tokens", max_tokens),
                            ("length_config", length_config)) if v is not None}
    takes = {"das": {"caps", "max_tokens", "length_config"}, "fixed": {"k"}, "none": set()}
    if name in takes and given - takes[name]:
        raise ValueError(f"policy {name!r} does not take {sorted(given - takes[name])} (it takes "
                         f"{sorted(takes[name]) or 'no settings'})")
    if latency is not None and not isinstance(latency, LatencyModel):
        raise TypeError(f"latency must be a LatencyModel (LatencyModel.load(path) reads a file), got {latency!r}")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral)
                                   or max_tokens < 0):
        raise ValueError(f"max_tokens must be an int >= 0 or None, got {max_tokens!r}")
    if name == "das":
        caps = ClassCaps() if caps is None else caps
        if not isinstance(caps, ClassCaps):
            raise ValueError(f"das: caps must be a ClassCaps, got {caps!r}")
        if length_config is not None and not isinstance(length_config, LengthConfig):
            raise TypeError(f"das: length_config must be a LengthConfig, got {length_config!r}")
        return ForwardAllowance(caps, max_tokens, latency=latency, length_config=length_config or LengthConfig())
    if name == "fixed":
        k = 8 if k is None else k
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"fixed: k must be an int >= 0, got {k!r}")
        return FixedBudget(k)
    if name == "none":
        return FixedBudget(0)
    raise ValueError(f"unknown policy {name!r}; valid policies: {', '.join(POLICIES)}")
