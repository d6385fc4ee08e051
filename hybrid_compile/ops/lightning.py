"""Lightning attention kernel ops (MiniMax-Text-01 / MiniMax-M1 linear-attention layers).

Math (transformers' ``MiniMaxLightningAttention``), per head ``h`` with a fixed decay slope
``s_h >= 0`` and an fp32 state ``S [K, V]``::

    S   <- exp(-s_h) * S + k_t (outer) v_t
    o_t <- q_t^T S

No query scale, no normalisation of q/k (the layer applies its activation before the op and
its RMSNorm + output gate after it). It is the gated delta rule without the delta correction and
with a constant per-head log-decay ``g = -s_h``; the GDN ops cannot express it (their write is
``beta * (v - k^T S)``), hence these ops.

- ``chunk_lightning_attention``             varlen prefill/extend, chunked (chunk states for the
  prefix cache in the ``_varlen`` row layout, as ``chunk_gated_delta_rule`` emits them).
- ``recurrent_lightning_attention_update``  decode (``L = 1``) and speculative verify: ``L``
  tokens per request, optional intermediate states per step; a draft TREE through
  ``parent_indices`` (each token from its parent's state).

State pool: ``ssm_states [num_slots, H, K, V]`` fp32/bf16/fp16 (read and computed in fp32, cast
on write), or float8_e4m3fn with ``ssm_scales [num_slots, H, V]`` (one fp32 scale per value column
over K, as the GDN state: :mod:`.fp8_cache`; dequantized on read, quantized on every write, and
between the steps of a verify as a decode step would store it). Slot index -1 marks a padding row: no
state read or write, zero outputs.
The CUDA implementations are Triton kernels (:mod:`.triton.lightning`).
"""

from __future__ import annotations

from typing import Optional

import torch

from ._validation import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_same_device,
    check_slot_indices,
    check_tensor,
    check_tree_parents,
    check_unique_slots,
    check_varlen_requests,
    check_varlen_values,
    tree_start_states,
)
from ._varlen import chunk_row_offsets, max_chunk_rows
from .fp8_cache import FP8_DTYPE, GDN_STATE_SCALE_DIM, check_scales, is_fp8, read_rows, round_trip, write_rows
from .registration import kernel_op

#: Chunk length of the chunked scan (chunk boundaries aligned to each request's first new token,
#: as in ``chunk_gated_delta_rule``; the prefix cache checkpoints at multiples of it).
LIGHTNING_CHUNK_SIZE = 64
#: Axis of a state slot ``[H, K, V]`` one FP8 scale covers (K: the kernels hold it whole, as GDN's).
LIGHTNING_STATE_SCALE_DIM = GDN_STATE_SCALE_DIM
#: State pool dtypes: float, or e4m3 with ``ssm_scales``.
STATE_DTYPES = FLOAT_DTYPES + (FP8_DTYPE,)


def _check_pool_and_slope(op, ssm_states, slope, h, kd, vd, ssm_scales=None):
    check_tensor(op, "ssm_states", ssm_states, dtypes=STATE_DTYPES, shape=(None, h, kd, vd))
    check_scales(op, ssm_states, ssm_scales, "ssm_scales", LIGHTNING_STATE_SCALE_DIM)
    check_tensor(op, "slope", slope, dtypes=(torch.float32,), shape=(h,))


# ----------------------------------------------------------------------------------------------
# chunk_lightning_attention (varlen prefill / extend)
# ----------------------------------------------------------------------------------------------


def _check_chunk(q, k, v, slope, ssm_states, cu_seqlens, state_indices, has_initial_state, ssm_scales=None):
    op = "chunk_lightning_attention"
    check_tensor(op, "q", q, ndim=3, dtypes=FLOAT_DTYPES)
    T, h, kd = q.shape
    check_tensor(op, "k", k, dtypes=FLOAT_DTYPES, shape=(T, h, kd))
    check_tensor(op, "v", v, dtypes=FLOAT_DTYPES, shape=(T, h, None))
    vd = v.shape[2]
    _check_pool_and_slope(op, ssm_states, slope, h, kd, vd, ssm_scales)
    check_varlen_requests(op, cu_seqlens, state_indices, has_initial_state)
    check_same_device(op, q=q, k=k, v=v, slope=slope, ssm_states=ssm_states, cu_seqlens=cu_seqlens,
                      state_indices=state_indices, has_initial_state=has_initial_state)
    check_varlen_values(op, cu_seqlens, T, state_indices, ssm_states.shape[0])


@kernel_op("hybrid_compile::chunk_lightning_attention", mutates_args=("ssm_states", "ssm_scales"))
def chunk_lightning_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slope: torch.Tensor,
    ssm_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    output_chunk_states: bool,
    ssm_scales: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lightning attention over a packed batch of variable-length requests (prefill / extend).

    Args:
        q, k: ``[T, H, K]`` float (after the layer's activation).
        v: ``[T, H, V]`` float.
        slope: ``[H]`` fp32 decay slopes (``S <- exp(-slope) * S`` per token).
        ssm_states: ``[num_slots, H, K, V]`` pool. **Mutated**: each real request's final state
            is written to its slot.
        cu_seqlens: ``[B + 1]`` int32/int64 token offsets of the requests.
        state_indices: ``[B]`` slots (-1 = padding request: no read/write, zero output).
        has_initial_state: ``[B]`` bool: start from the slot's state (else from zeros).
        output_chunk_states: also return the state before every chunk of ``LIGHTNING_CHUNK_SIZE``
            tokens of each request (the ``_varlen`` row layout, fp32).
        ssm_scales: ``[num_slots, H, V]`` fp32 scales when ``ssm_states`` is float8_e4m3fn (module
            docstring), else None. **Mutated** with the states (required, as every mutated argument:
            ``tests/test_project.py``).

    Returns:
        ``(o [T, H, V] in v.dtype, chunk_states [rows, H, K, V] fp32)``; ``rows`` is
        ``max_chunk_rows(T, B, LIGHTNING_CHUNK_SIZE)`` with ``output_chunk_states``, else 0.
    """
    _check_chunk(q, k, v, slope, ssm_states, cu_seqlens, state_indices, has_initial_state, ssm_scales)
    T, h, kd = q.shape
    vd = v.shape[2]
    C = LIGHTNING_CHUNK_SIZE
    dev = q.device
    batch = state_indices.shape[0]
    o = torch.zeros(T, h, vd, dtype=v.dtype, device=dev)
    rows = max_chunk_rows(T, batch, C) if output_chunk_states else 0
    chunk_states = torch.zeros(rows, h, kd, vd, dtype=torch.float32, device=dev)
    cu = [int(x) for x in cu_seqlens.tolist()]
    slots = [int(x) for x in state_indices.tolist()]
    row_off = chunk_row_offsets(cu_seqlens, C).tolist()
    s = slope.float()[:, None, None]  # [H, 1, 1]
    pos = torch.arange(C, device=dev, dtype=torch.float32)
    for b in range(batch):
        start, end = cu[b], cu[b + 1]
        if slots[b] < 0 or end == start:
            continue
        slot = torch.tensor([slots[b]], dtype=torch.int64, device=dev)
        state = (read_rows(ssm_states, ssm_scales, slot, LIGHTNING_STATE_SCALE_DIM)[0] if bool(has_initial_state[b])
                 else torch.zeros(h, kd, vd, dtype=torch.float32, device=dev))
        for j, c0 in enumerate(range(start, end, C)):
            c = min(C, end - c0)
            if output_chunk_states:
                chunk_states[row_off[b] + j] = state
            qc = q[c0 : c0 + c].float().transpose(0, 1)  # [H, c, K]
            kc = k[c0 : c0 + c].float().transpose(0, 1)
            vc = v[c0 : c0 + c].float().transpose(0, 1)  # [H, c, V]
            p = pos[:c]
            diff = p[:, None] - p[None, :]  # i - j
            decay = torch.where(diff >= 0, torch.exp(-s * diff.clamp(min=0)), torch.zeros_like(diff))  # [H, c, c]
            out = (qc * torch.exp(-s * (p[:, None] + 1))) @ state + ((qc @ kc.transpose(-1, -2)) * decay) @ vc
            o[c0 : c0 + c] = out.transpose(0, 1).to(v.dtype)
            state = torch.exp(-s * c) * state + (kc * torch.exp(-s * (c - 1 - p)[:, None])).transpose(-1, -2) @ vc
        write_rows(ssm_states, ssm_scales, slot, state[None], LIGHTNING_STATE_SCALE_DIM)
    return o, chunk_states


@chunk_lightning_attention.register_fake
def _(q, k, v, slope, ssm_states, cu_seqlens, state_indices, has_initial_state, output_chunk_states, ssm_scales):
    _check_chunk(q, k, v, slope, ssm_states, cu_seqlens, state_indices, has_initial_state, ssm_scales)
    T, h, kd = q.shape
    rows = max_chunk_rows(T, state_indices.shape[0], LIGHTNING_CHUNK_SIZE) if output_chunk_states else 0
    return v.new_empty(v.shape), v.new_empty((rows, h, kd, v.shape[2]), dtype=torch.float32)


# ----------------------------------------------------------------------------------------------
# recurrent_lightning_attention_update (decode, speculative verify)
# ----------------------------------------------------------------------------------------------


def _check_recurrent(q, k, v, slope, ssm_states, state_indices, intermediate_states, disable_state_update=True,
                     parent_indices=None, ssm_scales=None, intermediate_scales=None):
    op = "recurrent_lightning_attention_update"
    check_tensor(op, "q", q, ndim=4, dtypes=FLOAT_DTYPES)
    bs, steps, h, kd = q.shape
    check_tensor(op, "k", k, dtypes=FLOAT_DTYPES, shape=(bs, steps, h, kd))
    check_tensor(op, "v", v, dtypes=FLOAT_DTYPES, shape=(bs, steps, h, None))
    vd = v.shape[3]
    _check_pool_and_slope(op, ssm_states, slope, h, kd, vd, ssm_scales)
    check_tensor(op, "state_indices", state_indices, dtypes=INDEX_DTYPES, shape=(bs,))
    if intermediate_states is None and intermediate_scales is not None:
        raise ValueError(f"{op}: `intermediate_scales` without `intermediate_states`")
    if intermediate_states is not None:
        check_tensor(op, "intermediate_states", intermediate_states, ndim=5, dtypes=STATE_DTYPES)
        check_scales(op, intermediate_states, intermediate_scales, "intermediate_scales", LIGHTNING_STATE_SCALE_DIM,
                     "intermediate_states")
        s = intermediate_states.shape
        if s[0] < bs or s[1] < steps or tuple(s[2:]) != (h, kd, vd):
            raise ValueError(
                f"{op}: `intermediate_states` has shape {tuple(s)}, expected "
                f"[>= {bs}, >= {steps}, {h}, {kd}, {vd}] (batch rows, steps, H, K, V)"
            )
    check_tree_parents(op, parent_indices, bs, steps, has_intermediate=intermediate_states is not None,
                       disable_state_update=disable_state_update,
                       fp8=is_fp8(ssm_states) or (intermediate_states is not None and is_fp8(intermediate_states)))
    check_same_device(op, q=q, k=k, v=v, slope=slope, ssm_states=ssm_states, state_indices=state_indices,
                      intermediate_states=intermediate_states, parent_indices=parent_indices)
    check_slot_indices(op, "state_indices", state_indices, ssm_states.shape[0])
    check_unique_slots(op, "state_indices", state_indices)


@kernel_op(
    "hybrid_compile::recurrent_lightning_attention_update",
    mutates_args=("ssm_states", "intermediate_states", "ssm_scales", "intermediate_scales"),
)
def recurrent_lightning_attention_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slope: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    disable_state_update: bool,
    intermediate_states: Optional[torch.Tensor],
    ssm_scales: Optional[torch.Tensor],
    intermediate_scales: Optional[torch.Tensor],
    parent_indices: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``L`` lightning-attention steps per request from its slot's state (decode: ``L = 1``).

    Args:
        q, k: ``[B, L, H, K]`` float.
        v: ``[B, L, H, V]`` float.
        slope: ``[H]`` fp32 decay slopes.
        ssm_states: ``[num_slots, H, K, V]`` pool; slot ``state_indices[b]`` is the starting
            state. **Mutated** (final state written back) unless ``disable_state_update``.
        state_indices: ``[B]`` int32/int64; -1 = padding row (nothing read or written, zero output).
        disable_state_update: leave ``ssm_states`` untouched (speculative verify: the accepted
            step is committed later from ``intermediate_states`` by ``commit_speculative_state``).
        intermediate_states: optional ``[>= B, >= L, H, K, V]`` float buffer indexed by BATCH ROW.
            **Mutated**: ``intermediate_states[b, t]`` = state after step ``t``, real rows only.
        ssm_scales, intermediate_scales: fp32 scales (``[num_slots, H, V]``, ``[>= B, >= L, H, V]``)
            of an e4m3 pool / intermediate buffer (module docstring), else None. **Mutated** with their
            buffers (required, as every mutated argument).
        parent_indices: optional ``[B, L]`` int32/int64: a draft TREE (top-k > 1 drafts). Token
            ``t`` starts from the state stored after token ``parent_indices[b, t]`` (its row of
            ``intermediate_states``, as stored) or, for ``-1``, from the slot's state;
            ``-1 <= parent < t``. Needs ``intermediate_states`` and ``disable_state_update``; not with
            FP8 buffers. None: a chain (``parent = t - 1``).

    Returns:
        ``o``: ``[B, L, H, V]`` in ``v.dtype``.
    """
    _check_recurrent(q, k, v, slope, ssm_states, state_indices, intermediate_states, disable_state_update,
                     parent_indices, ssm_scales, intermediate_scales)
    bs, steps, h, vd = v.shape
    o = torch.zeros(bs, steps, h, vd, dtype=v.dtype, device=v.device)
    rows = torch.nonzero(state_indices >= 0).flatten()
    if rows.numel() == 0 or steps == 0:
        return o
    slots = state_indices.to(torch.int64)[rows]
    decay = torch.exp(-slope.float())[None, :, None, None]  # [1, H, 1, 1]
    state = read_rows(ssm_states, ssm_scales, slots, LIGHTNING_STATE_SCALE_DIM)  # [R, H, K, V] fp32
    qf, kf, vf = q[rows].float(), k[rows].float(), v[rows].float()
    out = torch.empty(rows.numel(), steps, h, vd, dtype=torch.float32, device=v.device)
    initial, history = state, []  # (a tree: the states after each token, as stored)
    parents = None if parent_indices is None else parent_indices.index_select(0, rows)
    for t in range(steps):
        if parents is not None:
            state = tree_start_states(initial, history, parents[:, t])
        state = decay * state + kf[:, t, :, :, None] * vf[:, t, :, None, :]
        out[:, t] = (qf[:, t, :, None, :] @ state).squeeze(-2)
        if intermediate_states is not None:
            write_rows(intermediate_states[:, t], None if intermediate_scales is None else intermediate_scales[:, t],
                       rows, state, LIGHTNING_STATE_SCALE_DIM)
        if parents is not None:
            history.append(state.to(intermediate_states.dtype).float())
        if is_fp8(ssm_states) and t < steps - 1:  # as a decode step would store it (fp8_cache.round_trip)
            state = round_trip(state, LIGHTNING_STATE_SCALE_DIM)
    if not disable_state_update:
        write_rows(ssm_states, ssm_scales, slots, state, LIGHTNING_STATE_SCALE_DIM)
    o.index_copy_(0, rows, out.to(v.dtype))
    return o


@recurrent_lightning_attention_update.register_fake
def _(q, k, v, slope, ssm_states, state_indices, disable_state_update, intermediate_states, ssm_scales,
      intermediate_scales, parent_indices=None):
    _check_recurrent(q, k, v, slope, ssm_states, state_indices, intermediate_states, disable_state_update,
                     parent_indices, ssm_scales, intermediate_scales)
    return v.new_empty(v.shape)
