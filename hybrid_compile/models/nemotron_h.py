"""NemotronH (``nemotron_h``): every layer is one of a Mamba2 mixer, an attention layer (no RoPE),
an MLP or an MoE block. Only the mixers (Mamba pool) and the attention layers (KV pool, through
the registered attention function) carry cache; MLP / MoE blocks stay HF's modules.

The mixer's ``time_step_limit`` is ``(time_step_min, inf)``: HF clamps ``dt`` in its chunked
prefill path only, and so does the ``mamba2_layer`` op (see :mod:`..layers.mamba2`).
"""

from __future__ import annotations

import torch
from torch import nn

from .base import ModelLayout, PatchHandle
from .mamba2_common import per_layer_layout, per_layer_mamba_layers, per_layer_patch

MODEL_TYPES = ("nemotron_h",)


def mamba_layers(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """``(mixer, pool layer id)`` of every Mamba2 mixer."""
    return per_layer_mamba_layers(model)


def layout(model: nn.Module, *, kv_dtype: torch.dtype, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> ModelLayout:
    return per_layer_layout(model, kv_dtype=kv_dtype, conv_dtype=conv_dtype, ssm_dtype=ssm_dtype)


def patch(model: nn.Module, handle: PatchHandle) -> None:
    per_layer_patch(model, handle)
