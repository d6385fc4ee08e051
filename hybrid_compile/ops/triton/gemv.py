"""The CUDA-core GEMV kernel shared by the block-FP8 ops (:mod:`.fp8`: dense and grouped calls at
decode) and the float experts op (:mod:`.moe`: ``moe_grouped_linear`` at decode): ``gemv_kernel``
and its launcher :func:`launch_gemv`.

A few rows against a large weight: tensor-core tiles would waste most of their rows, so each
program streams a ``[BLOCK_N, K]`` slab of the weight on the CUDA cores, built like ``skinny_mm``
(:mod:`.linear`), which streams a bf16 weight at the memory bandwidth. A program owns ``BLOCK_N``
output columns and ``ROWS`` (1-4) rows; per step along ``K`` it loads a ``[BLOCK_N, BLOCK_K]``
weight tile, converts it to fp32 and multiplies it by each row's per-column factor (the row's
activation, times the weight's block scale when ``SCALED``), accumulating one ``[BLOCK_N,
BLOCK_K]`` fp32 tile per row that is summed over ``K`` once at the end. The tiles are shaped
``[BLOCK_N, BLOCK_K / GROUP_W, GROUP_W]``: with block scales (FP8, ``GROUP_W`` up to the
128-column scale block) a thread loads each block's scale once, not once per column (ptxas for
sm_90a: 4x fewer scale loads, the same ~80 registers); without, ``GROUP_W = BLOCK_K``.

One flat grid, row tiles fastest (the row tiles of one column tile run side by side and read its
weight from L2; no grid-axis limit on the column tiles). ``GROUPED`` (MoE experts, rows sorted by
expert): row tile ``t`` belongs to the expert found from ``expert_offsets``
(:func:`~.common.expert_row_tile`), so a program streams only its expert's weight and the launch
is shape-only (:func:`~.common.grouped_row_tiles` row tiles; one past the last used tile reads
nothing). ``GATHER``: row ``r`` reads ``a[gather[r]]``; ``SCATTER``: it is stored at
``y[scatter[r]]``. ``ACT`` (:func:`~.common.apply_activation`): 1 = ``silu_and_mul``, where the same
``K`` loop also streams the up rows ``N + rn`` into a second accumulator per row (with block scales,
``SCALED``, times the scales of their own block row); 2 = relu2. ``HAS_BIAS`` adds a per-column bias
before the activation (not with ``silu_and_mul``). ``QUANT_A`` (block FP8 at batch-1 sizes):
the activation is the float one, and each program quantizes every 128-column run of its rows to
e4m3 and back as it loads it (:func:`~.common.quantize_axis`: the quantize kernel's bytes), so no
quantize kernel runs before the GEMV. No host sync, no atomics: usable in
CUDA graphs. Programmatic dependent launch (:mod:`.launch`): a dense program loads its first
weight tile before waiting for the kernel before it; a grouped one waits first (which expert's
weight to stream depends on the routing that kernel wrote). Every program releases the next
kernel before its stores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import apply_activation, cast_rne, expert_row_tile, grouped_row_tiles, pow2, quantize_axis
from .launch import pdl_launch

__all__ = ["GEMV_MAX_ROWS", "GROUPED_GEMV_TILES", "check_gemv_config", "gemv_by_expert_kernel", "gemv_kernel",
           "grouped_gemv_config", "launch_gemv"]

#: Most rows one GEMV program takes (its accumulators are written out one per row).
GEMV_MAX_ROWS = 4
#: Grouped (experts) GEMV tiles (BLOCK_N, BLOCK_K, num_warps, num_stages) by the weight's element size
#: in bytes, for one row per program and one weight tile per step, shared by the float experts
#: (:mod:`.moe`) and the FP8 ones (:mod:`.fp8`). From the FP8 sweep's grouped choice (BLOCK_K 256,
#: 16 x 256 = 4096 fp32 accumulators a program, 4 warps, 2 stages); for 2-byte weights the same tile:
#: a warp's 16-byte loads then cover one 256-column row (512 bytes), each step streams 8 KB a program
#: (the FP8 tile's 4 KB at twice the bytes per element) and ptxas for sm_90a gives 80 registers, no
#: spill. fp32: BLOCK_K 128 (a warp's 16-byte loads again span one row) and BLOCK_N 32, the same 4096
#: accumulators (96 registers).
GROUPED_GEMV_TILES = {1: (16, 256, 4, 2), 2: (16, 256, 4, 2), 4: (32, 128, 4, 2)}


@triton.jit
def _weight_tiles(w_ptr, ws_row, ws_up_row, rn64, n_ok, N, k0, rk, rg, K, stride_wn, stride_wk, stride_wsk,
                  SCALED: tl.constexpr, GATED: tl.constexpr, GROUP_W: tl.constexpr, SCALE_BLOCK: tl.constexpr,
                  EVEN_K: tl.constexpr):
    """The weight tile at columns ``k0 + rk`` as ``[BLOCK_N, G, GROUP_W]`` fp32, the up rows' tile
    (``GATED``; else the same tile again, unused), the block scale of each run ``[G]`` (``SCALED``:
    the tile's rows share one block row, so one scale load a run; else ones, unused), the up rows'
    (``GATED`` and ``SCALED``: from their own block row ``ws_up_row``; else the same) and the column
    mask ``[G, GROUP_W]``."""
    kk = k0 + rk
    if EVEN_K:
        k_ok = tl.full(rk.shape, 1, tl.int1)
    else:
        k_ok = kk < K
    mask = n_ok[:, None, None] & k_ok[None, :, :]
    cols = kk[None, :, :] * stride_wk
    w = tl.load(w_ptr + rn64[:, None, None] * stride_wn + cols, mask=mask, other=0.0).to(tl.float32)
    w_up = w
    if GATED:
        w_up = tl.load(w_ptr + (rn64 + N)[:, None, None] * stride_wn + cols, mask=mask, other=0.0).to(tl.float32)
    w_scale = tl.full(rg.shape, 1.0, tl.float32)
    w_scale_up = w_scale
    if SCALED:
        run0 = k0 + rg * GROUP_W
        w_scale = tl.load(ws_row + (run0 // SCALE_BLOCK) * stride_wsk, mask=run0 < K, other=0.0)
        w_scale_up = w_scale
        if GATED:
            w_scale_up = tl.load(ws_up_row + (run0 // SCALE_BLOCK) * stride_wsk, mask=run0 < K, other=0.0)
    return w, w_up, w_scale, w_scale_up, k_ok


@triton.jit
def _row_product(acc, acc_up, a_ptr, src, ok, kk, k_ok, stride_am, stride_ak, w, w_up, w_scale, w_scale_up,
                 SCALED: tl.constexpr, GATED: tl.constexpr, QUANT_A: tl.constexpr):
    """One row's accumulators plus the weight tiles times the row's per-column factor: its activation
    ``a[src, kk]`` in fp32 (``QUANT_A``: quantized to e4m3 per run of 128 columns and dequantized, the
    bytes of the quantize kernel's fp32 output; times the block scale when ``SCALED``, the up rows'
    own for the up tile; zeros for a row past the tile's)."""
    a = tl.load(a_ptr + src * stride_am + kk * stride_ak, mask=tl.where(ok, k_ok, False), other=0.0).to(tl.float32)
    if QUANT_A:
        q, a_scale = quantize_axis(a, 1)
        a = q * a_scale[:, None]
    a_up = a
    if SCALED:
        a_up = a * w_scale_up[:, None]
        a = a * w_scale[:, None]
    acc += w * a[None, :, :]
    if GATED:
        acc_up += w_up * a_up[None, :, :]
    return acc, acc_up


@triton.jit
def _step(a_ptr, kk, k_ok, stride_am, stride_ak, w, w_up, w_scale, w_scale_up, src0, src1, src2, src3,
          ok0, ok1, ok2, ok3,
          acc0, acc1, acc2, acc3, up0, up1, up2, up3,
          ROWS: tl.constexpr, SCALED: tl.constexpr, GATED: tl.constexpr, QUANT_A: tl.constexpr):
    """One weight tile applied to the program's ``ROWS`` (1-4) rows."""
    acc0, up0 = _row_product(acc0, up0, a_ptr, src0, ok0, kk, k_ok, stride_am, stride_ak, w, w_up, w_scale,
                             w_scale_up, SCALED, GATED, QUANT_A)
    if ROWS >= 2:
        acc1, up1 = _row_product(acc1, up1, a_ptr, src1, ok1, kk, k_ok, stride_am, stride_ak, w, w_up, w_scale,
                                 w_scale_up, SCALED, GATED, QUANT_A)
    if ROWS >= 3:
        acc2, up2 = _row_product(acc2, up2, a_ptr, src2, ok2, kk, k_ok, stride_am, stride_ak, w, w_up, w_scale,
                                 w_scale_up, SCALED, GATED, QUANT_A)
    if ROWS >= 4:
        acc3, up3 = _row_product(acc3, up3, a_ptr, src3, ok3, kk, k_ok, stride_am, stride_ak, w, w_up, w_scale,
                                 w_scale_up, SCALED, GATED, QUANT_A)
    return acc0, acc1, acc2, acc3, up0, up1, up2, up3


@triton.jit
def _row_index(idx_ptr, row, ok, INDIRECT: tl.constexpr):
    """Where row ``row`` reads or writes: ``idx_ptr[row]`` (gather / scatter) or ``row`` itself, int64."""
    out = row.to(tl.int64)
    if INDIRECT:
        out = tl.load(idx_ptr + row, mask=ok, other=0).to(tl.int64)
    return out


@triton.jit
def _store_row(y_ptr, bias_ptr, scatter_ptr, row, ok, N, rn, n_ok, acc, acc_up,
               HAS_BIAS: tl.constexpr, SCATTER: tl.constexpr, ACT: tl.constexpr):
    """One row's output: the accumulators summed over ``K``, the bias, the activation, one rounding."""
    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    out = apply_activation(out, tl.sum(tl.sum(acc_up, axis=2), axis=1), ACT)
    dst = _row_index(scatter_ptr, row, ok, SCATTER)
    tl.store(y_ptr + dst * N + rn, cast_rne(out, y_ptr.dtype.element_ty), mask=tl.where(ok, n_ok, False))


@triton.jit
def _row_sources(gather_ptr, row0, row_end, ROWS: tl.constexpr, GATHER: tl.constexpr):
    """Rows ``row0 .. row0 + 3`` of a program: whether each is below ``row_end`` and where each reads
    (:func:`_row_index`; past ``ROWS``, row ``row0``'s)."""
    ok0 = row0 < row_end
    ok1 = row0 + 1 < row_end
    ok2 = row0 + 2 < row_end
    ok3 = row0 + 3 < row_end
    src0 = _row_index(gather_ptr, row0, ok0, GATHER)
    src1 = src0
    src2 = src0
    src3 = src0
    if ROWS >= 2:
        src1 = _row_index(gather_ptr, row0 + 1, ok1, GATHER)
    if ROWS >= 3:
        src2 = _row_index(gather_ptr, row0 + 2, ok2, GATHER)
    if ROWS >= 4:
        src3 = _row_index(gather_ptr, row0 + 3, ok3, GATHER)
    return ok0, ok1, ok2, ok3, src0, src1, src2, src3


@triton.jit
def _accumulators(BLOCK_N: tl.constexpr, G: tl.constexpr, GROUP_W: tl.constexpr):
    """Zeroed fp32 accumulators of four rows and their silu_and_mul up products (unused otherwise)."""
    acc0 = tl.zeros((BLOCK_N, G, GROUP_W), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, G, GROUP_W), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, G, GROUP_W), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, G, GROUP_W), dtype=tl.float32)
    up0 = tl.zeros((BLOCK_N, G, GROUP_W), dtype=tl.float32)
    up1 = tl.zeros((BLOCK_N, G, GROUP_W), dtype=tl.float32)
    up2 = tl.zeros((BLOCK_N, G, GROUP_W), dtype=tl.float32)
    up3 = tl.zeros((BLOCK_N, G, GROUP_W), dtype=tl.float32)
    return acc0, acc1, acc2, acc3, up0, up1, up2, up3


@triton.jit
def _store_rows(y_ptr, bias_ptr, scatter_ptr, row0, ok0, ok1, ok2, ok3, N, rn, n_ok, acc0, acc1, acc2, acc3,
                up0, up1, up2, up3, HAS_BIAS: tl.constexpr, SCATTER: tl.constexpr, ACT: tl.constexpr,
                ROWS: tl.constexpr):
    """The program's ``ROWS`` rows' outputs (:func:`_store_row`)."""
    _store_row(y_ptr, bias_ptr, scatter_ptr, row0, ok0, N, rn, n_ok, acc0, up0, HAS_BIAS, SCATTER, ACT)
    if ROWS >= 2:
        _store_row(y_ptr, bias_ptr, scatter_ptr, row0 + 1, ok1, N, rn, n_ok, acc1, up1, HAS_BIAS, SCATTER, ACT)
    if ROWS >= 3:
        _store_row(y_ptr, bias_ptr, scatter_ptr, row0 + 2, ok2, N, rn, n_ok, acc2, up2, HAS_BIAS, SCATTER, ACT)
    if ROWS >= 4:
        _store_row(y_ptr, bias_ptr, scatter_ptr, row0 + 3, ok3, N, rn, n_ok, acc3, up3, HAS_BIAS, SCATTER, ACT)


# N and K stay specialized (their divisibility by 16 lets the activation and output rows load and
# store as vectors); the row count varies per step
@triton.jit(do_not_specialize=["M", "E", "TILES_M"])
def gemv_kernel(
    a_ptr, gather_ptr, w_ptr, ws_ptr, bias_ptr, y_ptr, scatter_ptr, offsets_ptr,
    M, N, K, E, TILES_M,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk,
    GROUPED: tl.constexpr, SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, GATHER: tl.constexpr,
    SCATTER: tl.constexpr, ACT: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_W: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    BLOCK_E: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr, QUANT_A: tl.constexpr = False,
):
    # (silu_and_mul's up rows would need a bias of their own; with block scales they have their own block
    # row, one for the whole tile: the launcher checks that BLOCK_N divides N)
    tl.static_assert(ACT != 1 or not HAS_BIAS)
    tl.static_assert(not QUANT_A or GROUP_W == 128)  # a run of the K step is one activation group
    GATED: tl.constexpr = ACT == 1
    pid = tl.program_id(0)
    pid_m = pid % TILES_M
    pid_n = pid // TILES_M
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn64 = rn.to(tl.int64)
    n_ok = rn < N  # N: output columns (silu_and_mul: the gate rows; the up rows follow at N + rn)
    # a K step as G runs of GROUP_W columns: with block scales each run shares one weight scale
    G: tl.constexpr = BLOCK_K // GROUP_W
    rg = tl.arange(0, G)
    rk = rg[:, None] * GROUP_W + tl.arange(0, GROUP_W)[None, :]
    acc0, acc1, acc2, acc3, up0, up1, up2, up3 = _accumulators(BLOCK_N, G, GROUP_W)
    if GROUPED:
        # which expert's weight to stream depends on the routing the previous kernels wrote: wait first
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        expert, row0, row_end = expert_row_tile(offsets_ptr, E, pid_m, ROWS, BLOCK_E)
        e64 = tl.minimum(expert, E - 1).to(tl.int64)
        w_ptr += e64 * stride_we
        ws_row = ws_ptr + e64 * stride_wse + ((pid_n * BLOCK_N) // SCALE_BLOCK) * stride_wsn
        ws_up_row = ws_ptr + e64 * stride_wse + ((N + pid_n * BLOCK_N) // SCALE_BLOCK) * stride_wsn
        k_end = tl.where(expert < E, K, 0)  # a tile past the last used one reads nothing
        k_start = 0
    else:
        row0 = pid_m * ROWS
        row_end = M
        k_end = K
        ws_row = ws_ptr + ((pid_n * BLOCK_N) // SCALE_BLOCK) * stride_wsn  # BLOCK_N divides the scale block
        ws_up_row = ws_ptr + ((N + pid_n * BLOCK_N) // SCALE_BLOCK) * stride_wsn
        # the first weight tile is loaded before anything that reads the activation: under a
        # programmatic dependent launch it streams while the kernel before is still running
        w, w_up, w_scale, w_scale_up, k_ok = _weight_tiles(w_ptr, ws_row, ws_up_row, rn64, n_ok, N, 0, rk, rg, K,
                                                           stride_wn, stride_wk, stride_wsk, SCALED, GATED, GROUP_W,
                                                           SCALE_BLOCK, EVEN_K)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        k_start = BLOCK_K
    ok0, ok1, ok2, ok3, src0, src1, src2, src3 = _row_sources(gather_ptr, row0, row_end, ROWS, GATHER)
    if not GROUPED:
        acc0, acc1, acc2, acc3, up0, up1, up2, up3 = _step(
            a_ptr, rk, k_ok, stride_am, stride_ak, w, w_up, w_scale, w_scale_up, src0, src1, src2, src3,
            ok0, ok1, ok2, ok3,
            acc0, acc1, acc2, acc3, up0, up1, up2, up3, ROWS, SCALED, GATED, QUANT_A)
    for k0 in range(k_start, k_end, BLOCK_K):
        w, w_up, w_scale, w_scale_up, k_ok = _weight_tiles(w_ptr, ws_row, ws_up_row, rn64, n_ok, N, k0, rk, rg, K,
                                                           stride_wn, stride_wk, stride_wsk, SCALED, GATED, GROUP_W,
                                                           SCALE_BLOCK, EVEN_K)
        acc0, acc1, acc2, acc3, up0, up1, up2, up3 = _step(
            a_ptr, k0 + rk, k_ok, stride_am, stride_ak, w, w_up, w_scale, w_scale_up, src0, src1, src2, src3,
            ok0, ok1, ok2, ok3,
            acc0, acc1, acc2, acc3, up0, up1, up2, up3, ROWS, SCALED, GATED, QUANT_A)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start launching
    _store_rows(y_ptr, bias_ptr, scatter_ptr, row0, ok0, ok1, ok2, ok3, N, rn, n_ok, acc0, acc1, acc2, acc3,
                up0, up1, up2, up3, HAS_BIAS, SCATTER, ACT, ROWS)


# N and K stay specialized as in gemv_kernel; the expert count is a launch size
@triton.jit(do_not_specialize=["E"])
def gemv_by_expert_kernel(
    a_ptr, gather_ptr, w_ptr, ws_ptr, y_ptr, scatter_ptr, offsets_ptr,
    N, K, E,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk,
    SCALED: tl.constexpr, GATHER: tl.constexpr, SCATTER: tl.constexpr, ACT: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_W: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    # program (expert, column tile), column tiles fastest (an expert's slabs lie back to back): every row
    # of the expert, ROWS at a time, against its [BLOCK_N, K] slab (one pass when it has at most ROWS rows)
    GATED: tl.constexpr = ACT == 1
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_n = pid % tiles_n
    expert = pid // tiles_n
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn64 = rn.to(tl.int64)
    n_ok = rn < N
    G: tl.constexpr = BLOCK_K // GROUP_W
    rg = tl.arange(0, G)
    rk = rg[:, None] * GROUP_W + tl.arange(0, GROUP_W)[None, :]
    e64 = expert.to(tl.int64)
    w_ptr += e64 * stride_we
    ws_row = ws_ptr + e64 * stride_wse + ((pid_n * BLOCK_N) // SCALE_BLOCK) * stride_wsn
    ws_up_row = ws_ptr + e64 * stride_wse + ((N + pid_n * BLOCK_N) // SCALE_BLOCK) * stride_wsn
    if USE_PDL:  # the expert's rows are the routing's, written by the kernels before
        tl.extra.cuda.gdc_wait()
    lo = tl.load(offsets_ptr + expert).to(tl.int32)
    hi = tl.load(offsets_ptr + expert + 1).to(tl.int32)
    for chunk in range(0, tl.cdiv(hi - lo, ROWS)):
        row0 = lo + chunk * ROWS
        ok0, ok1, ok2, ok3, src0, src1, src2, src3 = _row_sources(gather_ptr, row0, hi, ROWS, GATHER)
        acc0, acc1, acc2, acc3, up0, up1, up2, up3 = _accumulators(BLOCK_N, G, GROUP_W)
        for k0 in range(0, K, BLOCK_K):
            w, w_up, w_scale, w_scale_up, k_ok = _weight_tiles(w_ptr, ws_row, ws_up_row, rn64, n_ok, N, k0, rk, rg, K,
                                                               stride_wn, stride_wk, stride_wsk, SCALED, GATED,
                                                               GROUP_W, SCALE_BLOCK, EVEN_K)
            acc0, acc1, acc2, acc3, up0, up1, up2, up3 = _step(
                a_ptr, k0 + rk, k_ok, stride_am, stride_ak, w, w_up, w_scale, w_scale_up, src0, src1, src2, src3,
                ok0, ok1, ok2, ok3,
                acc0, acc1, acc2, acc3, up0, up1, up2, up3, ROWS, SCALED, GATED, False)
        _store_rows(y_ptr, y_ptr, scatter_ptr, row0, ok0, ok1, ok2, ok3, N, rn, n_ok, acc0, acc1, acc2, acc3,
                    up0, up1, up2, up3, False, SCATTER, ACT, ROWS)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


def grouped_gemv_config(n: int, k: int, element_bytes: int, gated: bool = False,
                        rows: int = 1) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of a grouped GEMV for ``n`` output columns over ``k``
    input channels of ``element_bytes`` weights: :data:`GROUPED_GEMV_TILES`, ``BLOCK_N`` halved for
    ``gated`` (``silu_and_mul``: a gate and an up accumulator per column) and divided by the ``rows`` a
    program takes; a ``K`` shorter than ``BLOCK_K`` shortens the tile and widens ``BLOCK_N`` to keep
    the accumulators (at most 128, the FP8 scale block, and no wider than ``n`` needs). A weight row
    that fits one step of a tile wider than 128 columns is streamed in 128-column steps (BLOCK_N
    doubled): on an H200 (2026-11-28, ``benchmarks/fused_moe.py --sweep --tp 2``) Qwen3-Next-80B's
    bf16 ``down_proj`` at TP 2 (K = 256) took 46.7 / 147.1 us at 16 / 64 tokens against 55.9 / 187.8 us
    in one 256-column step."""
    block_n, block_k, warps, stages = GROUPED_GEMV_TILES[element_bytes]
    fit = min(block_k, pow2(k, 16))
    if fit > 128 and k <= fit:
        fit = 128
    accumulators = block_n * block_k // ((2 if gated else 1) * pow2(rows))
    block_n = max(2, min(128, pow2(n, 2), accumulators // fit))
    return block_n, fit, warps, stages


def check_gemv_config(op: str, config: tuple[int, int, int, int], rows: int) -> None:
    """``config`` = (BLOCK_N, BLOCK_K, warps, stages): ``BLOCK_N`` a power of two, ``BLOCK_K`` a power
    of two >= 16; ``rows`` per program 1..4."""
    if len(config) != 4:
        raise ValueError(f"{op}: a GEMV config is (BLOCK_N, BLOCK_K, num_warps, num_stages), got {config}")
    block_n, block_k = config[:2]
    if block_n < 1 or block_n & (block_n - 1) or block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"{op}: BLOCK_N={block_n} must be a power of two and BLOCK_K={block_k} a power of two >= 16")
    if not 1 <= rows <= GEMV_MAX_ROWS:
        raise ValueError(f"{op}: rows_per_program must be 1..{GEMV_MAX_ROWS}, got {rows}")


def launch_gemv(a: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, config: tuple[int, int, int, int], rows: int,
                *, expert_offsets: torch.Tensor | None = None, gather_index: torch.Tensor | None = None,
                scatter_index: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                scale_block: int = 1, bias: torch.Tensor | None = None, activation: int = 0,
                pdl: bool | None = None, quantize_a: bool = False, by_expert: bool = False) -> torch.Tensor:
    """Fill ``y [R, N]`` with ``act(a[src(r)] @ weight[e(r), cols].T (+ bias))`` for each row ``r``.

    ``a [X, K]`` (any strides); ``weight [E, N_w, K]`` (``E == 1`` for a dense call) whose rows
    ``[0, N)`` are the output columns (``activation`` 1, silu_and_mul: ``N_w = 2N``, the up rows
    follow); ``config`` = (BLOCK_N, BLOCK_K, num_warps, num_stages); ``rows`` per program.
    ``expert_offsets [E + 1]``: grouped rows sorted by expert; ``gather_index`` / ``scatter_index``
    ``[R]``: where each row reads / is stored; ``scale [E, cdiv(N_w, scale_block), cdiv(K,
    scale_block)]``: the weight's fp32 block scales (``BLOCK_N`` then divides ``scale_block``).
    ``quantize_a``: ``a`` is the float activation, which each program quantizes per 128-column group
    as it streams it (block FP8: ``scale_block`` 128 and ``BLOCK_K`` at least 128). ``by_expert``
    (grouped, no bias, no ``quantize_a``): ``gemv_by_expert_kernel``, a program per (expert, column
    tile) taking all the expert's rows, ``rows`` at a time, instead of one per (row tile, column tile)."""
    block_n, block_k, warps, stages = config
    if activation == 1 and scale is not None and y.shape[1] % block_n:
        raise ValueError(f"launch_gemv: silu_and_mul with block scales needs BLOCK_N ({block_n}) to divide the "
                         f"output columns ({y.shape[1]}): a tile's up rows then share one block row of scales")
    if quantize_a and (scale is None or scale_block != 128 or block_k < 128):
        raise ValueError(f"launch_gemv: quantize_a needs 128 x 128 block scales and BLOCK_K >= 128, got scale_block "
                         f"{scale_block}, BLOCK_K {block_k}")
    experts, _, k = weight.shape
    m, n = y.shape
    grouped = expert_offsets is not None
    ws = scale if scale is not None else weight  # (unread without SCALED)
    gather = gather_index if gather_index is not None else a
    scatter = scatter_index if scatter_index is not None else a
    strides = (a.stride(0), a.stride(1), *weight.stride(), *(scale.stride() if scale is not None else (0, 0, 0)))
    # what both kernels take by keyword
    shared = dict(SCALED=scale is not None, GATHER=gather_index is not None, SCATTER=scatter_index is not None,
                  ACT=activation, ROWS=rows, BLOCK_N=block_n, BLOCK_K=block_k,
                  GROUP_W=min(block_k, scale_block) if scale is not None else block_k, SCALE_BLOCK=scale_block,
                  EVEN_K=k % block_k == 0, num_warps=warps, num_stages=stages, **pdl_launch(a.device, pdl))
    if by_expert:
        if not grouped or bias is not None or quantize_a:
            raise ValueError("launch_gemv: by_expert needs expert_offsets and takes no bias or quantize_a")
        gemv_by_expert_kernel[(experts * triton.cdiv(n, block_n),)](
            a, gather, weight, ws, y, scatter, expert_offsets, n, k, experts, *strides, **shared)
        return y
    tiles_m = grouped_row_tiles(m, rows, experts) if grouped else triton.cdiv(m, rows)
    gemv_kernel[(tiles_m * triton.cdiv(n, block_n),)](
        a, gather, weight, ws, bias if bias is not None else a, y, scatter, expert_offsets if grouped else a,
        m, n, k, experts, tiles_m, *strides,
        GROUPED=grouped, HAS_BIAS=bias is not None, BLOCK_E=pow2(experts), QUANT_A=quantize_a, **shared,
    )
    return y
