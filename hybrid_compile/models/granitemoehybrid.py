"""GraniteMoeHybrid (``granitemoehybrid``, IBM Granite 4.0): Mamba2 mixers and attention layers
(RoPE or none, per ``position_embedding_type``), MoE + shared-MLP blocks and Granite's
multipliers (embedding, attention, residual, logits scaling), all of which stay inside HF's
modules. Mixers run through the ``mamba2_layer`` op, attention through the registered
attention function.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import ModelLayout, PatchHandle
from .mamba2_common import per_layer_layout, per_layer_mamba_layers, per_layer_patch

MODEL_TYPES = ("granitemoehybrid",)


def mamba_layers(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """``(mixer, pool layer id)`` of every Mamba2 mixer."""
    return per_layer_mamba_layers(model)


def layout(model: nn.Module, *, kv_dtype: torch.dtype, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> ModelLayout:
    return per_layer_layout(model, kv_dtype=kv_dtype, conv_dtype=conv_dtype, ssm_dtype=ssm_dtype)


def patch(model: nn.Module, handle: PatchHandle) -> None:
    per_layer_patch(model, handle)
