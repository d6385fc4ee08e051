"""Skinny matmul: ``y = x @ weight.T`` for a handful of rows (decode at small batch).

At batch 1 a decode step's projections are matrix-vector products that only stream the
weights; cuBLAS runs them at 55-90 % of the memory bandwidth on an H200, the long-row ones as
split-K kernels plus a separate reduction kernel. ``skinny_mm`` is the op the compile backend's
rewrite pass (:mod:`hybrid_compile.passes.rewrite`) puts in place of the projections' ``mm``
nodes: its CUDA implementation runs a Triton matrix-vector kernel (:mod:`.triton.linear`) at
one row, and at two rows for long rows, where it beats cuBLAS; elsewhere it calls ``torch.mm``.
The CPU implementation is ``torch.mm`` (the ground truth the kernel is tested against).

``gated_norm_linear`` is a mixer's output: its gated RMSNorm (``gated_rms_norm``, either order)
followed by its bias-free output projection. At one row its CUDA implementation normalises inside
the matrix-vector kernel (each program normalises the groups of the ``x`` tile it multiplies): the
norm's own kernel and its round trip through memory leave the decode step. Elsewhere it runs the
norm's kernel, then ``skinny_mm``'s choice of matmul.
"""

from __future__ import annotations

import torch

from ._validation import FLOAT_DTYPES, check_same_device, check_tensor
from .norm import gated_rms_norm

__all__ = ["SKINNY_MAX_ROWS", "gated_norm_linear", "norm_weight_per_channel", "skinny_mm"]

#: Most rows of ``x`` the Triton kernel takes; above this the CUDA op calls ``torch.mm``.
SKINNY_MAX_ROWS = 2


def _check_skinny_mm(x: torch.Tensor, weight: torch.Tensor) -> None:
    op = "skinny_mm"
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(op, "weight", weight, ndim=2, dtypes=(x.dtype,), shape=(None, x.shape[1]))
    check_same_device(op, x=x, weight=weight)


@torch.library.custom_op("hybrid_compile::skinny_mm", mutates_args=())
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


def norm_weight_per_channel(norm_weight: torch.Tensor, channels: int) -> torch.Tensor:
    """A gated norm's weight as ``[channels]``: as it is, or one ``[group_size]`` weight repeated per
    group (the Qwen3-Next-style norms normalise ``[tokens * groups, group_size]`` rows)."""
    return norm_weight if norm_weight.numel() == channels else norm_weight.repeat(channels // norm_weight.numel())


def _check_gated_norm_linear(x, z, norm_weight, weight, eps, group_size):
    op = "gated_norm_linear"
    _check_skinny_mm(x, weight)
    check_tensor(op, "z", z, dtypes=FLOAT_DTYPES, shape=tuple(x.shape))
    check_tensor(op, "norm_weight", norm_weight, ndim=1, dtypes=FLOAT_DTYPES)
    if group_size <= 0 or x.shape[1] % group_size:
        raise ValueError(f"{op}: group_size must be > 0 and divide the {x.shape[1]} channels, got {group_size}")
    if norm_weight.shape[0] not in (x.shape[1], group_size):
        raise ValueError(f"{op}: norm_weight must have {x.shape[1]} (channels) or {group_size} (group_size) "
                         f"elements, got {norm_weight.shape[0]}")
    if not eps >= 0.0:
        raise ValueError(f"{op}: eps must be >= 0, got {eps}")
    check_same_device(op, x=x, z=z, norm_weight=norm_weight)


@torch.library.custom_op("hybrid_compile::gated_norm_linear", mutates_args=())
def gated_norm_linear(
    x: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_size: int,
    norm_before_gate: bool,
) -> torch.Tensor:
    """``gated_rms_norm(x, norm_weight, z, eps, group_size, norm_before_gate) @ weight.T``.

    Args:
        x: ``[M, K]`` the mixer's core output (any strides).
        z: ``[M, K]`` the gate (any strides).
        norm_weight: the norm's weight, ``[K]`` or ``[group_size]`` (applied to every group).
        weight: ``[N, K]`` the output projection's weight, in ``x.dtype``.
        eps, group_size, norm_before_gate: as ``gated_rms_norm``.

    Returns:
        ``[M, N]`` contiguous, in ``x.dtype``; the normalised values are rounded to ``x.dtype``
        before the product, as the two modules in a row do.
    """
    _check_gated_norm_linear(x, z, norm_weight, weight, eps, group_size)
    normed = gated_rms_norm(x, norm_weight_per_channel(norm_weight, x.shape[1]), z, eps, group_size, norm_before_gate)
    return torch.mm(normed, weight.t())


@gated_norm_linear.register_fake
def _(x, z, norm_weight, weight, eps, group_size, norm_before_gate):
    _check_gated_norm_linear(x, z, norm_weight, weight, eps, group_size)
    return x.new_empty(x.shape[0], weight.shape[0])
