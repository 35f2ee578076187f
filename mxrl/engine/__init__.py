"""The rollout engine: same model code as the trainer, weights as the plan says, verified loads.

from mxrl.engine import Engine, SamplingParams
engine = Engine(model, "nvfp4-dequantized")
completions = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=64))
"""

from mxrl.engine.config import CacheOptions, EngineConfig
from mxrl.engine.engine import Engine
from mxrl.engine.params import Completion, GenerateStats, SamplingParams

__all__ = [
    "CacheOptions",
    "Completion",
    "Engine",
    "EngineConfig",
    "GenerateStats",
    "SamplingParams",
]
