"""Triton kernel of ``uniform_step_metadata`` (:mod:`hybrid_compile.ops.metadata`): one program
per request writes the request's new ``req_to_token`` entries and every metadata row of the
step, its KV indices copied from its ``req_to_token`` row in blocks of ``BLOCK_KV``.

A shape-only launch (no host sync) that replaces about twenty torch kernels per decode step.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..metadata import STAGED_COLUMNS, _check_uniform_step_metadata
from .launch import pdl_launch, pdl_wait_and_release

__all__ = ["uniform_step_metadata_triton"]

_FIRST_SLOT = len(STAGED_COLUMNS)  # staged column of the first new token's KV slot
_BLOCK_KV = 1024


@triton.jit(do_not_specialize=["n_ids_src", "padding_slot"])
def _uniform_step_metadata_kernel(
    staged_ptr, stride_staged, ids_src_ptr, n_ids_src, r2t_ptr, stride_r2t,
    ids_ptr, pos_ptr, ocl_ptr, logits_ptr, qsl_ptr, seq_ptr, prefix_ptr, prompt_ptr, mamba_ptr, init_ptr,
    indptr_ptr, kvi_ptr, padding_slot,
    STEPS: tl.constexpr, BLOCK_STEPS: tl.constexpr, FIRST_SLOT: tl.constexpr, BLOCK_KV: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait_and_release(USE_PDL)
    r = tl.program_id(0).to(tl.int64)
    row = staged_ptr + r * stride_staged
    slot = tl.load(row)
    prefix = tl.load(row + 1)
    start = tl.load(row + 2)
    mamba = tl.load(row + 3)
    prompt = tl.load(row + 4)
    real = slot >= 0
    j = tl.arange(0, BLOCK_STEPS)
    jm = j < STEPS
    t = r * STEPS + j
    new_slots = tl.load(row + FIRST_SLOT + j, mask=jm, other=0)
    ids = tl.load(row + FIRST_SLOT + STEPS + j, mask=jm, other=0)
    # device ids (none: n_ids_src 0) a runtime count, not a constexpr: one compiled variant for both
    from_src = jm & (t < n_ids_src)
    ids = tl.where(from_src, tl.load(ids_src_ptr + t, mask=from_src, other=0), ids)
    tl.store(ids_ptr + t, ids, mask=jm)
    tl.store(pos_ptr + t, prefix + j, mask=jm)
    tl.store(ocl_ptr + t, new_slots, mask=jm)
    tl.store(logits_ptr + t, t, mask=jm)
    seq = prefix + STEPS
    tl.store(qsl_ptr + r + 1, ((r + 1) * STEPS).to(tl.int32))
    tl.store(indptr_ptr + r + 1, (start + seq).to(tl.int32))
    if tl.program_id(0) == 0:
        tl.store(qsl_ptr, 0)
        tl.store(indptr_ptr, 0)
    tl.store(seq_ptr + r, seq.to(tl.int32))
    tl.store(prefix_ptr + r, prefix.to(tl.int32))
    tl.store(prompt_ptr + r, prompt.to(tl.int32))
    tl.store(mamba_ptr + r, mamba.to(tl.int32))
    tl.store(init_ptr + r, prefix > 0)
    # the request's req_to_token row: new entries written, cached ones copied to kv_indices
    # (padding rows have prefix 0 and touch no row)
    r2t_row = r2t_ptr + tl.maximum(slot, 0) * stride_r2t
    # (the mask a block: Triton's interpreter rejects a block & scalar mask)
    # a real request's masked token (KV slot -1: K/V not stored) maps to the padding slot
    entries = tl.where(real & (new_slots >= 0), new_slots, padding_slot).to(tl.int32)
    tl.store(r2t_row + prefix + j, entries, mask=jm & (j * 0 + slot >= 0))
    kv_row = kvi_ptr + start
    for k0 in range(0, prefix, BLOCK_KV):
        k = k0 + tl.arange(0, BLOCK_KV)
        km = k < prefix
        tl.store(kv_row + k, tl.load(r2t_row + k, mask=km), mask=km)
    tl.store(kv_row + prefix + j, entries, mask=jm)


def uniform_step_metadata_triton(
    staged: torch.Tensor, ids_src: Optional[torch.Tensor], steps: int, padding_slot: int, req_to_token: torch.Tensor,
    input_ids: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor, logits_indices: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, prefix_lens: torch.Tensor, prompt_lens: torch.Tensor,
    mamba_cache_indices: torch.Tensor, has_initial_state: torch.Tensor, kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
) -> None:
    """Triton ``uniform_step_metadata`` (same arguments and writes as the op)."""
    rows = staged.shape[0]
    if rows == 0:
        query_start_loc.zero_()
        kv_indptr.zero_()
        return
    has_src = ids_src is not None
    _uniform_step_metadata_kernel[(rows,)](
        staged, staged.stride(0), ids_src if has_src else staged, ids_src.shape[0] if has_src else 0,
        req_to_token, req_to_token.stride(0),
        input_ids, positions, out_cache_loc, logits_indices, query_start_loc, seq_lens, prefix_lens, prompt_lens,
        mamba_cache_indices, has_initial_state, kv_indptr, kv_indices, int(padding_slot),
        STEPS=int(steps), BLOCK_STEPS=triton.next_power_of_2(int(steps)), FIRST_SLOT=_FIRST_SLOT,
        BLOCK_KV=_BLOCK_KV, num_warps=4,
        **pdl_launch(staged.device),
    )


def _uniform_step_metadata_cuda(staged, ids_src, steps, padding_slot, req_to_token, input_ids, positions,
                                out_cache_loc, logits_indices, query_start_loc, seq_lens, prefix_lens, prompt_lens,
                                mamba_cache_indices, has_initial_state, kv_indptr, kv_indices):
    args = (staged, ids_src, steps, padding_slot, req_to_token, input_ids, positions, out_cache_loc, logits_indices,
            query_start_loc, seq_lens, prefix_lens, prompt_lens, mamba_cache_indices, has_initial_state, kv_indptr,
            kv_indices)
    _check_uniform_step_metadata(*args)
    uniform_step_metadata_triton(*args)


torch.library.register_kernel("hybrid_compile::uniform_step_metadata", "cuda", _uniform_step_metadata_cuda)
