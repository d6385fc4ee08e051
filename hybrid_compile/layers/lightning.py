"""Lightning attention layer op: the recurrent core of a MiniMax ``MiniMaxLightningAttention`` layer.

``hybrid_compile::lightning_layer`` takes the activated ``qkv`` projection (HF's
``act_fn(qkv_proj(x))``, per head ``[q, k, v]``) and the layer's decay slopes and returns the core
attention output, reading the layer's state pool from the forward context. The projection, the
RMSNorm, the sigmoid output gate and ``out_proj`` stay outside (HF's modules, in the compiled
pieces). The layer has no conv: its Mamba-pool spec keeps a 1-wide conv (an empty window).

By forward mode:
- DECODE: ``recurrent_lightning_attention_update`` over one token in place.
- EXTEND (prefill, chunked prefill, mixed): ``chunk_lightning_attention`` with initial states where
  the request has them; prefix-cache checkpoints (chunk states) when the step asks for them.
- TARGET_VERIFY: ``recurrent_lightning_attention_update`` over each request's ``draft_len`` tokens
  with ``disable_state_update``, writing the state after every step into the layer's intermediate
  buffer for the engine's commit; a draft tree (the verify batch's parents) starts each token from
  its parent's stored state.

An FP8 state pool (``ssm_state_dtype="fp8"``) passes its scales (one per value column over K) to
every op, and its intermediate buffers' scales to the verify; the prefix-cache checkpoints are
quantized into the pool's slots as they are copied.
"""

from __future__ import annotations

import torch

from .. import ops as _ops  # noqa: F401  (registers the kernel ops)
from ..ops.lightning import LIGHTNING_CHUNK_SIZE, LIGHTNING_STATE_SCALE_DIM
from .context import ForwardMode, by_mixed_parts, require_forward_context
from .tracking import tracking, track_ssm_checkpoints
from ..ops.registration import kernel_op

_kernels = torch.ops.hybrid_compile


def _check(qkv: torch.Tensor, slope: torch.Tensor, num_heads: int, head_dim: int) -> None:
    if qkv.dim() != 2 or qkv.shape[1] != 3 * num_heads * head_dim:
        raise ValueError(
            f"lightning_layer: qkv must be [tokens, {3 * num_heads * head_dim}] (per head q, k, v), got "
            f"{tuple(qkv.shape)}"
        )
    if slope.dim() != 1 or slope.shape[0] != num_heads:
        raise ValueError(f"lightning_layer: slope must be [{num_heads}], got {tuple(slope.shape)}")


@kernel_op("hybrid_compile::lightning_layer", mutates_args=())
def lightning_layer(qkv: torch.Tensor, slope: torch.Tensor, layer_id: int, num_heads: int,
                    head_dim: int) -> torch.Tensor:
    """Lightning attention of one MiniMax linear layer for the step's packed tokens.

    Args:
        qkv: ``[N, H * 3 * D]`` activated projection, per head ``[q, k, v]`` (HF's layout).
        slope: ``[H]`` fp32 decay slopes (HF's ``slope_rate``).
        layer_id: HF layer index (key of ``ForwardContext.mamba_caches``); its state pool
            ``[S, H, D, D]`` is updated.
        num_heads, head_dim: ``H`` and ``D``.

    Returns:
        ``[N, H, D]`` core attention output in qkv's dtype (zeros for padding rows).
    """
    _check(qkv, slope, num_heads, head_dim)
    split = by_mixed_parts(lambda x: lightning_layer(x, slope, layer_id, num_heads, head_dim), qkv)
    if split is not None:  # a mixed step: its decode rows through the decode path (no chunked scan)
        return split
    ctx = require_forward_context("hybrid_compile::lightning_layer")
    md = ctx.metadata
    _, ssm_states, ssm_scales = ctx.mamba_cache(layer_id)  # scales: an FP8 state pool's, else None
    n = qkv.shape[0]
    q, k, v = qkv.view(n, num_heads, 3 * head_dim).split(head_dim, dim=-1)

    if md.mode is ForwardMode.DECODE:
        return _kernels.recurrent_lightning_attention_update(
            q[:, None], k[:, None], v[:, None], slope, ssm_states, md.mamba_cache_indices, False, None, ssm_scales,
            None,
        ).squeeze(1)
    if md.mode is ForwardMode.EXTEND:
        track = tracking(md)
        out, chunk_states = _kernels.chunk_lightning_attention(
            q, k, v, slope, ssm_states, md.query_start_loc, md.mamba_cache_indices, md.has_initial_state, track,
            ssm_scales,
        )
        if track:
            track_ssm_checkpoints(md, ssm_states, chunk_states, LIGHTNING_CHUNK_SIZE, ssm_scales,
                                  LIGHTNING_STATE_SCALE_DIM)
        return out
    if md.mode is ForwardMode.TARGET_VERIFY:
        verify = ctx.verify_batch(layer_id, "lightning_layer")
        out = _kernels.recurrent_lightning_attention_update(
            verify.per_request(q), verify.per_request(k), verify.per_request(v), slope, ssm_states,
            verify.cache_indices, True, verify.intermediates[1], ssm_scales, verify.intermediates[2], verify.parents,
        )
        return verify.pad(out.reshape(verify.num_tokens, num_heads, head_dim), n)
    raise NotImplementedError(f"lightning_layer: forward mode {md.mode.value} is not supported")


@lightning_layer.register_fake
def _(qkv, slope, layer_id, num_heads, head_dim):
    _check(qkv, slope, num_heads, head_dim)
    return qkv.new_zeros(qkv.shape[0], num_heads, head_dim)
