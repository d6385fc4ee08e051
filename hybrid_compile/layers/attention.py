"""Full-attention layer op: write the step's K/V into the layer's KV pool, then attend.

``hybrid_compile::attention_layer`` is a graph split point: Dynamo sees an opaque op (its fake
impl returns zeros of the output shape), so the whole model traces in one graph and the
piecewise backend can cut it here. At run time it reads the forward context (pool views and
KV indices of the step) and dispatches by forward mode to the paged-attention kernel ops:
DECODE to ``paged_attention_decode``; EXTEND and TARGET_VERIFY (speculative verify: the draft
tokens of each request attend causally over its prefix and the drafts before them, with
``query_start_loc`` as qo_indptr; a draft tree's tokens see only their ancestors among the drafts,
``ForwardMetadata.tree_mask``) to ``paged_attention_extend``.
"""

from __future__ import annotations

import torch

from .. import ops as _ops  # noqa: F401  (registers the kernel ops)
from .context import ForwardMode, require_forward_context
from ..ops.registration import kernel_op

_kernels = torch.ops.hybrid_compile


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"attention_layer: q, k, v must be [tokens, heads, head_dim], got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError("attention_layer: q, k, v must have the same number of tokens")


@kernel_op("hybrid_compile::attention_layer", mutates_args=())
def attention_layer(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_id: int,
    scale: float,
    sliding_window: int,
    logit_softcap: float,
) -> torch.Tensor:
    """Attention of the step's new tokens over their requests' cached + new K/V.

    Args:
        q: ``[N, Hq, D]`` queries of the N packed new tokens (after RoPE).
        k, v: ``[N, Hkv, D]`` / ``[N, Hkv, Dv]`` their keys and values; written into the pool of
            ``layer_id`` at ``metadata.out_cache_loc`` (the op's side effect on the KV pool).
        layer_id: the HF layer index (key of ``ForwardContext.kv_caches``).
        scale, sliding_window (<= 0: none), logit_softcap (0: none): as the kernel ops.

    Returns:
        ``[N, Hq, Dv]`` in q's dtype.
    """
    _check(q, k, v)
    # HF's eager attention hands over views of [1, H, T, D] tensors, whose head stride is T * D:
    # Triton specialises kernels on a stride's divisibility, so such a stride would JIT-compile new
    # variants as T (or the decode batch) changes. Those get a token-major copy; token-major views
    # (the compiled path's column slices of a packed projection) keep their fixed strides, uncopied.
    q, k, v = (t if t.stride(0) == max(t.stride()) else t.contiguous() for t in (q, k, v))
    ctx = require_forward_context("hybrid_compile::attention_layer")
    md = ctx.metadata
    k_cache, v_cache, k_scale, v_scale = ctx.kv_cache(layer_id)  # scales: FP8 KV cache only
    _kernels.store_kv_cache(k_cache, v_cache, md.out_cache_loc, k, v, k_scale, v_scale)
    if md.mode is ForwardMode.DECODE:
        out, _ = _kernels.paged_attention_decode(
            q, k_cache, v_cache, md.kv_indptr, md.kv_indices, scale, sliding_window, logit_softcap, k_scale, v_scale
        )
    else:
        out, _ = _kernels.paged_attention_extend(
            q, k_cache, v_cache, md.query_start_loc, md.kv_indptr, md.kv_indices, scale, True,
            sliding_window, logit_softcap, k_scale, v_scale, md.tree_mask,
        )
    return out


@attention_layer.register_fake
def _(q, k, v, layer_id, scale, sliding_window, logit_softcap):
    _check(q, k, v)
    return q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
