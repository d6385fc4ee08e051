"""Triton kernel of ``gdn_gating`` (same schema and semantics as :mod:`hybrid_compile.ops.gdn`).

Grid ``cdiv(T, BT)``, each program a ``[BT, next_pow2(Hv)]`` tile of ``a`` / ``b`` (strided views
allowed), fp32 math, two contiguous fp32 outputs. A shape-only launch (no host sync), usable
inside CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gdn import _check_gdn_gating
from .common import pow2
from .launch import pdl_launch, pdl_wait_and_release

__all__ = ["gdn_gating_triton"]


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
    bh = pow2(H)
    bt = max(1, min(128, 2048 // bh))
    _gdn_gating_kernel[(triton.cdiv(T, bt),)](
        A_log.contiguous(), a, b, dt_bias.contiguous(), g, beta,
        T, H, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        float(softplus_beta), float(softplus_threshold),
        BT=bt, BH=bh, num_warps=4,
        **pdl_launch(a.device),
    )
    return g, beta


def _gdn_gating_cuda(A_log, a, b, dt_bias, softplus_beta=1.0, softplus_threshold=20.0):
    _check_gdn_gating(A_log, a, b, dt_bias)
    return gdn_gating_triton(A_log, a, b, dt_bias, softplus_beta, softplus_threshold)


torch.library.register_kernel("hybrid_compile::gdn_gating", "cuda", _gdn_gating_cuda)
