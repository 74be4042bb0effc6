"""dasrl: distribution-aware speculative decoding for the rollout phase of RL post-training.

    from dasrl import RolloutSession, SessionConfig, SamplingParams, load_model
    model, tok = load_model("smollm2-135m")
    with RolloutSession(model, tok, SessionConfig()) as session:
        rollouts = session.generate(prompts, sampling=SamplingParams(temperature=0.6), max_new_tokens=512)
        session.end_step()

The public API is the names below and those of the public subpackages' `__all__` (dasrl.drafter,
dasrl.policy, dasrl.engine, dasrl.rollout, dasrl.models, dasrl.atomic, dasrl.integrations.trl / .ray /
.vllm / .verl, each importing its framework lazily); everything else is private.
"""

from dasrl.drafter import DraftStore, StoreConfig
from dasrl.engine import Completion, EngineConfig, SamplingParams, SpecEngine
from dasrl.models import load_model
from dasrl.policy import ClassCaps, LatencyModel, OnlineLatency, make_policy
from dasrl.rollout import Rollout, RolloutSession, Session, SessionConfig, read_trace, write_trace

__version__ = "0.1.0"

__all__ = ["DraftStore", "StoreConfig", "Completion", "EngineConfig", "SamplingParams", "SpecEngine", "load_model",
           "ClassCaps", "LatencyModel", "OnlineLatency", "make_policy", "Rollout", "RolloutSession", "Session", "SessionConfig",
           "read_trace", "write_trace", "__version__"]
