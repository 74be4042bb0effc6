"""The generation engine: batched, lossless speculative decoding over a Hugging Face causal LM."""

from dasrl.engine.cache import RowCache
from dasrl.engine.engine import (Completion, EngineConfig, EngineStepError, RunStats, SpecEngine, StepInfo,
                                 default_threads, model_lock)
from dasrl.engine.guards import UnsupportedModel
from dasrl.engine.packing import pack_drafts
from dasrl.engine.sampling import SamplingParams, draw, filtered_probs
from dasrl.engine.stops import LineStop

__all__ = ["RowCache", "Completion", "EngineConfig", "EngineStepError", "RunStats", "SpecEngine", "StepInfo",
           "default_threads", "model_lock", "UnsupportedModel", "pack_drafts", "SamplingParams", "draw",
           "filtered_probs", "LineStop"]
