"""Step metadata on the device: ``uniform_step_metadata``, every per-step tensor of a step in
which each request adds the same number of tokens (DECODE: 1; TARGET_VERIFY: the draft length),
built in one op from one small host->device copy.

The engine (``engine/forward_batch.py``) stages one int64 row per request on the host and copies the
rows to the device at once; the op then writes the request's new ``req_to_token`` entries and
every metadata tensor the layer ops read: into fresh tensors for an eager or compiled step, or
straight into a full CUDA graph's stable buffers (``compilation/cuda_graphs.py``), padding rows
included. On CUDA it is one Triton kernel (:mod:`.triton.metadata`) where the torch ops of the
general path take about twenty small kernels (about 60 us of a 1.9 ms batch-1 decode step on an
H100).

Staged row of request ``r`` (``STAGED_COLUMNS`` then ``steps`` KV slots then ``steps`` token
ids): its ``req_to_token`` row (-1: a padding request), its cached length ``p`` (0 for padding),
its first entry in ``kv_indices`` (``kv_indptr[r]``; row 0 starts at 0), its Mamba slot (-1
for padding), its prompt length, the KV slot of each new token (-1 for padding: no K/V is
stored), and the new tokens' ids. A real request's token may be masked too (KV slot -1: its K/V
not stored, the padding slot in its ``req_to_token`` entry and ``kv_indices``; an MTP head's
window, ``engine/speculative/mtp.py``): tokens after it in the request must not be attended to.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._validation import check_same_device, check_tensor, should_check_values
from .registration import kernel_op

__all__ = ["STAGED_COLUMNS", "padding_row", "padding_rows", "padding_tree", "staged_row", "staged_width",
           "uniform_step_metadata"]

#: The fixed leading columns of a staged row; the ``steps`` KV slots and ``steps`` ids follow.
STAGED_COLUMNS = ("req_slot", "prefix_len", "kv_start", "mamba_slot", "prompt_len")


def staged_width(steps: int) -> int:
    """Columns of a staged row for requests of ``steps`` new tokens."""
    return len(STAGED_COLUMNS) + 2 * steps


def staged_row(req_slot: int, prefix_len: int, kv_start: int, mamba_slot: int, prompt_len: int,
               kv_slots: list[int], ids: list[int]) -> list[int]:
    """The staged row of a request (``kv_slots`` / ``ids``: its new tokens' KV slots and ids)."""
    return [req_slot, prefix_len, kv_start, mamba_slot, prompt_len, *kv_slots, *ids]


def padding_row(kv_start: int, steps: int) -> list[int]:
    """The staged row of a padding request of ``steps`` tokens: no request row, nothing cached,
    Mamba slot -1, prompt length ``steps``, no K/V stored, ids 0 (``pad_requests``' padding)."""
    return [-1, 0, kv_start, -1, steps, *([-1] * steps), *([0] * steps)]


def padding_rows(kv_start: int, count: int, steps: int) -> list[list[int]]:
    """``count`` consecutive padding rows, the first starting at ``kv_start`` in ``kv_indices``."""
    return [padding_row(kv_start + i * steps, steps) for i in range(count)]


def padding_tree(steps: int) -> tuple[list[int], list[int]]:
    """The draft tree a padding request of ``steps`` tokens verifies (a draft-tree TARGET_VERIFY step's
    padding rows): a chain, as (parent of each token, -1 for the first; ancestor bits of each token,
    itself included, as a signed int64: the attention op's ``tree_mask``)."""
    bits = [(1 << (j + 1)) - 1 for j in range(steps)]
    return list(range(-1, steps - 1)), [b - (1 << 64) if b >= 1 << 63 else b for b in bits]


_MUTATED = ("req_to_token", "input_ids", "positions", "out_cache_loc", "logits_indices", "query_start_loc", "seq_lens",
            "prefix_lens", "prompt_lens", "mamba_cache_indices", "has_initial_state", "kv_indptr", "kv_indices")


def _check_uniform_step_metadata(staged, ids_src, steps, padding_slot, req_to_token, input_ids, positions,
                                 out_cache_loc, logits_indices, query_start_loc, seq_lens, prefix_lens, prompt_lens,
                                 mamba_cache_indices, has_initial_state, kv_indptr, kv_indices):
    op = "uniform_step_metadata"
    if steps < 1:
        raise ValueError(f"{op}: steps (new tokens per request) must be >= 1, got {steps}")
    check_tensor(op, "staged", staged, ndim=2, dtypes=(torch.int64,), shape=(None, staged_width(steps)))
    rows = staged.shape[0]
    n = rows * steps
    if ids_src is not None:
        check_tensor(op, "ids_src", ids_src, ndim=1, dtypes=(torch.int64,))
        if ids_src.shape[0] > n:
            raise ValueError(f"{op}: `ids_src` has {ids_src.shape[0]} ids for a step of {n} tokens")
    check_tensor(op, "req_to_token", req_to_token, ndim=2, dtypes=(torch.int32,))
    for name, t in (("input_ids", input_ids), ("positions", positions), ("out_cache_loc", out_cache_loc),
                    ("logits_indices", logits_indices)):
        check_tensor(op, name, t, dtypes=(torch.int64,), shape=(n,))
    for name, t in (("query_start_loc", query_start_loc), ("kv_indptr", kv_indptr)):
        check_tensor(op, name, t, dtypes=(torch.int32,), shape=(rows + 1,))
    for name, t in (("seq_lens", seq_lens), ("prefix_lens", prefix_lens), ("prompt_lens", prompt_lens),
                    ("mamba_cache_indices", mamba_cache_indices)):
        check_tensor(op, name, t, dtypes=(torch.int32,), shape=(rows,))
    check_tensor(op, "has_initial_state", has_initial_state, dtypes=(torch.bool,), shape=(rows,))
    check_tensor(op, "kv_indices", kv_indices, ndim=1, dtypes=(req_to_token.dtype,))
    for name, t in (("req_to_token", req_to_token), ("input_ids", input_ids), ("kv_indices", kv_indices)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{op}: `{name}` must be contiguous in its last dim")
    check_same_device(op, staged=staged, ids_src=ids_src, req_to_token=req_to_token, input_ids=input_ids,
                      positions=positions, out_cache_loc=out_cache_loc, logits_indices=logits_indices,
                      query_start_loc=query_start_loc, seq_lens=seq_lens, prefix_lens=prefix_lens,
                      prompt_lens=prompt_lens, mamba_cache_indices=mamba_cache_indices,
                      has_initial_state=has_initial_state, kv_indptr=kv_indptr, kv_indices=kv_indices)
    if rows and should_check_values(staged, kv_indices):
        _check_staged_values(op, staged, steps, req_to_token, kv_indices)


def _check_staged_values(op, staged, steps, req_to_token, kv_indices):
    """Value checks (host reads: CPU tensors, or debug mode on CUDA), on the rows as Python lists
    (a handful of requests: cheaper than tensor reductions)."""
    num_rows, width = req_to_token.shape
    seen, end = set(), 0
    for slot, prefix, start in staged[:, :3].tolist():
        if not -1 <= slot < num_rows:
            raise IndexError(f"{op}: request slots must be in [0, {num_rows}) or -1 (padding), got {slot}")
        if slot >= 0:
            if slot in seen:
                raise ValueError(f"{op}: repeated request slots ({slot})")
            seen.add(slot)
        if prefix < 0 or (slot < 0 and prefix != 0) or prefix + steps > width:
            raise ValueError(f"{op}: cached lengths must be >= 0 (0 for padding rows) with {steps} more tokens "
                             f"fitting a req_to_token row of {width}, got {prefix}")
        if start != end:
            raise ValueError(f"{op}: kv_start must be 0 then the running sum of the sequence lengths, got {start} "
                             f"where {end} was due")
        end = start + prefix + steps
    if end > kv_indices.shape[0]:
        raise ValueError(f"{op}: `kv_indices` holds {kv_indices.shape[0]} entries, the step needs {end}")


@kernel_op("hybrid_compile::uniform_step_metadata", mutates_args=_MUTATED)
def uniform_step_metadata(
    staged: torch.Tensor,
    ids_src: Optional[torch.Tensor],
    steps: int,
    padding_slot: int,
    req_to_token: torch.Tensor,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    logits_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    prompt_lens: torch.Tensor,
    mamba_cache_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
) -> None:
    """Write the metadata of a step of ``R`` requests adding ``steps`` tokens each.

    Args:
        staged: ``[R, 5 + 2 * steps]`` int64, one row per request (module docstring).
        ids_src: ``[m]`` int64 ids of the first ``m <= R * steps`` tokens already on the device
            (the tokens the previous step sampled), used instead of the staged ids; or None.
        steps: new tokens per request.
        padding_slot: the KV pool's padding slot, the ``kv_indices`` of a padding request.
        req_to_token: ``[num_requests, max_context_len]`` int32; **mutated**: request ``r``'s
            entries ``p .. p + steps - 1`` become its new tokens' KV slots (``padding_slot``
            for a masked token, staged slot -1).

    Written (``mutated``; ``n = R * steps``, ``t = r * steps + j``):
        input_ids ``[n]`` int64 (``ids_src`` then the staged ids); positions ``[n]`` int64
        ``p + j``; out_cache_loc ``[n]`` int64 the staged KV slots; logits_indices ``[n]`` int64
        ``t``; query_start_loc ``[R+1]`` int32 ``r * steps``; seq_lens ``[R]`` int32
        ``p + steps``; prefix_lens ``[R]`` int32 ``p``; prompt_lens, mamba_cache_indices ``[R]``
        int32 as staged; has_initial_state ``[R]`` bool ``p > 0``; kv_indptr ``[R+1]`` int32
        ``kv_start`` then its last row's end; kv_indices (``req_to_token``'s dtype, at least
        ``kv_indptr[R]`` entries) request ``r``'s ``req_to_token`` entries ``0 .. p + steps - 1``
        from ``kv_start``, ``steps`` copies of ``padding_slot`` for a padding request.
    """
    _check_uniform_step_metadata(staged, ids_src, steps, padding_slot, req_to_token, input_ids, positions,
                                 out_cache_loc, logits_indices, query_start_loc, seq_lens, prefix_lens, prompt_lens,
                                 mamba_cache_indices, has_initial_state, kv_indptr, kv_indices)
    rows = staged.shape[0]
    if rows == 0:
        query_start_loc.zero_()
        kv_indptr.zero_()
        return
    dev = staged.device
    cols = len(STAGED_COLUMNS)
    slot, prefix, start, mamba, prompt = staged[:, :cols].unbind(1)
    new_slots = staged[:, cols: cols + steps]
    input_ids.view(rows, steps).copy_(staged[:, cols + steps:])
    if ids_src is not None:
        input_ids[: ids_src.shape[0]] = ids_src
    positions.view(rows, steps).copy_(prefix[:, None] + torch.arange(steps, device=dev))
    out_cache_loc.view(rows, steps).copy_(new_slots)
    torch.arange(rows * steps, out=logits_indices)
    torch.arange(0, (rows + 1) * steps, steps, out=query_start_loc)
    seq = prefix + steps
    kv_indptr[0] = 0
    kv_indptr[1:].copy_(start + seq)
    seq_lens.copy_(seq)
    prefix_lens.copy_(prefix)
    prompt_lens.copy_(prompt)
    mamba_cache_indices.copy_(mamba)
    torch.gt(prefix, 0, out=has_initial_state)
    real = slot >= 0
    positions_2d = positions.view(rows, steps)
    # a real request's masked token (KV slot -1: not stored) gets the padding slot, never -1
    entries = torch.where(new_slots >= 0, new_slots, padding_slot)
    req_to_token[slot[real, None], positions_2d[real]] = entries[real].to(req_to_token.dtype)
    # every token of every request: req_to_token row entries 0 .. seq-1 (the new ones written above)
    total = int(start[-1] + seq[-1])
    kv_indices[:total] = request_token_slots(req_to_token, slot, seq, start, total, padding_slot)


def request_token_slots(req_to_token: torch.Tensor, req_slots: torch.Tensor, seq_lens: torch.Tensor,
                        starts: torch.Tensor, total: int, padding_slot: int | None = None) -> torch.Tensor:
    """``[total]`` KV slots of every token of every request, in position order: request ``i``'s
    ``req_to_token[req_slots[i], 0 .. seq_lens[i] - 1]`` at offset ``starts[i]`` (``starts`` its
    ``kv_indptr``, ``total`` the last request's end, known to the caller: no host sync). With
    ``padding_slot``, a request of slot < 0 (a padding row) gets that slot for each of its tokens."""
    dev = seq_lens.device
    owner = torch.repeat_interleave(torch.arange(seq_lens.shape[0], device=dev), seq_lens, output_size=total)
    col = torch.arange(total, device=dev) - starts[owner]
    rows = req_slots.to(torch.int64)[owner]
    if padding_slot is None:
        return req_to_token[rows, col]
    of_request = rows >= 0
    kv = torch.full((total,), padding_slot, dtype=req_to_token.dtype, device=dev)
    kv[of_request] = req_to_token[rows[of_request], col[of_request]]
    return kv


@uniform_step_metadata.register_fake
def _(staged, ids_src, steps, padding_slot, req_to_token, input_ids, positions, out_cache_loc, logits_indices,
      query_start_loc, seq_lens, prefix_lens, prompt_lens, mamba_cache_indices, has_initial_state, kv_indptr,
      kv_indices):
    _check_uniform_step_metadata(staged, ids_src, steps, padding_slot, req_to_token, input_ids, positions,
                                 out_cache_loc, logits_indices, query_start_loc, seq_lens, prefix_lens, prompt_lens,
                                 mamba_cache_indices, has_initial_state, kv_indptr, kv_indices)
    return None
