"""Shared patching of transformers' Mamba2-style mixers (Mamba2, NemotronH, Falcon-H1, Bamba,
GraniteMoeHybrid, Zamba2) and the layout helpers their family modules use.

Every one of these mixers has the same structure (transformers' ``Mamba2Mixer``): ``in_proj``
-> split into ``gate | xBC | dt`` -> causal conv over ``xBC`` -> split ``x | B | C`` -> SSD with
``A = -exp(A_log)``, ``D``, ``dt_bias``, softplus -> gated RMSNorm(y, gate) -> ``out_proj``.
The patched forward keeps HF's projections, norm and output projection and routes the conv +
scan through the ``mamba2_layer`` op. Falcon-H1's extras (``ssm_in_multiplier`` before
``in_proj``, the µP ``mup_vector`` after it, an optional norm replaced by ``y * silu(gate)``)
are read from the mixer when present.

Outside an engine step (no forward context) the patched forward is HF's own ``forward``.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
from torch import nn

from ..layers import mamba2 as _mamba2_layer  # noqa: F401  (registers mamba2_layer)
from ..layers.context import get_forward_context
from ..memory import AttentionLayerSpec, MambaLayerSpec
from .base import ModelLayout, PatchHandle, install_attention, patch_forward

# Context length used when the model has no position limit (pure SSMs such as Mamba2); raise it
# with EngineConfig.max_context_len.
DEFAULT_MAX_CONTEXT_NO_POSITIONS = 32768

_MIXER_ATTRS = (
    "in_proj", "conv1d", "A_log", "dt_bias", "D", "norm", "out_proj", "num_heads", "head_dim", "n_groups",
    "ssm_state_size", "intermediate_size", "conv_dim", "chunk_size", "time_step_limit", "layer_idx",
)


def is_mamba2_mixer(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in _MIXER_ATTRS)


def find_mamba2_mixers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if is_mamba2_mixer(m)]


def is_attention(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "layer_idx"))


def find_attention_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if is_attention(m)]


def text_config(model: nn.Module):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def max_positions(cfg) -> int:
    return int(getattr(cfg, "max_position_embeddings", None) or DEFAULT_MAX_CONTEXT_NO_POSITIONS)


def dt_limits(mixer: nn.Module) -> tuple[float, float]:
    lo, hi = mixer.time_step_limit if mixer.time_step_limit is not None else (0.0, math.inf)
    return float(lo), float(hi)


def mamba_spec(mixer: nn.Module, layer_id: int, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> MambaLayerSpec:
    width = mixer.conv1d.weight.shape[-1]
    state = (int(mixer.num_heads), int(mixer.head_dim), int(mixer.ssm_state_size))
    return MambaLayerSpec(layer_id, int(width), int(mixer.conv_dim), state, conv_dtype, ssm_dtype)


def attention_spec(attn: nn.Module, layer_id: int, kv_dtype: torch.dtype) -> AttentionLayerSpec:
    head_dim = int(attn.head_dim)
    kv_heads, rem = divmod(attn.k_proj.out_features, head_dim)
    v_heads, v_rem = divmod(attn.v_proj.out_features, kv_heads) if kv_heads else (0, 1)
    if rem or v_rem or kv_heads <= 0:
        raise ValueError(f"{type(attn).__name__}: cannot derive the KV head layout from k_proj/v_proj")
    return AttentionLayerSpec(layer_id, kv_heads, head_dim, kv_dtype, v_heads)


def chunk_size_of(mixers: Iterable[nn.Module]) -> int:
    sizes = {int(m.chunk_size) for m in mixers}
    if len(sizes) != 1:
        raise ValueError(f"Mamba2 mixers disagree on chunk_size: {sorted(sizes)}")
    return sizes.pop()


def check_activation(mixer: nn.Module) -> None:
    act = mixer.activation if isinstance(getattr(mixer, "activation", None), str) else None
    if act is None or act.lower() not in ("silu", "swish"):
        raise ValueError(
            f"{type(mixer).__name__} (layer {mixer.layer_idx}): conv activation {act!r} is not supported "
            "(the conv ops implement silu)"
        )


def make_mixer_forward(layer_id: int) -> Callable:
    """The patched ``forward`` of one Mamba2-style mixer whose pools are ``mamba_caches[layer_id]``."""

    def mamba2_mixer_forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        if get_forward_context() is None:
            return type(self).forward(
                self, hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs
            )
        dtype = hidden_states.dtype
        hidden = hidden_states[0]  # [N, hidden]: the packed step is a batch of one row
        n = hidden.shape[0]
        multiplier = getattr(self, "ssm_in_multiplier", None)  # Falcon-H1
        if multiplier is not None:
            hidden = hidden * multiplier
        projected = self.in_proj(hidden)
        mup = getattr(self, "mup_vector", None)  # Falcon-H1
        if mup is not None:
            projected = projected * mup.reshape(-1)
        gate, xBC, dt = projected.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        lo, hi = dt_limits(self)
        y = torch.ops.hybrid_compile.mamba2_layer(
            xBC, dt, self.conv1d.weight.squeeze(1), self.conv1d.bias, self.A_log, self.D, self.dt_bias,
            layer_id, int(self.num_heads), int(self.head_dim), int(self.n_groups), int(self.ssm_state_size),
            self.activation, int(self.chunk_size), lo, hi, False,
        )
        y = y.reshape(1, n, -1)
        if isinstance(self.norm, nn.Identity) or getattr(self, "mamba_rms_norm", True) is False:
            y = y * nn.functional.silu(gate[None])  # Falcon-H1 without the gated norm
        else:
            y = self.norm(y, gate[None])
        return self.out_proj(y.to(dtype))

    return mamba2_mixer_forward


def patch_mixers(mixers: Iterable[tuple[nn.Module, int]], handle: PatchHandle) -> None:
    """Patch each ``(mixer, layer_id)``; ``layer_id`` names its pools in the forward context."""
    for mixer, layer_id in mixers:
        check_activation(mixer)
        patch_forward(mixer, make_mixer_forward(layer_id), handle)


# ---------------------------------------------------------------------------------------------
# families whose every layer is either attention or a Mamba2 mixer (HF layer index = pool id)
# ---------------------------------------------------------------------------------------------


def per_layer_mamba_layers(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """``(mixer, pool layer id)`` of every Mamba2 mixer: the id is HF's layer index."""
    mixers = find_mamba2_mixers(model)
    if not mixers:
        raise ValueError(f"{type(model).__name__}: found no Mamba2 mixer")
    return [(m, int(m.layer_idx)) for m in mixers]


def mamba2_family_layout(
    model: nn.Module,
    mixers: Iterable[tuple[nn.Module, int]],
    attention_uses: Iterable[tuple[nn.Module, int]],
    *,
    kv_dtype: torch.dtype,
    conv_dtype: torch.dtype,
    ssm_dtype: torch.dtype,
) -> ModelLayout:
    """Layout from ``(mixer, Mamba pool id)`` and ``(attention module, KV pool id)`` pairs."""
    cfg = text_config(model)
    mixers = list(mixers)
    attention = [attention_spec(a, kv_id, kv_dtype) for a, kv_id in attention_uses]
    mamba = [mamba_spec(m, lid, conv_dtype, ssm_dtype) for m, lid in mixers]
    return ModelLayout(attention, mamba, int(cfg.vocab_size), max_positions(cfg), chunk_size_of(m for m, _ in mixers))


def per_layer_layout(
    model: nn.Module, *, kv_dtype: torch.dtype, conv_dtype: torch.dtype, ssm_dtype: torch.dtype
) -> ModelLayout:
    """Layout of a model whose attention modules and Mamba2 mixers each own one HF layer index."""
    return mamba2_family_layout(
        model, per_layer_mamba_layers(model), [(a, int(a.layer_idx)) for a in find_attention_modules(model)],
        kv_dtype=kv_dtype, conv_dtype=conv_dtype, ssm_dtype=ssm_dtype,
    )


def per_layer_patch(model: nn.Module, handle: PatchHandle) -> None:
    """Attention through the registered function (when the model has any), mixers through the op."""
    mixers = per_layer_mamba_layers(model)
    if find_attention_modules(model):
        install_attention(model, handle)
    patch_mixers(mixers, handle)
