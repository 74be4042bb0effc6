"""The RL-facing side: rollout sessions, traces, load balancing."""

from dasrl.rollout.routing import ROUTERS, groups_of, make_router
from dasrl.rollout.session import (Rollout, RolloutSession, Session, SessionConfig, StepSummary, history_drafter,
                                   speculation_policy)
from dasrl.rollout.trace import (FORMAT, Response, Trace, TraceError, TraceWriter, read_parquet, read_trace,
                                 summarize, write_trace)

__all__ = ["ROUTERS", "groups_of", "make_router", "Rollout", "RolloutSession", "Session", "SessionConfig", "StepSummary",
           "history_drafter", "speculation_policy", "FORMAT", "Response", "Trace", "TraceError", "TraceWriter",
           "read_parquet", "read_trace", "summarize", "write_trace"]
