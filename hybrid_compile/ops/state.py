"""State ops: move recurrent state between slots of the Mamba pool.

Three ops, one gather/scatter underneath:

- ``copy_state_slots``      slot -> slot inside the same pool tensors (copy-on-write of a
                            prefix-cache hit into the request's private slot).
- ``commit_speculative_state``  per request, the intermediate state of its last accepted
                            draft step -> its main slot (after a speculative verify step).
- ``track_chunk_states``    chunk-boundary states returned by a chunked scan (GDN / SSD) ->
                            a cache slot (prefix-cache checkpoints at chunk boundaries).

FP8 pools (:mod:`.fp8_cache`) keep their scales in tensors of their own with the same leading slot
dimension: the copy and the commit move them like any other pool tensor (listed beside their
values); ``track_chunk_states`` quantizes the fp32 chunk states into an FP8 pool and its scales.

Index tensors are int32/int64; an entry of -1 in any index (or an accepted length <= 0)
means "skip this row". Rows are processed in order, so a later row wins if two rows write
the same destination (callers should not do that; debug checks reject it).
"""

from __future__ import annotations

import torch

from typing import Optional
from .registration import kernel_op

from .fp8_cache import FP8_DTYPE, check_scales, is_fp8, write_rows
from ._validation import (
    INDEX_DTYPES,
    check_same_device,
    check_slot_indices,
    check_tensor,
    check_unique_slots,
)


def _scatter_rows(dst: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] for every i where both indices are >= 0."""
    src_rows = src_rows.to(torch.int64)
    dst_rows = dst_rows.to(torch.int64)
    keep = (src_rows >= 0) & (dst_rows >= 0)
    if not bool(keep.all()):
        dst_rows, src_rows = dst_rows[keep], src_rows[keep]
    rows = src.index_select(0, src_rows)
    if is_fp8(dst):  # (torch has no CPU index_copy_ for float8: move the bytes)
        if rows.dtype != FP8_DTYPE:
            raise ValueError("a float8 pool tensor takes rows of float8 only (quantize them first)")
        dst.view(torch.uint8).index_copy_(0, dst_rows, rows.view(torch.uint8))
    else:
        dst.index_copy_(0, dst_rows, rows.to(dst.dtype))


def _check_pair_rows(op: str, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    check_tensor(op, "src_slots", src_rows, ndim=1, dtypes=INDEX_DTYPES)
    check_tensor(op, "dst_slots", dst_rows, ndim=1, dtypes=INDEX_DTYPES, shape=(src_rows.shape[0],))


def _check_copy_state_slots(states, src_slots, dst_slots):
    op = "copy_state_slots"
    _check_pair_rows(op, src_slots, dst_slots)
    if len(states) == 0:
        raise ValueError(f"{op}: `states` must hold at least one pool tensor")
    for i, s in enumerate(states):
        check_tensor(op, f"states[{i}]", s)
        if s.dim() < 1 or s.shape[0] != states[0].shape[0]:
            raise ValueError(f"{op}: every pool tensor must have the same number of slots (dim 0)")
    check_same_device(op, **{f"states[{i}]": s for i, s in enumerate(states)}, src_slots=src_slots, dst_slots=dst_slots)
    check_slot_indices(op, "src_slots", src_slots, states[0].shape[0])
    check_slot_indices(op, "dst_slots", dst_slots, states[0].shape[0])
    check_unique_slots(op, "dst_slots", dst_slots)


@kernel_op("hybrid_compile::copy_state_slots", mutates_args=("states",))
def copy_state_slots(states: list[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Copy whole slots within pool tensors: ``states[j][dst_slots[i]] = states[j][src_slots[i]]``.

    Args:
        states: pool tensors, each ``[num_slots, ...]`` (e.g. conv windows ``[S, W-1, D]`` and
            SSM states ``[S, H, K, V]`` of every linear layer), any dtype. **Mutated.**
        src_slots, dst_slots: ``[N]`` int32/int64. Rows with -1 in either are skipped.
            Destinations must be distinct and no destination may be another row's source.
    """
    _check_copy_state_slots(states, src_slots, dst_slots)
    if src_slots.numel() == 0:
        return
    for s in states:
        # Gather first, then scatter: a destination that is also a source of another row reads
        # the old value (the caller is told not to rely on this, but it stays well defined).
        _scatter_rows(s, s.clone() if s.numel() else s, src_slots, dst_slots)


@copy_state_slots.register_fake
def _(states, src_slots, dst_slots):
    _check_copy_state_slots(states, src_slots, dst_slots)


def _check_commit(states, intermediate_states, state_indices, accepted_steps):
    op = "commit_speculative_state"
    if len(states) == 0 or len(states) != len(intermediate_states):
        raise ValueError(
            f"{op}: `states` and `intermediate_states` must be non-empty lists of equal length, "
            f"got {len(states)} and {len(intermediate_states)}"
        )
    check_tensor(op, "state_indices", state_indices, ndim=1, dtypes=INDEX_DTYPES)
    batch = state_indices.shape[0]
    check_tensor(op, "accepted_steps", accepted_steps, ndim=1, dtypes=INDEX_DTYPES, shape=(batch,))
    for i, (s, inter) in enumerate(zip(states, intermediate_states)):
        check_tensor(op, f"states[{i}]", s)
        if inter.dim() != s.dim() + 1:
            raise ValueError(
                f"{op}: intermediate_states[{i}] must be [batch, steps, *slot_shape] with slot shape "
                f"{tuple(s.shape[1:])}, got {tuple(inter.shape)}"
            )
        if inter.shape[0] < batch or tuple(inter.shape[2:]) != tuple(s.shape[1:]):
            raise ValueError(
                f"{op}: intermediate_states[{i}] has shape {tuple(inter.shape)}, expected "
                f"[>= {batch}, steps, {', '.join(str(x) for x in s.shape[1:])}]"
            )
        check_same_device(op, state=s, intermediate=inter, state_indices=state_indices, accepted_steps=accepted_steps)
        check_slot_indices(op, "state_indices", state_indices, s.shape[0])
    check_unique_slots(op, "state_indices", state_indices)
    steps = intermediate_states[0].shape[1]
    from ._validation import should_check_values

    if accepted_steps.numel() and should_check_values(accepted_steps) and int(accepted_steps.max()) > steps:
        raise IndexError(f"{op}: `accepted_steps` has a value above the {steps} intermediate steps")


@kernel_op(
    "hybrid_compile::commit_speculative_state", mutates_args=("states",)
)
def commit_speculative_state(
    states: list[torch.Tensor],
    intermediate_states: list[torch.Tensor],
    state_indices: torch.Tensor,
    accepted_steps: torch.Tensor,
) -> None:
    """Commit the state after the last accepted verify step into each request's main slot.

    For each batch row ``b`` with ``state_indices[b] >= 0`` and ``accepted_steps[b] > 0``:
    ``states[j][state_indices[b]] = intermediate_states[j][b, accepted_steps[b] - 1]``.

    Args:
        states: pool tensors ``[num_slots, *slot_shape]`` (conv windows, SSM states). **Mutated.**
        intermediate_states: per pool tensor, the per-step buffer written by the verify ops,
            ``[max_batch, steps, *slot_shape]``, indexed by batch row (not by slot).
        state_indices: ``[B]`` int32/int64 main slot of each request, -1 = padding (skipped).
        accepted_steps: ``[B]`` int32/int64 number of verify steps whose state to keep
            (accepted draft tokens + 1 for the verified token); <= 0 leaves the slot untouched.
    """
    _check_commit(states, intermediate_states, state_indices, accepted_steps)
    batch = state_indices.shape[0]
    if batch == 0:
        return
    idx = state_indices.to(torch.int64)
    acc = accepted_steps.to(torch.int64)
    rows = torch.arange(batch, device=idx.device)
    keep = (idx >= 0) & (acc > 0)
    dst = torch.where(keep, idx, torch.full_like(idx, -1))
    for s, inter in zip(states, intermediate_states):
        steps = inter.shape[1]
        flat = inter[:batch].reshape(batch * steps, *inter.shape[2:])
        src = torch.where(keep, rows * steps + (acc - 1).clamp(min=0), torch.full_like(idx, -1))
        _scatter_rows(s, flat, src, dst)


@commit_speculative_state.register_fake
def _(states, intermediate_states, state_indices, accepted_steps):
    _check_commit(states, intermediate_states, state_indices, accepted_steps)


def _check_track(ssm_states, chunk_states, src_chunks, dst_slots, ssm_scales=None, scale_dim=-1):
    op = "track_chunk_states"
    check_tensor(op, "ssm_states", ssm_states)
    if ssm_states.dim() > 1 and not -(ssm_states.dim() - 1) <= scale_dim < 0:
        raise ValueError(f"{op}: `scale_dim` must index a slot dim from the end (-1 .. -{ssm_states.dim() - 1})")
    check_scales(op, ssm_states, ssm_scales, "ssm_scales", scale_dim)
    check_tensor(op, "chunk_states", chunk_states)
    if chunk_states.dim() != ssm_states.dim() or tuple(chunk_states.shape[1:]) != tuple(ssm_states.shape[1:]):
        raise ValueError(
            f"{op}: `chunk_states` {tuple(chunk_states.shape)} must be [num_chunks, *slot_shape] with the slot "
            f"shape of `ssm_states` {tuple(ssm_states.shape[1:])}"
        )
    check_tensor(op, "src_chunks", src_chunks, ndim=1, dtypes=INDEX_DTYPES)
    check_tensor(op, "dst_slots", dst_slots, ndim=1, dtypes=INDEX_DTYPES, shape=(src_chunks.shape[0],))
    check_same_device(op, ssm_states=ssm_states, chunk_states=chunk_states, src_chunks=src_chunks, dst_slots=dst_slots)
    check_slot_indices(op, "src_chunks", src_chunks, chunk_states.shape[0])
    check_slot_indices(op, "dst_slots", dst_slots, ssm_states.shape[0])
    check_unique_slots(op, "dst_slots", dst_slots)


@kernel_op("hybrid_compile::track_chunk_states", mutates_args=("ssm_states", "ssm_scales"))
def track_chunk_states(
    ssm_states: torch.Tensor,
    chunk_states: torch.Tensor,
    src_chunks: torch.Tensor,
    dst_slots: torch.Tensor,
    ssm_scales: Optional[torch.Tensor],
    scale_dim: int,
) -> None:
    """Checkpoint chunk-boundary SSM states into cache slots: ``ssm_states[dst_slots[i]] = chunk_states[src_chunks[i]]``.

    Args:
        ssm_states: SSM state pool ``[num_slots, *state_shape]`` (GDN ``[S, H, K, V]``, Mamba2
            ``[S, H, P, N]``), fp32/bf16/fp16. **Mutated.**
        chunk_states: ``[num_chunks, *state_shape]`` as returned by ``chunk_gated_delta_rule`` /
            ``ssd_chunk_scan`` with ``output_chunk_states=True`` (state at the start of each chunk).
        src_chunks, dst_slots: ``[N]`` int32/int64; rows with -1 in either are skipped.
        ssm_scales: fp32 scales of an FP8 ``ssm_states`` (its shape without ``scale_dim`` per slot),
            **mutated**: the chunk states are quantized into the slots (:mod:`.fp8_cache`). None for
            a float pool.
        scale_dim: the slot axis one scale covers (GDN -2, Mamba2 -1); used with ``ssm_scales`` only.
    """
    _check_track(ssm_states, chunk_states, src_chunks, dst_slots, ssm_scales, scale_dim)
    if not src_chunks.numel():
        return
    if ssm_scales is None:
        _scatter_rows(ssm_states, chunk_states, src_chunks, dst_slots)
        return
    src, dst = src_chunks.to(torch.int64), dst_slots.to(torch.int64)
    keep = (src >= 0) & (dst >= 0)
    src, dst = src[keep], dst[keep]
    write_rows(ssm_states, ssm_scales, dst, chunk_states.index_select(0, src), scale_dim)


@track_chunk_states.register_fake
def _(ssm_states, chunk_states, src_chunks, dst_slots, ssm_scales=None, scale_dim=-1):
    _check_track(ssm_states, chunk_states, src_chunks, dst_slots, ssm_scales, scale_dim)
