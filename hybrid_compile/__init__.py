"""hybrid_compile: fast serving of Hugging Face hybrid language models.

Hybrid models mix full-attention layers with linear-attention / state-space layers
(Qwen3-Next, Qwen3.5, Falcon-H1, NemotronH, Mamba2, Bamba, ...). :func:`wrap` takes an
unmodified HF model and returns a :class:`HybridEngine` that runs it through torch.library
custom ops with its own KV and Mamba-state pools (see DESIGN.md)::

    import hybrid_compile as hc
    engine = hc.wrap(model)
    out = engine.generate(input_ids, max_new_tokens=64)

Importing the package registers every kernel op under ``torch.ops.hybrid_compile``.
"""

from __future__ import annotations

from torch import nn

from . import ops  # noqa: F401  (registers the custom ops)
from .engine import EngineConfig, HybridEngine, SamplingParams
from .engine.speculative import DraftSource, SpeculativeConfig
from .models import supported_model_types
from .loading import from_pretrained
from .serving import AsyncEngine, StreamOutput

__version__ = "0.1.0"


def wrap(
    model: nn.Module, config: EngineConfig | dict | None = None, tokenizer=None, tensor_parallel_size: int = 1,
    **overrides,
) -> HybridEngine:
    """Wrap a Hugging Face hybrid model in a :class:`HybridEngine`.

    Detects the family from ``model.config.model_type``, patches this instance's layers (other
    instances are untouched; ``engine.close()`` undoes it), sizes the pools and returns the
    engine. ``config`` is an :class:`EngineConfig` (or dict); ``overrides`` are its fields as
    keyword arguments. An unsupported model type raises ValueError listing the supported ones.
    ``tokenizer`` (optional, also settable later as ``engine.tokenizer``) lets ``generate`` and
    ``generate_batch`` take strings and chat messages and return text.
    """
    if tensor_parallel_size != 1:
        raise ValueError(
            f"wrap(tensor_parallel_size={tensor_parallel_size}): a model already loaded in this process is served "
            "from one device; tensor parallelism loads each rank's shard from the checkpoint itself: use "
            "hc.from_pretrained(checkpoint_dir, tensor_parallel_size=N)"
        )
    return HybridEngine(model, EngineConfig.from_args(config, **overrides), tokenizer=tokenizer)


__all__ = [
    "AsyncEngine", "DraftSource", "EngineConfig", "HybridEngine", "SamplingParams", "SpeculativeConfig",
    "StreamOutput", "from_pretrained", "ops", "supported_model_types", "wrap", "__version__",
]
