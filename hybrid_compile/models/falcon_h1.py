"""Falcon-H1 (``falcon_h1``): every decoder layer runs an attention branch and a Mamba2 branch in
parallel on the same normed input and adds them, with µP
multipliers around both (``attention_in/out_multiplier``, ``ssm_in/out_multiplier``, the
per-channel ``mup_vector`` on ``in_proj``'s output, ``key_multiplier``, embedding / LM-head /
MLP multipliers).

Both branches of layer ``i`` carry cache, so they need distinct pool ids: attention keeps HF's
layer index ``i`` (what the registered attention function reads from the module), the mixer
uses ``num_layers + i`` for its Mamba pool. The decoder layer, the multipliers outside the
mixer and the optional gated norm (``mamba_rms_norm``; ``y * silu(gate)`` without it) stay HF's
code; the two µP factors inside the mixer (``ssm_in_multiplier``, ``mup_vector``) are applied by
the patched mixer forward (:mod:`.mamba2_common`).
"""

from __future__ import annotations

import torch
from torch import nn

from .base import ModelLayout, PatchHandle, install_attention
from .mamba2_common import (
    find_attention_modules,
    find_mamba2_mixers,
    mamba2_family_layout,
    patch_mixers,
    text_config,
)

MODEL_TYPES = ("falcon_h1",)


def mamba_layers(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """``(mixer, pool layer id)``: the Mamba branch of layer ``i`` uses id ``num_layers + i``."""
    mixers = find_mamba2_mixers(model)
    if not mixers:
        raise ValueError(f"{type(model).__name__}: found no Falcon-H1 Mamba2 mixer")
    offset = int(text_config(model).num_hidden_layers)
    return [(m, offset + int(m.layer_idx)) for m in mixers]


def layout(model: nn.Module, *, kv_dtype: torch.dtype, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> ModelLayout:
    return mamba2_family_layout(
        model, mamba_layers(model), [(a, int(a.layer_idx)) for a in find_attention_modules(model)],
        kv_dtype=kv_dtype, conv_dtype=conv_dtype, ssm_dtype=ssm_dtype,
    )


def patch(model: nn.Module, handle: PatchHandle) -> None:
    mixers = mamba_layers(model)
    install_attention(model, handle)
    patch_mixers(mixers, handle)
