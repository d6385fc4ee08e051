"""Depthwise causal conv1d ops (Qwen3-Next GatedDeltaNet, Mamba2 mixers).

The math is HF's ``nn.Conv1d(dim, dim, W, groups=dim, padding=W-1)`` over ``[B, dim, L]``
(first ``L`` outputs kept) followed by the activation, i.e. per channel ``d``::

    out[t, d] = act(bias[d] + sum_{w=0}^{W-1} weight[d, w] * x[t - (W-1) + w, d])

``weight[:, W-1]`` multiplies the current token (the causal_conv1d convention); inputs
before the first token come from the request's conv window.

Conv-state pool layout: ``conv_states[num_slots, W-1, D]``, token-major: row 0 is the
oldest input of the window, row ``W-2`` the newest. (HF's own cache stores ``[B, D, W]``;
the token-major layout makes one slot's window a contiguous run of rows so that writing it
from packed ``[T, D]`` activations is a plain row copy.)

Three ops:

- ``causal_conv1d_fn``       varlen prefill / extend over packed tokens ``[T, D]``.
- ``causal_conv1d_update``   decode (``L == 1``) and speculative verify (``L`` draft tokens)
                             over ``[B, L, D]``, optionally recording the window after
                             every step for the commit op.
- ``track_conv_window``      prefix-cache checkpoint of the window at a given new-token
                             offset of each request (the conv half of a chunk-boundary
                             checkpoint, ``layers/tracking.py``).

Computation is fp32 internally; outputs have ``x``'s dtype; pools may be fp32/bf16/fp16
(read, compute in fp32, cast on write). Slot index -1 marks a padding request: its outputs
are zero and no state is read or written.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ._validation import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_cu_seqlens,
    check_same_device,
    check_slot_indices,
    check_tensor,
    check_tree_parents,
    check_unique_slots,
    should_check_values,
    tree_start_states,
)
from .registration import kernel_op

_SILU_NAMES = ("silu", "swish")
_IDENTITY_NAMES = ("none", "identity", "")


def _is_silu(op: str, activation: Optional[str]) -> bool:
    """True for "silu"/"swish", False for None/"none"/"identity"/""; raise for anything else."""
    if activation is None:
        return False
    if not isinstance(activation, str):
        raise TypeError(f"{op}: `activation` must be a string or None, got {type(activation).__name__}")
    name = activation.lower()
    if name in _SILU_NAMES:
        return True
    if name in _IDENTITY_NAMES:
        return False
    raise ValueError(
        f"{op}: unsupported `activation` {activation!r}; expected one of "
        f"'silu', 'swish', 'none', 'identity' or None"
    )


def _check_weight_and_pool(op: str, weight, bias, conv_states) -> tuple[int, int]:
    """Common checks on weight [D, W], bias [D] and conv_states [S, W-1, D]; returns (D, W)."""
    check_tensor(op, "weight", weight, ndim=2, dtypes=FLOAT_DTYPES)
    dim, width = weight.shape
    if width < 2:
        raise ValueError(f"{op}: `weight` must be [D, W] with kernel width W >= 2, got {tuple(weight.shape)}")
    if bias is not None:
        check_tensor(op, "bias", bias, dtypes=FLOAT_DTYPES, shape=(dim,))
    check_tensor(op, "conv_states", conv_states, dtypes=FLOAT_DTYPES, shape=(None, width - 1, dim))
    return dim, width


def _initial_windows(conv_states, idx, use) -> torch.Tensor:
    """[B, W-1, D] fp32 windows conv_states[idx[b]] where use[b], zeros elsewhere (idx may be -1)."""
    win = conv_states.index_select(0, idx.clamp(min=0)).float()
    return torch.where(use[:, None, None], win, torch.zeros((), dtype=win.dtype, device=win.device))


def _write_slots(pool: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor) -> None:
    """pool[slots[b]] = rows[b] (cast to the pool dtype) for every b with keep[b]."""
    if bool(keep.all()):
        pool.index_copy_(0, slots, rows.to(pool.dtype))
    else:
        pool.index_copy_(0, slots[keep], rows[keep].to(pool.dtype))


def _finish(y: torch.Tensor, bias, silu: bool) -> torch.Tensor:
    if bias is not None:
        y = y + bias.float()
    if silu:
        y = F.silu(y)
    return y


# --------------------------------------------------------------------------------------------
# causal_conv1d_fn
# --------------------------------------------------------------------------------------------


def _check_causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation):
    op = "causal_conv1d_fn"
    _is_silu(op, activation)
    dim, _ = _check_weight_and_pool(op, weight, bias, conv_states)
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES, shape=(None, dim))
    check_tensor(op, "cache_indices", cache_indices, ndim=1, dtypes=INDEX_DTYPES)
    batch = cache_indices.shape[0]
    check_tensor(op, "query_start_loc", query_start_loc, ndim=1, dtypes=INDEX_DTYPES, shape=(batch + 1,))
    check_tensor(op, "has_initial_state", has_initial_state, ndim=1, dtypes=(torch.bool,), shape=(batch,))
    check_same_device(
        op, x=x, weight=weight, bias=bias, conv_states=conv_states, query_start_loc=query_start_loc,
        cache_indices=cache_indices, has_initial_state=has_initial_state,
    )
    check_cu_seqlens(op, "query_start_loc", query_start_loc, x.shape[0])
    check_slot_indices(op, "cache_indices", cache_indices, conv_states.shape[0])
    check_unique_slots(op, "cache_indices", cache_indices)


@kernel_op("hybrid_compile::causal_conv1d_fn", mutates_args=("conv_states",))
def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: Optional[str],
) -> torch.Tensor:
    """Varlen causal depthwise conv1d over packed tokens (prefill / extend), updating conv windows.

    For request ``b`` (tokens ``query_start_loc[b]:query_start_loc[b+1]``) the window before
    its first token is ``conv_states[cache_indices[b]]`` if ``has_initial_state[b]`` else
    zeros; ``out[t] = act(bias + sum_w weight[:, w] * window_t[w])`` with ``window_t`` the
    ``W`` most recent inputs ending at token ``t`` (``weight[:, W-1]`` multiplies token ``t``).
    Afterwards ``conv_states[cache_indices[b]]`` holds the last ``W-1`` inputs of the
    request's combined stream (initial window ++ new tokens), so a request shorter than
    ``W-1`` keeps the newest part of its old window, shifted towards row 0.

    Args:
        x: ``[T, D]`` packed inputs, fp32/bf16/fp16 (may be a non-contiguous view).
        weight: ``[D, W]`` conv weight (``conv1d.weight.squeeze(1)``), W >= 2, any float dtype.
        bias: ``[D]`` or None.
        conv_states: ``[num_slots, W-1, D]`` window pool, token-major (row 0 oldest).
            **Mutated**: slots of non-empty, non-padding requests.
        query_start_loc: ``[B+1]`` int32/int64 cumulative token offsets (``[0] == 0``, ``[-1] == T``).
        cache_indices: ``[B]`` int32/int64 slot of each request; -1 = padding request (its
            outputs are zero, nothing is read or written). Non-padding slots must be distinct.
        has_initial_state: ``[B]`` bool; False = start from a zero window (the old slot
            content is ignored, then overwritten).
        activation: "silu" (alias "swish") or "none"/"identity"/None.

    Returns:
        ``[T, D]`` in ``x``'s dtype. A zero-length request leaves its slot untouched.
    """
    _check_causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation)
    silu = _is_silu("causal_conv1d_fn", activation)
    num_tokens, dim = x.shape
    width = weight.shape[1]
    k = width - 1
    batch = cache_indices.shape[0]
    if num_tokens == 0 or batch == 0:
        return x.new_zeros((num_tokens, dim))
    dev = x.device
    qsl = query_start_loc.to(torch.int64)
    idx = cache_indices.to(torch.int64)
    starts, ends = qsl[:-1], qsl[1:].contiguous()
    valid = idx >= 0
    win = _initial_windows(conv_states, idx, valid & has_initial_state)  # [B, K, D]

    # Combined streams laid end to end: request b occupies rows
    # [starts[b] + b*K, ends[b] + (b+1)*K) of `buf`: its K window rows, then its tokens.
    reqs = torch.arange(batch, device=dev)
    ks = torch.arange(k, device=dev)
    buf = torch.empty((num_tokens + batch * k, dim), dtype=torch.float32, device=dev)
    win_rows = (starts + reqs * k)[:, None] + ks  # [B, K]
    buf.index_copy_(0, win_rows.reshape(-1), win.reshape(-1, dim))
    tok = torch.arange(num_tokens, device=dev)
    req_of_tok = torch.searchsorted(ends, tok, right=True)  # [T] request of each token
    tok_rows = tok + (req_of_tok + 1) * k
    buf.index_copy_(0, tok_rows, x.float())

    wf = weight.float()
    y = torch.zeros((num_tokens, dim), dtype=torch.float32, device=dev)
    for w in range(width):
        y.addcmul_(buf.index_select(0, tok_rows - k + w), wf[:, w])
    y = _finish(y, bias, silu)
    y = torch.where(valid[req_of_tok][:, None], y, torch.zeros((), dtype=y.dtype, device=dev))

    last_rows = (ends + (reqs + 1) * k)[:, None] - k + ks  # [B, K] last K rows of each stream
    new_win = buf.index_select(0, last_rows.reshape(-1)).reshape(batch, k, dim)
    _write_slots(conv_states, new_win, idx, valid & (ends > starts))
    return y.to(x.dtype)


@causal_conv1d_fn.register_fake
def _(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation):
    _check_causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation)
    return x.new_empty(x.shape)


# --------------------------------------------------------------------------------------------
# causal_conv1d_update
# --------------------------------------------------------------------------------------------


def _check_causal_conv1d_update(
    x, conv_states, weight, bias, activation, conv_state_indices, disable_state_update, intermediate_conv_windows,
    parent_indices=None,
):
    op = "causal_conv1d_update"
    _is_silu(op, activation)
    dim, width = _check_weight_and_pool(op, weight, bias, conv_states)
    check_tensor(op, "x", x, ndim=3, dtypes=FLOAT_DTYPES, shape=(None, None, dim))
    batch, steps = x.shape[0], x.shape[1]
    check_tensor(op, "conv_state_indices", conv_state_indices, ndim=1, dtypes=INDEX_DTYPES, shape=(batch,))
    if not isinstance(disable_state_update, bool):
        raise TypeError(f"{op}: `disable_state_update` must be a bool")
    if intermediate_conv_windows is not None:
        check_tensor(
            op, "intermediate_conv_windows", intermediate_conv_windows, ndim=4, dtypes=FLOAT_DTYPES,
            shape=(None, steps, width - 1, dim),
        )
        if intermediate_conv_windows.shape[0] < batch:
            raise ValueError(
                f"{op}: `intermediate_conv_windows` has {intermediate_conv_windows.shape[0]} rows, "
                f"needs at least the batch size {batch}"
            )
    check_same_device(
        op, x=x, conv_states=conv_states, weight=weight, bias=bias, conv_state_indices=conv_state_indices,
        intermediate_conv_windows=intermediate_conv_windows,
    )
    check_slot_indices(op, "conv_state_indices", conv_state_indices, conv_states.shape[0])
    check_unique_slots(op, "conv_state_indices", conv_state_indices)
    check_tree_parents(op, parent_indices, batch, steps, has_intermediate=intermediate_conv_windows is not None,
                       disable_state_update=disable_state_update, fp8=False)


@kernel_op(
    "hybrid_compile::causal_conv1d_update", mutates_args=("conv_states", "intermediate_conv_windows")
)
def causal_conv1d_update(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    activation: Optional[str],
    conv_state_indices: torch.Tensor,
    disable_state_update: bool,
    intermediate_conv_windows: Optional[torch.Tensor],
    parent_indices: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal conv1d for ``L`` new tokens per request from its cached window (decode / verify).

    Step ``t`` of request ``b`` appends ``x[b, t]`` to the window and outputs
    ``act(bias + sum_w weight[:, w] * window[w])`` over the ``W`` most recent inputs; the
    window starts as ``conv_states[conv_state_indices[b]]``.

    Args:
        x: ``[B, L, D]`` inputs (decode: ``L == 1``; verify: packed ``[B*L, D]`` reshaped by
            the caller), fp32/bf16/fp16, may be non-contiguous.
        conv_states: ``[num_slots, W-1, D]`` window pool (row 0 oldest). **Mutated** unless
            ``disable_state_update``: slot ``conv_state_indices[b]`` gets the final window
            (the last ``W-1`` inputs after step ``L-1``).
        weight: ``[D, W]`` (``conv1d.weight.squeeze(1)``); bias: ``[D]`` or None.
        activation: "silu" (alias "swish") or "none"/"identity"/None.
        conv_state_indices: ``[B]`` int32/int64 slot of each request; -1 = padding row (zero
            output, nothing read or written, its intermediate rows untouched). Non-padding
            slots must be distinct.
        disable_state_update: True = leave ``conv_states`` unchanged (speculative verify).
        intermediate_conv_windows: optional ``[>= B, L, W-1, D]`` buffer (any float dtype),
            indexed by BATCH ROW (not slot). **Mutated**: row ``[b, t]`` = window after step
            ``t`` (the ``W-1`` most recent inputs, row 0 oldest) for non-padding ``b``;
            ``commit_speculative_state`` later copies row ``[b, accepted-1]`` into the slot.
        parent_indices: optional ``[B, L]`` int32/int64: a draft TREE (speculative verify of
            top-k > 1 drafts). Node ``t`` continues the window stored after node
            ``parent_indices[b, t]`` (its row of ``intermediate_conv_windows``, as stored), or the
            slot's window for ``-1``; ``-1 <= parent < t``. Needs the intermediate buffer and
            ``disable_state_update``. None: a chain (``parent = t - 1``).

    Returns:
        ``[B, L, D]`` in ``x``'s dtype.
    """
    _check_causal_conv1d_update(
        x, conv_states, weight, bias, activation, conv_state_indices, disable_state_update, intermediate_conv_windows,
        parent_indices,
    )
    silu = _is_silu("causal_conv1d_update", activation)
    batch, steps, dim = x.shape
    width = weight.shape[1]
    k = width - 1
    if batch == 0 or steps == 0:
        return x.new_zeros((batch, steps, dim))
    dev = x.device
    idx = conv_state_indices.to(torch.int64)
    valid = idx >= 0
    win = _initial_windows(conv_states, idx, valid)  # [B, K, D]
    if parent_indices is not None:
        return _conv1d_update_tree(x, win, weight, bias, silu, valid, intermediate_conv_windows, parent_indices)
    stream = torch.cat([win, x.float()], dim=1)  # [B, K + L, D]

    wf = weight.float()
    y = torch.zeros((batch, steps, dim), dtype=torch.float32, device=dev)
    for w in range(width):
        y.addcmul_(stream[:, w : w + steps], wf[:, w])
    y = _finish(y, bias, silu)
    zero = torch.zeros((), dtype=y.dtype, device=dev)
    y = torch.where(valid[:, None, None], y, zero)

    if intermediate_conv_windows is not None:
        # windows[b, t] = stream[b, t+1 : t+1+K]  -> [B, L, K, D]
        windows = stream.unfold(1, k, 1)[:, 1:].permute(0, 1, 3, 2)
        dst = intermediate_conv_windows[:batch]
        dst.copy_(torch.where(valid[:, None, None, None], windows.to(dst.dtype), dst))
    if not disable_state_update:
        _write_slots(conv_states, stream[:, steps:], idx, valid)
    return y.to(x.dtype)


def _conv1d_update_tree(x, win, weight, bias, silu, valid, inter, parents) -> torch.Tensor:
    """``causal_conv1d_update`` over a draft tree: node ``t`` appends ``x[:, t]`` to its parent's
    stored window (``win``: the slots' windows, for parent -1)."""
    steps = x.shape[1]
    dst = inter[: x.shape[0]]
    wf = weight.float()
    history: list[torch.Tensor] = []  # window after each node, as stored
    ys = []
    for t in range(steps):
        stream = torch.cat([tree_start_states(win, history, parents[:, t]), x[:, t, None].float()], dim=1)  # [B, W, D]
        y = torch.zeros_like(stream[:, 0])
        for w in range(wf.shape[1]):
            y.addcmul_(stream[:, w], wf[:, w])
        ys.append(_finish(y, bias, silu))
        stored = stream[:, 1:].to(dst.dtype)
        dst[:, t] = torch.where(valid[:, None, None], stored, dst[:, t])
        history.append(stored.float())
    y = torch.where(valid[:, None, None], torch.stack(ys, 1), torch.zeros((), device=x.device))
    return y.to(x.dtype)


@causal_conv1d_update.register_fake
def _(x, conv_states, weight, bias, activation, conv_state_indices, disable_state_update,
      intermediate_conv_windows, parent_indices=None):
    _check_causal_conv1d_update(
        x, conv_states, weight, bias, activation, conv_state_indices, disable_state_update, intermediate_conv_windows,
        parent_indices,
    )
    return x.new_empty(x.shape)


# --------------------------------------------------------------------------------------------
# track_conv_window
# --------------------------------------------------------------------------------------------


def _check_track_conv_window(conv_states, x, query_start_loc, cache_indices, has_initial_state, track_lens, dst_slots):
    op = "track_conv_window"
    check_tensor(op, "conv_states", conv_states, ndim=3, dtypes=FLOAT_DTYPES)
    if conv_states.shape[1] < 1:
        raise ValueError(f"{op}: `conv_states` must be [num_slots, W-1, D] with W >= 2, got {tuple(conv_states.shape)}")
    dim = conv_states.shape[2]
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES, shape=(None, dim))
    check_tensor(op, "cache_indices", cache_indices, ndim=1, dtypes=INDEX_DTYPES)
    batch = cache_indices.shape[0]
    check_tensor(op, "query_start_loc", query_start_loc, ndim=1, dtypes=INDEX_DTYPES, shape=(batch + 1,))
    check_tensor(op, "has_initial_state", has_initial_state, ndim=1, dtypes=(torch.bool,), shape=(batch,))
    check_tensor(op, "track_lens", track_lens, ndim=1, dtypes=INDEX_DTYPES, shape=(batch,))
    check_tensor(op, "dst_slots", dst_slots, ndim=1, dtypes=INDEX_DTYPES, shape=(batch,))
    check_same_device(
        op, conv_states=conv_states, x=x, query_start_loc=query_start_loc, cache_indices=cache_indices,
        has_initial_state=has_initial_state, track_lens=track_lens, dst_slots=dst_slots,
    )
    check_cu_seqlens(op, "query_start_loc", query_start_loc, x.shape[0])
    check_slot_indices(op, "cache_indices", cache_indices, conv_states.shape[0])
    check_slot_indices(op, "dst_slots", dst_slots, conv_states.shape[0])
    check_unique_slots(op, "dst_slots", dst_slots)
    if batch and should_check_values(track_lens, query_start_loc, dst_slots):
        lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int64)
        active = (track_lens >= 0) & (dst_slots >= 0)
        bad = active & (track_lens.to(torch.int64) > lens)
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"{op}: `track_lens[{b}]` = {int(track_lens[b])} exceeds the request's {int(lens[b])} new tokens"
            )


@kernel_op("hybrid_compile::track_conv_window", mutates_args=("conv_states",))
def track_conv_window(
    conv_states: torch.Tensor,
    x: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    track_lens: torch.Tensor,
    dst_slots: torch.Tensor,
) -> None:
    """Checkpoint the conv window of each request at a new-token offset into a cache slot.

    For request ``b`` with ``track_lens[b] >= 0``, ``dst_slots[b] >= 0`` and
    ``cache_indices[b] >= 0``: ``conv_states[dst_slots[b]]`` = the ``W-1`` inputs that
    precede new-token offset ``track_lens[b]`` of request ``b``, i.e. the window
    ``causal_conv1d_fn`` would leave after consuming only its first ``track_lens[b]`` new
    tokens. Inputs before the request's first new token come from its initial window
    (``conv_states[cache_indices[b]]`` if ``has_initial_state[b]``, else zeros). This is the
    conv half of a prefix-cache checkpoint (``layers/tracking.py``), correct also when
    ``track_lens[b] < W-1`` (the window then reaches back into the initial window).

    MUST be called BEFORE ``causal_conv1d_fn`` runs on the same batch: that op overwrites
    ``conv_states[cache_indices[b]]``, the source of the initial window. All windows are
    gathered before any write, so a destination that is another row's source is read first;
    callers should still not reuse a slot that ``causal_conv1d_fn`` will read as a destination.

    Args:
        conv_states: ``[num_slots, W-1, D]`` window pool (row 0 oldest). **Mutated** at
            ``dst_slots`` of tracked rows only.
        x: ``[T, D]`` packed inputs of the extend (the same tensor given to ``causal_conv1d_fn``).
        query_start_loc: ``[B+1]`` int32/int64 cumulative token offsets.
        cache_indices: ``[B]`` int32/int64 source slot of each request; -1 = padding (skipped).
        has_initial_state: ``[B]`` bool.
        track_lens: ``[B]`` int32/int64 number of new tokens consumed at the checkpoint;
            -1 = no checkpoint for this request; must be <= the request's length.
        dst_slots: ``[B]`` int32/int64 destination slot; -1 = skip. Must be distinct.
    """
    _check_track_conv_window(conv_states, x, query_start_loc, cache_indices, has_initial_state, track_lens, dst_slots)
    batch = cache_indices.shape[0]
    if batch == 0:
        return
    num_tokens, dim = x.shape
    k = conv_states.shape[1]
    dev = x.device
    idx = cache_indices.to(torch.int64)
    tl = track_lens.to(torch.int64)
    dst = dst_slots.to(torch.int64)
    keep = (tl >= 0) & (dst >= 0) & (idx >= 0)
    win = _initial_windows(conv_states, idx, (idx >= 0) & has_initial_state)  # [B, K, D]
    # Position j of the tracked window is position tl + j of the combined stream
    # (K window rows, then the new tokens).
    pos = tl.clamp(min=0)[:, None] + torch.arange(k, device=dev)  # [B, K]
    from_win = pos < k
    win_part = win.gather(1, pos.clamp(max=k - 1)[:, :, None].expand(batch, k, dim))
    if num_tokens > 0:
        tok = (query_start_loc[:-1].to(torch.int64)[:, None] + pos - k).clamp(0, num_tokens - 1)
        tok_part = x.float().index_select(0, tok.reshape(-1)).reshape(batch, k, dim)
        new_win = torch.where(from_win[:, :, None], win_part, tok_part)
    else:
        new_win = win_part
    _write_slots(conv_states, new_win, dst, keep)


@track_conv_window.register_fake
def _(conv_states, x, query_start_loc, cache_indices, has_initial_state, track_lens, dst_slots):
    _check_track_conv_window(conv_states, x, query_start_loc, cache_indices, has_initial_state, track_lens, dst_slots)
