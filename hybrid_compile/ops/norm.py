"""Gated (grouped) RMSNorm: the output norm of the GDN and Mamba2 mixers.

One op, ``gated_rms_norm``, with both orders of transformers' gated norms, including their
casting order (so results match the HF modules bit for bit on CPU):

- ``norm_before_gate=True``  — ``Qwen3NextRMSNormGated``: normalise ``x`` in fp32, cast to
  the input dtype, multiply by ``weight``, then multiply by ``silu(z)`` in fp32, cast back.
- ``norm_before_gate=False`` — Mamba2 ``MambaRMSNormGated`` (also NemotronH):
  ``x * silu(z)`` in fp32, RMS-normalise each group of ``group_size`` channels, cast to the
  input dtype, multiply by ``weight``.

Not covered: ``FalconH1RMSNormGated`` (it multiplies by ``weight`` in fp32 before casting).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._validation import FLOAT_DTYPES, check_divisible, check_same_device, check_tensor
from .registration import kernel_op

__all__ = ["gated_rms_norm"]


def _check_gated_rms_norm(x, weight, z, eps, group_size):
    op = "gated_rms_norm"
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    T, D = x.shape
    check_tensor(op, "weight", weight, ndim=1, dtypes=FLOAT_DTYPES)
    if weight.shape[0] not in (D, group_size):
        raise ValueError(f"{op}: `weight` must have D={D} or group_size={group_size} elements, got {weight.shape[0]}")
    if z is not None:
        check_tensor(op, "z", z, dtypes=FLOAT_DTYPES, shape=(T, D))
    if group_size <= 0:
        raise ValueError(f"{op}: group_size must be > 0, got {group_size}")
    check_divisible(op, "the hidden size D must be a multiple of group_size", D, group_size)
    if not eps >= 0.0:
        raise ValueError(f"{op}: eps must be >= 0, got {eps}")
    check_same_device(op, x=x, weight=weight, z=z)


def _group_rms(h: torch.Tensor, group_size: int, eps: float) -> torch.Tensor:
    T, D = h.shape
    g = h.reshape(T, D // group_size, group_size)
    var = g.pow(2).mean(-1, keepdim=True)
    return (g * torch.rsqrt(var + eps)).reshape(T, D)


@kernel_op("hybrid_compile::gated_rms_norm", mutates_args=())
def gated_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    z: torch.Tensor | None,
    eps: float,
    group_size: int,
    norm_before_gate: bool,
) -> torch.Tensor:
    """Grouped RMSNorm of ``x`` with an optional ``silu(z)`` gate before or after the norm.

    Args:
        x: ``[T, D]`` fp32/bf16/fp16 (may be a non-contiguous view).
        weight: ``[D]`` scale, any float dtype; or ``[group_size]``, the same scale for every group
            (Qwen3-Next's norm on ``[tokens * heads, head_dim]`` rows, applied to ``[tokens,
            heads * head_dim]``).
        z: ``[T, D]`` gate, or None for a plain (grouped) RMSNorm.
        eps: variance epsilon.
        group_size: channels per normalisation group; must divide ``D`` (``D`` = one group,
            a plain gated RMSNorm; Mamba2 uses ``intermediate_size // n_groups``).
        norm_before_gate: True = Qwen3Next order (``norm(x) * weight * silu(z)``), False =
            Mamba2 order (``norm(x * silu(z)) * weight``); see the module docstring for the
            exact casts.

    Returns:
        ``[T, D]`` in ``x.dtype``. (HF's Mamba2 module returns ``weight.dtype * x.dtype``
        promoted, e.g. fp32 for a bf16 input with an fp32 weight; the values are the same
        once cast to ``x.dtype``, which the mixer does before ``out_proj``.)
    """
    _check_gated_rms_norm(x, weight, z, eps, group_size)
    if weight.shape[0] != x.shape[1]:
        weight = weight.repeat(x.shape[1] // group_size)
    input_dtype = x.dtype
    h = x.float()
    if norm_before_gate:
        h = _group_rms(h, group_size, eps)
        h = weight * h.to(input_dtype)
        if z is not None:
            h = h * F.silu(z.float())
    else:
        if z is not None:
            h = h * F.silu(z.float())
        h = _group_rms(h, group_size, eps)
        h = weight * h.to(input_dtype)
    return h.to(input_dtype).contiguous()


@gated_rms_norm.register_fake
def _(x, weight, z, eps, group_size, norm_before_gate):
    _check_gated_rms_norm(x, weight, z, eps, group_size)
    return x.new_empty(x.shape)
