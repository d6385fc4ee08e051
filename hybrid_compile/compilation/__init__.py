"""torch.compile backend: FX split pass at the layer ops, Inductor-compiled pieces, piecewise and
full CUDA-graph runners.

- :mod:`.split`: ``split_graph`` cuts a Dynamo graph at the splitting ops (default: the layer ops
  ``attention_layer``, ``mla_layer``, ``gdn_layer``, ``kda_layer``, ``mamba2_layer``, ``short_conv_layer``,
  ``mamba1_ssm_layer``, ``lightning_layer``), each
  alone in its piece.
- :mod:`.backend`: ``HybridCompileBackend`` / ``hybrid_compile_backend``: split, compile every other
  piece with Inductor, leave the layer ops as eager calls between them; records compile stats.
- :mod:`.rewrite`: post-grad rewrite pass (Inductor's ``post_grad_custom_pre_pass``): projections
  that share an input become one matmul over their weights, packed once by the backend.
- :mod:`.cuda_graphs`: full CUDA graphs of decode steps over stable metadata buffers, piecewise
  CUDA graphs of the compiled pieces per token bucket, bucket helpers (the engine decides which
  graphs to capture in ``engine/graph_setup.py`` and pads steps in ``engine/forward_batch.py``).
"""

from .backend import CompileStats, HybridCompileBackend, hybrid_compile_backend
from .split import DEFAULT_SPLITTING_OPS, SplitItem, resolve_ops, split_graph

__all__ = [
    "CompileStats", "DEFAULT_SPLITTING_OPS", "HybridCompileBackend", "SplitItem", "hybrid_compile_backend",
    "resolve_ops", "split_graph",
]
