"""Triton kernel of ``moe_topk_softmax`` (:mod:`hybrid_compile.ops.moe_router`): the softmax top-k router.

``_topk_softmax_kernel``: grid ``(cdiv(T, ROWS),)``; each program holds ``ROWS`` token rows of all
``E`` logits in registers (``BLOCK_E`` = next power of two of ``E``, masked lanes at -inf): a fp32
softmax (max, exp, sum, IEEE-rounded division as torch's), then ``TOP_K`` passes of (row max, lowest
index holding it), each pass taking its expert out (-1 stands below every probability). The chosen
weights gather in a ``[ROWS, BLOCK_K]`` tile so the renormalising sum + divide needs no second read.
Shape-only launch, no host sync: usable in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..moe_router import _check_router
from .common import div_rn, pow2
from .launch import pdl_launch, pdl_wait_and_release

__all__ = ["moe_topk_softmax_triton"]


@triton.jit(do_not_specialize=["T", "stride_t", "stride_e"])
def _topk_softmax_kernel(
    logits_ptr, w_ptr, idx_ptr, T, E, stride_t, stride_e,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_wait_and_release(USE_PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < T
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_t + cols[None, :] * stride_e,
                mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    x = tl.where(col_ok[None, :], x, float("-inf"))  # rows past T stay finite (zeros), unstored
    m = tl.max(x, axis=1)
    e = tl.exp(x - m[:, None])
    p = div_rn(e, tl.sum(e, axis=1)[:, None])
    p = tl.where(col_ok[None, :], p, -1.0)  # masked experts are never chosen
    kcols = tl.arange(0, BLOCK_K)
    weights = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
    indices = tl.zeros((ROWS, BLOCK_K), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=1)
        # the lowest index holding the max (a NaN row matches nothing: clamp into range)
        arg = tl.min(tl.where(p == best[:, None], cols[None, :], BLOCK_E), axis=1)
        arg = tl.minimum(arg, E - 1)
        weights = tl.where(kcols[None, :] == j, best[:, None], weights)
        indices = tl.where(kcols[None, :] == j, arg[:, None], indices)
        p = tl.where(cols[None, :] == arg[:, None], -1.0, p)
    if RENORMALIZE:
        total = tl.sum(tl.where(kcols[None, :] < TOP_K, weights, 0.0), axis=1)
        weights = div_rn(weights, total[:, None])
    out = rows[:, None].to(tl.int64) * TOP_K + kcols[None, :]
    ok = row_ok[:, None] & (kcols[None, :] < TOP_K)
    tl.store(w_ptr + out, weights, mask=ok)
    tl.store(idx_ptr + out, indices.to(tl.int64), mask=ok)


def moe_topk_softmax_triton(logits: torch.Tensor, top_k: int, renormalize: bool, rows_per_program: int | None = None,
                            pdl: bool | None = None):
    """``moe_topk_softmax`` on the GPU (or under the interpreter); ``rows_per_program`` overrides the
    launcher's choice (1 row per program up to 64 tokens: the decode case, most programs in flight;
    4 beyond)."""
    T, E = logits.shape
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    indices = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, indices
    rows = rows_per_program or (1 if T <= 64 else 4)
    block_e = pow2(E)
    _topk_softmax_kernel[(triton.cdiv(T, rows),)](
        logits, weights, indices, T, E, logits.stride(0), logits.stride(1),
        TOP_K=top_k, RENORMALIZE=renormalize, ROWS=rows, BLOCK_E=block_e, BLOCK_K=pow2(top_k),
        num_warps=4 if block_e * rows >= 1024 else 1, **pdl_launch(logits.device, pdl),
    )
    return weights, indices


def _topk_softmax_cuda(logits, top_k, renormalize):
    _check_router(logits, top_k)
    return moe_topk_softmax_triton(logits, top_k, renormalize)


torch.library.register_kernel("hybrid_compile::moe_topk_softmax", "cuda", _topk_softmax_cuda)
