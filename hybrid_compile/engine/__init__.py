"""Generation engine: scheduler (continuous batching, chunked prefill, retraction), model
runner (forward batch metadata + forward context), sampler, and the HybridEngine API."""

from .config import EngineConfig
from .engine import HybridEngine, StepOutput
from .sampling import SamplingParams

__all__ = ["EngineConfig", "HybridEngine", "SamplingParams", "StepOutput"]
