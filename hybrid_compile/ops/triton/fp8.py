"""Triton kernels of the block-FP8 ops (:mod:`hybrid_compile.ops.fp8`).

- ``_quantize_kernel`` (``fp8_quantize_per_token_group``): grid ``(cdiv(M, BR), cdiv(K, 128))``, each
  program ``BR`` rows of one 128-channel group: max magnitude, scale, e4m3 values (``DEQUANT``:
  instead the fp32 ``q * scale``, the reference's dequantized activation, for the GEMV).
- the GEMV (decode: dense calls of at most :data:`FP8_DECODE_MAX_ROWS` rows, grouped calls of at
  most one row per :data:`FP8_GROUPED_GEMV_EXPERTS_PER_ROW` experts): the CUDA-core
  ``gemv_kernel`` of :mod:`.gemv` (shared with the float experts; at batch-1 sizes it quantizes the
  activation itself, :func:`gemv_quantizes_activation`, else after the quantize kernel), ``SCALED`` by the weight's
  128 x 128 block scales: each program owns ``BLOCK_N`` output columns (dividing the 128-row
  weight block, so one block row of scales) and up to four rows; per step along ``K`` it loads a
  ``[BLOCK_N, BLOCK_K]`` e4m3 tile (``BLOCK_K`` up to 2048), converts it to fp32 and multiplies it
  by each row's per-column factor ``a[k] * weight_scale_inv[k // 128]`` (``a``: the dequantized
  activation). Grouped: a program per (row of one expert, column tile), streaming only that
  expert's weight; shape-only launch. Programmatic dependent launch: a dense program loads its
  first weight tile before waiting for the quantize kernel.
- cuBLAS's block-scaled GEMM (``torch._scaled_mm`` with 1 x 128 activation and 128 x 128 weight
  scales; Hopper, CUDA 12.9+, torch 2.9+): dense calls above decode size with whole weight blocks go
  there (:func:`use_cublas`; ``HYBRID_COMPILE_FP8_GEMM`` picks), after the quantize kernel writes the
  activation in its layouts. An H200 (2026-11-28, 4,096 rows of the 80B model's projections): 1.2-1.5x
  our tensor-core kernel below, quantize included.
- ``_fp8_gemm_kernel`` (more rows; the experts, and dense calls cuBLAS does not take): a 1-D grid over ``cdiv(N, BN) x row tiles``, walked ``GROUP_M``
  row tiles at a time column by column (programs side by side share rows and columns in L2); each
  program a ``[BM, BN]`` output tile, stepping along ``K`` one 128-channel block at a time: ``tl.dot`` of an e4m3
  activation tile and an e4m3 weight tile on the FP8 tensor cores (fp32 accumulation), scaled by
  the activation's per-row group scale and the weight's block scale (one per step when ``BN``
  divides 128, one per column when it is a multiple of 128). The
  activation comes from the quantize kernel; ``QUANT_A`` (the earlier decode scheme, kept for the
  sweep's comparison) quantizes each ``[BM, 128]`` tile in the GEMM instead.
  ``GROUPED`` (MoE experts): rows sorted by expert; row tile ``t`` belongs to the expert whose
  cumulative tile count passes ``t``, so the launch is shape-only: ``min(T, cdiv(T, BM) + E)`` row
  tiles bound the used ones; a program past the last used tile runs zero ``K`` steps.

Why the activation is quantized once, by its own kernel: the scale and the e4m3 values must be the
bytes of the plain-torch path (decode and prefill agree, the oracle tests hold), which takes an
IEEE-rounded division per element (:func:`~.common.div_rn`, a multi-instruction sequence on the
GPU; ``x * (1 / scale)`` is an ulp off at times, and an ulp moves a value across an e4m3 rounding
tie). Done inside the GEMM, every one of the ``cdiv(N, BN)`` column programs repeats those
divisions for the same rows: about as many instructions as streaming the weight takes. One small
kernel does them once; it costs a launch, which the programmatic dependent launch overlaps. At one
token the balance turns: the repeated divisions are a few million for the whole call, while the
launch of the quantize kernel (and the GEMV's wait on it) is a fixed few microseconds that batch-1
decode pays 48 times a forward on the 80B shape's 8 layers; there the GEMV quantizes its own rows.

e4m3 rounding: values are rounded to the e4m3 grid explicitly (:func:`~.common.round_to_e4m3`, nearest even)
before the cast, which is then exact: Triton's CPU interpreter's fp32 -> e4m3 cast drops the carry
when rounding up crosses a power of two (0.496 -> 0.25); the GPU's conversion rounds the same way
as the explicit rounding. Everything is a shape-only launch (no host sync): usable in CUDA graphs.
FP8 needs compute capability 8.9 or later; older GPUs get a clear error.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ..fp8 import (
    FP8_BLOCK, FP8_DTYPE, FP8_EPS, FP8_GROUP, FP8_MAX, _cdiv, _check_grouped, _check_linear, _check_quantize,
)
from ..moe import GROUPED_ACTIVATIONS, activate_and_scatter, grouped_output_width
from .common import cast_rne, expert_row_tile, grouped_row_tiles, pow2, quantize_axis, sm_count
from .gemv import GEMV_MAX_ROWS, check_gemv_config, grouped_gemv_config, launch_gemv
from .launch import pdl_launch, pdl_wait_and_release

__all__ = ["FP8_DECODE_MAX_ROWS", "FP8_GEMV_MAX_ROWS", "FP8_GROUPED_GEMV_EXPERTS_PER_ROW", "FP8_GROUPED_GEMV_ROWS",
           "FP8_GEMM_ENV", "FP8_GEMV_FUSED_QUANT_MAX", "cublas_block_gemm_supported",
           "fp8_block_linear_triton", "fp8_dequantized_activation_triton", "fp8_gemm_choice", "fp8_linear_cublas",
           "fp8_quantize_for_cublas", "gemv_quantizes_activation", "fp8_gemm_config", "fp8_gemm_triton",
           "fp8_gemv_config", "fp8_gemv_triton", "fp8_grouped_linear_triton", "fp8_quantize_triton", "use_cublas",
           "use_gemv"]

#: Dense calls of at most this many rows take the GEMV kernel (CUDA cores: per e4m3 weight element
#: one conversion plus one FMA per row). H100 sweep (``benchmarks/fp8.py --sweep``, 2026-11-27): at the
#: Qwen3-Next-80B shapes the GEMV beats the tensor-core path up to 8 rows (1.0-1.5x at 8 rows, two
#: row tiles of 4) and loses at 16 (the tensor cores 1.26x ahead on the geometric mean).
FP8_DECODE_MAX_ROWS = 8
#: Most rows one GEMV program takes (its accumulators are written out one per row).
FP8_GEMV_MAX_ROWS = GEMV_MAX_ROWS
#: Grouped (experts) calls take the GEMV kernel up to one row per this many experts (and always up to
#: :data:`FP8_DECODE_MAX_ROWS` rows), the tensor cores above. H200 sweep (2026-11-28, ``benchmarks/fp8.py
#: --sweep --sweep-only experts --tp 1`` / ``--tp 2``, Qwen3-Next-80B's 512 experts, top-10): at 160 and
#: 640 rows the tensor cores took 0.45-0.87x the GEMV's time on both projections at both slices (the
#: routed gate_up with silu_and_mul at 64 tokens: 204 vs 449 us at TP 1, 116 vs 218 us at TP 2); at 40
#: rows the two were within 1.25x either way; at 10 rows the GEMV won (down_proj 9.6 vs 13.7 us).
FP8_GROUPED_GEMV_EXPERTS_PER_ROW = 16
#: Rows of one expert per GEMV program when grouped: one (the sweep: 1.02-1.74x over row pairs, whose
#: programs wait on a second row that most hit experts do not have); an expert with more rows is
#: streamed once per row, from L2 when its programs run side by side.
FP8_GROUPED_GEMV_ROWS = 1
#: Most element quantizations a GEMV call repeats when it quantizes its own activation (see
#: :func:`gemv_quantizes_activation`). H200 sweep, 2026-11-30 (``benchmarks/fp8.py --sweep
#: --sweep-only dense --sweep-rows 1 2 --gemv-grid ...``, every tile also after the quantize kernel,
#: ``benchmarks/results/fp8_sweep_dense_h200_2026-11-30.json``): the GEMV quantizing its own rows won
#: up to ~1 M repeats (one row of the output projections, 1.05 M: 6.7 against 8.5 us) and lost from
#: ~2 M (two rows of them, 2.1 M: 14.1 against 10.8 us; two rows of q_proj, 4.2 M).
FP8_GEMV_FUSED_QUANT_MAX = 3 << 19
#: Dense GEMV tiles (BLOCK_N, BLOCK_K, warps, stages) by the call's rows (1, 2, 3-4, 5-8). 3-8 rows:
#: the H100 sweep's configs with the best geometric mean over the seven dense shapes, each within
#: 2-13 % of the best config of every shape. 1-2 rows by the weight's shape (:func:`_dense_shape_kind`),
#: from the H200 sweep above (each timed call cycling over weight copies past the L2): one row, wide
#: projections (in_proj_qkvz, q_proj) 11.3 us geometric mean against 13.5 with the earlier (8, 1024,
#: 4, 2), the others 1.08x; two rows, long rows 10.8 against 18.0 us (after the quantize kernel, by
#: :data:`FP8_GEMV_FUSED_QUANT_MAX`), wide 18.0 against 21.1 (where the GEMV is asked for: the ops take
#: the tensor cores for wide projections from two rows, :func:`use_gemv`).
_DENSE_GEMV_TILES = {1: (8, 1024, 8, 2), 2: (8, 1024, 8, 2), 4: (4, 1024, 8, 2), 8: (2, 512, 4, 2)}
_DENSE_GEMV_TILES_BY_SHAPE = {(1, "wide"): (32, 256, 4, 2), (2, "wide"): (16, 256, 4, 2), (2, "long"): (8, 512, 8, 2)}
#: The tensor-core GEMM's decode tiles (16-row tiles, narrow column tiles) up to this many rows.
DECODE_TILE_MAX_ROWS = 64


@triton.jit(do_not_specialize=["M", "M_OUT", "stride_sm"])
def _quantize_kernel(x_ptr, q_ptr, s_ptr, M, M_OUT, K, stride_xm, stride_xk, stride_sm, stride_sg, BR: tl.constexpr,
                     GROUP: tl.constexpr, DEQUANT: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    # rows M..M_OUT (padding for cuBLAS) are written as zeros with the scale of a zero group
    pdl_wait_and_release(USE_PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    r64 = rows.to(tl.int64)
    m = (rows < M)[:, None] & (cols < K)[None, :]
    out = (rows < M_OUT)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + r64[:, None] * stride_xm + cols[None, :] * stride_xk, mask=m, other=0.0).to(tl.float32)
    q, scale = quantize_axis(x, 1)
    if DEQUANT:  # fp32 q * scale: the reference's dequantized activation, the same single rounding
        tl.store(q_ptr + r64[:, None] * K + cols[None, :], q * scale[:, None], mask=out)
    else:
        tl.store(q_ptr + r64[:, None] * K + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=out)
        tl.store(s_ptr + r64 * stride_sm + g * stride_sg, scale, mask=rows < M_OUT)


@triton.jit(do_not_specialize=["M", "N", "K", "E"])
def _fp8_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, y_ptr, offsets_ptr,
    M, N, K, E,
    stride_am, stride_ak, stride_asm,
    stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk,
    QUANT_A: tl.constexpr, GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_wait_and_release(USE_PDL)
    # a 1-D grid over (row tile, column tile), GROUP_M row tiles at a time column by column: the
    # programs running side by side share their activation rows and weight columns in L2
    tiles_n = tl.cdiv(N, BN)
    pid = tl.program_id(0)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_m = tl.minimum(tl.num_programs(0) // tiles_n - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    if GROUPED:
        expert, row0, row_end = expert_row_tile(offsets_ptr, E, pid_m, BM, BLOCK_E)
        w_ptr += tl.minimum(expert, E - 1).to(tl.int64) * stride_we
        ws_ptr += tl.minimum(expert, E - 1).to(tl.int64) * stride_wse
        k_steps = tl.where(expert < E, tl.cdiv(K, BK), 0)
    else:
        row0 = pid_m * BM
        row_end = M
        k_steps = tl.cdiv(K, BK)
    rm = row0 + tl.arange(0, BM)
    m_ok = rm < row_end
    rm64 = rm.to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN)
    n_ok = rn < N
    rk = tl.arange(0, BK)
    if BN <= BK:  # BN divides the 128-row weight block: one scale per K step
        ws_row = ws_ptr + ((pid_n * BN) // BK) * stride_wsn
    else:  # BN spans several weight blocks: a scale per column
        ws_row = ws_ptr + (rn // BK) * stride_wsn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, k_steps):
        kk = kb * BK + rk
        if EVEN_K:  # every K step whole: masks along the rows and columns only
            w_mask = n_ok[:, None]
            a_mask = m_ok[:, None]
        else:
            k_ok = kk < K
            w_mask = n_ok[:, None] & k_ok[None, :]
            a_mask = m_ok[:, None] & k_ok[None, :]
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + kk[None, :] * stride_wk, mask=w_mask, other=0.0)
        if QUANT_A:
            a = tl.load(a_ptr + rm64[:, None] * stride_am + kk[None, :] * stride_ak, mask=a_mask, other=0.0)
            aq, a_scale = quantize_axis(a.to(tl.float32), 1)
            aq = aq.to(w.dtype)
        else:
            aq = tl.load(a_ptr + rm64[:, None] * stride_am + kk[None, :] * stride_ak, mask=a_mask, other=0.0)
            a_scale = tl.load(as_ptr + rm64 * stride_asm + kb, mask=m_ok, other=0.0)
        part = tl.dot(aq, tl.trans(w), out_dtype=tl.float32)
        if BN <= BK:
            acc += part * (a_scale[:, None] * tl.load(ws_row + kb * stride_wsk))
        else:
            acc += part * (a_scale[:, None] * tl.load(ws_row + kb * stride_wsk, mask=n_ok, other=0.0)[None, :])
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm64[:, None] * N + rn[None, :], cast_rne(acc, y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------


def fp8_gemm_config(m: int, n: int, k: int, *, grouped: bool = False, experts: int = 1,
                    sms: int = 132) -> tuple[int, int, int, int, int]:
    """(BM, BN, num_warps, num_stages, GROUP_M) for ``m`` rows (``grouped``: ``m`` rows over ``experts``;
    ``GROUP_M``: row tiles the launch order walks column by column, for L2 reuse).

    Decode (few rows): 16-row tiles and narrow column tiles, so enough programs stream the weight
    at once (at least about two per SM). Prefill: 64 x 128 tiles, 4 warps, the launch walking 8
    row tiles at a time; 3 stages dense, 4 for experts (``benchmarks/fp8.py --sweep --prefill`` on
    an H100, 2026-11-28: the best geometric mean over the 80B model's shapes at 4k and 8k rows,
    1.07x dense and 1.26x experts over the earlier 128 x 128, 8 warps, 3 stages).
    """
    rows_per_group = m / max(experts, 1) if grouped else m
    if m <= DECODE_TILE_MAX_ROWS or rows_per_group <= 16:
        bm = 16 if rows_per_group <= 16 else min(64, pow2(m))
        tiles_m = grouped_row_tiles(m, bm, experts) if grouped else _cdiv(m, bm)
        bn = 128
        while bn > 16 and _cdiv(n, bn) * tiles_m < 2 * sms:
            bn //= 2
        return bm, bn, 4, 4, 1
    return 64, 128, 4, 4 if grouped else 3, 8


def _check_fp8_device(op: str, device: torch.device) -> None:
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise RuntimeError(f"{op}: FP8 tensor cores need compute capability 8.9 or later (Ada, Hopper); "
                           f"{torch.cuda.get_device_name(device)} has {torch.cuda.get_device_capability(device)}")


def fp8_quantize_triton(x: torch.Tensor, pdl: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_quantize_per_token_group`` on the GPU (or under the interpreter)."""
    m, k = x.shape
    g = _cdiv(k, FP8_GROUP)
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(m, g, dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, s.fill_(FP8_EPS / FP8_MAX)
    _launch_quantize(x, q, s, False, pdl)
    return q, s


def fp8_dequantized_activation_triton(x: torch.Tensor, pdl: bool | None = None) -> torch.Tensor:
    """``x`` quantized per token group and dequantized again, ``q.float() * scale`` in fp32 ``[M, K]``
    (the bytes of the reference's dequantized activation): the GEMV kernel's input."""
    m, k = x.shape
    xd = torch.empty(m, k, dtype=torch.float32, device=x.device)
    if m and k:
        _launch_quantize(x, xd, xd, True, pdl)
    return xd


def _launch_quantize(x, out, scale, dequant, pdl, rows_out=None):
    """``rows_out`` (at least ``x``'s rows): rows written, zeros past ``x``'s; ``scale`` ``[rows, G]``
    of any strides (a transposed view: column-major)."""
    m, k = x.shape
    rows_out = m if rows_out is None else rows_out
    g = _cdiv(k, FP8_GROUP)
    br = 16
    stride_sm, stride_sg = (g, 1) if dequant else scale.stride()
    _quantize_kernel[(triton.cdiv(rows_out, br), g)](
        x, out, scale, m, rows_out, k, x.stride(0), x.stride(1), stride_sm, stride_sg, BR=br, GROUP=FP8_GROUP,
        DEQUANT=dequant, num_warps=4, **pdl_launch(x.device, pdl))


def _empty_product(x, n, bias, rows: int | None = None):
    """The ``[M, N]`` output (``M``: ``rows``, else ``x``'s) when there is nothing to stream (``None``
    when there is): no rows or columns, or ``K == 0`` (zeros, plus the bias; every grouped activation
    maps 0 to 0)."""
    m, k = x.shape if rows is None else (rows, x.shape[1])
    if m and n and k:
        return None
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_() if bias is None else y.copy_(bias.to(y.dtype).expand(m, n))
    return None


def _gemm(x, weight, scale_inv, bias, offsets, config, pdl, quant_in_gemm):
    grouped = offsets is not None
    m, k = x.shape
    n = weight.shape[-2]
    experts = weight.shape[0] if grouped else 1
    y = _empty_product(x, n, bias)
    if y is not None:
        return y
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    config = config or fp8_gemm_config(m, n, k, grouped=grouped, experts=experts, sms=sm_count(x.device))
    if len(config) not in (4, 5):
        raise ValueError(f"fp8 GEMM: config is (BM, BN, warps, stages[, GROUP_M]), got {config!r}")
    bm, bn, warps, stages, group_m = (*config, 1) if len(config) == 4 else config
    if FP8_BLOCK % bn and bn % FP8_BLOCK:
        raise ValueError(f"fp8 GEMM: BN={bn} must divide the weight block {FP8_BLOCK} or be a multiple of it")
    if group_m < 1:
        raise ValueError(f"fp8 GEMM: GROUP_M={group_m} must be at least 1")
    if quant_in_gemm:
        a, a_scale = x, x  # a_scale unused
    else:
        a, a_scale = fp8_quantize_triton(x, pdl)
    tiles_m = grouped_row_tiles(m, bm, experts) if grouped else _cdiv(m, bm)
    ws = scale_inv if grouped else scale_inv[None]
    w = weight if grouped else weight[None]
    _fp8_gemm_kernel[(triton.cdiv(n, bn) * tiles_m,)](
        a, a_scale, w, ws, bias if bias is not None else x, y, offsets if grouped else x,
        m, n, k, experts,
        a.stride(0), a.stride(1), a_scale.stride(0),
        w.stride(0), w.stride(1), w.stride(2), ws.stride(0), ws.stride(1), ws.stride(2),
        QUANT_A=quant_in_gemm, GROUPED=grouped, HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=FP8_BLOCK,
        BLOCK_E=pow2(experts), GROUP_M=group_m, EVEN_K=k % FP8_BLOCK == 0, num_warps=warps, num_stages=stages,
        **pdl_launch(x.device, pdl),
    )
    return y


def fp8_gemm_triton(x, weight, weight_scale_inv, bias=None, expert_offsets=None, config=None,
                    pdl: bool | None = None, quant_in_gemm: bool = False):
    """The tensor-core path of both ops (``expert_offsets`` given: grouped over ``weight[E, N, K]``).

    ``config`` = (BM, BN, warps, stages[, GROUP_M]) overrides :func:`fp8_gemm_config`. ``quant_in_gemm``: every
    column program quantizes its activation tile itself (the earlier decode scheme, kept so the sweep
    of ``benchmarks/fp8.py`` can time it against the default: the activation quantized once by the
    quantize kernel, whose IEEE divisions are then not repeated by each of the ``cdiv(N, BN)``
    column programs)."""
    return _gemm(x, weight, weight_scale_inv, bias, expert_offsets, config, pdl, quant_in_gemm)


def fp8_gemv_config(n: int, k: int, rows: int, grouped: bool = False,
                    gated: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of the GEMV kernel for ``n`` output columns over ``k``.

    Dense: ``rows`` = the call's rows, tiles from :data:`_DENSE_GEMV_TILES` (``BLOCK_K`` capped at the
    row length). Grouped: ``rows`` = rows per program, the experts' tiles of 1-byte weights
    (:func:`~.gemv.grouped_gemv_config`, shared with the float experts: ``BLOCK_K`` 256 with 4096 fp32
    accumulators, a row that fits one step streamed in 128-column steps; ``gated``: silu_and_mul's
    gate and up accumulators, ``BLOCK_N`` then a power of two dividing ``n``, so that a tile's up rows
    share one block row of scales). ``benchmarks/fp8.py --sweep`` times a grid around these choices."""
    if grouped:
        block_n, block_k, warps, stages = grouped_gemv_config(n, k, 1, gated, rows)
        if gated:
            block_n = max(1, min(block_n, n & -n))
        return block_n, block_k, warps, stages
    rows = pow2(min(max(rows, 1), FP8_DECODE_MAX_ROWS))
    block_n, block_k, warps, stages = _DENSE_GEMV_TILES_BY_SHAPE.get((rows, _dense_shape_kind(n, k)),
                                                                     _DENSE_GEMV_TILES[rows])
    return block_n, min(block_k, pow2(k, 16)), warps, stages


def _dense_shape_kind(n: int, k: int) -> str:
    """A dense weight ``[n, k]`` as the GEMV tiles tell them apart: "wide" (``n >= 8192``: many output
    columns over short rows, in_proj_qkvz and q_proj of the 80B shape), "long" (``k >= 4096``: the output
    projections), else "other"."""
    return "wide" if n >= 8192 and k < 4096 else "long" if k >= 4096 else "other"


def fp8_gemv_triton(x, weight, weight_scale_inv, bias=None, expert_offsets=None, config=None,
                    pdl: bool | None = None, rows_per_program: int | None = None,
                    quantize_in_gemv: bool | None = None, gather_index=None, scatter_index=None,
                    activation: str = "none"):
    """The GEMV path of both ops (CUDA cores, few rows; ``expert_offsets`` given: grouped, with the
    grouped op's ``gather_index`` / ``scatter_index`` / ``activation``).

    The activation is quantized once (:func:`fp8_dequantized_activation_triton`, the rows of ``x``
    before any gather), or by the GEMV's programs themselves as they stream it (``quantize_in_gemv``;
    None: when :func:`gemv_quantizes_activation`), which saves the quantize kernel's launch; each program
    streams a ``[BLOCK_N, K]`` slab of the weight (of its expert, when grouped) for
    ``rows_per_program`` rows (default: up to 4 rows of a dense call, one row of an expert when
    grouped). ``config`` = (BLOCK_N, BLOCK_K, warps, stages) overrides
    :func:`fp8_gemv_config`. Dense calls of more rows than a program takes launch several row
    tiles (each re-reads the weight, from L2 when the tiles run side by side)."""
    grouped = expert_offsets is not None
    m, k = x.shape
    rows_out = gather_index.shape[0] if gather_index is not None else m
    n = grouped_output_width(weight.shape[-2], activation)
    gated = activation == "silu_and_mul"
    rows = rows_per_program if rows_per_program is not None else (
        FP8_GROUPED_GEMV_ROWS if grouped else min(max(m, 1), FP8_GEMV_MAX_ROWS))
    if config is None:
        config = fp8_gemv_config(n, k, rows if grouped else m, grouped, gated)
    check_gemv_config("fp8_gemv_triton", config, rows)
    if FP8_BLOCK % config[0]:
        raise ValueError(f"fp8_gemv_triton: BLOCK_N={config[0]} must divide the weight block {FP8_BLOCK}")
    y = _empty_product(x, n, bias, rows_out)
    if y is not None:
        return y
    y = torch.empty(rows_out, n, dtype=x.dtype, device=x.device)
    fused = gemv_quantizes_activation(rows_out, n, k, config) if quantize_in_gemv is None else quantize_in_gemv
    a = x if fused else fp8_dequantized_activation_triton(x, pdl)
    return launch_gemv(a, weight if grouped else weight[None], y, config, rows,
                       expert_offsets=expert_offsets, gather_index=gather_index, scatter_index=scatter_index,
                       scale=weight_scale_inv if grouped else weight_scale_inv[None], scale_block=FP8_BLOCK,
                       bias=bias, activation=GROUPED_ACTIVATIONS.index(activation), pdl=pdl, quantize_a=fused)


def gemv_quantizes_activation(m: int, n: int, k: int, config: tuple[int, int, int, int]) -> bool:
    """Whether the GEMV quantizes its own activation: every column program re-quantizes its rows, so
    the call repeats ``m * cdiv(n, BLOCK_N) * k`` element quantizations (IEEE divisions); taken up to
    :data:`FP8_GEMV_FUSED_QUANT_MAX` of them, with ``BLOCK_K`` covering whole 128-column groups."""
    return config[1] >= FP8_GROUP and m * _cdiv(n, config[0]) * k <= FP8_GEMV_FUSED_QUANT_MAX


def use_gemv(rows: int, experts: int | None = None, *, weight_shape: tuple[int, int] | None = None) -> bool:
    """Whether the ops take the GEMV path: a dense call of at most :data:`FP8_DECODE_MAX_ROWS` rows (of
    one row where its ``weight_shape`` ``(N, K)`` is "wide", :func:`_dense_shape_kind`: at two rows the
    tensor-core GEMM took 14.4 / 15.2 us against the best GEMV tile's 18.8 / 16.5 at in_proj_qkvz / q_proj
    of the 80B shape on an H200, 2026-11-30, and its time stays flat with the rows where the GEMV's grows);
    a grouped one of at most that many or of one row per :data:`FP8_GROUPED_GEMV_EXPERTS_PER_ROW` experts
    (decode at batch 1-3 of top-10 over 512 experts: one row on each of a few experts)."""
    if experts is None:
        wide = weight_shape is not None and _dense_shape_kind(*weight_shape) == "wide"
        return rows <= (1 if wide else FP8_DECODE_MAX_ROWS)
    return rows <= max(FP8_DECODE_MAX_ROWS, experts // FP8_GROUPED_GEMV_EXPERTS_PER_ROW)


def fp8_block_linear_triton(x, weight, weight_scale_inv, bias=None, config=None, pdl: bool | None = None):
    """``fp8_block_linear``: the GEMV path for few rows (:func:`use_gemv`), else the tensor cores.
    ``config`` = (BM, BN, warps, stages[, GROUP_M]) asks for the tensor-core path with these tiles."""
    if config is None and use_gemv(x.shape[0], weight_shape=tuple(weight.shape)):
        return fp8_gemv_triton(x, weight, weight_scale_inv, bias, pdl=pdl)
    return fp8_gemm_triton(x, weight, weight_scale_inv, bias, config=config, pdl=pdl)


def fp8_grouped_linear_triton(x, weight, weight_scale_inv, expert_offsets, gather_index=None, scatter_index=None,
                              activation: str = "none", config=None, pdl: bool | None = None):
    """``fp8_grouped_linear``: one launch for every expert, the GEMV path at decode (:func:`use_gemv`:
    the row gather, the activation and the scatter inside the kernel), else the tensor cores (after
    the activation's quantize kernel; the rows gathered before, the activation in fp32 and the scatter
    after, on the GEMM's output in ``x.dtype``). ``config`` = (BM, BN, warps, stages[, GROUP_M]) asks
    for the tensor-core path with these tiles."""
    rows = gather_index.shape[0] if gather_index is not None else x.shape[0]
    if config is None and use_gemv(rows, weight.shape[0]):
        return fp8_gemv_triton(x, weight, weight_scale_inv, expert_offsets=expert_offsets, pdl=pdl,
                               gather_index=gather_index, scatter_index=scatter_index, activation=activation)
    rows_in = x.index_select(0, gather_index) if gather_index is not None else x
    y = fp8_gemm_triton(rows_in, weight, weight_scale_inv, expert_offsets=expert_offsets, config=config, pdl=pdl)
    return activate_and_scatter(y if activation == "none" else y.float(), activation, scatter_index, x.dtype)


# --------------------------------------------------------------------------------------------
# cuBLAS's block-scaled FP8 GEMM (Hopper): the dense op above decode size
# --------------------------------------------------------------------------------------------

#: ``HYBRID_COMPILE_FP8_GEMM``: which GEMM serves a dense ``fp8_block_linear`` call above
#: :data:`FP8_DECODE_MAX_ROWS` rows. ``auto`` (default): cuBLAS's block-scaled GEMM where
#: :func:`cublas_block_gemm_supported` and the shapes allow (:func:`use_cublas`), else our tensor-core
#: kernel; ``triton``: always our kernel; ``cublas``: cuBLAS, an error where it cannot run.
FP8_GEMM_ENV = "HYBRID_COMPILE_FP8_GEMM"
_FP8_GEMM_CHOICES = ("auto", "triton", "cublas")


def fp8_gemm_choice() -> str:
    choice = os.environ.get(FP8_GEMM_ENV, "auto")
    if choice not in _FP8_GEMM_CHOICES:
        raise ValueError(f"{FP8_GEMM_ENV}={choice!r}: expected one of {', '.join(_FP8_GEMM_CHOICES)}")
    return choice


def _version(text: str | None) -> tuple[int, ...]:
    return tuple(int(p) for p in (text or "0").split("+")[0].split(".")[:2] if p.isdigit())


@functools.lru_cache(maxsize=None)
def _cublas_block_gemm_on(index: int) -> bool:
    return (torch.cuda.get_device_capability(index)[0] == 9 and _version(torch.version.cuda) >= (12, 9)
            and _version(torch.__version__) >= (2, 9))


def cublas_block_gemm_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` has the DeepSeek block recipe (1 x 128 activation groups, 128 x 128
    weight blocks) on ``device``: cuBLAS 12.9+ through torch 2.9+, compute capability 9.x (Hopper)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _cublas_block_gemm_on(device.index if device.index is not None else torch.cuda.current_device())


def use_cublas(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a dense ``fp8_block_linear`` call goes to cuBLAS's block-scaled GEMM: above decode size,
    whole 128 x 128 weight blocks, ``K`` a multiple of 4 blocks (torch 2.11 refuses the weight scales
    of other ``K``, padded or not), a row-major weight, a bf16 or fp32 output, on a supporting device
    (``HYBRID_COMPILE_FP8_GEMM=cublas`` makes any other case an error, ``triton`` turns it off)."""
    choice = fp8_gemm_choice()
    if choice == "triton" or use_gemv(x.shape[0]):  # (decode sizes, whatever the shape: our kernels)
        return False
    n, k = weight.shape
    fits = (n % FP8_BLOCK == 0 and k % (4 * FP8_BLOCK) == 0 and weight.is_contiguous()
            and x.dtype in (torch.bfloat16, torch.float32))
    if choice == "cublas" and not (fits and cublas_block_gemm_supported(x.device)):
        raise RuntimeError(f"{FP8_GEMM_ENV}=cublas: cuBLAS's block-scaled FP8 GEMM needs a Hopper GPU, CUDA 12.9+, "
                           f"torch 2.9+, N a multiple of {FP8_BLOCK} and K of {4 * FP8_BLOCK}, a contiguous weight "
                           f"and a bf16 / fp32 activation; got {x.device} ({torch.version.cuda}, torch {torch.__version__}), "
                           f"N={n} K={k}, {x.dtype}")
    return fits and cublas_block_gemm_supported(x.device)


def fp8_quantize_for_cublas(x: torch.Tensor, pdl: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_quantize_per_token_group`` in cuBLAS's layouts: ``(q [M4, K], scale_t [G, M4])``, ``M4`` the
    rows rounded up to a multiple of 4 (rows past ``M``: zeros, scale ``1e-10 / 448``)."""
    m, k = x.shape
    rows = -(-m // 4) * 4
    q = torch.empty(rows, k, dtype=FP8_DTYPE, device=x.device)
    scale_t = torch.empty(_cdiv(k, FP8_GROUP), rows, dtype=torch.float32, device=x.device)
    if rows and k:
        _launch_quantize(x, q, scale_t.t(), False, pdl, rows_out=rows)
    return q, scale_t


def fp8_linear_cublas(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                      bias: torch.Tensor | None = None, pdl: bool | None = None) -> torch.Tensor:
    """``fp8_block_linear`` by cuBLAS's block-scaled GEMM: our quantize kernel writes the e4m3
    activation and its group scales (the bytes of the plain-torch path) in the layouts cuBLAS asks
    for: rows padded to a multiple of 4 (zeros), scales column-major ``[G, M]``. The GEMM accumulates
    each 128-channel block in fp32 and scales it, as the reference does, in another order of additions."""
    m, n = x.shape[0], weight.shape[0]
    y = _empty_product(x, n, bias)
    if y is not None:
        return y
    q, scale_t = fp8_quantize_for_cublas(x, pdl)
    y = torch._scaled_mm(q, weight.t(), scale_a=scale_t.t(), scale_b=weight_scale_inv.contiguous().t(),
                         out_dtype=x.dtype)[:m]
    return y if bias is None else y.add_(bias.to(y.dtype))


def _quantize_cuda(x):
    _check_quantize(x)
    _check_fp8_device("fp8_quantize_per_token_group", x.device)
    return fp8_quantize_triton(x)


def _linear_cuda(x, weight, weight_scale_inv, bias=None):
    _check_linear(x, weight, weight_scale_inv, bias)
    _check_fp8_device("fp8_block_linear", x.device)
    if use_cublas(x, weight):
        return fp8_linear_cublas(x, weight, weight_scale_inv, bias)
    return fp8_block_linear_triton(x, weight, weight_scale_inv, bias)


def _grouped_cuda(x, weight, weight_scale_inv, expert_offsets, gather_index=None, scatter_index=None,
                  activation="none"):
    _check_grouped(x, weight, weight_scale_inv, expert_offsets, gather_index, scatter_index, activation)
    _check_fp8_device("fp8_grouped_linear", x.device)
    return fp8_grouped_linear_triton(x, weight, weight_scale_inv, expert_offsets, gather_index, scatter_index,
                                     activation)


torch.library.register_kernel("hybrid_compile::fp8_quantize_per_token_group", "cuda", _quantize_cuda)
torch.library.register_kernel("hybrid_compile::fp8_block_linear", "cuda", _linear_cuda)
torch.library.register_kernel("hybrid_compile::fp8_grouped_linear", "cuda", _grouped_cuda)
