"""Triton kernel of ``skinny_mm`` (:mod:`hybrid_compile.ops.linear`): ``y = x @ w.T`` for at most
:data:`~hybrid_compile.ops.linear.SKINNY_MAX_ROWS` rows.

A matrix-vector kernel that streams the weight once: grid ``cdiv(N, BLOCK_N)``, each program a
``[BLOCK_N, BLOCK_K]`` weight tile per step along ``K`` (loads along ``K``, the weight's contiguous
dimension), multiplied elementwise in fp32 by every row of ``x`` (``ROWS`` = ``M``, both rows
in the program so the tile is read once) and accumulated in one ``[BLOCK_N, BLOCK_K]``
tile per row that is summed over ``K`` once at the end (no per-step cross-lane reductions). No tensor cores: at a few rows the kernel is bound by the weight's bytes,
not by FMAs. Tile sizes come from :func:`skinny_mm_config` (measured on an H100 and an H200:
``benchmarks/kernels.py --only skinny_mm``). Shape-only launch (no host sync), usable in CUDA graphs.
The CUDA op uses it where it beats cuBLAS (:func:`use_skinny_kernel`), else ``torch.mm``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..linear import SKINNY_MAX_ROWS, _check_skinny_mm
from .common import cast_rne, pow2
from .launch import pdl_launch

__all__ = ["skinny_mm_config", "skinny_mm_triton", "use_skinny_kernel"]


@triton.jit
def _row_product(x_ptr, row, M, kk, stride_xm, stride_xk, k_ok, w):
    """``w * x[row, kk]`` in fp32 (zeros past the last row)."""
    x = tl.load(x_ptr + row * stride_xm + kk * stride_xk, mask=k_ok & ((kk * 0 + row) < M), other=0.0)
    return w * x.to(tl.float32)[None, :]


@triton.jit
def _store_row(y_ptr, row, M, N, rn, n_ok, acc):
    tl.store(y_ptr + row * N + rn, cast_rne(tl.sum(acc, axis=1), y_ptr.dtype.element_ty),
             mask=n_ok & ((rn * 0 + row) < M))


@triton.jit
def _weight_tile(w_ptr, rn, kk, n_ok, K, stride_wn, stride_wk, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The ``[BLOCK_N, BLOCK_K]`` weight tile at columns ``kk``, in fp32 (and its column mask)."""
    if EVEN_K:
        k_ok = tl.full((BLOCK_K,), 1, tl.int1)
    else:
        k_ok = kk < K
    w = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :] * stride_wk, mask=n_ok[:, None] & k_ok[None, :],
                other=0.0)
    return w.to(tl.float32), k_ok


@triton.jit(do_not_specialize=["M"])  # the row count varies per step: one compile per ROWS
def _skinny_mm_kernel(
    x_ptr, w_ptr, y_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    # the first weight tile is loaded before anything that reads x: under a programmatic dependent
    # launch (USE_PDL) it streams while the kernel that writes x is still finishing
    w, k_ok = _weight_tile(w_ptr, rn, rk, n_ok, K, stride_wn, stride_wk, BLOCK_K, EVEN_K)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x (and y's memory) belong to the previous kernel until here
    # one 2-D accumulator per row (a 3-D [ROWS, BLOCK_N, BLOCK_K] tile costs layout conversions)
    acc0 = _row_product(x_ptr, 0, M, rk, stride_xm, stride_xk, k_ok, w)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if ROWS >= 2:
        acc1 += _row_product(x_ptr, 1, M, rk, stride_xm, stride_xk, k_ok, w)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + rk
        w, k_ok = _weight_tile(w_ptr, rn, kk, n_ok, K, stride_wn, stride_wk, BLOCK_K, EVEN_K)
        acc0 += _row_product(x_ptr, 0, M, kk, stride_xm, stride_xk, k_ok, w)
        if ROWS >= 2:
            acc1 += _row_product(x_ptr, 1, M, kk, stride_xm, stride_xk, k_ok, w)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start launching
    _store_row(y_ptr, 0, M, N, rn, n_ok, acc0)
    if ROWS >= 2:
        _store_row(y_ptr, 1, M, N, rn, n_ok, acc1)


def skinny_mm_config(n: int, k: int, rows: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an ``[n, k]`` weight and ``rows`` rows of ``x``.

    One row: from a sweep on an H100 at the reference model's shapes (``BLOCK_N`` 2-16, ``BLOCK_K``
    256-2048, 4/8 warps, 1-3 stages; within ~1 % of the best config of each shape, 3-9 % faster than
    the earlier H200-swept tiles, which stopped at ``BLOCK_K`` 1024): a whole row of 2048 per step
    and two output channels per program; long rows (``k >= 4096``: the down and output
    projections, few output channels) eight channels and 8 warps, so that enough programs stream at
    once. Two rows: from the H200 sweeps (a row of 1024 per step; 2 stages where ``K`` is not a
    multiple of it: at the MLP's down projection, K = 5632, 8.1 µs against 10.0 with the earlier 512
    / 3 stages, 2026-11-30)."""
    if rows == 2:
        return 2, min(1024, max(16, pow2(k))), 4, 2 if k % 1024 else 1
    if k >= 4096:
        return 8, 2048, 8, 2
    return 2, min(2048, max(16, pow2(k))), 4, 2


def use_skinny_kernel(m: int, k: int) -> bool:
    """Whether the Triton kernel beats cuBLAS for ``m`` rows of length ``k`` (H200, bf16): at one row
    always (1.0-1.45x, LM head included); at two rows only for long rows (``k >= 4096``: 1.07-1.3x,
    where cuBLAS runs split-K plus a reduction kernel); from three rows on, never (cuBLAS at 3-4 rows
    takes about its 1-row time on the wide projections; a 4-row build of this kernel and the dense GEMV
    kernel of :mod:`.gemv` reached 0.5-1.09x cuBLAS there, ``benchmarks/results/kernels_skinny*_h200_2026-11-30.json``)."""
    return m == 1 or (m == 2 and k >= 4096)


def skinny_mm_triton(x: torch.Tensor, weight: torch.Tensor, config: tuple[int, int, int, int] | None = None,
                     pdl: bool | None = None):
    """``x @ weight.T`` for ``x.shape[0] <= SKINNY_MAX_ROWS`` (``config`` overrides the tiles).

    ``pdl`` (default: :func:`~.launch.programmatic_launch_supported`) launches the kernel as a programmatic
    dependent launch: it starts while the previous kernel finishes, loads its first weight tile
    (weights are never written by a decode step) and waits for that kernel before reading ``x``."""
    m, k = x.shape
    n = weight.shape[0]
    if m > SKINNY_MAX_ROWS:
        raise ValueError(f"skinny_mm_triton: at most {SKINNY_MAX_ROWS} rows, got {m}")
    if m == 0 or n == 0 or k == 0:
        return x.new_zeros(m, n)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = config or skinny_mm_config(n, k, m)
    _skinny_mm_kernel[(triton.cdiv(n, block_n),)](
        x, weight, y, m, n, k, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        ROWS=m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=warps, num_stages=stages,
        **pdl_launch(x.device, pdl),
    )
    return y


def _skinny_mm_cuda(x, weight):
    _check_skinny_mm(x, weight)
    if not use_skinny_kernel(x.shape[0], x.shape[1]):
        return torch.mm(x, weight.t())  # cuBLAS is as fast or faster at these shapes
    return skinny_mm_triton(x, weight)


torch.library.register_kernel("hybrid_compile::skinny_mm", "cuda", _skinny_mm_cuda)
