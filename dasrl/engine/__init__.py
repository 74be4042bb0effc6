"""The generation engine: batched, lossless speculative decoding over a Hugging Face causal LM."""

from dasrl.engine.cache import RowCache
from dasrl.engine.engine import (Completion, EngineConfig, EngineStepError, RunStats, SpecEngine, StepInfo,
                                 default_threads, model_lock)
from dasrl.engine.guards import UnsupportedModel
from dasrl.engine.packing import pack_drafts
from dasrl.engine.sampling import SamplingParams, draw, filtered_probs
from dasrl.engine.stops import LineStop
from dasrl.engine.verify import Verdict, accepted_counts, depths, verify

__all__ = ["RowCache", "Completion", "EngineConfig", "EngineStepError", "RunStats", "SpecEngine", "StepInfo",
           "default_threads", "model_lock", "UnsupportedModel", "pack_drafts", "SamplingParams", "draw",
           "filtered_probs", "LineStop", "Verdict", "accepted_counts", "depths", "verify"]
