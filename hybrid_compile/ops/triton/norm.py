"""Triton kernel of ``gated_rms_norm`` (same schema and semantics as :mod:`hybrid_compile.ops.norm`,
including the norm's casting order).

Grid ``(cdiv(T, BR), D // group_size)``, each program normalises ``BR`` rows of one group. A group
of up to 4096 channels is held in registers (one read of ``x`` / ``z``); a larger group is
processed in chunks of 4096 with a second read. Casts as the op: the normalised value is rounded
to ``x.dtype``, multiplied by the weight and rounded to ``promote_types(weight.dtype, x.dtype)``,
then (``norm_before_gate``) multiplied by ``silu(z)`` in fp32, and finally rounded to ``x.dtype``.
A shape-only launch (no host sync), usable inside CUDA graphs.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..norm import _check_gated_rms_norm
from .common import cast_rne, pow2
from .launch import pdl_launch, pdl_wait_and_release

__all__ = ["gated_rms_norm_triton"]


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
    bg = min(pow2(group_size), max_group_block)
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


def _gated_rms_norm_cuda(x, weight, z, eps, group_size, norm_before_gate):
    _check_gated_rms_norm(x, weight, z, eps, group_size)
    return gated_rms_norm_triton(x, weight, z, eps, group_size, norm_before_gate)


torch.library.register_kernel("hybrid_compile::gated_rms_norm", "cuda", _gated_rms_norm_cuda)
