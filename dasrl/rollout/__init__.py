"""The RL-facing side: rollout sessions, load balancing. Names load on first use (PEP 562): routing needs
numpy only (the VeRL router imports it), the session `dasrl[engine]`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dasrl._extras import lazy_exports as _lazy_exports

_ROUTING = ["ROUTERS", "groups_of", "make_router"]
_SESSION = ["Rollout", "RolloutSession", "Session", "SessionConfig", "StepSummary", "history_drafter",
            "speculation_policy"]
_EXPORTS = {**dict.fromkeys(_ROUTING, "dasrl.rollout.routing"), **dict.fromkeys(_SESSION, "dasrl.rollout.session")}

__all__ = [*_ROUTING, *_SESSION]

if TYPE_CHECKING:
    from dasrl.rollout.routing import ROUTERS, groups_of, make_router
    from dasrl.rollout.session import (Rollout, RolloutSession, Session, SessionConfig, StepSummary,
                                       history_drafter, speculation_policy)

__getattr__, __dir__ = _lazy_exports("dasrl.rollout", _EXPORTS)
