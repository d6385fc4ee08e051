"""hybrid_compile: fast serving of Hugging Face hybrid language models.

Hybrid models mix full-attention layers with linear-attention / state-space layers
(Qwen3-Next, Qwen3.5, Falcon-H1, NemotronH, Mamba2, Bamba, ...). This package wraps an
unmodified HF model and runs it through torch.library custom ops, torch.compile and a
generation engine that owns the KV and Mamba-state pools (see DESIGN.md).

Importing the package registers every kernel op under ``torch.ops.hybrid_compile``.
"""

from . import ops  # noqa: F401  (registers the custom ops)

__version__ = "0.1.0"

__all__ = ["ops", "__version__"]
