"""dasrl: distribution-aware speculative decoding for the rollout phase of RL post-training.

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from dasrl import RolloutSession, SessionConfig, SamplingParams
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()   # the model you train
    tok = AutoTokenizer.from_pretrained(folder)
    with RolloutSession(model, tok, SessionConfig()) as session:
        rollouts = session.generate(prompts, sampling=SamplingParams(temperature=0.6), max_new_tokens=512)
        session.end_step()

The public API is the names below and the `__all__` of dasrl.drafter, .policy, .engine, .rollout, .atomic
and dasrl.integrations.trl / .ray / .vllm / .verl; everything else is private. The names load on first use
(PEP 562), so `import dasrl.drafter` (numpy and the C++ core only) does not pay for torch and transformers;
a name whose extra is not installed raises ImportError naming it (`pip install 'dasrl[engine]'`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dasrl._extras import lazy_exports as _lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "DraftStore": "dasrl.drafter", "StoreConfig": "dasrl.drafter",
    "Completion": "dasrl.engine", "EngineConfig": "dasrl.engine", "SamplingParams": "dasrl.engine",
    "SpecEngine": "dasrl.engine",
    "ClassCaps": "dasrl.policy", "LatencyModel": "dasrl.policy", "OnlineLatency": "dasrl.policy",
    "make_policy": "dasrl.policy",
    "Rollout": "dasrl.rollout", "RolloutSession": "dasrl.rollout", "Session": "dasrl.rollout",
    "SessionConfig": "dasrl.rollout",
}  # each top-level name -> the public module it comes from

__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:
    from dasrl.drafter import DraftStore, StoreConfig
    from dasrl.engine import Completion, EngineConfig, SamplingParams, SpecEngine
    from dasrl.policy import ClassCaps, LatencyModel, OnlineLatency, make_policy
    from dasrl.rollout import Rollout, RolloutSession, Session, SessionConfig


__getattr__, __dir__ = _lazy_exports("dasrl", _EXPORTS)
