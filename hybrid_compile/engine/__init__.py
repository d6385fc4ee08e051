"""Generation engine: the HybridEngine API and its step loop (:mod:`.engine`), the scheduler
(continuous batching, chunked prefill, retraction: :mod:`.scheduler`), elastic pools (memory
moved between the KV and Mamba pools at run time: :mod:`.elastic`), the forward batch of a
step (a scheduled batch turned into packed input ids and forward metadata, padding for the
compiled forward and CUDA graphs included: :mod:`.forward_batch`), the compile and CUDA-graph
setup (which graphs, warm-up, capture: :mod:`.graph_setup`), the start-up phases' timing and
progress bar (:mod:`.startup`), the model runner (runs one step
under its forward context: :mod:`.runner`), the sampler (:mod:`.sampling`) and speculative
decoding (:mod:`.speculative`)."""

from .config import EngineConfig
from .engine import HybridEngine, StepOutput
from .sampling import SamplingParams

__all__ = ["EngineConfig", "HybridEngine", "SamplingParams", "StepOutput"]
