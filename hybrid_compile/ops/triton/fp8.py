"""Triton kernels of the block-FP8 ops (:mod:`hybrid_compile.ops.fp8`).

- ``_quantize_kernel`` (``fp8_quantize_per_token_group``): grid ``(cdiv(M, BR), cdiv(K, 128))``, each
  program ``BR`` rows of one 128-channel group: max magnitude, scale, e4m3 values.
- ``_fp8_gemm_kernel`` (``fp8_block_linear`` and ``fp8_grouped_linear``): grid ``(cdiv(N, BN), row
  tiles)``; each program a ``[BM, BN]`` output tile, stepping along ``K`` one 128-channel block at a
  time: ``tl.dot`` of an e4m3 activation tile and an e4m3 weight tile on the FP8 tensor cores (fp32
  accumulation), scaled by the activation's per-row group scale and the weight's block scale (``BN``
  divides 128, so a tile's columns share one weight scale per step). Two ways to get the activation:

  * ``QUANT_A`` (the decode path, ``M <= 64``): the kernel reads the bf16/fp32 activation and
    quantizes each ``[BM, 128]`` tile itself, with the same arithmetic as ``_quantize_kernel``, so
    a decode projection is one launch; the few rows are re-read by every column program, which
    costs nothing next to streaming the weight.
  * otherwise (prefill) the activation is quantized once by ``_quantize_kernel`` and the GEMM
    reads e4m3 values and their scales.

  ``GROUPED`` (MoE experts): rows are sorted by expert; row tile ``t`` belongs to the expert whose
  cumulative tile count passes ``t``, computed in the kernel from ``expert_offsets`` (a vector
  cumsum over the experts), so the launch is shape-only: ``min(T, cdiv(T, BM) + E)`` row tiles
  bound the used ones; a program past the last used tile runs zero ``K`` steps and stores nothing.

e4m3 rounding: values are rounded to the e4m3 grid explicitly (:func:`round_to_e4m3`, nearest even)
before the cast, which is then exact: Triton's CPU interpreter's fp32 -> e4m3 cast drops the carry
when rounding up crosses a power of two (0.496 -> 0.25); the GPU's conversion rounds the same way
as the explicit rounding. Everything is a shape-only launch (no host sync): usable in CUDA graphs.
FP8 tensor cores need compute capability 8.9 or later; older GPUs get a clear error.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..fp8 import (
    FP8_BLOCK, FP8_DTYPE, FP8_EPS, FP8_GROUP, FP8_MAX, _cdiv, _check_grouped, _check_linear, _check_quantize,
)
from .common import cast_rne, div_rn, expert_row_tile, grouped_row_tiles, pow2
from .launch import pdl_launch, pdl_wait_and_release

__all__ = ["fp8_gemm_config", "fp8_block_linear_triton", "fp8_grouped_linear_triton", "fp8_quantize_triton",
           "QUANT_IN_GEMM_MAX_ROWS"]

#: Up to this many rows the GEMM quantizes the activation itself (the decode path).
QUANT_IN_GEMM_MAX_ROWS = 64


@triton.jit
def round_to_e4m3(v):
    """fp32 ``v`` (already within +-448) rounded to the nearest e4m3 value, ties to even, as fp32."""
    a = tl.abs(v)
    u = v.to(tl.uint32, bitcast=True)
    normal = (((u + 0x7FFFF + ((u >> 20) & 1)) >> 20) << 20).to(tl.float32, bitcast=True)  # 3 mantissa bits
    sub = (a + 16384.0) - 16384.0  # subnormals: multiples of 2**-9 (the fp32 ulp of 2**14)
    sub = tl.where(v < 0, -sub, sub)
    return tl.where(a < 0.015625, sub, normal)


@triton.jit
def _quantize_tile(x):
    """``[R, 128]`` fp32 -> (e4m3-valued fp32 tile, per-row fp32 scale)."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = div_rn(tl.maximum(amax, FP8_EPS_C), FP8_MAX_C)  # IEEE divisions: the CPU path's bytes
    q = tl.minimum(tl.maximum(div_rn(x, scale[:, None]), -FP8_MAX_C), FP8_MAX_C)
    return round_to_e4m3(q), scale


FP8_EPS_C = tl.constexpr(FP8_EPS)
FP8_MAX_C = tl.constexpr(FP8_MAX)


@triton.jit(do_not_specialize=["M"])
def _quantize_kernel(x_ptr, q_ptr, s_ptr, M, K, G, stride_xm, stride_xk, BR: tl.constexpr, GROUP: tl.constexpr,
                     USE_PDL: tl.constexpr = False):
    pdl_wait_and_release(USE_PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    r64 = rows.to(tl.int64)
    m = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + r64[:, None] * stride_xm + cols[None, :] * stride_xk, mask=m, other=0.0).to(tl.float32)
    q, scale = _quantize_tile(x)
    tl.store(q_ptr + r64[:, None] * K + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=m)
    tl.store(s_ptr + r64 * G + g, scale, mask=rows < M)


@triton.jit(do_not_specialize=["M", "N", "K", "E"])
def _fp8_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, y_ptr, offsets_ptr,
    M, N, K, E,
    stride_am, stride_ak, stride_asm,
    stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk,
    QUANT_A: tl.constexpr, GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BLOCK_E: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait_and_release(USE_PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
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
    ws_row = ws_ptr + ((pid_n * BN) // BK) * stride_wsn  # BN divides the 128-row weight block
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, k_steps):
        kk = kb * BK + rk
        k_ok = kk < K
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + kk[None, :] * stride_wk,
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        a_mask = m_ok[:, None] & k_ok[None, :]
        if QUANT_A:
            a = tl.load(a_ptr + rm64[:, None] * stride_am + kk[None, :] * stride_ak, mask=a_mask, other=0.0)
            aq, a_scale = _quantize_tile(a.to(tl.float32))
            aq = aq.to(w.dtype)
        else:
            aq = tl.load(a_ptr + rm64[:, None] * stride_am + kk[None, :] * stride_ak, mask=a_mask, other=0.0)
            a_scale = tl.load(as_ptr + rm64 * stride_asm + kb, mask=m_ok, other=0.0)
        w_scale = tl.load(ws_row + kb * stride_wsk)
        part = tl.dot(aq, tl.trans(w), out_dtype=tl.float32)
        acc += part * (a_scale[:, None] * w_scale)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm64[:, None] * N + rn[None, :], cast_rne(acc, y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def fp8_gemm_config(m: int, n: int, k: int, *, grouped: bool = False, experts: int = 1,
                    sms: int = 132) -> tuple[int, int, int, int]:
    """(BM, BN, num_warps, num_stages) for ``m`` rows (``grouped``: ``m`` rows over ``experts``).

    Decode (few rows): 16-row tiles and narrow column tiles, so enough programs stream the weight
    at once (at least about two per SM). Prefill: 128 x 128 tiles (64-row tiles for experts, whose
    row groups are short), 8 warps and 3 stages.
    """
    rows_per_group = m / max(experts, 1) if grouped else m
    if m <= QUANT_IN_GEMM_MAX_ROWS or rows_per_group <= 16:
        bm = 16 if rows_per_group <= 16 else min(64, pow2(m))
        tiles_m = grouped_row_tiles(m, bm, experts) if grouped else _cdiv(m, bm)
        bn = 128
        while bn > 16 and _cdiv(n, bn) * tiles_m < 2 * sms:
            bn //= 2
        return bm, bn, 4, 4
    bm = 64 if grouped and rows_per_group < 128 else 128
    return bm, 128, 8, 3


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
    br = 16
    _quantize_kernel[(triton.cdiv(m, br), g)](
        x, q, s, m, k, g, x.stride(0), x.stride(1), BR=br, GROUP=FP8_GROUP, num_warps=4, **pdl_launch(x.device, pdl))
    return q, s


def _gemm(x, weight, scale_inv, bias, offsets, config, pdl):
    grouped = offsets is not None
    m, k = x.shape
    n = weight.shape[-2]
    experts = weight.shape[0] if grouped else 1
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_() if bias is None else y.copy_(bias.to(y.dtype).expand(m, n))
    bm, bn, warps, stages = config or fp8_gemm_config(m, n, k, grouped=grouped, experts=experts,
                                                       sms=_sm_count(x.device))
    if FP8_BLOCK % bn:
        raise ValueError(f"fp8 GEMM: BN={bn} must divide the weight block {FP8_BLOCK}")
    quant_a = m <= QUANT_IN_GEMM_MAX_ROWS
    if quant_a:
        a, a_scale = x, x  # a_scale unused
    else:
        a, a_scale = fp8_quantize_triton(x, pdl)
    tiles_m = grouped_row_tiles(m, bm, experts) if grouped else _cdiv(m, bm)
    ws = scale_inv if grouped else scale_inv[None]
    w = weight if grouped else weight[None]
    _fp8_gemm_kernel[(triton.cdiv(n, bn), tiles_m)](
        a, a_scale, w, ws, bias if bias is not None else x, y, offsets if grouped else x,
        m, n, k, experts,
        a.stride(0), a.stride(1), a_scale.stride(0),
        w.stride(0), w.stride(1), w.stride(2), ws.stride(0), ws.stride(1), ws.stride(2),
        QUANT_A=quant_a, GROUPED=grouped, HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=FP8_BLOCK,
        BLOCK_E=pow2(experts), num_warps=warps, num_stages=stages, **pdl_launch(x.device, pdl),
    )
    return y


def fp8_block_linear_triton(x, weight, weight_scale_inv, bias=None, config=None, pdl: bool | None = None):
    """``fp8_block_linear`` (``config`` = (BM, BN, warps, stages) overrides :func:`fp8_gemm_config`)."""
    return _gemm(x, weight, weight_scale_inv, bias, None, config, pdl)


def fp8_grouped_linear_triton(x, weight, weight_scale_inv, expert_offsets, config=None, pdl: bool | None = None):
    """``fp8_grouped_linear``: one launch for every expert."""
    return _gemm(x, weight, weight_scale_inv, None, expert_offsets, config, pdl)


def _quantize_cuda(x):
    _check_quantize(x)
    _check_fp8_device("fp8_quantize_per_token_group", x.device)
    return fp8_quantize_triton(x)


def _linear_cuda(x, weight, weight_scale_inv, bias=None):
    _check_linear(x, weight, weight_scale_inv, bias)
    _check_fp8_device("fp8_block_linear", x.device)
    return fp8_block_linear_triton(x, weight, weight_scale_inv, bias)


def _grouped_cuda(x, weight, weight_scale_inv, expert_offsets):
    _check_grouped(x, weight, weight_scale_inv, expert_offsets)
    _check_fp8_device("fp8_grouped_linear", x.device)
    return fp8_grouped_linear_triton(x, weight, weight_scale_inv, expert_offsets)


torch.library.register_kernel("hybrid_compile::fp8_quantize_per_token_group", "cuda", _quantize_cuda)
torch.library.register_kernel("hybrid_compile::fp8_block_linear", "cuda", _linear_cuda)
torch.library.register_kernel("hybrid_compile::fp8_grouped_linear", "cuda", _grouped_cuda)
