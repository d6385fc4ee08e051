"""Triton kernels of the state ops (:mod:`hybrid_compile.ops.state`): copy / commit / track.

All three are "copy row ``src`` of one tensor to row ``dst`` of another" with every slot
flattened to one row of ``R = prod(slot_shape)`` elements. One kernel, one launch per pool
tensor, grid ``(N, cdiv(R, BLOCK))``: program ``(i, c)`` reads index row ``i`` on device,
skips it in-kernel when an index is -1 (or, for the commit, ``accepted_steps <= 0``), and
copies ``BLOCK`` elements. No host sync and a grid from shapes only, so every launcher is
CUDA-graph safe (the commit runs in the speculative decode step).

FP8 pools: their scales are separate slot-indexed tensors, copied and committed like the values
(bit copies); ``track_chunk_states`` into an FP8 pool quantizes (:func:`.fp8_cache.move_state_rows`).

Same-dtype copies move raw bits (the tensors are viewed as same-width integers), so any dtype
is copied bit for bit; a cross-dtype copy (commit / track into a lower-precision pool) goes
through fp32 with round-to-nearest-even, like ``Tensor.to``.

Rows are copied in parallel: a destination that is another row's source gives an undefined
result here (the op's docstring forbids it; its plain-torch path gathers first).

Layout: each slot must be one contiguous run (``t[0].is_contiguous()``; the slot stride may be
anything). The Mamba pool's per-layer views are. Another layout raises a ValueError (no silent
slow path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cast_rne
from .fp8_cache import move_state_rows
from ..state import _check_commit, _check_copy_state_slots, _check_track

__all__ = ["copy_state_slots_triton", "commit_speculative_state_triton", "track_chunk_states_triton"]

_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_BLOCK = 4096


@triton.jit
def _copy_rows_kernel(
    src_ptr, dst_ptr, idx_a_ptr, idx_b_ptr,
    R, stride_src0, stride_src1, stride_dst0, steps,
    COMMIT: tl.constexpr, CAST: tl.constexpr, BLOCK: tl.constexpr,
):
    """COMMIT=False: dst[idx_b[i]] = src[idx_a[i]].
    COMMIT=True:  dst[idx_a[i]] = src[i, idx_b[i] - 1] (idx_b = accepted steps, 1..steps)."""
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(idx_a_ptr + i).to(tl.int64)
    b = tl.load(idx_b_ptr + i).to(tl.int64)
    if COMMIT:
        ok = (a >= 0) & (b > 0) & (b <= steps)
        src_off = i.to(tl.int64) * stride_src0 + (b - 1) * stride_src1
        dst_slot = a
    else:
        ok = (a >= 0) & (b >= 0)
        src_off = a * stride_src0
        dst_slot = b
    m = tl.where(ok, cols < R, False)  # a select, not `&`: Triton's interpreter mishandles block & scalar
    v = tl.load(src_ptr + src_off + cols, mask=m)
    if CAST:
        v = cast_rne(v.to(tl.float32), dst_ptr.dtype.element_ty)
    tl.store(dst_ptr + dst_slot * stride_dst0 + cols, v, mask=m)


def _slot_is_contiguous(t: torch.Tensor, lead: int) -> bool:
    """The trailing dims after ``lead`` leading dims form one contiguous run."""
    inner = t
    for _ in range(lead):
        if inner.shape[0] == 0:
            return True
        inner = inner[0]
    return inner.is_contiguous()


def _require(ok: bool, op: str, *tensors: torch.Tensor) -> None:
    """The CUDA kernel handles slots that are one contiguous run, bit copies of any dtype and
    casts between float dtypes; anything else is an error, not a slow path."""
    if not ok:
        desc = ", ".join(f"{tuple(t.shape)} strides {t.stride()} {t.dtype}" for t in tensors)
        raise ValueError(
            f"{op}: the CUDA kernel needs each slot to be one contiguous run and float (or same) dtypes; "
            f"got {desc}"
        )


def _operands(src: torch.Tensor, dst: torch.Tensor):
    """(src, dst, cast) for the kernel: same dtype -> integer views (bit copy), else floats + cast."""
    if src.dtype == dst.dtype:
        bits = _BITS_DTYPE.get(src.element_size())
        if bits is None:
            return None
        return src.view(bits), dst.view(bits), False
    if src.dtype in _FLOAT_DTYPES and dst.dtype in _FLOAT_DTYPES:
        return src, dst, True
    return None


def _launch(src, dst, idx_a, idx_b, rows, slot_numel, stride_src0, stride_src1, steps, commit) -> bool:
    ops = _operands(src, dst)
    if ops is None:
        return False
    if rows == 0 or slot_numel == 0:
        return True
    src_k, dst_k, cast = ops
    block = min(_MAX_BLOCK, triton.next_power_of_2(slot_numel))
    num_warps = max(1, min(8, block // 512))
    _copy_rows_kernel[(rows, triton.cdiv(slot_numel, block))](
        src_k, dst_k, idx_a, idx_b,
        slot_numel, stride_src0, stride_src1, dst.stride(0), steps,
        COMMIT=commit, CAST=cast, BLOCK=block, num_warps=num_warps,
    )
    return True


def copy_state_slots_triton(states: list[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Triton ``copy_state_slots``: ``states[j][dst_slots[i]] = states[j][src_slots[i]]``, -1 rows skipped."""
    n = src_slots.shape[0]
    if n == 0:
        return
    src_idx, dst_idx = src_slots.contiguous(), dst_slots.contiguous()
    for s in states:
        if s.dim() == 0 or s.numel() == 0:
            continue
        slot_numel = s[0].numel()
        _require(_slot_is_contiguous(s, 1), "copy_state_slots", s)
        _require(_launch(s, s, src_idx, dst_idx, n, slot_numel, s.stride(0), 0, 0, commit=False), "copy_state_slots", s)


def commit_speculative_state_triton(
    states: list[torch.Tensor],
    intermediate_states: list[torch.Tensor],
    state_indices: torch.Tensor,
    accepted_steps: torch.Tensor,
) -> None:
    """Triton ``commit_speculative_state``: ``states[j][state_indices[b]] = intermediate_states[j][b, accepted_steps[b] - 1]``.

    Rows with ``state_indices[b] < 0``, ``accepted_steps[b] <= 0`` (or, unchecked on CUDA,
    ``accepted_steps[b] > steps``) are skipped in-kernel.
    """
    batch = state_indices.shape[0]
    if batch == 0:
        return
    idx, acc = state_indices.contiguous(), accepted_steps.contiguous()
    for s, inter in zip(states, intermediate_states):
        if s.numel() == 0 or inter.numel() == 0:
            continue
        slot_numel = s[0].numel()
        steps = inter.shape[1]
        _require(_slot_is_contiguous(s, 1) and _slot_is_contiguous(inter, 2), "commit_speculative_state", s, inter)
        _require(
            _launch(inter, s, idx, acc, batch, slot_numel, inter.stride(0), inter.stride(1), steps, commit=True),
            "commit_speculative_state", s, inter,
        )


def track_chunk_states_triton(
    ssm_states: torch.Tensor, chunk_states: torch.Tensor, src_chunks: torch.Tensor, dst_slots: torch.Tensor,
    ssm_scales: torch.Tensor | None = None, scale_dim: int = -1,
) -> None:
    """Triton ``track_chunk_states``: ``ssm_states[dst_slots[i]] = chunk_states[src_chunks[i]]``, -1 rows skipped
    (quantized with ``ssm_scales`` into an FP8 pool)."""
    n = src_chunks.shape[0]
    if n == 0 or ssm_states.numel() == 0 or chunk_states.numel() == 0:
        return
    if ssm_scales is not None:
        move_state_rows(chunk_states, None, src_chunks.contiguous(), ssm_states, ssm_scales, dst_slots.contiguous(),
                        scale_dim)
        return
    slot_numel = ssm_states[0].numel()
    src_idx, dst_idx = src_chunks.contiguous(), dst_slots.contiguous()
    _require(_slot_is_contiguous(ssm_states, 1) and _slot_is_contiguous(chunk_states, 1), "track_chunk_states",
             ssm_states, chunk_states)
    _require(
        _launch(chunk_states, ssm_states, src_idx, dst_idx, n, slot_numel, chunk_states.stride(0), 0, 0, commit=False),
        "track_chunk_states", ssm_states, chunk_states,
    )


# --------------------------------------------------------------------------------------------
# registration as the CUDA kernels of the ops
# --------------------------------------------------------------------------------------------


def _copy_state_slots_cuda(states, src_slots, dst_slots):
    _check_copy_state_slots(states, src_slots, dst_slots)
    copy_state_slots_triton(states, src_slots, dst_slots)


def _commit_speculative_state_cuda(states, intermediate_states, state_indices, accepted_steps):
    _check_commit(states, intermediate_states, state_indices, accepted_steps)
    commit_speculative_state_triton(states, intermediate_states, state_indices, accepted_steps)


def _track_chunk_states_cuda(ssm_states, chunk_states, src_chunks, dst_slots, ssm_scales=None, scale_dim=-1):
    _check_track(ssm_states, chunk_states, src_chunks, dst_slots, ssm_scales, scale_dim)
    track_chunk_states_triton(ssm_states, chunk_states, src_chunks, dst_slots, ssm_scales, scale_dim)


torch.library.register_kernel("hybrid_compile::copy_state_slots", "cuda", _copy_state_slots_cuda)
torch.library.register_kernel("hybrid_compile::commit_speculative_state", "cuda", _commit_speculative_state_cuda)
torch.library.register_kernel("hybrid_compile::track_chunk_states", "cuda", _track_chunk_states_cuda)
