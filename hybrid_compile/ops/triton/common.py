"""Helpers shared by the Triton kernel modules: :func:`pow2` (block sizes), :func:`cast_rne`
(fp32 -> storage dtype, rounding to nearest even under Triton's CPU interpreter too, which
otherwise truncates fp32 -> bf16), :func:`div_rn` (IEEE-rounded fp32 division) and :func:`softplus`
(torch's, for the Mamba dt)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["cast_rne", "div_rn", "pow2", "softplus"]


def pow2(n: int, lo: int = 1) -> int:
    """The smallest power of two >= ``n`` (and >= ``lo``): block sizes of the launchers."""
    return max(lo, triton.next_power_of_2(max(int(n), 1)))


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


@triton.jit
def div_rn(x, y):
    """``x / y`` rounded to nearest as IEEE (and torch on the CPU) divides; ``y`` broadcasts to ``x``'s shape.

    Triton's fp32 ``/`` is an approximate division on NVIDIA GPUs (off by an ulp at times), the
    ``ieee_rounding`` flag of ``tl.fdiv`` is ignored by Triton 3.6, and ``tl.math.div_rn`` does not
    broadcast: hence the explicit broadcast (adding zeros is exact). The FP8 quantizers use it so the
    GPU writes the same bytes as the plain-torch path.
    """
    return tl.math.div_rn(x, y + tl.zeros_like(x))


@triton.jit
def softplus(v):
    """torch's softplus (threshold 20) with an accurate log1p (``log(w) * u / (w - 1)``, w = 1 + u)."""
    u = tl.exp(v)
    w = 1.0 + u
    den = tl.where(w == 1.0, 1.0, w - 1.0)
    lp = tl.where(w == 1.0, u, tl.log(w) * (u / den))
    return tl.where(v > 20.0, v, lp)
