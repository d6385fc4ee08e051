"""Zamba (v1, ``zamba``): every layer is a multi-head Mamba1 mixer; "hybrid" layers also run a
*shared* transformer block first (attention over ``concat(hidden, embeddings)`` + MLP, one set of
weights tied across every use), whose output is added through a per-layer linear.

``ZambaMambaMixer`` is Mamba1 split into ``n_mamba_heads`` heads, each with its own ``x_proj`` /
``dt_proj`` (``x_proj_weight [H, rank + 2N, head_dim]``, ``dt_proj_weight [H, head_dim, rank]``) and
so its own B / C: the scan runs once over all ``D_inner`` channels with the heads as B/C groups
(``mamba1_ssm_layer``, B/C ``[tokens, H, N]``); its ``in_proj`` rows interleave ``x`` and the gate per
channel. The conv runs in ``short_conv_layer`` (silu), the projections between the two ops in the
compiled pieces. State pool ``[S, D_inner, N]`` (the heads' ``[head_dim, N]`` states side by side).

The shared attention blocks: as Zamba2's (:mod:`.zamba2`), HF builds one attention instance per hybrid
layer with ``layer_idx = None``; hybrid layer ``i``'s gets KV pool id ``num_layers + i``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers.context import get_forward_context
from .base import ModelLayout, PatchHandle, install_attention, patch_forward
from .mamba1 import MAMBA1_CHECKPOINT_ALIGN, mamba1_spec
from .mamba2_common import attention_spec, check_activation, max_positions, text_config
from .zamba2 import assign_kv_ids, shared_attention_uses

MODEL_TYPES = ("zamba",)

_MIXER_ATTRS = ("in_proj", "conv1d", "x_proj_weight", "dt_proj_weight", "dt_proj_bias", "A_log", "D", "out_proj",
                "n_mamba_heads", "mamba_head_dim", "time_step_rank", "ssm_state_size", "layer_idx")


def mamba_layers(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """``(mixer, pool layer id)``: HF's layer index."""
    mixers = [(m, int(m.layer_idx)) for m in model.modules() if all(hasattr(m, a) for a in _MIXER_ATTRS)]
    if not mixers:
        raise ValueError(f"{type(model).__name__}: found no Zamba Mamba mixer")
    return mixers


def attention_uses(model: nn.Module) -> list[tuple[nn.Module, int]]:
    return shared_attention_uses(model, "shared_transf")


def zamba_mixer_forward(self, hidden_states, *args, **kwargs):
    """Patched ``ZambaMambaMixer.forward``: HF's own outside an engine step, the layer ops inside."""
    if get_forward_context() is None:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    layer_id = int(self.layer_idx)
    dtype = hidden_states.dtype
    n = hidden_states.shape[1]
    heads, head_dim, rank, state = (int(v) for v in (self.n_mamba_heads, self.mamba_head_dim, self.time_step_rank,
                                                    self.ssm_state_size))
    d_inner = heads * head_dim
    xz = self.in_proj(hidden_states[0]).view(n, d_inner, 2)  # rows interleave x and the gate per channel
    x = torch.ops.hybrid_compile.short_conv_layer(
        xz[..., 0].contiguous(), self.conv1d.weight.squeeze(1), self.conv1d.bias, layer_id, self.activation
    )
    params = torch.einsum("nhd,hrd->nhr", x.view(n, heads, head_dim), self.x_proj_weight)
    dt, B, C = params.split([rank, state, state], dim=-1)
    dt = torch.einsum("nhr,hdr->nhd", dt, self.dt_proj_weight).reshape(n, d_inner)
    y = torch.ops.hybrid_compile.mamba1_ssm_layer(
        x, dt, B, C, xz[..., 1], self.A_log.reshape(d_inner, state), self.D.reshape(d_inner),
        self.dt_proj_bias.reshape(d_inner), layer_id, MAMBA1_CHECKPOINT_ALIGN,
    )
    return self.out_proj(y[None].to(dtype))


def layout(model: nn.Module, *, kv_dtype: torch.dtype, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> ModelLayout:
    cfg = text_config(model)
    mamba = [mamba1_spec(m, lid, conv_dtype, ssm_dtype) for m, lid in mamba_layers(model)]
    attention = [attention_spec(a, kv_id, kv_dtype) for a, kv_id in attention_uses(model)]
    return ModelLayout(attention, mamba, int(cfg.vocab_size), max_positions(cfg), MAMBA1_CHECKPOINT_ALIGN)


def patch(model: nn.Module, handle: PatchHandle) -> None:
    mixers = mamba_layers(model)
    uses = attention_uses(model)
    install_attention(model, handle)
    assign_kv_ids(uses, handle)
    for mixer, _ in mixers:
        check_activation(mixer)
        patch_forward(mixer, zamba_mixer_forward, handle)


__all__ = ["MODEL_TYPES", "attention_uses", "layout", "mamba_layers", "patch"]
