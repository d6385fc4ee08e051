"""Triton kernels of ``moe_grouped_linear`` and ``moe_combine_top_k`` (:mod:`hybrid_compile.ops.moe`).

``moe_grouped_linear``: a float grouped GEMM on the tensor cores, and at decode the CUDA-core GEMV
of :mod:`.gemv`; :func:`moe_grouped_linear_triton` picks one (:func:`moe_path`), or
``torch._grouped_mm`` for bf16 above decode size where :data:`LARGE_CALLS_PATH` asks for it
(:func:`hybrid_compile.ops.moe.grouped_mm_linear`). ``moe_combine_top_k``: ``_combine_top_k_kernel``
(:func:`moe_combine_top_k_triton`), one program per (token, column block). ``moe_sort_pairs``:
``_sort_pairs_kernel`` (:func:`moe_sort_pairs_triton`), the routing sort by counting.

``_grouped_gemm_kernel``: grid ``(cdiv(N, BN), row tiles)``; each program one ``[BM, BN]`` output
tile of one expert, stepping along ``K`` by ``BK`` with ``tl.dot`` on the tensor cores (bf16 / fp16
operands, or fp32 in IEEE precision, fp32 accumulation). Rows are sorted by expert: the expert of
row tile ``t`` comes from the experts' cumulative tile counts (:func:`.common.expert_row_tile`, the
FP8 grouped GEMM's scheme), so the launch is shape-only (``min(R, cdiv(R, BM) + E)`` row tiles
bound the used ones; programs past the last used tile run zero ``K`` steps and store nothing) and
each tile's rows are padded to ``BM`` by masking. ``GATHER``: row ``r`` reads ``x[gather[r]]``;
``SCATTER``: it is stored at ``y[scatter[r]]``. ``ACT`` (the index in
:data:`~hybrid_compile.ops.moe.GROUPED_ACTIVATIONS`) is applied to the fp32 accumulator before the
one rounding of the store: 0 none; 1 silu_and_mul, where each program accumulates the gate tile
(weight rows ``rn``) and the up tile (rows ``N + rn``, ``N`` the output width) over one ``K`` loop and
stores ``silu(gate) * up``; 2 relu2. No host sync, no atomics: usable in CUDA graphs.

Decode (at most :data:`MOE_GEMV_ROWS_PER_EXPERT` rows per expert on average: top-k routing spreads a
few tokens over many experts, one or two rows each): a 16-row tensor-core tile would waste most of
its rows and too few programs would stream the weights, so the call takes ``gemv_kernel``
(:mod:`.gemv`, the kernel of the FP8 experts' decode path without the block scales): one program
per (row of an expert, ``BLOCK_N`` output columns), streaming that expert's ``[BLOCK_N, K]`` weight
slab (``silu_and_mul``: its gate and its up rows) on the CUDA cores with fp32 accumulators, the
same gather, scatter, activations and shape-only launch; tiles from :data:`~.gemv.GROUPED_GEMV_TILES`.
Short ungated rows with at least one row per expert (a 64-token step's ``down_proj`` slice under tensor
parallelism) take its by-expert form (``gemv_by_expert_kernel``: a program per expert and column tile
over all the expert's rows, reading the slab once; :data:`MOE_GEMV_BY_EXPERT_MAX_K`).

Tiles of the tensor-core kernel: at decode :func:`fp8_gemm_config`'s choice (16-row tiles and column
tiles narrow enough that about two programs per SM stream the weights); prefill: 64 / 128-row
tiles by the rows per expert, 128 columns, 8 warps, 3 stages; ``BK`` 64 (128 for 16-bit weights at
decode in column tiles narrower than 128: fewer loop steps over the long ``K`` of the weight stream).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..moe import (GROUPED_ACTIVATIONS, _check_combine, _check_grouped, _check_sort, check_activation,
                   grouped_mm_linear, grouped_output_width, reference_moe_sort_pairs)
from .common import apply_activation, cast_rne, expert_row_tile, grouped_row_tiles, pow2, sm_count
from .fp8 import fp8_gemm_config
from .gemv import check_gemv_config, grouped_gemv_config, launch_gemv
from .launch import pdl_launch, pdl_wait_and_release

__all__ = ["LARGE_CALLS_PATH", "MOE_GEMV_BY_EXPERT_MAX_K", "MOE_GEMV_BY_EXPERT_ROWS", "MOE_GEMV_LONG_K", "MOE_GEMV_LONG_K_MAX_PROGRAMS", "MOE_GEMV_ROWS_PER_EXPERT",
           "MOE_PATHS", "MOE_SORT_MAX_PAIRS", "moe_gemm_config", "moe_combine_top_k_triton", "moe_gemv_config", "moe_gemv_tiles",
           "moe_grouped_linear_triton", "moe_path", "moe_sort_pairs_triton"]

#: The kernels :func:`moe_grouped_linear_triton` can take: ours, and ``torch._grouped_mm`` (bf16:
#: :func:`~hybrid_compile.ops.moe.grouped_mm_linear`, the grouped GEMM transformers' experts call).
MOE_PATHS = ("gemv", "gemv_by_expert", "tensor_cores", "grouped_mm")
#: Calls of at most this many rows per expert on average take the GEMV (the FP8 experts' earlier
#: threshold: in an H100 sweep one row per program beat the FP8 tensor cores at every decode size up to
#: 64 tokens of top-10 routing over 512 experts; a 2026-11-28 H200 sweep moved the FP8 experts to the
#: tensor cores above one row per 16 experts, ``ops.triton.fp8.FP8_GROUPED_GEMV_EXPERTS_PER_ROW``; for
#: bf16 the same sweep had transformers' grouped_mm slower than this GEMV at 16 and 64 tokens).
#: ``benchmarks/fused_moe.py --sweep`` times both paths for the float weights.
MOE_GEMV_ROWS_PER_EXPERT = 2
#: The path of the calls above decode size (:func:`moe_path`): ``"grouped_mm"`` for bf16 weights
#: (other dtypes keep our tensor-core kernel), or ``"tensor_cores"`` everywhere. ``benchmarks/fused_moe.py``
#: times both: on an H200 (2026-11-27) at 256 / 1,024 / 4,096 tokens of the Qwen3-Next-80B experts
#: ``grouped_mm`` took 1.22 / 1.56 / 2.77 ms against our tensor cores' 1.55 / 2.56 / 4.91 ms
#: (transformers' own ``grouped_mm`` path 1.20 / 1.45 / 2.41 ms).
LARGE_CALLS_PATH = "grouped_mm"

# Triton's interpreter multiplies the raw bits of bf16 operands in tl.dot: there the tiles are
# widened to fp32 first (exact for bf16 / fp16 values, so the products are those of the GPU's dot)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit(do_not_specialize=["R", "N", "K", "E"])
def _grouped_gemm_kernel(
    x_ptr, gather_ptr, w_ptr, y_ptr, scatter_ptr, offsets_ptr,
    R, N, K, E,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk,
    GATHER: tl.constexpr, SCATTER: tl.constexpr, IEEE: tl.constexpr, ACT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BLOCK_E: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait_and_release(USE_PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    expert, row0, row_end = expert_row_tile(offsets_ptr, E, pid_m, BM, BLOCK_E)
    w_ptr += tl.minimum(expert, E - 1).to(tl.int64) * stride_we
    k_steps = tl.where(expert < E, tl.cdiv(K, BK), 0)
    rm = row0 + tl.arange(0, BM)
    m_ok = rm < row_end
    if GATHER:
        src = tl.load(gather_ptr + rm, mask=m_ok, other=0).to(tl.int64)
    else:
        src = rm.to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN)
    n_ok = rn < N  # N: output columns (silu_and_mul: the gate rows; the up rows follow at N + rn)
    rk = tl.arange(0, BK)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    w_up_rows = w_rows + N.to(tl.int64) * stride_wn  # silu_and_mul's up rows (unused otherwise)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_up = tl.zeros((BM, BN), dtype=tl.float32)  # silu_and_mul's up products (unused otherwise)
    for kb in range(0, k_steps):
        kk = kb * BK + rk
        k_ok = kk < K
        w_mask = n_ok[:, None] & k_ok[None, :]
        a = tl.load(x_ptr + src[:, None] * stride_xm + kk[None, :] * stride_xk,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :] * stride_wk, mask=w_mask, other=0.0)
        if ACT == 1:
            wu = tl.load(w_up_rows + kk[None, :] * stride_wk, mask=w_mask, other=0.0)
        if IEEE:  # fp32 weights: exact fp32 products (tf32 would miss the CPU path's tolerance)
            a = a.to(tl.float32)
            acc += tl.dot(a, tl.trans(w.to(tl.float32)), input_precision="ieee")
            if ACT == 1:
                acc_up += tl.dot(a, tl.trans(wu.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w))
            if ACT == 1:
                acc_up += tl.dot(a, tl.trans(wu))
    acc = apply_activation(acc, acc_up, ACT)
    if SCATTER:
        dst = tl.load(scatter_ptr + rm, mask=m_ok, other=0).to(tl.int64)
    else:
        dst = rm.to(tl.int64)
    tl.store(y_ptr + dst[:, None] * N + rn[None, :], cast_rne(acc, y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def moe_gemm_config(rows: int, n: int, k: int, experts: int, dtype: torch.dtype,
                    sms: int = 132, gated: bool = False) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, num_warps, num_stages) for ``rows`` sorted rows over ``experts`` (``gated``:
    ``silu_and_mul``, two weight tiles per K step)."""
    bm, bn, warps, stages, _ = fp8_gemm_config(rows, n, k, grouped=True, experts=experts, sms=sms)
    decode = bm == 16
    if not decode:  # prefill: 128 x 128 tiles (64 rows where an expert's rows are short), 8 warps, 3 stages
        bm, bn, warps, stages = (64 if rows / max(experts, 1) < 128 else 128), 128, 8, 3
    # narrow column tiles (one row per expert hit): long K steps. With 128-wide tiles BK 64 was
    # faster in every case of a tile sweep on an H100 (Qwen3.5-35B / Nemotron-3-Nano experts, 16 to
    # 256 tokens, both projections: 3-15 % less time than BK 128)
    bk = 128 if decode and dtype != torch.float32 and bn < 128 else 64
    if dtype == torch.float32 and (not decode or gated):
        # fp32 tiles are twice as large in shared memory (gated decode: two 128 x 64 fp32 weight
        # tiles per stage, ~200 KB at 3 stages, at the edge of an H100's 227 KB)
        stages = 2
    return bm, bn, bk, warps, stages


#: A grouped GEMV whose default tiles make a grid of at most this many programs (rows x column tiles:
#: one decode token's pairs over narrow expert slices) streams 2-byte weights in ``MOE_GEMV_LONG_K``-column
#: steps, ``BLOCK_N`` narrowed to keep the accumulators (twice the programs, half the loop's steps). On an
#: H200 (2026-11-28, ``benchmarks/fused_moe.py --sweep --sweep-paths gemv --tokens 1``, 16 calls timed in
#: one CUDA graph) Qwen3-Next-80B's gated ``gate_up`` at one token (10 rows) took 7.85 -> 6.06 us at TP 4
#: (128 columns: 160 programs) and 9.26 -> 7.94 us at TP 2 (256 columns: 320 programs); at 16 / 64 tokens
#: (2,560 programs and more) the long steps were 10 / 15 % slower. 384: the folded shared expert's 11th row
#: at TP 2; one token at TP 1 (640 programs) was not measured and keeps the default.
MOE_GEMV_LONG_K_MAX_PROGRAMS = 384
#: Rows of one expert a program of the ``"gemv_by_expert"`` path (:func:`~.gemv.launch_gemv`'s
#: ``by_expert``: a program per expert and column tile) takes per pass over its weight slab.
MOE_GEMV_BY_EXPERT_ROWS = 1
#: Decode calls take the by-expert GEMV for ungated weights of at most this many input channels with
#: at least one row per expert on average (:func:`moe_path`): a slab of one or two 128-column steps is
#: little work per program, and a program per expert reads it once for all the expert's rows, where one
#: per row re-reads it. On an H200 (2026-11-29, ``benchmarks/fused_moe.py --sweep --sweep-paths
#: gemv_by_expert --tp 4 / --tp 2``) Qwen3-Next-80B's ``down_proj`` slice (K = 128 / 256) took 86.4 /
#: 124.0 us against the row GEMV's 102.1 / 147.9 us at 64 tokens (1.25 rows per expert), but 48.2 /
#: 53.6 against 33.4 / 48.6 us at 16 (0.31); the gated ``gate_up`` (K = 2048) was 0.89-0.96x at both.
MOE_GEMV_BY_EXPERT_MAX_K = 256
MOE_GEMV_LONG_K = 512


def moe_gemv_config(n: int, k: int, dtype: torch.dtype, gated: bool = False, rows: int = 1,
                    total_rows: int | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of the GEMV for ``n`` output columns over ``k`` input
    channels of ``dtype`` weights (:func:`~.gemv.grouped_gemv_config`), ``rows`` per program; a call of
    ``total_rows`` rows whose grid would be small takes :data:`MOE_GEMV_LONG_K`-column steps
    (:data:`MOE_GEMV_LONG_K_MAX_PROGRAMS`; 2-byte weights, one row a program, at least two such steps)."""
    block_n, block_k, warps, stages = grouped_gemv_config(n, k, dtype.itemsize, gated, rows)
    if (total_rows is not None and dtype.itemsize == 2 and rows == 1 and block_k < MOE_GEMV_LONG_K <= k // 2
            and total_rows * triton.cdiv(n, block_n) <= MOE_GEMV_LONG_K_MAX_PROGRAMS):
        return max(2, block_n * block_k // MOE_GEMV_LONG_K), MOE_GEMV_LONG_K, warps, stages
    return block_n, block_k, warps, stages


def moe_gemv_tiles(path: str, n: int, k: int, dtype: torch.dtype, gated: bool, total_rows: int,
                   rows_per_program: int | None = None) -> tuple[tuple[int, int, int, int], int]:
    """(config, rows per program) a GEMV ``path`` takes by default: ``"gemv"`` one row a program and
    :func:`moe_gemv_config`'s tiles for a call of ``total_rows``; ``"gemv_by_expert"``
    :data:`MOE_GEMV_BY_EXPERT_ROWS` a pass and :func:`~.gemv.grouped_gemv_config`'s tiles. A given
    ``rows_per_program`` is kept (the tiles then sized for it)."""
    if rows_per_program is None:
        rows_per_program = 1 if path == "gemv" else MOE_GEMV_BY_EXPERT_ROWS
    if path == "gemv":
        return moe_gemv_config(n, k, dtype, gated, rows_per_program, total_rows=total_rows), rows_per_program
    return grouped_gemv_config(n, k, dtype.itemsize, gated, rows_per_program), rows_per_program


def moe_path(rows: int, experts: int, dtype: torch.dtype | None = None, k: int | None = None,
             gated: bool = False) -> str:
    """The kernel :func:`moe_grouped_linear_triton` takes by default for ``rows`` sorted rows over
    ``experts`` of weights in ``dtype`` (``k`` input channels, ``gated``: silu_and_mul): ``"gemv"`` at
    decode (at most :data:`MOE_GEMV_ROWS_PER_EXPERT` rows per expert on average), by expert
    (``"gemv_by_expert"``) there for short ungated rows of at least one row per expert on average
    (:data:`MOE_GEMV_BY_EXPERT_MAX_K`), else :data:`LARGE_CALLS_PATH` (``"grouped_mm"`` only for bf16)."""
    if LARGE_CALLS_PATH not in ("tensor_cores", "grouped_mm"):
        raise ValueError(f'ops.triton.moe.LARGE_CALLS_PATH must be "tensor_cores" or "grouped_mm", got {LARGE_CALLS_PATH!r}')
    if rows <= MOE_GEMV_ROWS_PER_EXPERT * experts:
        if not gated and k is not None and k <= MOE_GEMV_BY_EXPERT_MAX_K and rows >= experts:
            return "gemv_by_expert"
        return "gemv"
    if LARGE_CALLS_PATH == "grouped_mm" and dtype != torch.bfloat16:
        return "tensor_cores"
    return LARGE_CALLS_PATH


def moe_grouped_linear_triton(x, weight, expert_offsets, gather_index=None, scatter_index=None, activation="none",
                              config=None, pdl: bool | None = None, path: str | None = None,
                              rows_per_program: int | None = None):
    """``moe_grouped_linear`` on the GPU (or under the interpreter).

    ``path``: ``"gemv"``, ``"gemv_by_expert"`` (the GEMV with a program per expert and column tile,
    :func:`~.gemv.launch_gemv`'s ``by_expert``), ``"tensor_cores"`` or ``"grouped_mm"`` (``torch._grouped_mm``, bf16, no
    ``config``) forces that kernel; ``None``: :func:`moe_path`, except that a ``config`` without a
    ``path`` asks for the tensor cores. ``config``: the path's tiles,
    (BM, BN, BK, warps, stages) for the tensor cores (default :func:`moe_gemm_config`), (BLOCK_N,
    BLOCK_K, warps, stages) for the GEMV (default :func:`moe_gemv_config`; by expert
    :func:`~.gemv.grouped_gemv_config`). ``rows_per_program`` (GEMV only, 1-4, default 1; by expert
    :data:`MOE_GEMV_BY_EXPERT_ROWS`): rows of one expert a GEMV program takes (by expert: per pass)."""
    experts, n_rows, k = weight.shape
    check_activation(activation, n_rows)
    if path is not None and path not in MOE_PATHS:
        raise ValueError(f"moe_grouped_linear_triton: `path` must be one of {MOE_PATHS} or None, got {path!r}")
    # grid and tiles over the output columns: with silu_and_mul a program owns BN output columns and
    # reads both their gate and up weight rows, so the config sees the output width N/2 (its
    # programs-per-SM count is then the real one; each streams twice the weight bytes per K step)
    n = grouped_output_width(n_rows, activation)
    rows = gather_index.shape[0] if gather_index is not None else x.shape[0]
    gated = activation == "silu_and_mul"
    path = path or ("tensor_cores" if config is not None else moe_path(rows, experts, weight.dtype, k, gated))
    if path == "grouped_mm":
        if config is not None or rows_per_program is not None:
            raise ValueError("moe_grouped_linear_triton: path='grouped_mm' (torch._grouped_mm) takes no `config` "
                             "or `rows_per_program`")
        return grouped_mm_linear(x, weight, expert_offsets, gather_index, scatter_index, activation)
    if path in ("gemv", "gemv_by_expert"):
        default, rows_per_program = moe_gemv_tiles(path, n, k, x.dtype, gated, rows, rows_per_program)
        config = config or default
        check_gemv_config("moe_grouped_linear_triton", config, rows_per_program)
    else:
        if rows_per_program is not None:
            raise ValueError("moe_grouped_linear_triton: `rows_per_program` is an option of the GEMV path, "
                             "not of the tensor cores")
        if config is not None and len(config) != 5:
            raise ValueError(f"moe_grouped_linear_triton: a tensor-core config is (BM, BN, BK, num_warps, "
                             f"num_stages), got {config}")
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return y
    if k == 0:  # empty products: every activation maps 0 to 0
        return y.zero_()
    act = GROUPED_ACTIVATIONS.index(activation)
    if path in ("gemv", "gemv_by_expert"):
        return launch_gemv(x, weight, y, config, rows_per_program, expert_offsets=expert_offsets,
                           gather_index=gather_index, scatter_index=scatter_index, activation=act, pdl=pdl,
                           by_expert=path == "gemv_by_expert")
    bm, bn, bk, warps, stages = config or moe_gemm_config(rows, n, k, experts, x.dtype, sms=sm_count(x.device),
                                                          gated=gated)
    _grouped_gemm_kernel[(triton.cdiv(n, bn), grouped_row_tiles(rows, bm, experts))](
        x, gather_index if gather_index is not None else expert_offsets, weight, y,
        scatter_index if scatter_index is not None else expert_offsets, expert_offsets,
        rows, n, k, experts,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), weight.stride(2),
        GATHER=gather_index is not None, SCATTER=scatter_index is not None, IEEE=x.dtype == torch.float32 or _INTERPRET,
        ACT=act, BM=bm, BN=bn, BK=bk, BLOCK_E=pow2(experts), num_warps=warps, num_stages=stages,
        **pdl_launch(x.device, pdl),
    )
    return y


def _grouped_cuda(x, weight, expert_offsets, gather_index=None, scatter_index=None, activation="none"):
    _check_grouped(x, weight, expert_offsets, gather_index, scatter_index, activation)
    return moe_grouped_linear_triton(x, weight, expert_offsets, gather_index, scatter_index, activation)


torch.library.register_kernel("hybrid_compile::moe_grouped_linear", "cuda", _grouped_cuda)


# -- the top-k weighted sum ---------------------------------------------------------------------


@triton.jit(do_not_specialize=["H"])
def _combine_top_k_kernel(out, w, y, H, s_out, s_wt, s_wk, s_y,
                          TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr):
    # one program: BLOCK_H columns of one token; its TOP_K rows read along the columns (coalesced)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    pdl_wait_and_release(USE_PDL)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        weight = tl.load(w + t * s_wt + j * s_wk).to(tl.float32)
        row = tl.load(out + (t * TOP_K + j) * s_out + cols, mask=mask, other=0.0).to(tl.float32)
        acc += weight * row
    tl.store(y + t * s_y + cols, acc.to(y.dtype.element_ty), mask=mask)


def moe_combine_top_k_triton(out, top_k_weights, block_h: int | None = None, pdl: bool | None = None):
    """``moe_combine_top_k`` on the GPU (or under the interpreter): grid ``(T, cdiv(H, BLOCK_H))``,
    each program one token's ``BLOCK_H`` columns, its ``top_k`` rows summed in fp32 in order."""
    tokens, top_k = top_k_weights.shape
    h = out.shape[1]
    y = torch.empty(tokens, h, dtype=out.dtype, device=out.device)
    if tokens == 0 or h == 0:
        return y
    if top_k == 0:
        return y.zero_()
    if out.stride(1) != 1:
        out = out.contiguous()
    block_h = block_h or min(1024, pow2(h, 16))
    _combine_top_k_kernel[(tokens, triton.cdiv(h, block_h))](
        out, top_k_weights, y, h, out.stride(0), top_k_weights.stride(0), top_k_weights.stride(1), y.stride(0),
        TOP_K=top_k, BLOCK_H=block_h, num_warps=4 if block_h >= 512 else 1, **pdl_launch(out.device, pdl),
    )
    return y


def _combine_cuda(out, top_k_weights):
    _check_combine(out, top_k_weights)
    return moe_combine_top_k_triton(out, top_k_weights)


torch.library.register_kernel("hybrid_compile::moe_combine_top_k", "cuda", _combine_cuda)


# -- the routing sort ---------------------------------------------------------------------------

#: ``moe_sort_pairs`` ranks up to this many (token, expert) pairs in its kernel (decode and short
#: extends: the counting is quadratic in the pairs); larger calls (prefill, where the sort is a sliver
#: of the step) take torch's sort, the CPU implementation's code.
MOE_SORT_MAX_PAIRS = 4096
#: The sort kernel's tiles: pairs (or experts) a program ranks, and the widest step over the pairs
SORT_BLOCK_I = 16
SORT_MAX_BLOCK_J = 1024
#: ... and under Triton's interpreter, whose cost is per program: 64 pairs a program (the suite's tiny
#: MoE engines sort every layer; tests/test_ops_moe.py checks both sizes)
SORT_BLOCK_I_INTERPRETED = 64


@triton.jit(do_not_specialize=["N", "E"])
def _sort_pairs_kernel(ids, order, token_of_row, offsets, N, E, TOP_K: tl.constexpr, BLOCK_I: tl.constexpr,
                       BLOCK_J: tl.constexpr, USE_PDL: tl.constexpr):
    # programs [0, cdiv(N, BLOCK_I)): BLOCK_I pairs each, ranked by the pairs before them in the stable
    # order (a smaller expert, or the same expert at a smaller index) and stored at their rank; the rest:
    # BLOCK_I experts' offsets each (the pairs of a smaller expert). Both count over all N pairs.
    pid = tl.program_id(0)
    rank_programs = tl.cdiv(N, BLOCK_I)
    lanes = tl.arange(0, BLOCK_I)
    rj = tl.arange(0, BLOCK_J)
    pdl_wait_and_release(USE_PDL)
    # int32 compares (expert ids < E, pair indices < N, both far below 2**31)
    past = 2147483647  # masked pairs: above every expert, never counted
    if pid < rank_programs:
        i = pid * BLOCK_I + lanes
        i_ok = i < N
        e_i = tl.where(i_ok, tl.load(ids + i, mask=i_ok, other=0).to(tl.int32), past)
        rank = tl.zeros((BLOCK_I,), dtype=tl.int32)
        for j0 in range(0, N, BLOCK_J):
            j = j0 + rj
            e_j = tl.where(j < N, tl.load(ids + j, mask=j < N, other=0).to(tl.int32), past)
            before = (e_j[None, :] < e_i[:, None]) | ((e_j[None, :] == e_i[:, None]) & (j[None, :] < i[:, None]))
            rank += tl.sum(before.to(tl.int32), axis=1)
        tl.store(order + rank, i.to(tl.int64), mask=i_ok)
        tl.store(token_of_row + rank, (i // TOP_K).to(tl.int64), mask=i_ok)
    else:
        e = (pid - rank_programs) * BLOCK_I + lanes
        count = tl.zeros((BLOCK_I,), dtype=tl.int32)
        for j0 in range(0, N, BLOCK_J):
            j = j0 + rj
            e_j = tl.where(j < N, tl.load(ids + j, mask=j < N, other=0).to(tl.int32), past)
            count += tl.sum((e_j[None, :] < e[:, None]).to(tl.int32), axis=1)
        tl.store(offsets + e, count.to(tl.int64), mask=e <= E)


def moe_sort_pairs_triton(top_k_index: torch.Tensor, num_experts: int, pdl: bool | None = None,
                          block_i: int | None = None):
    """``moe_sort_pairs`` on the GPU (or under the interpreter): one launch of ``_sort_pairs_kernel`` up
    to :data:`MOE_SORT_MAX_PAIRS` pairs, torch's sort above; ``block_i`` pairs a program (default
    :data:`SORT_BLOCK_I`, :data:`SORT_BLOCK_I_INTERPRETED` under the interpreter)."""
    tokens, top_k = top_k_index.shape
    n = tokens * top_k
    if n > MOE_SORT_MAX_PAIRS:
        return reference_moe_sort_pairs(top_k_index, num_experts)
    ids = top_k_index.reshape(-1)
    device = top_k_index.device
    order = torch.empty(n, dtype=torch.int64, device=device)
    token_of_row = torch.empty(n, dtype=torch.int64, device=device)
    offsets = torch.empty(num_experts + 1, dtype=torch.int64, device=device)
    if n == 0:
        return order, offsets.zero_(), token_of_row
    # a program ranks BLOCK_I pairs (or counts BLOCK_I experts' offsets) against every pair, up to
    # 1,024 of them in one step: many small programs side by side rather than a few looping (the loop's
    # steps are serial latency: 64 x 128 tiles took 13 us a call at 640 pairs on an H200)
    block_i = block_i or (SORT_BLOCK_I_INTERPRETED if _INTERPRET else SORT_BLOCK_I)
    block_j = min(SORT_MAX_BLOCK_J, pow2(n, 16))
    grid = triton.cdiv(n, block_i) + triton.cdiv(num_experts + 1, block_i)
    _sort_pairs_kernel[(grid,)](ids, order, token_of_row, offsets, n, num_experts, TOP_K=top_k, BLOCK_I=block_i,
                                BLOCK_J=block_j, num_warps=4, **pdl_launch(device, pdl))
    return order, offsets, token_of_row


def _sort_cuda(top_k_index, num_experts):
    _check_sort(top_k_index, num_experts)
    return moe_sort_pairs_triton(top_k_index, num_experts)


torch.library.register_kernel("hybrid_compile::moe_sort_pairs", "cuda", _sort_cuda)
