"""Triton kernels of ``moe_topk_softmax`` and ``moe_topk_sigmoid_grouped`` (:mod:`hybrid_compile.ops.moe_router`):
the softmax top-k router and the sigmoid group-limited one.

``_topk_softmax_kernel``: grid ``(cdiv(T, ROWS),)``; each program holds ``ROWS`` token rows of all
``E`` logits in registers (``BLOCK_E`` = next power of two of ``E``, masked lanes at -inf): a fp32
softmax (max, exp, sum, IEEE-rounded division as torch's), then ``TOP_K`` passes of (row max, lowest
index holding it), each pass taking its expert out (-1 stands below every probability). The chosen
weights gather in a ``[ROWS, BLOCK_K]`` tile so the renormalising sum + divide needs no second read.
Shape-only launch, no host sync: usable in CUDA graphs.

``_topk_sigmoid_grouped_kernel``: the same grid and tiles; sigmoid scores ``s`` and corrected scores
``c = s + bias``; with groups, each group's score (its largest ``c`` plus the largest of the rest),
``TOPK_GROUPS`` passes choosing groups (lowest index on ties) and the other groups' experts set to
-inf; then ``TOP_K`` passes over ``c`` as above, each taking the chosen expert's ``s`` as its weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..moe_router import _check_grouped_router, _check_router
from .common import div_rn, pow2
from .launch import pdl_launch, pdl_wait_and_release

__all__ = ["moe_topk_sigmoid_grouped_triton", "moe_topk_softmax_triton"]


@triton.jit
def _load_rows(logits_ptr, T, E, stride_t, stride_e, ROWS: tl.constexpr, BLOCK_E: tl.constexpr):
    """This program's ``ROWS`` token rows of logits as fp32 ``[ROWS, BLOCK_E]`` (rows past ``T`` and
    lanes past ``E`` zero), with ``rows``, ``row_ok``, ``cols``, ``col_ok``."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < T
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_t + cols[None, :] * stride_e,
                mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    return rows, row_ok, cols, col_ok, x


@triton.jit
def _top_k(score, value, cols, E, removed, TOP_K: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
           BLOCK_K: tl.constexpr, WEIGHT_IS_SCORE: tl.constexpr):
    """``TOP_K`` passes over ``score [ROWS, BLOCK_E]``, each taking the row's max at its lowest index
    (a NaN row matches nothing: the index is clamped into range) and setting it to ``removed``; the
    weights are the chosen scores (``WEIGHT_IS_SCORE``) or ``value`` at the chosen experts. Returns
    ``(weights [ROWS, BLOCK_K] fp32, indices [ROWS, BLOCK_K] int32)``."""
    kcols = tl.arange(0, BLOCK_K)
    weights = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
    indices = tl.zeros((ROWS, BLOCK_K), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(score, axis=1)
        arg = tl.min(tl.where(score == best[:, None], cols[None, :], BLOCK_E), axis=1)
        arg = tl.minimum(arg, E - 1)
        hit = cols[None, :] == arg[:, None]
        if WEIGHT_IS_SCORE:
            chosen = best
        else:
            chosen = tl.sum(tl.where(hit, value, 0.0), axis=1)
        weights = tl.where(kcols[None, :] == j, chosen[:, None], weights)
        indices = tl.where(kcols[None, :] == j, arg[:, None], indices)
        score = tl.where(hit, removed, score)
    return weights, indices


@triton.jit
def _renormalize(weights, eps, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """``weights`` divided (IEEE-rounded) by their row sum over the ``TOP_K`` chosen, plus ``eps``."""
    kcols = tl.arange(0, BLOCK_K)
    total = tl.sum(tl.where(kcols[None, :] < TOP_K, weights, 0.0), axis=1) + eps
    return div_rn(weights, total[:, None])


@triton.jit
def _store_top_k(w_ptr, idx_ptr, rows, row_ok, weights, indices, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The rows' ``[T, TOP_K]`` weights (fp32) and indices (int64)."""
    kcols = tl.arange(0, BLOCK_K)
    out = rows[:, None].to(tl.int64) * TOP_K + kcols[None, :]
    ok = row_ok[:, None] & (kcols[None, :] < TOP_K)
    tl.store(w_ptr + out, weights, mask=ok)
    tl.store(idx_ptr + out, indices.to(tl.int64), mask=ok)


@triton.jit(do_not_specialize=["T", "stride_t", "stride_e"])
def _topk_softmax_kernel(
    logits_ptr, w_ptr, idx_ptr, T, E, stride_t, stride_e,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_wait_and_release(USE_PDL)
    rows, row_ok, cols, col_ok, x = _load_rows(logits_ptr, T, E, stride_t, stride_e, ROWS, BLOCK_E)
    x = tl.where(col_ok[None, :], x, float("-inf"))  # rows past T stay finite (zeros), unstored
    m = tl.max(x, axis=1)
    e = tl.exp(x - m[:, None])
    p = div_rn(e, tl.sum(e, axis=1)[:, None])
    p = tl.where(col_ok[None, :], p, -1.0)  # masked experts are never chosen
    weights, indices = _top_k(p, p, cols, E, -1.0, TOP_K, ROWS, BLOCK_E, BLOCK_K, True)
    if RENORMALIZE:
        weights = _renormalize(weights, 0.0, TOP_K, BLOCK_K)  # (adding 0.0 is exact)
    _store_top_k(w_ptr, idx_ptr, rows, row_ok, weights, indices, TOP_K, BLOCK_K)


def _launch_setup(logits: torch.Tensor, top_k: int, rows_per_program: int | None):
    """(weights, indices, rows per program, BLOCK_E) of a router launch: the outputs ``[T, top_k]``
    and 1 row per program up to 64 tokens (the decode case, most programs in flight), 4 beyond."""
    T, E = logits.shape
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    indices = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    return weights, indices, rows_per_program or (1 if T <= 64 else 4), pow2(E)


def moe_topk_softmax_triton(logits: torch.Tensor, top_k: int, renormalize: bool, rows_per_program: int | None = None,
                            pdl: bool | None = None):
    """``moe_topk_softmax`` on the GPU (or under the interpreter); ``rows_per_program`` overrides the
    launcher's choice (:func:`_launch_setup`)."""
    T, E = logits.shape
    weights, indices, rows, block_e = _launch_setup(logits, top_k, rows_per_program)
    if T == 0:
        return weights, indices
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


@triton.jit(do_not_specialize=["T", "stride_t", "stride_e"])
def _topk_sigmoid_grouped_kernel(
    logits_ptr, bias_ptr, w_ptr, idx_ptr, T, E, stride_t, stride_e, scaling,
    TOP_K: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr, PER_GROUP: tl.constexpr,
    RENORMALIZE: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_wait_and_release(USE_PDL)
    rows, row_ok, cols, col_ok, x = _load_rows(logits_ptr, T, E, stride_t, stride_e, ROWS, BLOCK_E)
    s = div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + tl.exp(-x))  # sigmoid
    c = s + tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    c = tl.where(col_ok[None, :], c, float("-inf"))
    if NUM_GROUPS > 1:
        group_of = cols // PER_GROUP
        gcols = tl.arange(0, BLOCK_G)
        gscore = tl.full((ROWS, BLOCK_G), float("-inf"), tl.float32)
        for g in tl.static_range(NUM_GROUPS):
            in_g = (group_of == g)[None, :]
            m1 = tl.max(tl.where(in_g, c, float("-inf")), axis=1)
            a1 = tl.min(tl.where(in_g & (c == m1[:, None]), cols[None, :], BLOCK_E), axis=1)
            m2 = tl.max(tl.where(in_g & (cols[None, :] != a1[:, None]), c, float("-inf")), axis=1)
            gscore = tl.where(gcols[None, :] == g, (m1 + m2)[:, None], gscore)
        keep = tl.zeros((ROWS, BLOCK_E), dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUPS):
            best = tl.max(gscore, axis=1)
            arg = tl.min(tl.where(gscore == best[:, None], gcols[None, :], BLOCK_G), axis=1)
            keep = keep | (group_of[None, :] == arg[:, None])
            gscore = tl.where(gcols[None, :] == arg[:, None], float("-inf"), gscore)
        c = tl.where(keep, c, float("-inf"))
    weights, indices = _top_k(c, s, cols, E, float("-inf"), TOP_K, ROWS, BLOCK_E, BLOCK_K, False)
    if RENORMALIZE:
        weights = _renormalize(weights, 1e-20, TOP_K, BLOCK_K)
    _store_top_k(w_ptr, idx_ptr, rows, row_ok, weights * scaling, indices, TOP_K, BLOCK_K)


def moe_topk_sigmoid_grouped_triton(logits, bias, top_k: int, num_groups: int, topk_groups: int, renormalize: bool,
                                    scaling: float, rows_per_program: int | None = None, pdl: bool | None = None):
    """``moe_topk_sigmoid_grouped`` on the GPU (or under the interpreter); ``rows_per_program`` as
    :func:`moe_topk_softmax_triton`."""
    T, E = logits.shape
    weights, indices, rows, block_e = _launch_setup(logits, top_k, rows_per_program)
    if T == 0:
        return weights, indices
    _topk_sigmoid_grouped_kernel[(triton.cdiv(T, rows),)](
        logits, bias, weights, indices, T, E, logits.stride(0), logits.stride(1), float(scaling),
        TOP_K=top_k, NUM_GROUPS=num_groups, TOPK_GROUPS=topk_groups, PER_GROUP=E // num_groups,
        RENORMALIZE=renormalize, ROWS=rows, BLOCK_E=block_e, BLOCK_K=pow2(top_k), BLOCK_G=pow2(num_groups),
        num_warps=4 if block_e * rows >= 1024 else 1, **pdl_launch(logits.device, pdl),
    )
    return weights, indices


def _topk_sigmoid_grouped_cuda(logits, bias, top_k, num_groups, topk_groups, renormalize, scaling):
    _check_grouped_router(logits, bias, top_k, num_groups, topk_groups)
    return moe_topk_sigmoid_grouped_triton(logits, bias, top_k, num_groups, topk_groups, renormalize, scaling)


torch.library.register_kernel("hybrid_compile::moe_topk_sigmoid_grouped", "cuda", _topk_sigmoid_grouped_cuda)
