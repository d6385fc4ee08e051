"""Block-FP8 ops: the fine-grained FP8 format of the Qwen / DeepSeek FP8 checkpoints.

Format. A weight ``[N, K]`` is stored as ``float8_e4m3fn`` with one fp32 scale per
``128 x 128`` block, ``weight_scale_inv[cdiv(N, 128), cdiv(K, 128)]``: the real weight is
``weight.float() * weight_scale_inv`` broadcast over its block (the checkpoints' name: the inverse
of the scale the weight was multiplied by when it was quantized). Activations are quantized on the
fly ("dynamic" activation scheme) per token and group of :data:`FP8_GROUP` = 128 channels:
``scale = max(|x_group|, eps) / 448`` and ``q = round_to_nearest_even(x / scale)`` in e4m3.
Partial blocks and groups (a ``K`` or ``N`` that is not a multiple of 128) are allowed.

Ops (CPU implementations are the ground truth: plain torch, dequantize + matmul in fp32):

===============================  ==============================================================
``fp8_quantize_per_token_group``  ``x[M, K]`` -> ``(q[M, K] e4m3, scale[M, cdiv(K, 128)] fp32)``
``fp8_block_linear``              ``x[M, K] @ dequant(weight[N, K]).T (+ bias)``, the activation
                                  quantized per token group first (what the FP8 tensor cores see)
``fp8_grouped_linear``            the same for MoE experts: rows ``offsets[e]:offsets[e + 1]`` of
                                  ``x`` (tokens sorted by expert) times expert ``e``'s weight, with
                                  ``moe_grouped_linear``'s row gather / scatter and activations
===============================  ==============================================================

The CUDA implementations are Triton kernels (:mod:`.triton.fp8`), after one quantization launch:
a GEMV on the CUDA cores for decode (a few rows; grouped: about one row per expert) and a GEMM,
FP8 x FP8 on the tensor cores with fp32 accumulation, above that; each serves both linear ops (one
launch per call, the grouped one included). On Hopper a dense call above decode size goes to cuBLAS's
block-scaled GEMM instead (``torch._scaled_mm``, the same block recipe; ``HYBRID_COMPILE_FP8_GEMM``). Also here, in plain torch: :func:`quantize_weight_blocks` (a bf16 / fp32 weight to the
block format, used when a model is quantized on load) and :func:`dequantize_weight_blocks`.
"""

from __future__ import annotations

import torch

from ._validation import FLOAT_DTYPES, check_same_device, check_tensor
from .moe import activate_and_scatter, check_activation, check_sorted_rows, grouped_output_width
from .registration import kernel_op

__all__ = [
    "FP8_BLOCK", "FP8_DTYPE", "FP8_GROUP", "FP8_MAX", "dequantize_weight_blocks", "fp8_block_linear",
    "amax_to_scale", "fp8_grouped_linear", "fp8_quantize_per_token_group", "quantize_weight_blocks", "reference_block_linear",
    "reference_grouped_linear", "reference_quantize",
]

#: Storage dtype of FP8 weights and activations (e4m3, finite-only: the checkpoints' format).
FP8_DTYPE = torch.float8_e4m3fn
#: Largest finite e4m3fn value: a group's largest magnitude is scaled to it.
FP8_MAX = 448.0
#: Activation group: channels of one token that share one scale.
FP8_GROUP = 128
#: Weight block: ``FP8_BLOCK x FP8_BLOCK`` weights share one scale (``weight_block_size`` [128, 128]).
FP8_BLOCK = 128
#: Smallest group maximum used for a scale (an all-zero group gets a finite scale, not 0).
FP8_EPS = 1e-10


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


# --------------------------------------------------------------------------------------------
# plain-torch format helpers (the reference math)
# --------------------------------------------------------------------------------------------


def _expand_blocks(scale: torch.Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> torch.Tensor:
    """``[..., R, C]`` per-block scales -> ``[..., rows, cols]`` (each scale over its block)."""
    s = scale.repeat_interleave(block_rows, dim=-2).repeat_interleave(block_cols, dim=-1)
    return s[..., :rows, :cols]


def dequantize_weight_blocks(weight: torch.Tensor, scale_inv: torch.Tensor,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``weight[..., N, K]`` e4m3 with ``scale_inv[..., cdiv(N,128), cdiv(K,128)]`` -> ``dtype``."""
    n, k = weight.shape[-2:]
    return (weight.float() * _expand_blocks(scale_inv.float(), n, k, FP8_BLOCK, FP8_BLOCK)).to(dtype)


def quantize_weight_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight ``[..., N, K]`` -> ``(e4m3 weight, fp32 scale_inv[..., cdiv(N,128), cdiv(K,128)])``.

    Per ``128 x 128`` block: ``scale_inv = max|w| / 448`` (1 for an all-zero block) and
    ``q = w / scale_inv`` rounded to nearest even. Works block-row by block-row so the fp32
    temporaries stay small (a weight is quantized on the device it lives on).
    """
    if weight.dim() < 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_weight_blocks: a float weight of 2 or more dims is needed, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    *lead, n, k = weight.shape
    nb, kb = _cdiv(n, FP8_BLOCK), _cdiv(k, FP8_BLOCK)
    q = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    scale_inv = torch.empty(*lead, nb, kb, dtype=torch.float32, device=weight.device)
    for i in range(nb):
        rows = slice(i * FP8_BLOCK, min(n, (i + 1) * FP8_BLOCK))
        w = weight[..., rows, :].float()
        pad = kb * FP8_BLOCK - k
        wp = torch.nn.functional.pad(w, (0, pad)) if pad else w
        amax = wp.unflatten(-1, (kb, FP8_BLOCK)).abs().amax(dim=(-3, -1))  # [..., kb]
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        scale_inv[..., i, :] = s
        q[..., rows, :] = (w / s.repeat_interleave(FP8_BLOCK, -1)[..., None, :k]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale_inv


def amax_to_scale(amax: torch.Tensor) -> torch.Tensor:
    """``max(amax, 1e-10) / 448`` rounded as IEEE division on every device. The divisor is a tensor on
    ``amax``'s device: torch on CUDA turns a division by a Python scalar into a multiplication by its
    reciprocal (an ulp off at times), which would quantize differently from the CPU and the kernels.
    ``new_full`` fills it on the device (no host-to-device copy, so CUDA-graph capture is fine)."""
    return amax.clamp(min=FP8_EPS) / amax.new_full((), FP8_MAX)


def reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU implementation of ``fp8_quantize_per_token_group`` in plain torch."""
    m, k = x.shape
    g = _cdiv(k, FP8_GROUP)
    xf = x.float()
    pad = g * FP8_GROUP - k
    xg = (torch.nn.functional.pad(xf, (0, pad)) if pad else xf).view(m, g, FP8_GROUP)
    scale = amax_to_scale(xg.abs().amax(-1))
    q = (xg / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(m, g * FP8_GROUP)[:, :k]
    return q.contiguous(), scale


def _dequantize_groups(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    m, k = q.shape
    return q.float() * scale.repeat_interleave(FP8_GROUP, dim=1)[:, :k]


# --------------------------------------------------------------------------------------------
# fp8_quantize_per_token_group
# --------------------------------------------------------------------------------------------


def _check_quantize(x: torch.Tensor) -> None:
    check_tensor("fp8_quantize_per_token_group", "x", x, ndim=2, dtypes=FLOAT_DTYPES)


@kernel_op("hybrid_compile::fp8_quantize_per_token_group", mutates_args=())
def fp8_quantize_per_token_group(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations to e4m3, one scale per token and group of 128 channels.

    Args:
        x: ``[M, K]`` fp32/bf16/fp16 (any strides).

    Returns:
        ``q``: ``[M, K]`` ``float8_e4m3fn`` contiguous, ``round_to_nearest_even(x / scale)``;
        ``scale``: ``[M, cdiv(K, 128)]`` fp32, ``max(|group|, 1e-10) / 448``.
    """
    _check_quantize(x)
    return reference_quantize(x)


@fp8_quantize_per_token_group.register_fake
def _(x):
    _check_quantize(x)
    m, k = x.shape
    return x.new_empty(m, k, dtype=FP8_DTYPE), x.new_empty(m, _cdiv(k, FP8_GROUP), dtype=torch.float32)


# --------------------------------------------------------------------------------------------
# fp8_block_linear
# --------------------------------------------------------------------------------------------


def _check_weight(op: str, weight: torch.Tensor, scale_inv: torch.Tensor, k: int, experts: bool) -> None:
    lead = 1 if experts else 0
    check_tensor(op, "weight", weight, ndim=2 + lead, dtypes=(FP8_DTYPE,))
    n = weight.shape[-2]
    if weight.shape[-1] != k:
        raise ValueError(f"{op}: `weight` has {weight.shape[-1]} input channels, `x` has {k}")
    want = (*weight.shape[:lead], _cdiv(n, FP8_BLOCK), _cdiv(k, FP8_BLOCK))
    check_tensor(op, "weight_scale_inv", scale_inv, dtypes=(torch.float32,), shape=want)


def _check_linear(x, weight, weight_scale_inv, bias) -> None:
    op = "fp8_block_linear"
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    _check_weight(op, weight, weight_scale_inv, x.shape[1], experts=False)
    if bias is not None:
        check_tensor(op, "bias", bias, shape=(weight.shape[0],), dtypes=FLOAT_DTYPES)
    check_same_device(op, x=x, weight=weight, weight_scale_inv=weight_scale_inv, bias=bias)


@kernel_op("hybrid_compile::fp8_block_linear", mutates_args=())
def fp8_block_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear`` with a block-FP8 weight and a dynamically quantized activation.

    Args:
        x: ``[M, K]`` fp32/bf16/fp16 activations (any strides); quantized per token and group
            of 128 channels exactly as ``fp8_quantize_per_token_group``.
        weight: ``[N, K]`` ``float8_e4m3fn``.
        weight_scale_inv: ``[cdiv(N, 128), cdiv(K, 128)]`` fp32 block scales.
        bias: optional ``[N]``, added in fp32.

    Returns:
        ``[M, N]`` contiguous in ``x.dtype``: ``dequant(q_x) @ dequant(weight).T`` in fp32.
    """
    _check_linear(x, weight, weight_scale_inv, bias)
    return reference_block_linear(x, weight, weight_scale_inv, bias)


def reference_block_linear(x, weight, weight_scale_inv, bias=None):
    """The CPU implementation of ``fp8_block_linear`` in plain torch (any device: tests run it on CUDA
    tensors as the ground truth of the kernel)."""
    q, s = reference_quantize(x)
    y = _dequantize_groups(q, s) @ dequantize_weight_blocks(weight, weight_scale_inv).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@fp8_block_linear.register_fake
def _(x, weight, weight_scale_inv, bias=None):
    _check_linear(x, weight, weight_scale_inv, bias)
    return x.new_empty(x.shape[0], weight.shape[0])


# --------------------------------------------------------------------------------------------
# fp8_grouped_linear (MoE experts)
# --------------------------------------------------------------------------------------------


def _check_grouped(x, weight, weight_scale_inv, expert_offsets, gather_index=None, scatter_index=None,
                   activation="none") -> None:
    op = "fp8_grouped_linear"
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    _check_weight(op, weight, weight_scale_inv, x.shape[1], experts=True)
    check_activation(activation, weight.shape[1], op)
    check_same_device(op, x=x, weight=weight, weight_scale_inv=weight_scale_inv, expert_offsets=expert_offsets,
                      gather_index=gather_index, scatter_index=scatter_index)
    check_sorted_rows(op, x, weight.shape[0], expert_offsets, gather_index, scatter_index)


@kernel_op("hybrid_compile::fp8_grouped_linear", mutates_args=())
def fp8_grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, expert_offsets: torch.Tensor,
    gather_index: torch.Tensor | None = None, scatter_index: torch.Tensor | None = None, activation: str = "none",
) -> torch.Tensor:
    """``fp8_block_linear`` per expert over rows sorted by expert (one launch on CUDA), with the row
    gather, scatter and activations of ``moe_grouped_linear``.

    Args:
        x: ``[X, K]`` fp32/bf16/fp16 (any strides); each row quantized per 128-channel group.
        weight: ``[E, N, K]`` ``float8_e4m3fn`` (the experts' stacked weights).
        weight_scale_inv: ``[E, cdiv(N, 128), cdiv(K, 128)]`` fp32.
        expert_offsets: ``[E + 1]`` int32/int64, non-decreasing from 0 to ``R`` (the sorted rows:
            ``R = len(gather_index)``, else ``X``); the rows of expert ``e`` are ``offsets[e]:offsets[e+1]``.
        gather_index: optional ``[R]``, row ``r`` reads ``x[gather_index[r]]`` (else ``x[r]``).
        scatter_index: optional ``[R]``, a permutation of ``range(R)``: row ``r`` is written to
            ``y[scatter_index[r]]`` (else ``y[r]``).
        activation: ``"none"``, ``"silu_and_mul"`` (``N`` even: ``silu(gate) * up`` of the rows
            ``[0, N/2)`` and ``[N/2, N)``) or ``"relu2"``, on the fp32 products.

    Returns:
        ``[R, N]`` (``[R, N/2]`` for ``silu_and_mul``) contiguous in ``x.dtype``; before the
        activation, row ``r`` of expert ``e`` is ``dequant(q_x[src(r)]) @ dequant(weight[e]).T``.
    """
    _check_grouped(x, weight, weight_scale_inv, expert_offsets, gather_index, scatter_index, activation)
    return reference_grouped_linear(x, weight, weight_scale_inv, expert_offsets, gather_index, scatter_index,
                                    activation)


def reference_grouped_linear(x, weight, weight_scale_inv, expert_offsets, gather_index=None, scatter_index=None,
                             activation="none"):
    """The CPU implementation of ``fp8_grouped_linear`` in plain torch: a loop over the experts, the
    activation on the fp32 products."""
    q, s = reference_quantize(x)
    xd = _dequantize_groups(q, s)
    if gather_index is not None:
        xd = xd[gather_index]  # (a row's quantization is its own: quantize, then gather)
    y = torch.zeros(xd.shape[0], weight.shape[1], dtype=torch.float32, device=x.device)
    offsets = expert_offsets.tolist()
    for e in range(weight.shape[0]):
        lo, hi = offsets[e], offsets[e + 1]
        if hi > lo:
            y[lo:hi] = xd[lo:hi] @ dequantize_weight_blocks(weight[e], weight_scale_inv[e]).t()
    return activate_and_scatter(y, activation, scatter_index, x.dtype)


@fp8_grouped_linear.register_fake
def _(x, weight, weight_scale_inv, expert_offsets, gather_index=None, scatter_index=None, activation="none"):
    _check_grouped(x, weight, weight_scale_inv, expert_offsets, gather_index, scatter_index, activation)
    rows = gather_index.shape[0] if gather_index is not None else x.shape[0]
    return x.new_empty(rows, grouped_output_width(weight.shape[1], activation))
