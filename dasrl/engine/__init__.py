"""The generation engine: batched, lossless speculative decoding over a Hugging Face causal LM."""

from dasrl.engine.engine import Completion, EngineConfig, EngineStepError, RunStats, SpecEngine, StepInfo
from dasrl.engine.guards import UnsupportedModel
from dasrl.engine.sampling import SamplingParams

__all__ = ["Completion", "EngineConfig", "EngineStepError", "RunStats", "SamplingParams", "SpecEngine", "StepInfo",
           "UnsupportedModel"]
