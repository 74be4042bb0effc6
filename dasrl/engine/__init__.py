"""The generation engine: batched, lossless speculative decoding over a Hugging Face causal LM.

Needs `dasrl[engine]` (torch, transformers). Names load on first use (PEP 562), so the numpy-only modules
(verify, rows) serve the vLLM tracker without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dasrl._extras import lazy_exports as _lazy_exports

_EXPORTS = {
    "RowCache": "dasrl.engine.cache",
    **dict.fromkeys(["Completion", "EngineConfig", "EngineStepError", "SpecEngine", "StepInfo",
                     "default_threads", "model_lock"], "dasrl.engine.engine"),
    "UnsupportedModel": "dasrl.engine.guards",
    "pack_drafts": "dasrl.engine.packing",
    **dict.fromkeys(["SamplingParams", "draw", "filtered_probs"], "dasrl.engine.sampling"),
    "LineStop": "dasrl.engine.stops",
    **dict.fromkeys(["Verdict", "accepted_counts", "depths", "verify"], "dasrl.engine.verify"),
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from dasrl.engine.cache import RowCache
    from dasrl.engine.engine import (Completion, EngineConfig, EngineStepError, SpecEngine, StepInfo,
                                     default_threads, model_lock)
    from dasrl.engine.guards import UnsupportedModel
    from dasrl.engine.packing import pack_drafts
    from dasrl.engine.sampling import SamplingParams, draw, filtered_probs
    from dasrl.engine.stops import LineStop
    from dasrl.engine.verify import Verdict, accepted_counts, depths, verify

__getattr__, __dir__ = _lazy_exports("dasrl.engine", _EXPORTS)
