"""LFM families with short convolutions: LFM2 (``lfm2``), LFM2-MoE (``lfm2_moe``) and LFM3
(``lfm3``), whose conv mixers are the same.

Layers are either attention (``layer_types[i] == "full_attention"``, or LFM3's
``"sliding_attention"``: HF's attention module through the registered attention function, which
hands the module's ``sliding_window`` to the attention op; LFM3's per-head sigmoid output gate,
q/k norms and per-type RoPE stay HF's code) or a gated short conv (``"conv"``, ``*ShortConv``):
``B, C, x = in_proj(h).chunk(3)``, a depthwise causal conv of width ``conv_L_cache`` (no
activation) over ``B * x``, then ``out_proj(C * conv)``. Only the conv runs in the
``short_conv_layer`` op; the projections and both products stay HF's code in the compiled
pieces. The conv window is the layer's whole recurrent state, so its Mamba-pool spec is
conv-only (``state_shape == ()``, no SSM tensor). Dense and MoE feed-forward blocks stay HF's.

Prefix-cache checkpoints: a conv window can be checkpointed after any token (there is no chunk
kernel whose boundaries would constrain it), so the alignment ``ModelLayout.ssm_chunk_size`` (the
prefix cache's ``mamba_align``: checkpoint grid, prefill-chunk ends, branch points) is a free
choice. :data:`SHORT_CONV_CHECKPOINT_ALIGN` is 16 tokens: finer prefix reuse than the 64 of the
GDN chunk kernel, for a checkpoint that is cheap (one conv window per conv layer, ``(W-1) * hidden``
values: a few tokens' worth of KV), and it keeps chunked prefill of any size >= 16 on the grid.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers import short_conv as _short_conv_layer  # noqa: F401  (registers short_conv_layer)
from ..layers.context import get_forward_context
from ..memory import AttentionLayerSpec, MambaLayerSpec
from .base import ModelLayout, PatchHandle, install_attention, patch_forward

MODEL_TYPES = ("lfm2", "lfm2_moe", "lfm3")
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
SHORT_CONV_CHECKPOINT_ALIGN = 16


def _is_short_conv(module: nn.Module) -> bool:
    return type(module).__name__.endswith("ShortConv") and all(
        hasattr(module, a) for a in ("conv", "in_proj", "out_proj", "layer_idx")
    )


def short_conv_forward(self, hidden_states, *args, **kwargs):
    """Patched ``*ShortConv.forward``: HF's code outside an engine step, the layer op inside.

    HF's cache and mask arguments pass through untouched (their names differ across transformers
    versions: ``past_key_values`` / ``cache``); inside a step the pools replace them."""
    if get_forward_context() is None:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    b, c, x = self.in_proj(hidden_states[0]).chunk(3, dim=-1)
    conv = torch.ops.hybrid_compile.short_conv_layer(
        b * x, self.conv.weight.squeeze(1), self.conv.bias, int(self.layer_idx)
    )
    return self.out_proj((c * conv)[None])


def layout(model: nn.Module, *, kv_dtype: torch.dtype, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> ModelLayout:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    # the conv width of each mixer as built (hidden_size; a tensor-parallel rank's share of it)
    channels = {int(m.layer_idx): int(m.conv.weight.shape[0]) for m in model.modules() if _is_short_conv(m)}
    attention, mamba = [], []
    for i, kind in enumerate(cfg.layer_types[: cfg.num_hidden_layers]):
        if kind in ATTENTION_LAYER_TYPES:
            attention.append(AttentionLayerSpec(i, cfg.num_key_value_heads, head_dim, kv_dtype))
        elif kind == "conv":
            mamba.append(MambaLayerSpec(i, cfg.conv_L_cache, channels[i], (), conv_dtype, ssm_dtype))
        else:
            raise ValueError(f"{cfg.model_type}: unknown layer type {kind!r} at layer {i}")
    return ModelLayout(attention, mamba, cfg.vocab_size, cfg.max_position_embeddings, SHORT_CONV_CHECKPOINT_ALIGN)


def patch(model: nn.Module, handle: PatchHandle) -> None:
    install_attention(model, handle)
    mixers = [m for m in model.modules() if _is_short_conv(m)]
    if len(mixers) != model.config.layer_types[: model.config.num_hidden_layers].count("conv"):
        raise ValueError(f"{type(model).__name__}: found {len(mixers)} short-conv mixers, expected one per conv layer")
    for mixer in mixers:
        patch_forward(mixer, short_conv_forward, handle)
