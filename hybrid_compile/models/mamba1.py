"""Mamba1-family models: every cache-carrying layer is a Mamba1 mixer or an attention layer owning
one HF layer index (the index names its pool).

- Mamba (``mamba``, ``MambaForCausalLM``) and FalconMamba (``falcon_mamba``): pure SSMs, every
  layer a Mamba1 mixer; no attention layer (the KV pool holds token slots for bookkeeping only)
  and no position limit (context length ``DEFAULT_MAX_CONTEXT_NO_POSITIONS`` unless
  ``max_context_len`` says otherwise). FalconMamba adds weightless RMS norms on dt, B and C
  after ``x_proj``.
- Jamba (``jamba``): Mamba1 mixers (with weighted RMS norms on dt, B, C) and attention layers (no
  RoPE) at ``attn_layer_offset + k * attn_layer_period``, dense MLP or MoE blocks (HF's modules).

The patched mixer forward keeps HF's ``in_proj``, ``x_proj``, the dt/B/C norms (when the mixer has
them), ``dt_proj``'s weight and ``out_proj``; the causal conv + silu runs in the ``short_conv_layer``
op (conv-window pool ``[S, K-1, D_inner]``), the selective scan in ``mamba1_ssm_layer`` (SSM pool
``[S, D_inner, N]``; ``dt_proj.bias``, softplus, ``D`` and the ``silu(z)`` gate inside the kernel).

Prefix-cache checkpoints: the Mamba1 scan is sequential, so a state exists after every token and
the alignment ``ModelLayout.ssm_chunk_size`` is a free choice: :data:`MAMBA1_CHECKPOINT_ALIGN`
(64, the GDN chunk) — a checkpoint is ``D_inner * N`` fp32 per layer, prefill chunks of any
multiple of 64 stay on the grid. An FP8 SSM state keeps one scale per channel over N.
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from ..layers import mamba1 as _mamba1_layer  # noqa: F401  (registers mamba1_ssm_layer)
from ..layers import short_conv as _short_conv_layer  # noqa: F401  (registers short_conv_layer)
from ..layers.context import get_forward_context
from ..memory import MambaLayerSpec
from ..ops.fp8_cache import MAMBA1_STATE_SCALE_DIM
from .base import ModelLayout, PatchHandle, install_attention, patch_forward
from .mamba2_common import attention_spec, check_activation, find_attention_modules, max_positions, text_config

MODEL_TYPES = ("mamba", "falcon_mamba", "jamba")
MAMBA1_CHECKPOINT_ALIGN = 64

_MIXER_ATTRS = (
    "in_proj", "conv1d", "x_proj", "dt_proj", "A_log", "D", "out_proj", "time_step_rank", "ssm_state_size",
    "intermediate_size", "layer_idx",
)
_NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")


def is_mamba1_mixer(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in _MIXER_ATTRS) and module.A_log.dim() == 2


def mamba_layers(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """``(mixer, pool layer id)`` of every Mamba1 mixer: the id is HF's layer index."""
    mixers = [(m, int(m.layer_idx)) for m in model.modules() if is_mamba1_mixer(m)]
    if not mixers:
        raise ValueError(f"{type(model).__name__}: found no Mamba1 mixer")
    return mixers


def mamba1_mixer_forward(self, hidden_states, *args, **kwargs):
    """Patched Mamba1 mixer ``forward``: HF's own outside an engine step, the layer ops inside."""
    if get_forward_context() is None:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    layer_id = int(self.layer_idx)
    dtype = hidden_states.dtype
    x, z = self.in_proj(hidden_states[0]).chunk(2, dim=-1)  # the packed step is a batch of one row
    x = torch.ops.hybrid_compile.short_conv_layer(
        x, self.conv1d.weight.squeeze(1), self.conv1d.bias, layer_id, self.activation
    )
    rank, n = int(self.time_step_rank), int(self.ssm_state_size)
    dt, B, C = self.x_proj(x).split([rank, n, n], dim=-1)
    if all(hasattr(self, a) for a in _NORMS):  # FalconMamba (weightless), Jamba (weighted)
        dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
    dt = F.linear(dt, self.dt_proj.weight)  # the bias goes into the scan: softplus(dt + bias)
    y = torch.ops.hybrid_compile.mamba1_ssm_layer(
        x, dt, B[:, None], C[:, None], z, self.A_log, self.D, self.dt_proj.bias, layer_id, MAMBA1_CHECKPOINT_ALIGN
    )
    return self.out_proj(y[None].to(dtype))


def mamba1_spec(mixer: nn.Module, layer_id: int, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> MambaLayerSpec:
    """Pool spec of a Mamba1-style mixer: conv window ``[K-1, D_inner]``, state ``[D_inner, N]`` (an FP8
    state: one scale per channel over N, ``ssm_scale_dim`` -1)."""
    d_inner, width = (int(v) for v in (mixer.conv1d.weight.shape[0], mixer.conv1d.weight.shape[-1]))
    return MambaLayerSpec(layer_id, width, d_inner, (d_inner, int(mixer.ssm_state_size)), conv_dtype, ssm_dtype,
                          ssm_scale_dim=MAMBA1_STATE_SCALE_DIM)


def layout(model: nn.Module, *, kv_dtype: torch.dtype, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> ModelLayout:
    cfg = text_config(model)
    mamba = [mamba1_spec(m, lid, conv_dtype, ssm_dtype) for m, lid in mamba_layers(model)]
    attention = [attention_spec(a, int(a.layer_idx), kv_dtype) for a in find_attention_modules(model)]
    return ModelLayout(attention, mamba, int(cfg.vocab_size), max_positions(cfg), MAMBA1_CHECKPOINT_ALIGN)


def patch(model: nn.Module, handle: PatchHandle) -> None:
    """Attention through the registered function (Jamba), mixers through the layer ops."""
    mixers = mamba_layers(model)
    if find_attention_modules(model):
        install_attention(model, handle)
    for mixer, _ in mixers:
        check_activation(mixer)
        patch_forward(mixer, mamba1_mixer_forward, handle)


__all__ = ["MAMBA1_CHECKPOINT_ALIGN", "MODEL_TYPES", "layout", "mamba1_spec", "mamba_layers", "patch"]
