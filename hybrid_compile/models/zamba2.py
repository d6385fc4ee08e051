"""Zamba2 (``zamba2``): every layer is a Mamba2 mixer; "hybrid" layers also run a *shared*
transformer block first (attention over ``concat(hidden, embeddings)`` + MLP, weights tied
across every ``num_mem_blocks``-th hybrid layer, plus per-use LoRA-style adapters).

HF builds one ``Zamba2AttentionDecoderLayer`` instance per hybrid layer (the weights are tied,
the modules are not shared) and gives every ``Zamba2Attention`` ``layer_idx = -1``: the real
index is a forward argument, used for its KV cache. Each use of a shared block needs its own
KV pages, so the attention of hybrid layer ``i`` gets the pool id ``num_layers + i`` (written to
its instance's ``layer_idx``, which is what the registered attention function reads and what
HF's own code never reads; ``handle.undo()`` puts -1 back), and the mixer of layer ``i`` keeps
``i``. Were a version of transformers to reuse one attention instance for several layers,
:func:`patch` raises instead of mixing their caches.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import ModelLayout, PatchHandle, install_attention
from .mamba2_common import (
    mamba2_family_layout,
    patch_mixers,
    per_layer_mamba_layers,
    text_config,
)

MODEL_TYPES = ("zamba2",)


def mamba_layers(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """``(mixer, pool layer id)``: HF's layer index."""
    return per_layer_mamba_layers(model)


def shared_attention_uses(model: nn.Module, block_attr: str) -> list[tuple[nn.Module, int]]:
    """``(attention, KV pool id)`` of every hybrid layer (a module with ``block_attr``, the shared
    block, and ``mamba_decoder``): ``num_layers + layer index``. Shared with Zamba (v1)."""
    offset = int(text_config(model).num_hidden_layers)
    uses = []
    for module in model.modules():
        block = getattr(module, block_attr, None)
        mamba_decoder = getattr(module, "mamba_decoder", None)
        if block is None or mamba_decoder is None:
            continue
        uses.append((block.self_attn, offset + int(mamba_decoder.layer_idx)))
    seen: dict[int, int] = {}
    for attn, kv_id in uses:
        if id(attn) in seen:
            raise NotImplementedError(
                f"{type(model).__name__}: one attention module instance serves layers {seen[id(attn)]} and {kv_id}; "
                "hybrid_compile needs one instance per hybrid layer to give each use its own KV cache"
            )
        seen[id(attn)] = kv_id
    return uses


def assign_kv_ids(uses: list[tuple[nn.Module, int]], handle: PatchHandle) -> None:
    """Write each use's KV pool id to its attention instance's ``layer_idx`` (what the registered
    attention function reads); ``handle.undo()`` puts HF's value back."""
    for attn, kv_id in uses:
        old = attn.layer_idx
        attn.layer_idx = kv_id
        handle.restores.append(lambda a=attn, v=old: setattr(a, "layer_idx", v))


def attention_uses(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """``(Zamba2Attention, KV pool id)`` of every hybrid layer: ``num_layers + layer index``."""
    return shared_attention_uses(model, "shared_transformer")


def layout(model: nn.Module, *, kv_dtype: torch.dtype, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> ModelLayout:
    return mamba2_family_layout(
        model, mamba_layers(model), attention_uses(model), kv_dtype=kv_dtype, conv_dtype=conv_dtype, ssm_dtype=ssm_dtype
    )


def patch(model: nn.Module, handle: PatchHandle) -> None:
    mixers = mamba_layers(model)
    uses = attention_uses(model)
    install_attention(model, handle)
    assign_kv_ids(uses, handle)
    patch_mixers(mixers, handle)
