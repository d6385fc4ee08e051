"""Skinny matmul: ``y = x @ weight.T`` for a handful of rows (decode at small batch).

At batch 1 a decode step's projections are matrix-vector products that only stream the
weights; cuBLAS runs them at 55-90 % of the memory bandwidth on an H200, the long-row ones as
split-K kernels plus a separate reduction kernel. ``skinny_mm`` is the op the compile backend's
rewrite pass (:mod:`hybrid_compile.compilation.rewrite`) puts in place of the projections' ``mm``
nodes: its CUDA implementation runs a Triton matrix-vector kernel (:mod:`.triton.linear`) at
one row, and at two rows for long rows, where it beats cuBLAS; elsewhere it calls ``torch.mm``.
The CPU implementation is ``torch.mm`` (the ground truth the kernel is tested against).
"""

from __future__ import annotations

import torch

from ._validation import FLOAT_DTYPES, check_same_device, check_tensor
from .registration import kernel_op

__all__ = ["SKINNY_MAX_ROWS", "skinny_mm"]

#: Most rows of ``x`` the Triton kernel takes; above this the CUDA op calls ``torch.mm``.
SKINNY_MAX_ROWS = 2


def _check_skinny_mm(x: torch.Tensor, weight: torch.Tensor) -> None:
    op = "skinny_mm"
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(op, "weight", weight, ndim=2, dtypes=(x.dtype,), shape=(None, x.shape[1]))
    check_same_device(op, x=x, weight=weight)


@kernel_op("hybrid_compile::skinny_mm", mutates_args=())
def skinny_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (``F.linear`` without bias).

    Args:
        x: ``[M, K]`` activations (any strides).
        weight: ``[N, K]`` in ``x.dtype`` (a linear layer's weight; any strides).

    Returns:
        ``[M, N]`` contiguous, in ``x.dtype`` (fp32 accumulation).
    """
    _check_skinny_mm(x, weight)
    return torch.mm(x, weight.t())


@skinny_mm.register_fake
def _(x, weight):
    _check_skinny_mm(x, weight)
    return x.new_empty(x.shape[0], weight.shape[0])
