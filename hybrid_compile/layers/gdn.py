"""Gated DeltaNet layer ops: the recurrent core of a Qwen3-Next-style linear-attention layer
(``gdn_layer``) and of a Kimi-Linear Kimi Delta Attention layer (``kda_layer``: the same rule with
a per-channel decay, gates computed outside the op).

``hybrid_compile::gdn_layer`` takes the mixer's projections (``mixed_qkv`` before the conv,
``a``/``b`` gating inputs) and returns the core attention output, reading the layer's conv
window and SSM state pools from the forward context. Projections, the gated RMSNorm and the
output projection stay outside (HF's modules, in the compiled, graph-captured pieces): the op
holds only what touches pools and per-step metadata.

By forward mode:
- DECODE: ``causal_conv1d_update`` + ``fused_sigmoid_gating_delta_rule_update`` in place.
- EXTEND (prefill, chunked prefill, mixed prefill + decode): ``causal_conv1d_fn`` +
  ``gdn_gating`` + ``chunk_gated_delta_rule`` with initial states where the request has them;
  prefix-cache checkpoints inside the extend when the step asks for them (``layers/tracking.py``).
- TARGET_VERIFY (speculative verify): every request runs
  ``draft_len`` tokens (its last accepted token + the drafts): ``causal_conv1d_update`` over them
  and ``fused_recurrent_gated_delta_rule_update`` (gating the raw ``a`` / ``b`` itself; ``gdn_gating``
  first where ``beta_scale != 1``), both with
  ``disable_state_update`` and writing the state after every step into the layer's intermediate
  buffers (``ForwardContext.intermediate_caches``, rows = batch rows); the engine commits the
  state of the last accepted step afterwards (``commit_speculative_state``). Trailing requests
  of another length (filler that pads a step to a token-count bucket) are left at zero.

``kda_layer`` runs the same modes with the given per-channel ``g [N, H, K]`` and ``beta``; its
decode step is ``fused_recurrent_gated_delta_rule_update`` over one token (no fused gating).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import ops as _ops  # noqa: F401  (registers the kernel ops)
from ..ops.fp8_cache import GDN_STATE_SCALE_DIM
from ..ops.gdn import GDN_CHUNK_SIZE
from .context import ForwardMode, by_mixed_parts, require_forward_context
from .tracking import track_conv_checkpoints, track_ssm_checkpoints, tracking
from ..ops.registration import kernel_op

_kernels = torch.ops.hybrid_compile


def _check(mixed_qkv, a, b, num_k_heads, head_k_dim, num_v_heads, head_v_dim):
    conv_dim = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
    if mixed_qkv.dim() != 2 or mixed_qkv.shape[1] != conv_dim:
        raise ValueError(
            f"gdn_layer: mixed_qkv must be [tokens, {conv_dim}] (q, k, v channels), got {tuple(mixed_qkv.shape)}"
        )
    for name, t in (("a", a), ("b", b)):
        if t.dim() != 2 or t.shape[0] != mixed_qkv.shape[0] or t.shape[1] != num_v_heads:
            raise ValueError(f"gdn_layer: {name} must be [tokens, {num_v_heads}], got {tuple(t.shape)}")


def _gating(A_log, a, b, dt_bias, beta_scale: float):
    """(g, beta) of the delta rule: HF's softplus decay and ``beta_scale * sigmoid(b)``."""
    g, beta = _kernels.gdn_gating(A_log, a, b, dt_bias, 1.0, 20.0)
    return g, (beta * beta_scale if beta_scale != 1.0 else beta)


@kernel_op("hybrid_compile::gdn_layer", mutates_args=())
def gdn_layer(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: Optional[torch.Tensor],
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    layer_id: int,
    num_k_heads: int,
    head_k_dim: int,
    num_v_heads: int,
    head_v_dim: int,
    activation: str,
    beta_scale: float = 1.0,
) -> torch.Tensor:
    """Conv + gated delta rule of one GDN layer for the step's packed tokens.

    Args:
        mixed_qkv: ``[N, 2*Hk*K + Hv*V]`` projected q, k, v channels before the causal conv.
        a, b: ``[N, Hv]`` gating projections (decay input and write-strength logits).
        conv_weight: ``[conv_dim, W]`` depthwise conv weight (HF's ``conv1d.weight.squeeze(1)``).
        conv_bias: ``[conv_dim]`` or None.
        A_log, dt_bias: ``[Hv]`` the layer's decay parameters.
        layer_id: HF layer index (key of ``ForwardContext.mamba_caches``); the conv window pool
            ``[S, W-1, conv_dim]`` and SSM pool ``[S, Hv, K, V]`` of that layer are updated.
        activation: the conv activation (HF's ``config.hidden_act``, "silu").
        beta_scale: write strength ``beta = beta_scale * sigmoid(b)``; 2.0 for OLMo-Hybrid's
            ``allow_neg_eigval`` (beta in [0, 2]: the state transition may get negative eigenvalues).

    Returns:
        ``[N, Hv, V]`` core attention output in mixed_qkv's dtype (zeros for padding rows).
    """
    _check(mixed_qkv, a, b, num_k_heads, head_k_dim, num_v_heads, head_v_dim)
    split = by_mixed_parts(
        lambda x, a, b: gdn_layer(x, a, b, conv_weight, conv_bias, A_log, dt_bias, layer_id, num_k_heads, head_k_dim,
                                  num_v_heads, head_v_dim, activation, beta_scale), mixed_qkv, a, b)
    if split is not None:  # a mixed step: its decode rows through the decode path (no chunked scan)
        return split

    def gates(n: int):
        return _gating(A_log, a[:n], b[:n], dt_bias, beta_scale)

    def fused_decode(q, k, v, ssm_states, ssm_scales, md):
        if beta_scale != 1.0:  # the fused kernel computes beta = sigmoid(b): gate outside it
            return None
        return _kernels.fused_sigmoid_gating_delta_rule_update(
            A_log, dt_bias, q, k, v, a, b, ssm_states, md.mamba_cache_indices, True, 0.0, 1.0, 20.0, ssm_scales,
        )

    # the verify op gates the raw projections itself (no gating kernel) where beta is sigmoid(b)
    raw_gates = (lambda n: (a[:n], b[:n], A_log, dt_bias)) if beta_scale == 1.0 else None
    return _delta_rule_core("gdn_layer", mixed_qkv, conv_weight, conv_bias, layer_id, num_k_heads, head_k_dim,
                            num_v_heads, head_v_dim, activation, gates, fused_decode, raw_gates)


def _delta_rule_core(op, mixed_qkv, conv_weight, conv_bias, layer_id, num_k_heads, head_k_dim, num_v_heads,
                     head_v_dim, activation, gates, fused_decode=None, raw_gates=None):
    """Conv + delta rule by forward mode, shared by ``gdn_layer`` and ``kda_layer``.

    ``gates(n)`` returns ``(g, beta)`` of the first ``n`` tokens: g ``[n, Hv]`` (per head) or
    ``[n, Hv, K]`` (per key channel); ``fused_decode(q, k, v, ssm_states, ssm_scales, md)`` is a decode
    step with the gating fused in, or returns None (then decode runs the verify op over one step);
    ``raw_gates(n)``: ``(a, b, A_log, dt_bias)`` of the first ``n`` tokens for the verify op to gate
    itself, or None (then ``gates``)."""
    ctx = require_forward_context(f"hybrid_compile::{op}")
    md = ctx.metadata
    conv_states, ssm_states, ssm_scales = ctx.mamba_cache(layer_id)
    key_dim = num_k_heads * head_k_dim
    n = mixed_qkv.shape[0]

    def step_gates(g, beta, rows, steps):
        return g.reshape(rows, steps, *g.shape[1:]), beta.reshape(rows, steps, num_v_heads)

    if md.mode is ForwardMode.DECODE:
        x = _kernels.causal_conv1d_update(
            mixed_qkv.unsqueeze(1), conv_states, conv_weight, conv_bias, activation,
            md.mamba_cache_indices, False, None,
        ).squeeze(1)
        q, k, v = torch.split(x, [key_dim, key_dim, num_v_heads * head_v_dim], dim=-1)
        q = q.reshape(n, num_k_heads, head_k_dim)
        k = k.reshape(n, num_k_heads, head_k_dim)
        v = v.reshape(n, num_v_heads, head_v_dim)
        out = None if fused_decode is None else fused_decode(q, k, v, ssm_states, ssm_scales, md)
        if out is not None:
            return out
        g, beta = step_gates(*gates(n), n, 1)
        return _kernels.fused_recurrent_gated_delta_rule_update(
            q[:, None], k[:, None], v[:, None], g, beta, ssm_states, md.mamba_cache_indices, True, 0.0, False, None,
            ssm_scales, None, parent_indices=None,
        ).reshape(n, num_v_heads, head_v_dim)
    if md.mode is ForwardMode.EXTEND:
        track = tracking(md)  # prefix-cache checkpoints inside the extend (layers/tracking.py)
        if track:
            track_conv_checkpoints(md, conv_states, mixed_qkv)
        x = _kernels.causal_conv1d_fn(
            mixed_qkv, conv_weight, conv_bias, conv_states, md.query_start_loc,
            md.mamba_cache_indices, md.has_initial_state, activation,
        )
        q, k, v = torch.split(x, [key_dim, key_dim, num_v_heads * head_v_dim], dim=-1)
        g, beta = gates(n)
        out, chunk_states = _kernels.chunk_gated_delta_rule(
            q.reshape(n, num_k_heads, head_k_dim), k.reshape(n, num_k_heads, head_k_dim),
            v.reshape(n, num_v_heads, head_v_dim), g, beta, ssm_states, md.query_start_loc,
            md.mamba_cache_indices, md.has_initial_state, True, 0.0, track, ssm_scales,
        )
        if track:
            track_ssm_checkpoints(md, ssm_states, chunk_states, GDN_CHUNK_SIZE, ssm_scales, GDN_STATE_SCALE_DIM)
        return out
    if md.mode is ForwardMode.TARGET_VERIFY:
        verify = ctx.verify_batch(layer_id, op)
        rows, steps, nv = verify.rows, verify.steps, verify.num_tokens
        inter_conv, inter_ssm, inter_scales = verify.intermediates
        x = _kernels.causal_conv1d_update(
            verify.per_request(mixed_qkv), conv_states, conv_weight, conv_bias, activation, verify.cache_indices,
            True, inter_conv, verify.parents,
        )
        q, k, v = torch.split(x, [key_dim, key_dim, num_v_heads * head_v_dim], dim=-1)
        gating = {}
        if raw_gates is None:
            g, beta = step_gates(*gates(nv), rows, steps)
        else:
            a, b, A_log, dt_bias = raw_gates(nv)
            g, beta = step_gates(a, b, rows, steps)
            gating = dict(A_log=A_log, dt_bias=dt_bias)
        out = _kernels.fused_recurrent_gated_delta_rule_update(
            q.reshape(rows, steps, num_k_heads, head_k_dim), k.reshape(rows, steps, num_k_heads, head_k_dim),
            v.reshape(rows, steps, num_v_heads, head_v_dim), g, beta, ssm_states, verify.cache_indices, True, 0.0,
            True, inter_ssm, ssm_scales, inter_scales, verify.parents, **gating,
        )
        return verify.pad(out.reshape(nv, num_v_heads, head_v_dim), n)
    raise NotImplementedError(f"{op}: forward mode {md.mode.value} is not supported")


@gdn_layer.register_fake
def _(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, layer_id, num_k_heads, head_k_dim,
      num_v_heads, head_v_dim, activation, beta_scale=1.0):
    _check(mixed_qkv, a, b, num_k_heads, head_k_dim, num_v_heads, head_v_dim)
    return mixed_qkv.new_zeros(mixed_qkv.shape[0], num_v_heads, head_v_dim)


def _check_kda(mixed_qkv, g, beta, num_heads, head_dim):
    conv_dim = 3 * num_heads * head_dim
    if mixed_qkv.dim() != 2 or mixed_qkv.shape[1] != conv_dim:
        raise ValueError(
            f"kda_layer: mixed_qkv must be [tokens, {conv_dim}] (q, k, v channels), got {tuple(mixed_qkv.shape)}"
        )
    n = mixed_qkv.shape[0]
    if tuple(g.shape) != (n, num_heads, head_dim):
        raise ValueError(f"kda_layer: g must be [tokens, {num_heads}, {head_dim}], got {tuple(g.shape)}")
    if tuple(beta.shape) != (n, num_heads):
        raise ValueError(f"kda_layer: beta must be [tokens, {num_heads}], got {tuple(beta.shape)}")


@kernel_op("hybrid_compile::kda_layer", mutates_args=())
def kda_layer(
    mixed_qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: Optional[torch.Tensor],
    layer_id: int,
    num_heads: int,
    head_dim: int,
    activation: str,
) -> torch.Tensor:
    """Conv + Kimi Delta Attention of one Kimi-Linear layer for the step's packed tokens.

    The delta rule of ``gdn_layer`` with a per-channel decay: ``g`` and ``beta`` come computed
    (transformers' ``KimiLinearForgetGate`` and ``sigmoid(b_proj)``, outside the op, in the
    compiled pieces), and the same kernel ops run with ``g [N, H, K]``; decode runs the verify
    op over one step (no fused gating).

    Args:
        mixed_qkv: ``[N, 3*H*K]`` projected q, k, v channels before the short convs (one depthwise
            conv over the three, as HF's ``conv1d``).
        g: ``[N, H, K]`` per-channel log-decay (<= 0), fp32.
        beta: ``[N, H]`` write strength.
        conv_weight, conv_bias, layer_id, activation: as in ``gdn_layer``.
        num_heads, head_dim: ``H`` and ``K = V``.

    Returns:
        ``[N, H, K]`` core attention output in mixed_qkv's dtype (zeros for padding rows).
    """
    _check_kda(mixed_qkv, g, beta, num_heads, head_dim)
    split = by_mixed_parts(
        lambda x, g, beta: kda_layer(x, g, beta, conv_weight, conv_bias, layer_id, num_heads, head_dim, activation),
        mixed_qkv, g, beta)
    if split is not None:  # a mixed step: its decode rows through the decode path (no chunked scan)
        return split
    return _delta_rule_core("kda_layer", mixed_qkv, conv_weight, conv_bias, layer_id, num_heads, head_dim,
                            num_heads, head_dim, activation, lambda n: (g[:n], beta[:n]))


@kda_layer.register_fake
def _(mixed_qkv, g, beta, conv_weight, conv_bias, layer_id, num_heads, head_dim, activation):
    _check_kda(mixed_qkv, g, beta, num_heads, head_dim)
    return mixed_qkv.new_zeros(mixed_qkv.shape[0], num_heads, head_dim)
