"""hybrid_compile: fast serving of Hugging Face hybrid language models.

Hybrid models mix full-attention layers with linear-attention / state-space layers
(Qwen3-Next, Qwen3.5, Falcon-H1, NemotronH, Mamba2, Bamba, ...). :func:`wrap` takes an
unmodified HF model and returns a :class:`HybridEngine` that runs it through torch.library
custom ops with its own KV and Mamba-state pools (README: "How it works")::

    import hybrid_compile as hc
    engine = hc.wrap(model)
    out = engine.generate(input_ids, max_new_tokens=64)

Importing the package registers every kernel op under ``torch.ops.hybrid_compile``.
"""

from __future__ import annotations

from . import ops  # noqa: F401  (registers the custom ops)
from .engine import EngineConfig, HybridEngine, SamplingParams
from .engine.speculative import DraftSource, SpeculativeConfig
from .models import supported_model_types
from .loading import from_pretrained, wrap
from .serving import AsyncEngine, StreamOutput

__version__ = "0.1.0"


__all__ = [
    "AsyncEngine", "DraftSource", "EngineConfig", "HybridEngine", "SamplingParams", "SpeculativeConfig",
    "StreamOutput", "from_pretrained", "ops", "supported_model_types", "wrap", "__version__",
]
