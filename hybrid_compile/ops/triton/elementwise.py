"""Triton kernels of the elementwise / row-wise ops: ``gdn_gating`` and ``gated_rms_norm``.

Same schemas and semantics as :mod:`hybrid_compile.ops.gdn` (``gdn_gating``) and
:mod:`hybrid_compile.ops.norm` (``gated_rms_norm``), including the norm's casting order.

- ``gdn_gating``: grid ``cdiv(T, BT)``, each program a ``[BT, next_pow2(Hv)]`` tile of
  ``a`` / ``b`` (strided views allowed), fp32 math, two contiguous fp32 outputs.
- ``gated_rms_norm``: grid ``(cdiv(T, BR), D // group_size)``, each program normalises ``BR``
  rows of one group. A group of up to 4096 channels is held in registers (one read of ``x`` /
  ``z``); a larger group is processed in chunks of 4096 with a second read. Casts as the op:
  the normalised value is rounded to ``x.dtype``, multiplied by the weight and rounded to
  ``promote_types(weight.dtype, x.dtype)``, then (``norm_before_gate``) multiplied by
  ``silu(z)`` in fp32, and finally rounded to ``x.dtype``.

Both are shape-only launches (no host sync), usable inside CUDA graphs.

Also :func:`cast_rne`, the fp32 -> storage-dtype cast the sibling kernel modules use, so bf16
stores round to nearest even under Triton's CPU interpreter too (which otherwise truncates).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..gdn import _check_gdn_gating
from ..norm import _check_gated_rms_norm
from .launch import pdl_launch, pdl_wait_and_release

__all__ = ["cast_rne", "gdn_gating_triton", "gated_rms_norm_triton"]


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@triton.jit
def cast_rne(v, dtype: tl.constexpr):
    """fp32 ``v`` cast to ``dtype`` rounding to nearest even, as torch does.

    The GPU backend already rounds this way; Triton's interpreter truncates fp32 -> bf16, so the
    bf16 case rounds explicitly on the bits (the final cast is then exact). NaN stays NaN.
    Shared by the sibling kernel modules.
    """
    if dtype == tl.bfloat16:
        u = v.to(tl.uint32, bitcast=True)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        v = tl.where(v != v, v, r.to(tl.float32, bitcast=True))
    return v.to(dtype)


# --------------------------------------------------------------------------------------------
# gdn_gating
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=['T'])  # batch-dependent counts: one compile for all
def _gdn_gating_kernel(
    A_ptr, a_ptr, b_ptr, dt_ptr, g_ptr, beta_ptr,
    T, H, stride_at, stride_ah, stride_bt, stride_bh,
    sp_beta, sp_threshold,
    BT: tl.constexpr, BH: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait_and_release(USE_PDL)  # programmatic dependent launch: wait for the kernel before (launch.py)
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.arange(0, BH)
    rmask = rows < T
    cmask = cols < H
    m = rmask[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)[:, None]
    a = tl.load(a_ptr + r64 * stride_at + cols[None, :] * stride_ah, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + r64 * stride_bt + cols[None, :] * stride_bh, mask=m, other=0.0).to(tl.float32)
    A = tl.load(A_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    x = a + dt[None, :]
    bx = sp_beta * x
    e = tl.exp(tl.minimum(bx, sp_threshold))  # the clamp only avoids inf in the unused branch
    log1p_e = tl.where(e < 1e-4, e * (1.0 - 0.5 * e), tl.log(1.0 + e))
    sp = tl.where(bx > sp_threshold, x, log1p_e / sp_beta)
    g = -tl.exp(A)[None, :] * sp
    beta = tl.sigmoid(b)
    out = rows.to(tl.int64)[:, None] * H + cols[None, :]
    tl.store(g_ptr + out, g, mask=m)
    tl.store(beta_ptr + out, beta, mask=m)


def gdn_gating_triton(
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``gdn_gating`` (same arguments and results as the op: fresh fp32 ``(g, beta)``)."""
    T, H = a.shape
    g = torch.empty((T, H), dtype=torch.float32, device=a.device)
    beta = torch.empty((T, H), dtype=torch.float32, device=a.device)
    if T == 0 or H == 0:
        return g, beta
    bh = _pow2(H)
    bt = max(1, min(128, 2048 // bh))
    _gdn_gating_kernel[(triton.cdiv(T, bt),)](
        A_log.contiguous(), a, b, dt_bias.contiguous(), g, beta,
        T, H, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        float(softplus_beta), float(softplus_threshold),
        BT=bt, BH=bh, num_warps=4,
        **pdl_launch(a.device),
    )
    return g, beta


# --------------------------------------------------------------------------------------------
# gated_rms_norm
# --------------------------------------------------------------------------------------------

_ROUND_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_MAX_GROUP_BLOCK = 4096


@triton.jit
def _norm_input(x_ptr, z_ptr, rows64, rmask, cols, cmask, stride_xt, stride_xd, stride_zt, stride_zd,
                HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr):
    """fp32 value that gets normalised: x, or x * silu(z) in the gate-first (Mamba2) order."""
    m = rmask[:, None] & cmask[None, :]
    h = tl.load(x_ptr + rows64[:, None] * stride_xt + cols[None, :] * stride_xd, mask=m, other=0.0).to(tl.float32)
    if HAS_Z and not NORM_BEFORE_GATE:
        z = tl.load(z_ptr + rows64[:, None] * stride_zt + cols[None, :] * stride_zd, mask=m, other=0.0)
        z = z.to(tl.float32)
        h = h * (z * tl.sigmoid(z))
    return h


@triton.jit
def _norm_output(h, rstd, x_ptr, w_ptr, z_ptr, out_ptr, rows64, rmask, cols, cmask, D, NW,
                 stride_zt, stride_zd,
                 HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, ROUND: tl.constexpr):
    m = rmask[:, None] & cmask[None, :]
    n = h * rstd[:, None]
    n = cast_rne(n, x_ptr.dtype.element_ty).to(tl.float32)  # normalised value cast to the input dtype
    w = tl.load(w_ptr + cols % NW, mask=cmask, other=0.0).to(tl.float32)  # NW: D, or G (one weight per group)
    p = w[None, :] * n
    if ROUND == 1:  # weight * x_dtype product is bf16 (torch type promotion)
        p = cast_rne(p, tl.bfloat16).to(tl.float32)
    elif ROUND == 2:
        p = cast_rne(p, tl.float16).to(tl.float32)
    if HAS_Z and NORM_BEFORE_GATE:
        z = tl.load(z_ptr + rows64[:, None] * stride_zt + cols[None, :] * stride_zd, mask=m, other=0.0)
        z = z.to(tl.float32)
        p = p * (z * tl.sigmoid(z))
    tl.store(out_ptr + rows64[:, None] * D + cols[None, :], cast_rne(p, out_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=['T'])  # batch-dependent counts: one compile for all
def _gated_rms_norm_kernel(
    x_ptr, w_ptr, z_ptr, out_ptr,
    T, D, G, NW, stride_xt, stride_xd, stride_zt, stride_zd, eps,
    HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, ROUND: tl.constexpr,
    BR: tl.constexpr, BG: tl.constexpr, NCHUNK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait_and_release(USE_PDL)  # programmatic dependent launch: wait for the kernel before (launch.py)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    col0 = tl.program_id(1) * G
    rmask = rows < T
    rows64 = rows.to(tl.int64)
    if NCHUNK == 1:
        cols = col0 + tl.arange(0, BG)
        cmask = cols < col0 + G
        h = _norm_input(x_ptr, z_ptr, rows64, rmask, cols, cmask, stride_xt, stride_xd, stride_zt, stride_zd,
                        HAS_Z, NORM_BEFORE_GATE)
        rstd = tl.math.rsqrt(tl.sum(h * h, 1) / G + eps)
        _norm_output(h, rstd, x_ptr, w_ptr, z_ptr, out_ptr, rows64, rmask, cols, cmask, D, NW, stride_zt, stride_zd,
                     HAS_Z, NORM_BEFORE_GATE, ROUND)
    else:
        ss = tl.zeros([BR], dtype=tl.float32)
        for c in range(NCHUNK):
            cols = col0 + c * BG + tl.arange(0, BG)
            cmask = cols < col0 + G
            h = _norm_input(x_ptr, z_ptr, rows64, rmask, cols, cmask, stride_xt, stride_xd, stride_zt, stride_zd,
                            HAS_Z, NORM_BEFORE_GATE)
            ss += tl.sum(h * h, 1)
        rstd = tl.math.rsqrt(ss / G + eps)
        for c in range(NCHUNK):
            cols = col0 + c * BG + tl.arange(0, BG)
            cmask = cols < col0 + G
            h = _norm_input(x_ptr, z_ptr, rows64, rmask, cols, cmask, stride_xt, stride_xd, stride_zt, stride_zd,
                            HAS_Z, NORM_BEFORE_GATE)
            _norm_output(h, rstd, x_ptr, w_ptr, z_ptr, out_ptr, rows64, rmask, cols, cmask, D, NW, stride_zt,
                         stride_zd, HAS_Z, NORM_BEFORE_GATE, ROUND)


def _gated_rms_norm(x, weight, z, eps, group_size, norm_before_gate, *, max_group_block: int = _MAX_GROUP_BLOCK):
    T, D = x.shape
    out = torch.empty((T, D), dtype=x.dtype, device=x.device)
    if T == 0 or D == 0:
        return out
    bg = min(_pow2(group_size), max_group_block)
    nchunk = triton.cdiv(group_size, bg)
    br = max(1, min(64, 2048 // bg))
    num_warps = 4 if br * bg <= 2048 else 8
    has_z = z is not None
    z_arg = z if has_z else x
    round_code = _ROUND_CODES[torch.promote_types(weight.dtype, x.dtype)]
    _gated_rms_norm_kernel[(triton.cdiv(T, br), D // group_size)](
        x, weight.contiguous(), z_arg, out,
        T, D, group_size, weight.numel(), x.stride(0), x.stride(1), z_arg.stride(0), z_arg.stride(1), float(eps),
        HAS_Z=has_z, NORM_BEFORE_GATE=bool(norm_before_gate), ROUND=round_code,
        BR=br, BG=bg, NCHUNK=nchunk, num_warps=num_warps,
        **pdl_launch(x.device),
    )
    return out


def gated_rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    z: Optional[torch.Tensor],
    eps: float,
    group_size: int,
    norm_before_gate: bool,
) -> torch.Tensor:
    """Triton ``gated_rms_norm`` (same arguments and result as the op: ``[T, D]`` in ``x.dtype``)."""
    return _gated_rms_norm(x, weight, z, eps, group_size, norm_before_gate)


# --------------------------------------------------------------------------------------------
# registration as the CUDA kernels of the ops
# --------------------------------------------------------------------------------------------


def _gdn_gating_cuda(A_log, a, b, dt_bias, softplus_beta=1.0, softplus_threshold=20.0):
    _check_gdn_gating(A_log, a, b, dt_bias)
    return gdn_gating_triton(A_log, a, b, dt_bias, softplus_beta, softplus_threshold)


def _gated_rms_norm_cuda(x, weight, z, eps, group_size, norm_before_gate):
    _check_gated_rms_norm(x, weight, z, eps, group_size)
    return gated_rms_norm_triton(x, weight, z, eps, group_size, norm_before_gate)


torch.library.register_kernel("hybrid_compile::gdn_gating", "cuda", _gdn_gating_cuda)
torch.library.register_kernel("hybrid_compile::gated_rms_norm", "cuda", _gated_rms_norm_cuda)
