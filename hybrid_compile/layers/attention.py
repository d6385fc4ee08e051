"""Full-attention layer op: write the step's K/V into the layer's KV pool, then attend.

``hybrid_compile::attention_layer`` is a graph split point: Dynamo sees an opaque op (its fake
impl returns zeros of the output shape), so the whole model traces in one graph and the
piecewise backend can cut it here. At run time it reads the forward context (pool views and
KV indices of the step) and dispatches by forward mode to the paged-attention kernel ops:
DECODE to ``paged_attention_decode``; EXTEND and TARGET_VERIFY (speculative verify: the draft
tokens of each request attend causally over its prefix and the drafts before them, with
``query_start_loc`` as qo_indptr; a draft tree's tokens see only their ancestors among the drafts,
``ForwardMetadata.tree_mask``) to ``paged_attention_extend``.

``hybrid_compile::mla_layer`` is the same for multi-head latent attention over a compressed cache
(one row per token: the latent ``c`` and a rope key shared by the heads; V is the latent), with two
forms chosen per step on the host: **absorbed** (the up-projection folded into the query, every head
attending over the latents with head dim ``R + rope``: decode, verify and short extends) and
**expanded** (each context token's per-head key ``[W_uk c; k_rope]`` and value ``W_uv c`` rebuilt
from the cache for the step, then ordinary multi-head attention at head dims ``nope + rope`` /
``V``: long extends, where attending over the latents costs more than rebuilding the keys, see
:func:`mla_expands`). Both give the same values; transformers' own layer is the expanded form.
"""

from __future__ import annotations

import torch

from .. import ops as _ops  # noqa: F401  (registers the kernel ops)
from .context import ForwardMode, by_mixed_parts, require_forward_context
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


def _paged_attention(q, k_cache, v_cache, k_scale, v_scale, md, scale: float, sliding_window: int,
                     logit_softcap: float) -> torch.Tensor:
    """The step's queries over the pool, by forward mode: DECODE through ``paged_attention_decode``,
    EXTEND / TARGET_VERIFY (its tree mask included) through ``paged_attention_extend``."""
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
    split = by_mixed_parts(lambda q, k, v: attention_layer(q, k, v, layer_id, scale, sliding_window, logit_softcap),
                           q, k, v)
    if split is not None:  # a mixed step: its decode rows through decode attention
        return split
    # HF's eager attention hands over views of [1, H, T, D] tensors, whose head stride is T * D:
    # Triton specialises kernels on a stride's divisibility, so such a stride would JIT-compile new
    # variants as T (or the decode batch) changes. Those get a token-major copy; token-major views
    # (the compiled path's column slices of a packed projection) keep their fixed strides, uncopied.
    q, k, v = (t if t.stride(0) == max(t.stride()) else t.contiguous() for t in (q, k, v))
    ctx = require_forward_context("hybrid_compile::attention_layer")
    md = ctx.metadata
    k_cache, v_cache, k_scale, v_scale = ctx.kv_cache(layer_id)  # scales: FP8 KV cache only
    _kernels.store_kv_cache(k_cache, v_cache, md.out_cache_loc, k, v, k_scale, v_scale)
    return _paged_attention(q, k_cache, v_cache, k_scale, v_scale, md, scale, sliding_window, logit_softcap)


@attention_layer.register_fake
def _(q, k, v, layer_id, scale, sliding_window, logit_softcap):
    _check(q, k, v)
    return q.new_zeros(q.shape[0], q.shape[1], v.shape[2])


# -- multi-head latent attention ----------------------------------------------------------------


# the most bytes of rebuilt keys and values an expanded MLA step may hold at once (per layer call):
# 1 GiB is ~52k context tokens at Kimi-Linear-48B's 32 heads of 192 + 128 channels in bf16
MLA_EXPAND_MAX_BYTES = 1 << 30


def mla_expands(md, heads: int, nope: int, rope: int, rank: int, v_dim: int, itemsize: int) -> bool:
    """Whether an EXTEND step runs MLA in the expanded form: rebuilding the per-head key and value of
    every context token costs ``(nope + v_dim) * rank`` multiply-adds a token and head; attending
    over expanded keys instead of latents saves ``(2 * rank + rope) - (nope + rope + v_dim)`` a query,
    key and head. So it pays where sum(new_i * context_i) * saving > sum(context_i) * rebuild (the
    host copies of the lengths; Kimi-Linear-48B's dims: from ~171 new tokens per context token), and
    only while the rebuilt keys and values fit :data:`MLA_EXPAND_MAX_BYTES` (a mixed step's decode
    rows bring their whole contexts)."""
    if md.mode is not ForwardMode.EXTEND or not md.extend_lens_cpu:
        return False
    saving = (2 * rank + rope) - (nope + rope + v_dim)
    context = sum(md.seq_lens_cpu)
    if saving <= 0 or context * heads * (nope + rope + v_dim) * itemsize > MLA_EXPAND_MAX_BYTES:
        return False
    pairs = sum(n * c for n, c in zip(md.extend_lens_cpu, md.seq_lens_cpu))
    return pairs * saving > context * (nope + v_dim) * rank


def _check_mla(q_nope, q_rope, latent, k_rope, w_uk, w_uv) -> None:
    n, h, nope = q_nope.shape
    rank = latent.shape[-1]
    if (q_rope.dim() != 3 or q_rope.shape[:2] != (n, h) or latent.shape != (n, rank) or k_rope.dim() != 2
            or k_rope.shape != (n, q_rope.shape[2]) or w_uk.shape != (h, nope, rank) or w_uv.dim() != 3
            or w_uv.shape[0] != h or w_uv.shape[2] != rank):
        raise ValueError(
            f"mla_layer: expected q_nope [N, H, nope], q_rope [N, H, rope], latent [N, R], k_rope [N, rope], "
            f"w_uk [H, nope, R], w_uv [H, V, R]; got {tuple(q_nope.shape)}, {tuple(q_rope.shape)}, "
            f"{tuple(latent.shape)}, {tuple(k_rope.shape)}, {tuple(w_uk.shape)}, {tuple(w_uv.shape)}")


@kernel_op("hybrid_compile::mla_layer", mutates_args=())
def mla_layer(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    layer_id: int,
    scale: float,
) -> torch.Tensor:
    """Multi-head latent attention of the step's new tokens over their requests' compressed cache.

    Args:
        q_nope, q_rope: ``[N, H, nope]`` / ``[N, H, rope]`` the queries' two parts.
        latent, k_rope: ``[N, R]`` / ``[N, rope]`` the new tokens' compressed row (after the latent's
            norm), written into the pool of ``layer_id`` (one KV head of ``R + rope`` channels, V a
            view of its first ``R``) at ``metadata.out_cache_loc``.
        w_uk, w_uv: ``[H, nope, R]`` / ``[H, V, R]`` the up-projection of the latent to keys / values.
        layer_id, scale: as ``attention_layer``.

    Returns:
        ``[N, H, V]`` in q's dtype (before the output projection).
    """
    _check_mla(q_nope, q_rope, latent, k_rope, w_uk, w_uv)
    split = by_mixed_parts(lambda qn, qr, lat, kr: mla_layer(qn, qr, lat, kr, w_uk, w_uv, layer_id, scale),
                           q_nope, q_rope, latent, k_rope)
    if split is not None:  # a mixed step: its decode rows through decode attention
        return split
    ctx = require_forward_context("hybrid_compile::mla_layer")
    md = ctx.metadata
    k_cache, v_cache, k_scale, v_scale = ctx.kv_cache(layer_id)
    rank = latent.shape[-1]
    row = torch.cat((latent, k_rope), dim=-1).unsqueeze(1)  # [N, 1, R + rope]: the compressed cache row
    _kernels.store_kv_cache(k_cache, v_cache, md.out_cache_loc, row, row[..., :rank], k_scale, v_scale)
    heads, nope, rope, v_dim = q_nope.shape[1], q_nope.shape[2], q_rope.shape[2], w_uv.shape[1]
    if k_scale is None and mla_expands(md, heads, nope, rope, rank, v_dim, q_nope.element_size()):
        # every context token's row (prefix and new), rebuilt per head into a step-local K/V that
        # the extend kernel reads in context order (its indices: 0 .. C-1)
        rows = k_cache[md.kv_indices.long(), 0]  # [C, R + rope]
        c = rows[:, :rank].to(w_uk.dtype)
        k = torch.cat((torch.einsum("cr,hdr->chd", c, w_uk),
                       rows[:, None, rank:].to(w_uk.dtype).expand(-1, heads, -1)), dim=-1).to(q_nope.dtype)
        v = torch.einsum("cr,hvr->chv", c, w_uv).to(q_nope.dtype).contiguous()  # (einsum: head-major)
        order = torch.arange(rows.shape[0], dtype=md.kv_indices.dtype, device=rows.device)
        q = torch.cat((q_nope, q_rope), dim=-1)
        out, _ = _kernels.paged_attention_extend(
            q, k, v, md.query_start_loc, md.kv_indptr, order, scale, True, -1, 0.0, None, None, None,
        )
        return out
    q_abs = torch.cat((torch.einsum("nhd,hdr->nhr", q_nope, w_uk), q_rope), dim=-1)  # [N, H, R + rope]
    out = _paged_attention(q_abs, k_cache, v_cache, k_scale, v_scale, md, scale, -1, 0.0)
    return torch.einsum("nhr,hvr->nhv", out, w_uv).contiguous()  # [N, H, V] (einsum leaves it head-major)


@mla_layer.register_fake
def _(q_nope, q_rope, latent, k_rope, w_uk, w_uv, layer_id, scale):
    _check_mla(q_nope, q_rope, latent, k_rope, w_uk, w_uv)
    return q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])
