"""Kimi-Linear (``kimi_linear``, Kimi-Linear-48B-A3B): Kimi Delta Attention layers + multi-head
latent attention (MLA) layers + DeepSeek-V3-style MoE.

- ``KimiLinearDeltaAttention``: HF's q/k/v projections, forget gate (``g = -exp(A_log) *
  softplus(f_b(f_a(x)) + dt_bias)``, one log-decay per head and key channel), ``beta =
  sigmoid(b_proj)``, output gate and gated norm stay HF's modules; the short convs + delta rule
  run through the ``kda_layer`` op (the Gated DeltaNet kernel ops with ``g [N, H, K]``).
- ``KimiLinearAttention`` (MLA without RoPE: transformers applies no rotary embedding in this
  family; the ``qk_rope_head_dim`` part of the key is shared by all heads): the KV pool keeps the
  *compressed* cache, one vector per token ``[kv_a_layernorm(latent) (kv_lora_rank), k_rot
  (qk_rope_head_dim)]`` (an :class:`~..memory.AttentionLayerSpec` with one KV head and ``v_from_k``:
  V is the latent, a view of K's first channels); the ``mla_layer`` op attends over it. With
  ``kv_b_proj.weight = [W_uk; W_uv]`` per head it runs decode, verify and short extends in
  DeepSeek's **absorbed** form (``q_nope . (W_uk c) = (W_uk^T q_nope) . c``: each head attends over
  the latents with ``q' = [W_uk^T q_nope, q_rope]``, head dim ``kv_lora_rank + qk_rope_head_dim``,
  576 in the 48B checkpoint, and its output ``sum p c`` is projected by ``W_uv``) and long extends
  in the **expanded** form (keys and values rebuilt per head from the cached rows for the step,
  attention at head dims 192 / 128: ~3.4x fewer FLOPs a query and key at the 48B dims), whichever
  costs less for the step (``layers/attention.py::mla_expands``). Nothing per head is ever cached.

MoE blocks, MLPs, norms and the LM head stay HF's modules. Needs transformers' ``kimi_linear``
(transformers >= 5.17 has it); the module's 5.17 (``past_key_values`` / ``cache_params``) and
5.24 (``cache``) keyword names both pass through to HF's forward outside an engine step.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers import attention as _attention_layer  # noqa: F401  (registers mla_layer)
from ..layers import gdn as _gdn_layer  # noqa: F401  (registers kda_layer)
from ..layers.context import get_forward_context
from ..memory import AttentionLayerSpec, MambaLayerSpec
from ..ops.fp8_cache import GDN_STATE_SCALE_DIM
from .base import ModelLayout, PatchHandle, install_attention, patch_forward, require_hf_modules
from .gated_deltanet import delta_rule_layout

MODEL_TYPES = ("kimi_linear",)


def _is_mla(module: nn.Module) -> bool:
    return type(module).__name__ == "KimiLinearAttention"


def kda_forward(self, hidden_states, *args, **kwargs):
    """Patched ``KimiLinearDeltaAttention.forward``: HF's code outside an engine step, the layer op inside."""
    if get_forward_context() is None:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    hidden = hidden_states[0]
    n, h, d = hidden.shape[0], self.num_heads, self.head_dim
    mixed_qkv = torch.cat((self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)), dim=-1)
    g = self.forget_gate(hidden_states)[0]  # [N, H, K] fp32, HF's module
    beta = torch.sigmoid(self.b_proj(hidden))
    core = torch.ops.hybrid_compile.kda_layer(
        mixed_qkv, g, beta, self.conv1d.weight.squeeze(1), self.conv1d.bias, int(self.layer_idx), h, d,
        self.activation,
    )
    gate = self.g_b_proj(self.g_a_proj(hidden)).view(n, h, d)
    return self.o_proj(self.o_norm(core, gate).reshape(1, n, h * d))


def _absorbed_weights(self):
    """(W_uk ``[H, nope, R]``, W_uv ``[H, V, R]``): views of ``kv_b_proj.weight``."""
    if self.kv_b_proj.weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise NotImplementedError(
            f"kimi_linear layer {self.layer_idx}: the absorbed MLA multiplies by kv_b_proj's weight, which is "
            f"{self.kv_b_proj.weight.dtype}; only float32 / bfloat16 / float16 kv_b_proj weights are supported "
            "(keep kv_b_proj in high precision when quantizing)"
        )
    w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
    return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:]


def mla_forward(self, hidden_states, attention_mask=None, *args, **kwargs):
    """Patched ``KimiLinearAttention.forward``: HF's code outside an engine step; inside, the
    compressed latent + rope key go to the KV pool and the ``mla_layer`` op attends (absorbed or
    expanded form, per step)."""
    if get_forward_context() is None:
        return type(self).forward(self, hidden_states, attention_mask, *args, **kwargs)
    hidden = hidden_states[0]
    n, heads, rank = hidden.shape[0], self.num_heads, self.kv_lora_rank
    if self.q_lora_rank is None:
        q = self.q_proj(hidden)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
    q_nope, q_rope = q.view(n, heads, self.qk_head_dim).split([self.qk_nope_head_dim, self.qk_rope_head_dim], -1)
    latent, k_rot = self.kv_a_proj_with_mqa(hidden).split([rank, self.qk_rope_head_dim], -1)
    latent = self.kv_a_layernorm(latent)
    w_uk, w_uv = _absorbed_weights(self)
    o = torch.ops.hybrid_compile.mla_layer(q_nope, q_rope, latent, k_rot, w_uk, w_uv, int(self.layer_idx),
                                           float(self.scaling))  # [N, H, V]
    return self.o_proj(o.reshape(1, n, heads * self.v_head_dim)), None


def _require_transformers_classes(model: nn.Module) -> list[nn.Module]:
    """The model's ``KimiLinearDeltaAttention`` modules (transformers >= 5.17), or a clear error."""
    return require_hf_modules(model, "KimiLinearDeltaAttention", "kimi_linear")


def layout(model: nn.Module, *, kv_dtype: torch.dtype, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> ModelLayout:
    _require_transformers_classes(model)
    cfg = model.config
    h, d = cfg.linear_num_heads, cfg.linear_head_dim
    return delta_rule_layout(
        cfg, AttentionLayerSpec(0, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim, kv_dtype, v_head_dim=cfg.kv_lora_rank,
                                v_from_k=True),
        MambaLayerSpec(0, cfg.linear_conv_kernel_dim, 3 * h * d, (h, d, d), conv_dtype, ssm_dtype,
                       ssm_scale_dim=GDN_STATE_SCALE_DIM),
    )


def patch(model: nn.Module, handle: PatchHandle) -> None:
    install_attention(model, handle)
    kda = _require_transformers_classes(model)
    mla = [m for m in model.modules() if _is_mla(m)]
    for module in kda:
        patch_forward(module, kda_forward, handle)
    for module in mla:
        patch_forward(module, mla_forward, handle)
