"""Mamba2 SSD kernel ops: varlen chunked prefill scan and the decode / verify state update.

The math is the Mamba2 mixer of transformers (``mamba2_chunk_scan``,
``mamba2_selective_state_update``). Per head ``h`` (scalar ``A[h] < 0``), with head ``h``
reading group ``g = h // (H // G)`` of ``B`` / ``C``::

    dt_t = clamp(softplus(dt_t + dt_bias) if dt_softplus else dt_t + dt_bias, dt_min, dt_max)
    S    = S * exp(dt_t * A) + dt_t * x_t ⊗ B_t          # S: [P, N] per head
    y_t  = S @ C_t + D * x_t
    y_t  = y_t * silu(z_t)                               # only when z is given

Two ops:

- ``ssd_chunk_scan``          packed varlen prefill / extend, SSD chunked algorithm
                              (intra-chunk quadratic form + inter-chunk state passing).
                              Chunks are aligned to each request's first new token (see
                              ``_varlen.py``), described by :func:`varlen_chunk_table`.
- ``selective_state_update``  decode (``L = 1``) and speculative verify (``L`` steps per
                              request, optionally recording the state after every step).

Everything is computed in fp32; outputs are in ``x.dtype``; state pools may be
fp32/bf16/fp16 (read, compute in fp32, cast on write), or float8_e4m3fn with fp32 ``ssm_scales
[num_slots, H, P]`` beside them (dequantized on read, quantized on write, :mod:`.fp8_cache`). A state index of -1 marks a padding
request: its outputs are zero and no state is read or written.
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
from ._varlen import max_chunk_rows
from .fp8_cache import FP8_DTYPE, MAMBA2_STATE_SCALE_DIM, check_scales, is_fp8, read_rows, round_trip, write_rows
from .registration import kernel_op

#: State pool dtypes: float, or e4m3 with one fp32 scale per (slot, head, head-dim row) over N
#: (``ssm_scales [num_slots, H, P]``, :mod:`.fp8_cache`).
STATE_DTYPES = FLOAT_DTYPES + (FP8_DTYPE,)

__all__ = ["ssd_chunk_scan", "selective_state_update", "varlen_chunk_table"]

# Elements of one block of intra-chunk decay matrices in the plain-torch scan (memory bound).
_INTRA_BLOCK_ELEMS = 1 << 24


# --------------------------------------------------------------------------------------------
# Chunk metadata
# --------------------------------------------------------------------------------------------


def varlen_chunk_table(
    cu_seqlens: torch.Tensor, chunk_size: int, num_rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunks of a packed varlen batch, each request cut at multiples of ``chunk_size`` from its first token.

    Row ``r`` of the table is chunk-state row ``r`` of the ``_varlen.py`` layout: request
    ``b`` owns rows ``chunk_row_offsets[b] : chunk_row_offsets[b] + ceil(len_b / chunk_size)``,
    in order; zero-length requests own no row.

    Args:
        cu_seqlens: ``[B + 1]`` int32/int64 token offsets of the requests.
        chunk_size: tokens per chunk (> 0).
        num_rows: pad (or cut) the table to this many rows, e.g. ``max_chunk_rows(T, B, C)``
            so the metadata has a shape that depends on shapes only (for a kernel grid or a
            CUDA graph); ``None`` = exactly ``sum_b ceil(len_b / chunk_size)`` rows (reads the
            device). With ``num_rows`` given no value is read back to the host.

    Returns:
        ``(chunk_seq_idx, chunk_token_start, chunk_len)``, each ``[rows]`` int32 on the device
        of ``cu_seqlens``: the request of the chunk, the packed index of its first token and
        its number of tokens (``1..chunk_size``). Padding rows have ``chunk_seq_idx = -1``,
        ``chunk_token_start = 0`` and ``chunk_len = 0``.
    """
    if chunk_size <= 0:
        raise ValueError(f"varlen_chunk_table: chunk_size must be > 0, got {chunk_size}")
    cu = cu_seqlens.to(torch.int64)
    batch = cu.shape[0] - 1
    lens = cu[1:] - cu[:-1]
    n_chunks = (lens + chunk_size - 1) // chunk_size
    ends = torch.cumsum(n_chunks, 0)
    if num_rows is None:
        num_rows = int(ends[-1]) if batch > 0 else 0
    rows = torch.arange(num_rows, device=cu.device, dtype=torch.int64)
    seq = torch.searchsorted(ends, rows, right=True)  # == batch past the last chunk
    valid = seq < batch
    seq_c = seq.clamp(max=max(batch - 1, 0))
    if batch > 0:
        j = rows - (ends - n_chunks)[seq_c]
        start = cu[seq_c] + j * chunk_size
        length = torch.clamp(cu[seq_c + 1] - start, max=chunk_size)
    else:
        start = length = rows
    zero = torch.zeros_like(rows)
    seq_idx = torch.where(valid, seq_c, torch.full_like(rows, -1))
    start = torch.where(valid, start, zero)
    length = torch.where(valid, length, zero)
    return seq_idx.to(torch.int32), start.to(torch.int32), length.to(torch.int32)


# --------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------


def _discretize_dt(
    dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool, dt_min: float, dt_max: float
) -> torch.Tensor:
    """fp32 dt after bias, softplus and clamp (broadcasts dt_bias over the last dim)."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    return torch.clamp(dt, min=dt_min, max=dt_max)


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L]: out[..., l, s] = sum(a[..., s+1 : l+1]) for l >= s, -inf above the diagonal.

    Computed as a masked cumulative sum (as transformers' ``segment_sum``), which is more
    accurate than differences of a running cumsum.
    """
    n = a.shape[-1]
    ex = a[..., None].expand(*a.shape, n)  # ex[..., k, s] = a[k]
    strict = torch.tril(torch.ones(n, n, dtype=torch.bool, device=a.device), diagonal=-1)
    out = torch.cumsum(ex.masked_fill(~strict, 0.0), dim=-2)
    incl = torch.tril(torch.ones(n, n, dtype=torch.bool, device=a.device), diagonal=0)
    return out.masked_fill(~incl, float("-inf"))


def _check_common_params(op, H, A, D, dt_bias, dt_min, dt_max, A_is_log=False):
    check_tensor(op, "A_log" if A_is_log else "A", A, dtypes=FLOAT_DTYPES if A_is_log else (torch.float32,), shape=(H,))
    if D is not None:
        check_tensor(op, "D", D, dtypes=FLOAT_DTYPES, shape=(H,))
    if dt_bias is not None:
        check_tensor(op, "dt_bias", dt_bias, dtypes=FLOAT_DTYPES, shape=(H,))
    if not dt_min <= dt_max:
        raise ValueError(f"{op}: dt_min ({dt_min}) must be <= dt_max ({dt_max})")


def _check_groups(op, H, G):
    if G <= 0 or H % G != 0:
        raise ValueError(f"{op}: the number of heads ({H}) must be a multiple of the number of groups ({G}) of B/C")


# --------------------------------------------------------------------------------------------
# ssd_chunk_scan
# --------------------------------------------------------------------------------------------


def _check_ssd_chunk_scan(
    x, dt, A, B, C, D, z, dt_bias, dt_min, dt_max, ssm_states, cu_seqlens, state_indices, has_initial_state, chunk_size,
    ssm_scales=None,
):
    op = "ssd_chunk_scan"
    check_tensor(op, "x", x, ndim=3, dtypes=FLOAT_DTYPES)
    T, H, P = x.shape
    check_tensor(op, "dt", dt, dtypes=FLOAT_DTYPES, shape=(T, H))
    check_tensor(op, "B", B, ndim=3, dtypes=FLOAT_DTYPES)
    G, N = B.shape[1], B.shape[2]
    check_tensor(op, "B", B, shape=(T, G, N))
    check_tensor(op, "C", C, dtypes=FLOAT_DTYPES, shape=(T, G, N))
    _check_groups(op, H, G)
    _check_common_params(op, H, A, D, dt_bias, dt_min, dt_max)
    if z is not None:
        check_tensor(op, "z", z, dtypes=FLOAT_DTYPES, shape=(T, H, P))
    check_tensor(op, "ssm_states", ssm_states, ndim=4, dtypes=STATE_DTYPES)
    check_tensor(op, "ssm_states", ssm_states, shape=(None, H, P, N))
    check_scales(op, ssm_states, ssm_scales, "ssm_scales", MAMBA2_STATE_SCALE_DIM)
    check_varlen_requests(op, cu_seqlens, state_indices, has_initial_state)
    if chunk_size <= 0:
        raise ValueError(f"{op}: chunk_size must be > 0, got {chunk_size}")
    check_same_device(
        op, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, ssm_states=ssm_states,
        cu_seqlens=cu_seqlens, state_indices=state_indices, has_initial_state=has_initial_state,
    )
    check_varlen_values(op, cu_seqlens, T, state_indices, ssm_states.shape[0])


@kernel_op("hybrid_compile::ssd_chunk_scan", mutates_args=("ssm_states", "ssm_scales"))
def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_min: float,
    dt_max: float,
    ssm_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    chunk_size: int,
    output_chunk_states: bool,
    ssm_scales: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2 SSD scan over a packed varlen batch (prefill / extend), chunked form.

    Per request ``b`` (tokens ``cu_seqlens[b]:cu_seqlens[b+1]``) runs the recurrence of the
    module docstring from its initial state, with chunks of ``chunk_size`` tokens aligned to
    the request's first token (:func:`varlen_chunk_table`). Inside a chunk the output is the
    quadratic (attention-like) form; chunk-boundary states are passed between chunks.

    Args:
        x: ``[T, H, P]`` fp32/bf16/fp16 inputs (may be a non-contiguous view).
        dt: ``[T, H]`` raw time steps (before bias / softplus / clamp).
        A: ``[H]`` fp32, already negated (``-exp(A_log)``).
        B, C: ``[T, G, N]``; head ``h`` uses group ``h // (H // G)``.
        D: ``[H]`` skip coefficient, or None.
        z: ``[T, H, P]`` gate (``y *= silu(z)``), or None.
        dt_bias: ``[H]``, or None.
        dt_softplus: apply softplus to ``dt + dt_bias``.
        dt_min, dt_max: clamp of the discretised ``dt`` (``0.0, inf`` = none).
        ssm_states: ``[num_slots, H, P, N]`` fp32/bf16/fp16 state pool. **Mutated**: slot
            ``state_indices[b]`` receives the final state of every request with ``len_b > 0``.
        cu_seqlens: ``[B + 1]`` int32/int64.
        state_indices: ``[B]`` int32/int64 slot of each request. -1 = padding: zero output,
            no state read or written, zero chunk-state rows. Must be distinct otherwise.
        has_initial_state: ``[B]`` bool; start from ``ssm_states[state_indices[b]]`` when True,
            from zeros when False. A zero-length request leaves its slot untouched.
        ssm_scales: ``[num_slots, H, P]`` fp32 scales when ``ssm_states`` is float8_e4m3fn (one per
            head-dim row over N, :mod:`.fp8_cache`), **mutated** with the slot; None for a float pool.
        chunk_size: tokens per chunk (the model's ``chunk_size``, e.g. 256).
        output_chunk_states: also return the state at the start of every chunk.

    Returns:
        ``(y, chunk_states)``: ``y`` ``[T, H, P]`` in ``x.dtype``; ``chunk_states`` fp32
        ``[max_chunk_rows(T, B, chunk_size), H, P, N]`` in the ``_varlen.py`` row layout
        (row ``chunk_row_offsets[b] + j`` = state after ``j * chunk_size`` new tokens of
        request ``b``; unused rows zero) when ``output_chunk_states``, else ``[0, H, P, N]``.
    """
    _check_ssd_chunk_scan(
        x, dt, A, B, C, D, z, dt_bias, dt_min, dt_max, ssm_states, cu_seqlens, state_indices, has_initial_state, chunk_size,
        ssm_scales,
    )
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    R = H // G
    batch = cu_seqlens.shape[0] - 1
    dev = x.device
    Cs = chunk_size

    y_tok = torch.zeros(T, H, P, dtype=torch.float32, device=dev)
    n_rows = max_chunk_rows(T, batch, Cs) if output_chunk_states else 0
    chunk_states = torch.zeros(n_rows, H, P, N, dtype=torch.float32, device=dev)
    if T == 0 or batch == 0:
        return y_tok.to(x.dtype), chunk_states

    cu = cu_seqlens.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    slots = state_indices.to(torch.int64)
    req_ok = slots >= 0

    # Per-request initial states (zeros for padding / no initial state).
    init = torch.zeros(batch, H, P, N, dtype=torch.float32, device=dev)
    read = req_ok & has_initial_state
    if bool(read.any()):
        rr = read.nonzero().squeeze(1)
        init[rr] = read_rows(ssm_states, ssm_scales, slots[rr], MAMBA2_STATE_SCALE_DIM)

    # Chunks of the non-padding requests (global row ids kept for the chunk-state layout).
    seq_idx, tok_start, clen = (t.to(torch.int64) for t in varlen_chunk_table(cu_seqlens, Cs))
    row_offsets = torch.cumsum((lens + Cs - 1) // Cs, 0) - (lens + Cs - 1) // Cs
    keep = req_ok[seq_idx].nonzero().squeeze(1)
    cur = init.clone()
    if keep.numel() > 0:
        seq_idx, tok_start, clen = seq_idx[keep], tok_start[keep], clen[keep]
        jpos = keep - row_offsets[seq_idx]  # chunk number inside its request
        NC = keep.numel()

        pos = torch.arange(Cs, device=dev)
        valid = pos[None, :] < clen[:, None]  # [NC, Cs]
        tok = torch.where(valid, tok_start[:, None] + pos[None, :], torch.zeros_like(tok_start)[:, None])
        flat = tok.reshape(-1)

        def gather(t):  # [T, ...] -> [NC, Cs, ...] fp32, zero at padding positions
            g = t.index_select(0, flat).float().reshape(NC, Cs, *t.shape[1:])
            return torch.where(valid.reshape(NC, Cs, *([1] * (t.dim() - 1))), g, torch.zeros((), device=dev))

        xg = gather(x).reshape(NC, Cs, G, R, P)
        dtg = _discretize_dt(dt.index_select(0, flat).reshape(NC, Cs, H), dt_bias, dt_softplus, dt_min, dt_max)
        dtg = torch.where(valid[..., None], dtg, torch.zeros((), device=dev)).reshape(NC, Cs, G, R)
        Bg = gather(B)  # [NC, Cs, G, N]
        Cg = gather(C)

        dA = dtg * A.float().reshape(G, R)  # [NC, Cs, G, R]
        A_cum = torch.cumsum(dA, dim=1)
        xdt = xg * dtg[..., None]  # [NC, Cs, G, R, P]

        # 1. Intra-chunk (diagonal blocks): y_l += sum_{s<=l} (C_l . B_s) exp(sum dA(s, l]) dt_s x_s.
        #    The [chunks, H, Cs, Cs] decay matrices are built a block of chunks at a time to bound memory.
        y = torch.empty(NC, Cs, G, R, P, dtype=torch.float32, device=dev)
        blk = max(1, _INTRA_BLOCK_ELEMS // (H * Cs * Cs))
        for c0 in range(0, NC, blk):
            sl = slice(c0, c0 + blk)
            L = torch.exp(_segsum(dA[sl].permute(0, 2, 3, 1)))  # [nc, G, R, l, s]
            CB = torch.einsum("clgn,csgn->cgls", Cg[sl], Bg[sl])  # [nc, G, l, s]
            y[sl] = torch.einsum("cgrls,csgrp->clgrp", CB[:, :, None] * L, xdt[sl])

        # 2. State contributed by each chunk, decayed to the chunk end.
        decay_to_end = torch.exp(A_cum[:, -1:] - A_cum)  # [NC, Cs, G, R]
        local = torch.einsum("clgn,clgrp->cgrpn", Bg, xdt * decay_to_end[..., None]).reshape(NC, H, P, N)
        chunk_decay = torch.exp(A_cum[:, -1]).reshape(NC, H)

        # 3. Inter-chunk recurrence (sequential over chunk number, batched over requests).
        start_states = torch.empty(NC, H, P, N, dtype=torch.float32, device=dev)
        for j in range(int(jpos.max()) + 1):
            sel = (jpos == j).nonzero().squeeze(1)
            req = seq_idx[sel]
            s = cur[req]
            start_states[sel] = s
            cur[req] = s * chunk_decay[sel][..., None, None] + local[sel]

        # 4. Contribution of the chunk's start state: y_l += exp(sum dA[..l]) C_l . S_start
        y = y + torch.einsum("clgn,cgrpn->clgrp", Cg, start_states.reshape(NC, G, R, P, N)) * torch.exp(A_cum)[..., None]
        y = y.reshape(NC, Cs, H, P)
        if D is not None:
            y = y + D.float()[:, None] * xg.reshape(NC, Cs, H, P)
        if z is not None:
            y = y * F.silu(gather(z))

        vflat = valid.reshape(-1)
        y_tok[flat[vflat]] = y.reshape(NC * Cs, H, P)[vflat]
        if output_chunk_states:
            chunk_states[keep] = start_states

    # Final states of the non-padding, non-empty requests.
    write = (req_ok & (lens > 0)).nonzero().squeeze(1)
    if write.numel() > 0:
        write_rows(ssm_states, ssm_scales, slots[write], cur[write], MAMBA2_STATE_SCALE_DIM)
    return y_tok.to(x.dtype), chunk_states


@ssd_chunk_scan.register_fake
def _(
    x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max, ssm_states, cu_seqlens, state_indices,
    has_initial_state, chunk_size, output_chunk_states, ssm_scales=None,
):
    _check_ssd_chunk_scan(
        x, dt, A, B, C, D, z, dt_bias, dt_min, dt_max, ssm_states, cu_seqlens, state_indices, has_initial_state, chunk_size,
        ssm_scales,
    )
    T, H, P = x.shape
    N = B.shape[2]
    batch = cu_seqlens.shape[0] - 1
    rows = max_chunk_rows(T, batch, chunk_size) if output_chunk_states else 0
    return x.new_empty((T, H, P)), x.new_empty((rows, H, P, N), dtype=torch.float32)


# --------------------------------------------------------------------------------------------
# selective_state_update
# --------------------------------------------------------------------------------------------


def _check_selective_state_update(
    x, dt, A, B, C, D, z, dt_bias, dt_min, dt_max, ssm_states, state_indices, intermediate_states, A_is_log=False,
    ssm_scales=None, intermediate_scales=None, disable_state_update=True, parent_indices=None,
):
    op = "selective_state_update"
    check_tensor(op, "x", x, ndim=4, dtypes=FLOAT_DTYPES)
    batch, steps, H, P = x.shape
    check_tensor(op, "dt", dt, dtypes=FLOAT_DTYPES, shape=(batch, steps, H))
    check_tensor(op, "B", B, ndim=4, dtypes=FLOAT_DTYPES)
    G, N = B.shape[2], B.shape[3]
    check_tensor(op, "B", B, shape=(batch, steps, G, N))
    check_tensor(op, "C", C, dtypes=FLOAT_DTYPES, shape=(batch, steps, G, N))
    _check_groups(op, H, G)
    _check_common_params(op, H, A, D, dt_bias, dt_min, dt_max, A_is_log)
    if z is not None:
        check_tensor(op, "z", z, dtypes=FLOAT_DTYPES, shape=(batch, steps, H, P))
    check_tensor(op, "ssm_states", ssm_states, ndim=4, dtypes=STATE_DTYPES)
    check_tensor(op, "ssm_states", ssm_states, shape=(None, H, P, N))
    check_scales(op, ssm_states, ssm_scales, "ssm_scales", MAMBA2_STATE_SCALE_DIM)
    check_tensor(op, "state_indices", state_indices, dtypes=INDEX_DTYPES, shape=(batch,))
    if intermediate_states is None and intermediate_scales is not None:
        raise ValueError(f"{op}: `intermediate_scales` without `intermediate_states`")
    if intermediate_states is not None:
        check_tensor(op, "intermediate_states", intermediate_states, ndim=5, dtypes=STATE_DTYPES)
        check_scales(op, intermediate_states, intermediate_scales, "intermediate_scales", MAMBA2_STATE_SCALE_DIM,
                     "intermediate_states")
        check_intermediate_states(op, intermediate_states, batch, steps, (H, P, N))
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
    "hybrid_compile::selective_state_update",
    mutates_args=("ssm_states", "intermediate_states", "ssm_scales", "intermediate_scales"),
)
def selective_state_update(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_min: float,
    dt_max: float,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    disable_state_update: bool,
    intermediate_states: torch.Tensor | None,
    A_is_log: bool,
    ssm_scales: torch.Tensor | None,
    intermediate_scales: torch.Tensor | None,
    parent_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mamba2 recurrent step(s) for decode (``L = 1``) and speculative verify (``L`` steps).

    For every batch row ``b`` with ``state_indices[b] >= 0``: read ``S = ssm_states[slot]``,
    run the recurrence of the module docstring over its ``L`` tokens in order.

    Args:
        x: ``[B, L, H, P]`` fp32/bf16/fp16 (may be a non-contiguous view).
        dt: ``[B, L, H]`` raw time steps.
        A: ``[H]`` fp32, already negated.
        B, C: ``[B, L, G, N]``; head ``h`` uses group ``h // (H // G)``.
        D: ``[H]`` or None. z: ``[B, L, H, P]`` gate or None. dt_bias: ``[H]`` or None.
        dt_softplus, dt_min, dt_max: as in :func:`ssd_chunk_scan`.
        ssm_states: ``[num_slots, H, P, N]`` state pool. **Mutated** (slot gets the state
            after the last step) unless ``disable_state_update``.
        state_indices: ``[B]`` int32/int64 slot per row; -1 = padding row: zero output,
            nothing read or written (its ``intermediate_states`` rows stay untouched).
        disable_state_update: do not write ``ssm_states`` (verify: the commit happens later).
        intermediate_states: ``[>= B, L, H, P, N]`` fp32/bf16/fp16 or None. **Mutated**:
            ``intermediate_states[b, t]`` = state after step ``t`` of row ``b`` (indexed by
            batch row, not slot).
        A_is_log: ``A`` is the model's ``A_log`` (``[H]``, any float dtype): the kernel takes
            ``-exp(A_log)`` itself (a decode step then launches no kernels for it).
        ssm_scales, intermediate_scales: fp32 scales (``[num_slots, H, P]``, ``[>= B, L, H, P]``) of
            an FP8 ``ssm_states`` / ``intermediate_states`` (as in ``ssd_chunk_scan``), **mutated**
            with them; None for float buffers. With an FP8 pool the state is rounded to the FP8
            format between steps, as ``L`` decode steps would store it.
        parent_indices: optional ``[B, L]`` int32/int64: a draft TREE (top-k > 1 drafts). Node
            ``t`` starts from the state stored after node ``parent_indices[b, t]`` (its row of
            ``intermediate_states``, as stored), or the slot's state for ``-1``;
            ``-1 <= parent < t``. Needs ``intermediate_states``, ``disable_state_update`` and
            float buffers. None: a chain (``parent = t - 1``).

    Returns:
        ``y`` ``[B, L, H, P]`` in ``x.dtype``.
    """
    _check_selective_state_update(
        x, dt, A, B, C, D, z, dt_bias, dt_min, dt_max, ssm_states, state_indices, intermediate_states, A_is_log,
        ssm_scales, intermediate_scales, disable_state_update, parent_indices,
    )
    batch, steps, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    R = H // G
    out = torch.zeros(batch, steps, H, P, dtype=torch.float32, device=x.device)
    slots = state_indices.to(torch.int64)
    rows = (slots >= 0).nonzero().squeeze(1)
    nb = rows.numel()
    if nb == 0 or steps == 0:
        return out.to(x.dtype)
    rs = slots[rows]

    S = read_rows(ssm_states, ssm_scales, rs, MAMBA2_STATE_SCALE_DIM).reshape(nb, G, R, P, N)
    xs = x.index_select(0, rows).float().reshape(nb, steps, G, R, P)
    dts = _discretize_dt(dt.index_select(0, rows), dt_bias, dt_softplus, dt_min, dt_max).reshape(nb, steps, G, R)
    Bs = B.index_select(0, rows).float()  # [nb, L, G, N]
    Cs = C.index_select(0, rows).float()
    Af = (-torch.exp(A.float()) if A_is_log else A.float()).reshape(G, R)
    Df = D.float().reshape(G, R, 1) if D is not None else None
    ys = []
    initial, history = S, []  # (a tree: the states after each node, as stored)
    parents = None if parent_indices is None else parent_indices.index_select(0, rows)
    for t in range(steps):
        if parents is not None:
            S = tree_start_states(initial, history, parents[:, t])
        d = dts[:, t]  # [nb, G, R]
        dBx = (d[..., None] * xs[:, t])[..., None] * Bs[:, t, :, None, None, :]  # [nb, G, R, P, N]
        S = S * torch.exp(d * Af)[..., None, None] + dBx
        y = torch.einsum("bgrpn,bgn->bgrp", S, Cs[:, t])
        if Df is not None:
            y = y + Df * xs[:, t]
        ys.append(y.reshape(nb, H, P))
        if intermediate_states is not None:
            write_rows(intermediate_states[:, t], None if intermediate_scales is None else intermediate_scales[:, t],
                       rows, S.reshape(nb, H, P, N), MAMBA2_STATE_SCALE_DIM)
        if parents is not None:
            history.append(S.to(intermediate_states.dtype).float())
        if is_fp8(ssm_states) and t < steps - 1:  # as a decode step would store it (fp8_cache.round_trip)
            S = round_trip(S, MAMBA2_STATE_SCALE_DIM)
    y = torch.stack(ys, 1)  # [nb, L, H, P]
    if z is not None:
        y = y * F.silu(z.index_select(0, rows).float())
    out[rows] = y
    if not disable_state_update:
        write_rows(ssm_states, ssm_scales, rs, S.reshape(nb, H, P, N), MAMBA2_STATE_SCALE_DIM)
    return out.to(x.dtype)


@selective_state_update.register_fake
def _(
    x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max, ssm_states, state_indices,
    disable_state_update, intermediate_states, A_is_log=False, ssm_scales=None, intermediate_scales=None,
    parent_indices=None,
):
    _check_selective_state_update(
        x, dt, A, B, C, D, z, dt_bias, dt_min, dt_max, ssm_states, state_indices, intermediate_states, A_is_log,
        ssm_scales, intermediate_scales, disable_state_update, parent_indices,
    )
    return x.new_empty(x.shape)
