"""Triton pieces of the FP8 cache formats (:mod:`..fp8_cache`): e4m3 values with one fp32 scale
per vector along one axis.

- :func:`~.common.quantize_axis` (``@triton.jit``, shared with the block-FP8 kernels): an fp32 tile ->
  (e4m3-valued fp32 tile, scales), one scale per vector along axis 0 or 1 of the tile; the kernels
  that write an FP8 pool (GDN recurrent, Mamba2 step, KV store) call it on the tile they hold, which
  spans the whole scaled axis.
- ``move_state_rows``: ``dst[dst_rows[i]] = src[src_rows[i]]`` between an fp32 buffer and an FP8
  pool (either way), quantizing or dequantizing on the way; rows with -1 are skipped in-kernel.
  It serves ``track_chunk_states`` into an FP8 pool and the chunked (prefill) scans, which stage
  the batch's states through an fp32 buffer: dequantize the ``B`` initial states, run the fp32
  kernel pipeline on the buffer, quantize the ``B`` final states back (one read and one write of
  each request's state per prefill step, next to the scan's ``O(T)`` work).

Rounding: :func:`~.common.round_to_e4m3` before the cast (exact there), so the interpreter on CPU
and the GPU agree with ``Tensor.to(float8_e4m3fn)`` of the plain-torch path. Shape-only grids,
no host sync: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8_cache import is_fp8
from .common import quantize_axis

__all__ = ["move_state_rows", "round_rows", "store_state_rows"]


@triton.jit
def _move_rows_kernel(
    src, src_scales, dst, dst_scales, src_rows, dst_rows,
    O, RD, I,
    s_src, s_src_scale, s_dst, s_dst_scale,
    SRC_FP8: tl.constexpr, DST_FP8: tl.constexpr, BR: tl.constexpr, BI: tl.constexpr,
):
    """Slots are contiguous ``[O, RD, I]`` (scales ``[O, I]``, one per vector along RD)."""
    i = tl.program_id(0)
    o = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2) * BI + tl.arange(0, BI)
    a = tl.load(src_rows + i).to(tl.int64)
    b = tl.load(dst_rows + i).to(tl.int64)
    ok = (a >= 0) & (b >= 0)
    r = tl.arange(0, BR)
    m = (r[:, None] < tl.where(ok, RD, 0)) & (cols[None, :] < I)
    off = o * RD * I + r[:, None] * I + cols[None, :]
    x = tl.load(src + tl.maximum(a, 0) * s_src + off, mask=m, other=0.0).to(tl.float32)
    mc = cols < tl.where(ok, I, 0)
    if SRC_FP8:
        s = tl.load(src_scales + tl.maximum(a, 0) * s_src_scale + o * I + cols, mask=mc, other=0.0)
        x = x * s[None, :]
    if DST_FP8:
        x, s = quantize_axis(x, 0)
        tl.store(dst_scales + tl.maximum(b, 0) * s_dst_scale + o * I + cols, s, mask=mc)
    tl.store(dst + tl.maximum(b, 0) * s_dst + off, x.to(dst.dtype.element_ty), mask=m)


def move_state_rows(src: torch.Tensor, src_scales: torch.Tensor | None, src_rows: torch.Tensor,
                    dst: torch.Tensor, dst_scales: torch.Tensor | None, dst_rows: torch.Tensor, scale_dim: int) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` (rows with -1 skipped), each of ``src`` / ``dst`` fp32
    or FP8 with its scales (one per vector along slot axis ``scale_dim``, counted from the end).
    Every slot must be one contiguous run, the scales' slots too."""
    n = src_rows.shape[0]
    if n == 0 or src.numel() == 0:
        return
    shape = tuple(src.shape[1:])
    ax = scale_dim % len(shape)
    O = 1
    for d in shape[:ax]:
        O *= d
    RD = shape[ax]
    I = 1
    for d in shape[ax + 1:]:
        I *= d
    for t in (src, dst, src_scales, dst_scales):
        if t is not None and t.shape[0] and not t[0].is_contiguous():
            raise ValueError(f"move_state_rows: each slot must be one contiguous run, got strides {t.stride()}")
    br = triton.next_power_of_2(RD)
    bi = min(triton.next_power_of_2(I), max(1, 4096 // br))
    _move_rows_kernel[(n, O, triton.cdiv(I, bi))](
        src, src_scales if src_scales is not None else src, dst, dst_scales if dst_scales is not None else dst,
        src_rows, dst_rows, O, RD, I,
        src.stride(0), src_scales.stride(0) if src_scales is not None else 0,
        dst.stride(0), dst_scales.stride(0) if dst_scales is not None else 0,
        SRC_FP8=is_fp8(src), DST_FP8=is_fp8(dst), BR=br, BI=bi,
        num_warps=4 if br * bi >= 2048 else 1,
    )


@triton.jit
def store_state_rows(ptrs, scale_ptrs, S, mask, scale_mask, FP8: tl.constexpr, AXIS: tl.constexpr = 1,
                     STREAM: tl.constexpr = False):
    """Store an fp32 state tile ``S``: e4m3 values with one scale per vector along ``AXIS`` (1: per
    row over the columns, as the Mamba2 / Mamba1 states; 0: per column over the rows, as the GDN /
    lightning states' value columns over K; the program holds that axis whole) at ``scale_ptrs``
    (masked by ``scale_mask``) when ``FP8``, else cast to the buffer's dtype (``scale_ptrs`` unused).
    STREAM: the values are stored with the streaming cache modifier (``.cs``: the caller never reads
    them back, so they leave the caches first). A flag rather than a string argument: Triton 3.6
    passes a helper's string default through unwrapped and fails to compile it. Shared by the
    Mamba2, Mamba1, GDN and lightning step kernels."""
    if FP8:
        q, s = quantize_axis(S, AXIS)
        values = q.to(ptrs.dtype.element_ty)
        tl.store(scale_ptrs, s, mask=scale_mask)
    else:
        values = S.to(ptrs.dtype.element_ty)
    if STREAM:
        tl.store(ptrs, values, mask=mask, cache_modifier=".cs")
    else:
        tl.store(ptrs, values, mask=mask)


@triton.jit
def keep_step_state(S, t, L, ptrs, scale_ptrs, mask, scale_mask, HAS_INTER: tl.constexpr, INTER_FP8: tl.constexpr,
                    ROUND_STEPS: tl.constexpr, TREE: tl.constexpr, AXIS: tl.constexpr = 1):
    """The state ``S`` after step ``t`` of ``L`` of a recurrent step kernel: stored to the
    intermediate buffer (``ptrs``, as :func:`store_state_rows`) when ``HAS_INTER``; returned as the
    next step starts from it: as stored for a tree (its children start from the stored state; float
    buffers only), rounded to the FP8 format between steps when ``ROUND_STEPS`` (an FP8 pool: as a
    decode step would store it). Shared by the Mamba2, Mamba1, GDN and lightning step kernels."""
    if HAS_INTER:
        store_state_rows(ptrs, scale_ptrs, S, mask, scale_mask, INTER_FP8, AXIS)
        if TREE:
            S = S.to(ptrs.dtype.element_ty).to(tl.float32)
    if ROUND_STEPS:
        S = tl.where(t < L - 1, round_rows(S, AXIS), S)
    return S


@triton.jit
def round_rows(S, AXIS: tl.constexpr = 1):
    """fp32 tile ``S`` as the FP8 format (one scale per vector along ``AXIS``, as
    :func:`store_state_rows`) stores and returns it."""
    q, s = quantize_axis(S, AXIS)
    if AXIS == 1:
        return q * s[:, None]
    else:
        return q * s[None, :]


def stage_states(pool: torch.Tensor, scales: torch.Tensor, state_indices: torch.Tensor, scale_dim: int):
    """(fp32 ``[B, *slot_shape]`` copy of the batch's FP8 states, its row indices: ``b`` or -1 for a
    padding row). Rows of padding requests stay zero."""
    batch = state_indices.shape[0]
    buf = torch.zeros((batch, *pool.shape[1:]), dtype=torch.float32, device=pool.device)
    rows = torch.arange(batch, dtype=torch.int32, device=pool.device)
    rows = torch.where(state_indices >= 0, rows, -1)
    move_state_rows(pool, scales, state_indices, buf, None, rows, scale_dim)
    return buf, rows


def scan_on_staged_states(scan, pool: torch.Tensor, scales: torch.Tensor | None, cu_seqlens: torch.Tensor,
                          state_indices: torch.Tensor, scale_dim: int):
    """``scan(pool, state_indices)`` (a chunked prefill kernel pipeline over a float pool), on an FP8
    pool (``scales`` given) through an fp32 staging copy of the batch's states (:func:`stage_states`,
    rows ``b`` or -1), quantized back into the slots of the requests that had tokens (a zero-length
    request leaves its slot untouched). Returns what ``scan`` returns."""
    if scales is None:
        return scan(pool, state_indices)
    buf, rows = stage_states(pool, scales, state_indices, scale_dim)
    out = scan(buf, rows)
    written = cu_seqlens[1:] > cu_seqlens[:-1]
    unstage_states(buf, rows, pool, scales, state_indices, written, scale_dim)
    return out


def unstage_states(buf: torch.Tensor, rows: torch.Tensor, pool: torch.Tensor, scales: torch.Tensor,
                   state_indices: torch.Tensor, written: torch.Tensor, scale_dim: int) -> None:
    """Quantize ``buf[b]`` back into slot ``state_indices[b]`` where ``written[b]`` (bool)."""
    dst = torch.where(written & (state_indices >= 0), state_indices, -1)
    move_state_rows(buf, None, rows, pool, scales, dst, scale_dim)
