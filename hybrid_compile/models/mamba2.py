"""Mamba2 (``mamba2``, ``Mamba2ForCausalLM``): a pure SSM. Every layer is a Mamba2 mixer; there is
no attention layer at all, so the engine's KV pool holds token slots for bookkeeping only.

Each ``Mamba2Mixer`` keeps HF's ``in_proj``, gated RMSNorm and ``out_proj``; its conv + SSD
core runs through the ``mamba2_layer`` op (:mod:`.mamba2_common`). The model has no position
limit: the engine's context length defaults to ``DEFAULT_MAX_CONTEXT_NO_POSITIONS`` (raise it
with ``max_context_len``).
"""

from __future__ import annotations

import torch
from torch import nn

from .base import ModelLayout, PatchHandle
from .mamba2_common import per_layer_layout, per_layer_mamba_layers, per_layer_patch

MODEL_TYPES = ("mamba2",)


def mamba_layers(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """``(mixer, pool layer id)`` of every Mamba2 mixer."""
    return per_layer_mamba_layers(model)


def layout(model: nn.Module, *, kv_dtype: torch.dtype, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> ModelLayout:
    return per_layer_layout(model, kv_dtype=kv_dtype, conv_dtype=conv_dtype, ssm_dtype=ssm_dtype)


def patch(model: nn.Module, handle: PatchHandle) -> None:
    per_layer_patch(model, handle)
