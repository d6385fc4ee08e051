"""MiniMax (``minimax``: MiniMax-Text-01, MiniMax-M1): lightning attention layers + softmax attention
layers every few layers + MoE.

- ``MiniMaxLightningAttention``: HF's ``qkv_proj`` + activation, RMSNorm, sigmoid ``output_gate``
  and ``out_proj`` stay HF's modules; the recurrent core (linear attention with a fixed per-head
  decay ``exp(-slope_rate)``) runs through the ``lightning_layer`` op, with HF's ``slope_rate``
  buffer as the decay. Its per-request state ``[H, D, D]`` lives in the Mamba pool (a 1-wide conv
  spec: the layer has no conv window); with ``ssm_state_dtype="fp8"`` in e4m3 with one scale per
  value column over the key axis.
- ``MiniMaxAttention``: HF's code with our attention function (KV pool).

MoE blocks, norms, the decoder layers' alpha/beta residual factors and the LM head stay HF's modules.
Transformers 5.17 (``past_key_values``) and 5.24 (``cache``) keyword names both pass through to HF's
forward outside an engine step.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import lightning as _lightning_layer  # noqa: F401  (registers lightning_layer)
from ..layers.context import get_forward_context
from ..memory import AttentionLayerSpec, MambaLayerSpec
from ..ops.lightning import LIGHTNING_CHUNK_SIZE, LIGHTNING_STATE_SCALE_DIM
from .base import ModelLayout, PatchHandle, install_attention, patch_forward, require_hf_modules
from .gated_deltanet import delta_rule_layout

MODEL_TYPES = ("minimax",)


def lightning_forward(self, hidden_states, *args, **kwargs):
    """Patched ``MiniMaxLightningAttention.forward``: HF's code outside an engine step, the layer op inside."""
    if get_forward_context() is None:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    hidden = hidden_states[0]
    n, h, d = hidden.shape[0], self.num_attention_heads, self.head_dim
    qkv = self.act_fn(self.qkv_proj(hidden))
    core = torch.ops.hybrid_compile.lightning_layer(qkv, self.slope_rate.reshape(h).float(), int(self.layer_idx),
                                                    h, d)
    out = self.norm(core.reshape(n, h * d))
    out = F.sigmoid(self.output_gate(hidden)) * out
    return self.out_proj(out)[None], None


def _lightning_layers(model: nn.Module) -> list[nn.Module]:
    return require_hf_modules(model, "MiniMaxLightningAttention", "minimax")


def layout(model: nn.Module, *, kv_dtype: torch.dtype, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> ModelLayout:
    _lightning_layers(model)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    h = cfg.num_attention_heads
    base = delta_rule_layout(
        cfg, AttentionLayerSpec(0, cfg.num_key_value_heads, head_dim, kv_dtype),
        # no conv: a 1-wide conv keeps an empty window; the state is [H, D, D]
        MambaLayerSpec(0, 1, 1, (h, head_dim, head_dim), conv_dtype, ssm_dtype,
                       ssm_scale_dim=LIGHTNING_STATE_SCALE_DIM),
    )
    return replace(base, ssm_chunk_size=LIGHTNING_CHUNK_SIZE)


def patch(model: nn.Module, handle: PatchHandle) -> None:
    install_attention(model, handle)
    for module in _lightning_layers(model):
        patch_forward(module, lightning_forward, handle)
