"""Gated DeltaNet families: Qwen3-Next (``qwen3_next``), Qwen3.5 (``qwen3_5_text`` /
``qwen3_5_moe_text`` causal LMs, and the text path of the ``qwen3_5`` / ``qwen3_5_moe``
image-text models: token prompts only, the vision tower is not run) and OLMo-Hybrid
(``olmo_hybrid``).

Each ``*GatedDeltaNet`` mixer keeps HF's projections and output projection; its conv + delta-rule
core runs through the ``gdn_layer`` op and its gated RMSNorm through the ``gated_rms_norm`` op
(``_gated_norm``). The two generations differ
only in how the projections are laid out (Qwen3-Next: fused ``in_proj_qkvz``/``in_proj_ba``
with per-key-head interleaving, undone as HF's ``fix_query_key_value_ordering`` does;
Qwen3.5: separate ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``). OLMo-Hybrid
has separate ``q/k/v/a/b_proj``, a ``g_proj`` output gate, ``o_norm``/``o_proj`` and, with
``linear_allow_neg_eigval``, ``beta = 2 * sigmoid(b)`` (the op's ``beta_scale``). MoE blocks
and full-attention layers stay HF's modules (attention through the registered function).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..layers import gdn as _gdn_layer  # noqa: F401  (registers gdn_layer)
from ..layers.context import get_forward_context
from ..ops.fp8_cache import GDN_STATE_SCALE_DIM
from ..ops.gdn import GDN_CHUNK_SIZE
from ..memory import AttentionLayerSpec, MambaLayerSpec
from .base import (
    ModelLayout,
    PatchHandle,
    install_attention,
    patch_forward,
)

MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe", "olmo_hybrid")


def _is_gdn_mixer(module: nn.Module) -> bool:
    if not all(hasattr(module, a) for a in ("A_log", "dt_bias", "conv1d")):
        return False
    if hasattr(module, "norm") and hasattr(module, "out_proj"):  # Qwen3-Next / Qwen3.5
        return hasattr(module, "in_proj_qkvz") or hasattr(module, "in_proj_qkv")
    return all(hasattr(module, a) for a in ("q_proj", "k_proj", "v_proj", "g_proj", "o_norm", "o_proj"))  # OLMo


def _split_interleaved(mixer: nn.Module, qkvz: torch.Tensor, ba: torch.Tensor):
    """Qwen3-Next's per-key-head interleaved ``in_proj_qkvz`` / ``in_proj_ba`` outputs ``[N, ...]`` ->
    (mixed_qkv, z ``[N, Hv, V]``, b, a ``[N, Hv]``): the values of HF's
    ``fix_query_key_value_ordering``, by views that keep the token dimension apart. (HF's own, in
    transformers 5.17, reshapes ``value`` across batch and tokens; under compile Inductor then
    indexed the copy with a 64-bit modulo by the token count: ~0.6 ms per layer at a 4k prefill
    on an H100, at ~0.35 TB/s.)"""
    n, hk, kd, vd = qkvz.shape[0], mixer.num_k_heads, mixer.head_k_dim, mixer.head_v_dim
    per_key = mixer.num_v_heads // hk
    q, k, v, z = qkvz.view(n, hk, -1).split([kd, kd, per_key * vd, per_key * vd], dim=-1)
    b, a = ba.view(n, hk, 2 * per_key).split([per_key, per_key], dim=-1)
    mixed_qkv = torch.cat((q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)), dim=-1)
    return mixed_qkv, z.reshape(n, -1, vd), b.reshape(n, -1), a.reshape(n, -1)


def _project(mixer: nn.Module, hidden: torch.Tensor):
    """hidden ``[N, hidden]`` -> (mixed_qkv ``[N, conv_dim]``, z ``[N, Hv, V]``, b, a ``[N, Hv]``)."""
    n = hidden.shape[0]
    if hasattr(mixer, "in_proj_qkvz"):  # Qwen3-Next
        return _split_interleaved(mixer, mixer.in_proj_qkvz(hidden), mixer.in_proj_ba(hidden))
    if hasattr(mixer, "in_proj_qkv"):  # Qwen3.5
        mixed_qkv = mixer.in_proj_qkv(hidden)
        z = mixer.in_proj_z(hidden).reshape(n, -1, mixer.head_v_dim)
        return mixed_qkv, z, mixer.in_proj_b(hidden), mixer.in_proj_a(hidden)
    mixed_qkv = torch.cat((mixer.q_proj(hidden), mixer.k_proj(hidden), mixer.v_proj(hidden)), dim=-1)  # OLMo
    return mixed_qkv, mixer.g_proj(hidden).reshape(n, -1, mixer.head_v_dim), mixer.b_proj(hidden), mixer.a_proj(hidden)


def _one_buffer(mixed_qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor):
    """The four layer-op inputs as views of one ``[N, conv_dim + Hv*V + 2*Hv]`` buffer.

    Under compile they leave a piece (the layer op splits the graph there), so each is written to
    memory: as slices of a fused projection and HF's reordering, Inductor writes them with four
    copy kernels per layer; as one concatenation, with one (the ops take strided views)."""
    n, conv_dim, hv = mixed_qkv.shape[0], mixed_qkv.shape[1], b.shape[1]
    z_dim = z.shape[1] * z.shape[2]
    flat = torch.cat((mixed_qkv, z.reshape(n, z_dim), b, a), dim=-1)
    # slices, not torch.split: Inductor hands split outputs to the layer op with other strides than traced
    return (flat[:, :conv_dim], flat[:, conv_dim:conv_dim + z_dim].view(n, z.shape[1], z.shape[2]),
            flat[:, conv_dim + z_dim:conv_dim + z_dim + hv], flat[:, conv_dim + z_dim + hv:])


# transformers' gated norms (norm, then the silu gate) that the ``gated_rms_norm`` op reproduces exactly
_GATED_NORMS = frozenset({"Qwen3NextRMSNormGated", "Qwen3_5RMSNormGated", "Qwen3_5MoeRMSNormGated",
                          "OlmoHybridRMSNormGated"})


def _gated_norm(norm: nn.Module, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor | None:
    """``norm`` on ``[N * Hv, V]`` rows, as the ``gated_rms_norm`` op on ``core`` and ``z`` ``[N, Hv * V]``
    (groups of ``V``, one ``[V]`` weight); None for another norm class (the module is run).

    Under compile Inductor fuses the module into one kernel that the next projection waits for;
    the op's Triton kernel launches as a programmatic dependent, so the projection streams its
    weights meanwhile (H100, a 2048x4096 projection at one row: norm + projection 8.1 us, the
    projection alone 6.8 us). Reference Qwen3-Next at batch 1 on an H100: 1.90 ms/token with it
    and the new skinny_mm tiles, 1.97 before both (not measured apart). For the Mamba2 families'
    norm the op was slower (NemotronH 1.84 vs about 1.70 ms/token), so they keep the module."""
    if type(norm).__name__ not in _GATED_NORMS or getattr(norm, "activation", "silu") != "silu":
        return None
    return torch.ops.hybrid_compile.gated_rms_norm(core, norm.weight, z, float(norm.variance_epsilon),
                                                   norm.weight.numel(), True)


def gdn_mixer_forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """Patched ``*GatedDeltaNet.forward``: HF's code outside an engine step, the layer op inside."""
    if get_forward_context() is None:
        return type(self).forward(self, hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
    hidden = hidden_states[0]
    mixed_qkv, z, b, a = _one_buffer(*_project(self, hidden))
    core = torch.ops.hybrid_compile.gdn_layer(
        mixed_qkv, a, b, self.conv1d.weight.squeeze(1), self.conv1d.bias, self.A_log, self.dt_bias,
        int(self.layer_idx), self.num_k_heads, self.head_k_dim, self.num_v_heads, self.head_v_dim,
        self.activation, 2.0 if getattr(self, "allow_neg_eigval", False) else 1.0,
    )
    norm, out_proj = (self.norm, self.out_proj) if hasattr(self, "out_proj") else (self.o_norm, self.o_proj)
    n = hidden.shape[0]
    normed = _gated_norm(norm, core.reshape(n, -1), z.reshape(n, -1))
    if normed is None:
        normed = norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return out_proj(normed.reshape(1, n, -1))


def layout(model: nn.Module, *, kv_dtype: torch.dtype, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> ModelLayout:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    k_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    conv_dim = 2 * k_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    state_shape = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    return delta_rule_layout(
        cfg, AttentionLayerSpec(0, cfg.num_key_value_heads, head_dim, kv_dtype),
        MambaLayerSpec(0, cfg.linear_conv_kernel_dim, conv_dim, state_shape, conv_dtype, ssm_dtype,
                       ssm_scale_dim=GDN_STATE_SCALE_DIM),
    )


def delta_rule_layout(cfg, attention_spec: AttentionLayerSpec, linear_spec: MambaLayerSpec) -> ModelLayout:
    """The layout of a model whose ``cfg.layer_types`` are ``full_attention`` / ``linear_attention``
    (delta-rule layers): one copy of ``attention_spec`` / ``linear_spec`` per layer of that type."""
    attention, mamba = [], []
    for i, kind in enumerate(cfg.layer_types[: cfg.num_hidden_layers]):
        if kind == "full_attention":
            attention.append(replace(attention_spec, layer_ids=(i,)))
        elif kind == "linear_attention":
            mamba.append(replace(linear_spec, layer_ids=(i,)))
        else:
            raise ValueError(f"{cfg.model_type}: unknown layer type {kind!r} at layer {i}")
    return ModelLayout(attention, mamba, cfg.vocab_size, cfg.max_position_embeddings, GDN_CHUNK_SIZE)


def patch(model: nn.Module, handle: PatchHandle) -> None:
    install_attention(model, handle)
    mixers = [m for m in model.modules() if _is_gdn_mixer(m)]
    if not mixers:
        raise ValueError(f"{type(model).__name__}: found no Gated DeltaNet mixer to patch")
    for mixer in mixers:
        patch_forward(mixer, gdn_mixer_forward, handle)
