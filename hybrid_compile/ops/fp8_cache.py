"""FP8 cache formats: the e4m3 KV cache and the e4m3 recurrent state, in plain torch.

Both pools store ``float8_e4m3fn`` values with one fp32 scale per *vector* along one axis, kept
in a separate fp32 tensor beside the values (same leading slot dimension, so the slot-moving state
ops move a slot's scales like any other pool tensor):

- KV cache ``k_cache [slots, Hkv, D]`` -> ``k_scale [slots, Hkv]``: one scale per token and head
  (the vector is the head's ``D`` channels). Likewise ``v_scale`` for ``v_cache``.
- GDN state ``[slots, Hv, K, V]`` -> scales ``[slots, Hv, V]``: one per value column, over the
  ``K`` axis (:data:`GDN_STATE_SCALE_DIM`).
- Mamba2 state ``[slots, H, P, N]`` -> scales ``[slots, H, P]``: one per head-dim row, over the
  ``N`` axis (:data:`MAMBA2_STATE_SCALE_DIM`).
- Mamba1 state ``[slots, D_inner, N]`` -> scales ``[slots, D_inner]``: one per channel, over the
  ``N`` axis (:data:`MAMBA1_STATE_SCALE_DIM`).

The axis is the one every Triton program of the family holds whole (the GDN recurrent kernel
keeps all of ``K`` for a block of value columns; the Mamba2 step kernel all of ``N`` for a block
of rows), so a kernel can compute a vector's maximum itself when it writes. Quantization is the
same as the FP8 activations' (:mod:`.fp8`): ``scale = max(|vector|, 1e-10) / 448``, values
``round_to_nearest_even(x / scale)``; dequantization ``q * scale``. The state is re-quantized
on every write (every decode step): a dynamic scale follows the state as it grows or decays.

The helpers below are the reference math the ops' CPU paths use; they read and write pool rows
through ``uint8`` views where torch has no float8 kernel on CPU (``index_copy_``).
"""

from __future__ import annotations

from typing import Optional

import torch

from .fp8 import FP8_DTYPE, FP8_MAX, amax_to_scale

__all__ = [
    "FP8_DTYPE", "GDN_STATE_SCALE_DIM", "KV_SCALE_DIM", "MAMBA1_STATE_SCALE_DIM", "MAMBA2_STATE_SCALE_DIM", "dequantize_vectors",
    "is_fp8", "quantize_vectors", "read_rows", "round_trip", "scale_shape", "write_rows",
]

#: Axis of a GDN state slot ``[Hv, K, V]`` that one scale covers (K).
GDN_STATE_SCALE_DIM = -2
#: Axis of a Mamba2 state slot ``[H, P, N]`` that one scale covers (N).
MAMBA2_STATE_SCALE_DIM = -1
#: Axis of a Mamba1 state slot ``[D_inner, N]`` that one scale covers (N).
MAMBA1_STATE_SCALE_DIM = -1
#: Axis of a KV-cache token ``[Hkv, D]`` that one scale covers (D).
KV_SCALE_DIM = -1


def is_fp8(t: Optional[torch.Tensor]) -> bool:
    return t is not None and t.dtype == FP8_DTYPE


def scale_shape(shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
    """Shape of the scales of an FP8 tensor of ``shape`` with one scale per vector along ``dim``."""
    dim = dim % len(shape)
    return tuple(s for i, s in enumerate(shape) if i != dim)


def quantize_vectors(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (any float) -> (e4m3 values of ``x``'s shape, fp32 scales with ``dim`` removed)."""
    xf = x.float()
    scale = amax_to_scale(xf.abs().amax(dim))
    q = (xf / scale.unsqueeze(dim)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_vectors(q: torch.Tensor, scale: torch.Tensor, dim: int) -> torch.Tensor:
    """fp32 ``q * scale`` (``scale`` broadcast along ``dim``)."""
    return q.float() * scale.unsqueeze(dim)


def round_trip(x: torch.Tensor, dim: int) -> torch.Tensor:
    """fp32 ``x`` as the FP8 format stores and returns it (quantize, then dequantize). The
    multi-step (speculative verify) ops apply it between steps, so ``L`` verify steps round the
    state exactly as ``L`` decode steps, each storing it, do: speculative greedy output equals
    plain greedy output with an FP8 state too."""
    return dequantize_vectors(*quantize_vectors(x, dim), dim)


def read_rows(pool: torch.Tensor, scales: Optional[torch.Tensor], rows: torch.Tensor, dim: int) -> torch.Tensor:
    """fp32 values of ``pool[rows]``: dequantized when the pool is FP8 (``scales`` beside it)."""
    values = pool.index_select(0, rows)
    if not is_fp8(pool):
        return values.float()
    return dequantize_vectors(values, scales.index_select(0, rows), dim)


def write_rows(
    pool: torch.Tensor, scales: Optional[torch.Tensor], rows: torch.Tensor, values: torch.Tensor, dim: int
) -> None:
    """``pool[rows] = values``: quantized (values and ``scales[rows]``) when the pool is FP8, else cast."""
    if not is_fp8(pool):
        pool.index_copy_(0, rows, values.to(pool.dtype))
        return
    q, s = quantize_vectors(values, dim)
    pool.view(torch.uint8).index_copy_(0, rows, q.view(torch.uint8))
    scales.index_copy_(0, rows, s)


def check_scales(op: str, pool: torch.Tensor, scales: Optional[torch.Tensor], name: str, dim: int,
                 pool_name: str = "ssm_states") -> None:
    """An FP8 pool needs fp32 scales of :func:`scale_shape`; any other pool takes none."""
    if is_fp8(pool):
        want = tuple(pool.shape[:1]) + scale_shape(tuple(pool.shape[1:]), dim) if pool.dim() > 1 else None
        if scales is None:
            raise ValueError(f"{op}: an FP8 (float8_e4m3fn) `{pool_name}` needs `{name}` (fp32 scales {want})")
        if scales.dtype != torch.float32 or tuple(scales.shape) != want:
            raise ValueError(
                f"{op}: `{name}` must be fp32 of shape {want} for `{pool_name}` {tuple(pool.shape)}, got "
                f"{scales.dtype} {tuple(scales.shape)}"
            )
        if scales.device != pool.device:
            raise ValueError(f"{op}: `{name}` is on {scales.device}, `{pool_name}` on {pool.device}")
    elif scales is not None:
        raise ValueError(f"{op}: `{name}` is only for an FP8 `{pool_name}`, which is {pool.dtype}")
