"""Mamba2-family models whose every cache-carrying layer is either a Mamba2 mixer or an
attention layer owning one HF layer index (the index names its pool):

- Mamba2 (``mamba2``, ``Mamba2ForCausalLM``): a pure SSM. Every layer is a Mamba2 mixer; there is
  no attention layer at all, so the engine's KV pool holds token slots for bookkeeping only.

  Each ``Mamba2Mixer`` keeps HF's ``in_proj``, gated RMSNorm and ``out_proj``; its conv + SSD
  core runs through the ``mamba2_layer`` op (:mod:`.mamba2_common`). The model has no position
  limit: the engine's context length defaults to ``DEFAULT_MAX_CONTEXT_NO_POSITIONS`` (raise it
  with ``max_context_len``).

- NemotronH (``nemotron_h``): every layer is one of a Mamba2 mixer, an attention layer (no RoPE),
  an MLP or an MoE block. Only the mixers (Mamba pool) and the attention layers (KV pool, through
  the registered attention function) carry cache; MLP / MoE blocks stay HF's modules.

  The mixer's ``time_step_limit`` is ``(time_step_min, inf)``: HF clamps ``dt`` in its chunked
  prefill path only, and so does the ``mamba2_layer`` op (see :mod:`..layers.mamba2`).

- Bamba (``bamba``): Mamba2 mixers with attention layers at ``attn_layer_indices`` (RoPE), each
  layer followed by an MLP. Mixers run through the ``mamba2_layer`` op, attention through the
  registered attention function; everything else is HF's code.

- GraniteMoeHybrid (``granitemoehybrid``, IBM Granite 4.0): Mamba2 mixers and attention layers
  (RoPE or none, per ``position_embedding_type``), MoE + shared-MLP blocks and Granite's
  multipliers (embedding, attention, residual, logits scaling), all of which stay inside HF's
  modules. Mixers run through the ``mamba2_layer`` op, attention through the registered
  attention function.

Mixers run through the ``mamba2_layer`` op, attention through the registered attention
function; everything else (MLPs, MoE blocks, multipliers) stays HF's code.
"""

from __future__ import annotations

from .mamba2_common import per_layer_layout as layout
from .mamba2_common import per_layer_mamba_layers as mamba_layers
from .mamba2_common import per_layer_patch as patch

MODEL_TYPES = ("mamba2", "nemotron_h", "bamba", "granitemoehybrid")

__all__ = ["MODEL_TYPES", "layout", "mamba_layers", "patch"]
