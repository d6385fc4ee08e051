"""Mamba1 selective-scan kernel ops: varlen prefill scan and the decode / verify state update.

The math is transformers' Mamba1 mixer (``mamba_selective_scan`` / ``mamba_selective_state_update``
of Mamba, FalconMamba and Jamba). Per channel ``d`` of ``D_inner`` (``A [D_inner, N] < 0``, one
row of state per channel), reading group ``g = d // (D_inner / G)`` of the token's ``B_t``, ``C_t``
``[G, N]`` (Mamba / FalconMamba / Jamba: ``G = 1``, shared by every channel; Zamba: one group per
Mamba head)::

    dt_t[d] = softplus(dt_t[d] + dt_bias[d]) if dt_softplus else dt_t[d] + dt_bias[d]
    S[d]    = S[d] * exp(dt_t[d] * A[d]) + dt_t[d] * x_t[d] * B_t[g]    # S: [D_inner, N]
    y_t[d]  = S[d] . C_t[g] + D[d] * x_t[d]
    y_t[d]  = y_t[d] * silu(z_t[d])                                     # only when z is given

Unlike Mamba2 (one scalar ``A`` per head) the decay differs per state entry, so there is no
chunked matmul form: the scan is the sequential recurrence, batched over requests and channels.

Two ops:

- ``mamba1_selective_scan``  packed varlen prefill / extend. With ``output_chunk_states`` it also
                             returns the state every ``chunk_size`` tokens of each request, in the
                             chunk-state row layout of ``_varlen.py`` (what the prefix cache
                             checkpoints; the chunk is an alignment, not a kernel constraint).
- ``mamba1_state_update``    decode (``L = 1``) and speculative verify (``L`` steps per request,
                             optionally recording the state after every step; a chain, or a draft
                             tree through ``parent_indices``).

Everything is computed in fp32; outputs are in ``x.dtype``; state pools may be fp32/bf16/fp16
(read, compute in fp32, cast on write), or float8_e4m3fn with fp32 ``ssm_scales [num_slots, D_inner]``
beside them (one scale per channel over N, :mod:`.fp8_cache`: dequantized on read, quantized on
write). A state index of -1 marks a padding request: its outputs are zero and no state is read or
written.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._validation import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_same_device,
    check_slot_indices,
    check_intermediate_states,
    check_tensor,
    check_tree_parents,
    check_unique_slots,
    check_varlen_requests,
    check_varlen_values,
    tree_start_states,
)
from ._varlen import chunk_row_offsets, max_chunk_rows
from .fp8_cache import FP8_DTYPE, MAMBA1_STATE_SCALE_DIM, check_scales, is_fp8, read_rows, round_trip, write_rows
from .registration import kernel_op

#: State pool dtypes: float, or e4m3 with one fp32 scale per (slot, channel) over N.
STATE_DTYPES = FLOAT_DTYPES + (FP8_DTYPE,)

__all__ = ["mamba1_selective_scan", "mamba1_state_update"]


def _discretize_dt(dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool) -> torch.Tensor:
    """fp32 dt after bias and softplus (dt_bias broadcast over the last dim)."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    return F.softplus(dt) if dt_softplus else dt


def _decay_matrix(A: torch.Tensor, A_is_log: bool) -> torch.Tensor:
    """fp32 ``A`` (negative), from the model's ``A_log`` when ``A_is_log``."""
    return -torch.exp(A.float()) if A_is_log else A.float()


def _per_channel(bc: torch.Tensor, D_inner: int) -> torch.Tensor:
    """fp32 ``[..., G, N]`` -> ``[..., D_inner, N]``: each channel's group of B or C."""
    return bc.float().repeat_interleave(D_inner // bc.shape[-2], dim=-2)


def _check_groups(op, D_inner, G):
    if G <= 0 or D_inner % G != 0:
        raise ValueError(f"{op}: D_inner ({D_inner}) must be a multiple of the number of B/C groups ({G})")


def _check_params(op, D_inner, N, A, D, dt_bias, A_is_log):
    check_tensor(op, "A_log" if A_is_log else "A", A, dtypes=FLOAT_DTYPES if A_is_log else (torch.float32,),
                 shape=(D_inner, N))
    if D is not None:
        check_tensor(op, "D", D, dtypes=FLOAT_DTYPES, shape=(D_inner,))
    if dt_bias is not None:
        check_tensor(op, "dt_bias", dt_bias, dtypes=FLOAT_DTYPES, shape=(D_inner,))


# --------------------------------------------------------------------------------------------
# mamba1_selective_scan
# --------------------------------------------------------------------------------------------


def _check_selective_scan(
    x, dt, A, B, C, D, z, dt_bias, ssm_states, cu_seqlens, state_indices, has_initial_state, chunk_size, A_is_log,
    ssm_scales=None,
):
    op = "mamba1_selective_scan"
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    T, D_inner = x.shape
    check_tensor(op, "dt", dt, dtypes=FLOAT_DTYPES, shape=(T, D_inner))
    check_tensor(op, "B", B, ndim=3, dtypes=FLOAT_DTYPES)
    G, N = B.shape[1], B.shape[2]
    check_tensor(op, "B", B, shape=(T, G, N))
    check_tensor(op, "C", C, dtypes=FLOAT_DTYPES, shape=(T, G, N))
    _check_groups(op, D_inner, G)
    _check_params(op, D_inner, N, A, D, dt_bias, A_is_log)
    if z is not None:
        check_tensor(op, "z", z, dtypes=FLOAT_DTYPES, shape=(T, D_inner))
    check_tensor(op, "ssm_states", ssm_states, ndim=3, dtypes=STATE_DTYPES)
    check_tensor(op, "ssm_states", ssm_states, shape=(None, D_inner, N))
    check_scales(op, ssm_states, ssm_scales, "ssm_scales", MAMBA1_STATE_SCALE_DIM)
    check_varlen_requests(op, cu_seqlens, state_indices, has_initial_state)
    if chunk_size <= 0:
        raise ValueError(f"{op}: chunk_size must be > 0, got {chunk_size}")
    check_same_device(
        op, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, ssm_states=ssm_states,
        cu_seqlens=cu_seqlens, state_indices=state_indices, has_initial_state=has_initial_state,
    )
    check_varlen_values(op, cu_seqlens, T, state_indices, ssm_states.shape[0])


@kernel_op("hybrid_compile::mamba1_selective_scan", mutates_args=("ssm_states", "ssm_scales"))
def mamba1_selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    ssm_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    chunk_size: int,
    output_chunk_states: bool,
    A_is_log: bool,
    ssm_scales: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba1 selective scan over a packed varlen batch (prefill / extend).

    Per request ``b`` (tokens ``cu_seqlens[b]:cu_seqlens[b+1]``) runs the recurrence of the module
    docstring from its initial state.

    Args:
        x: ``[T, D_inner]`` fp32/bf16/fp16 (the conv output; may be a non-contiguous view).
        dt: ``[T, D_inner]`` raw time steps (``dt_proj`` without its bias).
        A: ``[D_inner, N]`` fp32, already negated (``-exp(A_log)``); the model's ``A_log`` (any float
            dtype) when ``A_is_log``.
        B, C: ``[T, G, N]``; channel ``d`` reads group ``d // (D_inner / G)``.
        D: ``[D_inner]`` skip coefficient, or None. z: ``[T, D_inner]`` gate (``y *= silu(z)``), or None.
        dt_bias: ``[D_inner]`` (``dt_proj.bias``), or None. dt_softplus: apply softplus to ``dt + dt_bias``.
        ssm_states: ``[num_slots, D_inner, N]`` fp32/bf16/fp16 state pool. **Mutated**: slot
            ``state_indices[b]`` receives the final state of every request with ``len_b > 0``.
        cu_seqlens: ``[B + 1]`` int32/int64.
        state_indices: ``[B]`` slot of each request; -1 = padding (zero output, no state read or
            written, zero chunk-state rows). Distinct otherwise.
        has_initial_state: ``[B]`` bool; start from the slot's state when True, from zeros when False.
        chunk_size: spacing of the chunk states (tokens).
        output_chunk_states: also return the state every ``chunk_size`` tokens.
        A_is_log: ``A`` is ``A_log``.
        ssm_scales: ``[num_slots, D_inner]`` fp32 scales of an FP8 ``ssm_states`` (**mutated** with it),
            None for a float pool.

    Returns:
        ``(y, chunk_states)``: ``y`` ``[T, D_inner]`` in ``x.dtype``; ``chunk_states`` fp32
        ``[max_chunk_rows(T, B, chunk_size), D_inner, N]`` (row ``chunk_row_offsets[b] + j`` = state
        after ``j * chunk_size`` new tokens of request ``b``; unused rows zero) when
        ``output_chunk_states``, else ``[0, D_inner, N]``.
    """
    _check_selective_scan(
        x, dt, A, B, C, D, z, dt_bias, ssm_states, cu_seqlens, state_indices, has_initial_state, chunk_size, A_is_log,
        ssm_scales,
    )
    T, D_inner = x.shape
    N = B.shape[2]
    batch = cu_seqlens.shape[0] - 1
    dev = x.device
    y = torch.zeros(T, D_inner, dtype=torch.float32, device=dev)
    n_rows = max_chunk_rows(T, batch, chunk_size) if output_chunk_states else 0
    chunk_states = torch.zeros(n_rows, D_inner, N, dtype=torch.float32, device=dev)
    if T == 0 or batch == 0:
        return y.to(x.dtype), chunk_states

    cu = cu_seqlens.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    slots = state_indices.to(torch.int64)
    reqs = ((slots >= 0) & (lens > 0)).nonzero().squeeze(1)  # the requests that run
    if reqs.numel() == 0:
        return y.to(x.dtype), chunk_states
    Af = _decay_matrix(A, A_is_log)
    dtf = _discretize_dt(dt, dt_bias, dt_softplus)  # [T, D_inner]
    xf = x.float()
    S = torch.zeros(reqs.numel(), D_inner, N, dtype=torch.float32, device=dev)
    read = has_initial_state[reqs]
    S[read] = read_rows(ssm_states, ssm_scales, slots[reqs[read]], MAMBA1_STATE_SCALE_DIM)
    rows0 = chunk_row_offsets(cu_seqlens, chunk_size)[reqs]
    # Sequential over the position inside the request, batched over the requests still running.
    for j in range(int(lens[reqs].max())):
        live = (lens[reqs] > j).nonzero().squeeze(1)
        if j % chunk_size == 0 and output_chunk_states:
            chunk_states[rows0[live] + j // chunk_size] = S[live]
        tok = cu[reqs[live]] + j
        d = dtf[tok]  # [r, D_inner]
        S[live] = S[live] * torch.exp(d[..., None] * Af) + (d * xf[tok])[..., None] * _per_channel(B[tok], D_inner)
        y[tok] = (S[live] * _per_channel(C[tok], D_inner)).sum(-1)
    if D is not None:
        y = y + D.float() * xf
    if z is not None:
        y = y * F.silu(z.float())
    runs = torch.zeros(batch, dtype=torch.bool, device=dev)
    runs[reqs] = True
    ran = torch.repeat_interleave(runs, lens, output_size=T)  # padding requests' tokens stay zero
    y = torch.where(ran[:, None], y, torch.zeros((), device=dev))
    write_rows(ssm_states, ssm_scales, slots[reqs], S, MAMBA1_STATE_SCALE_DIM)
    return y.to(x.dtype), chunk_states


@mamba1_selective_scan.register_fake
def _(
    x, dt, A, B, C, D, z, dt_bias, dt_softplus, ssm_states, cu_seqlens, state_indices, has_initial_state, chunk_size,
    output_chunk_states, A_is_log=False, ssm_scales=None,
):
    _check_selective_scan(
        x, dt, A, B, C, D, z, dt_bias, ssm_states, cu_seqlens, state_indices, has_initial_state, chunk_size, A_is_log,
        ssm_scales,
    )
    T, D_inner = x.shape
    rows = max_chunk_rows(T, cu_seqlens.shape[0] - 1, chunk_size) if output_chunk_states else 0
    return x.new_empty((T, D_inner)), x.new_empty((rows, D_inner, B.shape[2]), dtype=torch.float32)


# --------------------------------------------------------------------------------------------
# mamba1_state_update
# --------------------------------------------------------------------------------------------


def _check_state_update(x, dt, A, B, C, D, z, dt_bias, ssm_states, state_indices, intermediate_states, A_is_log,
                        ssm_scales=None, intermediate_scales=None, disable_state_update=True, parent_indices=None):
    op = "mamba1_state_update"
    check_tensor(op, "x", x, ndim=3, dtypes=FLOAT_DTYPES)
    batch, steps, D_inner = x.shape
    check_tensor(op, "dt", dt, dtypes=FLOAT_DTYPES, shape=(batch, steps, D_inner))
    check_tensor(op, "B", B, ndim=4, dtypes=FLOAT_DTYPES)
    G, N = B.shape[2], B.shape[3]
    check_tensor(op, "B", B, shape=(batch, steps, G, N))
    check_tensor(op, "C", C, dtypes=FLOAT_DTYPES, shape=(batch, steps, G, N))
    _check_groups(op, D_inner, G)
    _check_params(op, D_inner, N, A, D, dt_bias, A_is_log)
    if z is not None:
        check_tensor(op, "z", z, dtypes=FLOAT_DTYPES, shape=(batch, steps, D_inner))
    check_tensor(op, "ssm_states", ssm_states, ndim=3, dtypes=STATE_DTYPES)
    check_tensor(op, "ssm_states", ssm_states, shape=(None, D_inner, N))
    check_scales(op, ssm_states, ssm_scales, "ssm_scales", MAMBA1_STATE_SCALE_DIM)
    check_tensor(op, "state_indices", state_indices, dtypes=INDEX_DTYPES, shape=(batch,))
    if intermediate_states is None and intermediate_scales is not None:
        raise ValueError(f"{op}: `intermediate_scales` without `intermediate_states`")
    if intermediate_states is not None:
        check_tensor(op, "intermediate_states", intermediate_states, ndim=4, dtypes=STATE_DTYPES)
        check_scales(op, intermediate_states, intermediate_scales, "intermediate_scales", MAMBA1_STATE_SCALE_DIM,
                     "intermediate_states")
        check_intermediate_states(op, intermediate_states, batch, steps, (D_inner, N))
    check_same_device(
        op, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, ssm_states=ssm_states,
        state_indices=state_indices, intermediate_states=intermediate_states,
    )
    check_slot_indices(op, "state_indices", state_indices, ssm_states.shape[0])
    check_unique_slots(op, "state_indices", state_indices)
    check_tree_parents(op, parent_indices, batch, steps, has_intermediate=intermediate_states is not None,
                       disable_state_update=disable_state_update,
                       fp8=is_fp8(ssm_states) or (intermediate_states is not None and is_fp8(intermediate_states)))


@kernel_op(
    "hybrid_compile::mamba1_state_update",
    mutates_args=("ssm_states", "intermediate_states", "ssm_scales", "intermediate_scales"),
)
def mamba1_state_update(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    disable_state_update: bool,
    intermediate_states: torch.Tensor | None,
    A_is_log: bool,
    ssm_scales: torch.Tensor | None,
    intermediate_scales: torch.Tensor | None,
    parent_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mamba1 recurrent step(s) for decode (``L = 1``) and speculative verify (``L`` steps).

    Args:
        x: ``[B, L, D_inner]``; dt: ``[B, L, D_inner]`` raw; B, C: ``[B, L, G, N]``; z: ``[B, L, D_inner]``
            or None; A, D, dt_bias, dt_softplus, A_is_log: as in :func:`mamba1_selective_scan`.
        ssm_states: ``[num_slots, D_inner, N]``. **Mutated** (the slot gets the state after the last
            step) unless ``disable_state_update``.
        state_indices: ``[B]`` slot per row; -1 = padding row: zero output, nothing read or written.
        disable_state_update: do not write ``ssm_states`` (verify: the engine commits later).
        intermediate_states: ``[>= B, L, D_inner, N]`` or None. **Mutated**: ``[b, t]`` = state after
            step ``t`` of row ``b`` (indexed by batch row, not slot).
        ssm_scales, intermediate_scales: fp32 scales (``[num_slots, D_inner]``, ``[>= B, L, D_inner]``) of an
            FP8 ``ssm_states`` / ``intermediate_states`` (**mutated** with them); None for float buffers.
            With an FP8 pool the state is rounded to the FP8 format between steps, as ``L`` decode
            steps would store it (speculative greedy output equals plain greedy output).
        parent_indices: optional ``[B, L]`` int32/int64: a draft TREE (top-k > 1 drafts). Node
            ``t`` starts from the state stored after node ``parent_indices[b, t]`` (its row of
            ``intermediate_states``, as stored), or the slot's state for ``-1``;
            ``-1 <= parent < t``. Needs ``intermediate_states``, ``disable_state_update`` and
            float buffers. None: a chain (``parent = t - 1``).

    Returns:
        ``y`` ``[B, L, D_inner]`` in ``x.dtype``.
    """
    _check_state_update(x, dt, A, B, C, D, z, dt_bias, ssm_states, state_indices, intermediate_states, A_is_log,
                        ssm_scales, intermediate_scales, disable_state_update, parent_indices)
    batch, steps, D_inner = x.shape
    out = torch.zeros(batch, steps, D_inner, dtype=torch.float32, device=x.device)
    slots = state_indices.to(torch.int64)
    rows = (slots >= 0).nonzero().squeeze(1)
    if rows.numel() == 0 or steps == 0:
        return out.to(x.dtype)
    dim = MAMBA1_STATE_SCALE_DIM
    S = read_rows(ssm_states, ssm_scales, slots[rows], dim)
    Af = _decay_matrix(A, A_is_log)
    xs = x.index_select(0, rows).float()
    ds = _discretize_dt(dt.index_select(0, rows), dt_bias, dt_softplus)
    Bs, Cs = _per_channel(B.index_select(0, rows), D_inner), _per_channel(C.index_select(0, rows), D_inner)
    ys = []
    initial, history = S, []  # (a tree: the states after each node, as stored)
    parents = None if parent_indices is None else parent_indices.index_select(0, rows)
    for t in range(steps):
        if parents is not None:
            S = tree_start_states(initial, history, parents[:, t])
        d = ds[:, t]
        S = S * torch.exp(d[..., None] * Af) + (d * xs[:, t])[..., None] * Bs[:, t]
        ys.append((S * Cs[:, t]).sum(-1))
        if intermediate_states is not None:
            write_rows(intermediate_states[:, t], None if intermediate_scales is None else intermediate_scales[:, t],
                       rows, S, dim)
        if parents is not None:
            history.append(S.to(intermediate_states.dtype).float())
        if is_fp8(ssm_states) and t < steps - 1:  # as a decode step would store it (fp8_cache.round_trip)
            S = round_trip(S, dim)
    y = torch.stack(ys, 1)
    if D is not None:
        y = y + D.float() * xs
    if z is not None:
        y = y * F.silu(z.index_select(0, rows).float())
    out[rows] = y
    if not disable_state_update:
        write_rows(ssm_states, ssm_scales, slots[rows], S, dim)
    return out.to(x.dtype)


@mamba1_state_update.register_fake
def _(x, dt, A, B, C, D, z, dt_bias, dt_softplus, ssm_states, state_indices, disable_state_update,
      intermediate_states, A_is_log=False, ssm_scales=None, intermediate_scales=None, parent_indices=None):
    _check_state_update(x, dt, A, B, C, D, z, dt_bias, ssm_states, state_indices, intermediate_states, A_is_log,
                        ssm_scales, intermediate_scales, disable_state_update, parent_indices)
    return x.new_empty(x.shape)
