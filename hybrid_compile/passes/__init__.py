"""torch.compile backend: FX split pass at the layer ops, Inductor-compiled pieces (CPU half of
the compile issue); rewrite passes and piecewise / full CUDA-graph runners come with the GPU half.

- :mod:`.split`: ``split_graph`` cuts a Dynamo graph at the splitting ops (default: the layer ops
  ``attention_layer``, ``gdn_layer``, ``mamba2_layer``), each alone in its piece.
- :mod:`.backend`: ``HybridCompileBackend`` / ``hybrid_compile_backend``: split, compile every other
  piece with Inductor, leave the layer ops as eager calls between them; records compile stats.
"""

from .backend import CompileStats, HybridCompileBackend, hybrid_compile_backend
from .split import DEFAULT_SPLITTING_OPS, SplitItem, resolve_ops, split_graph

__all__ = [
    "CompileStats", "DEFAULT_SPLITTING_OPS", "HybridCompileBackend", "SplitItem", "hybrid_compile_backend",
    "resolve_ops", "split_graph",
]
