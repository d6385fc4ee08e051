"""Triton kernels of ``argmax_rows`` (:mod:`hybrid_compile.ops.sampling`): two passes.

Pass one, grid ``(B, cdiv(V, BLOCK_V))``: each program reduces one block of one row to its
(largest value in fp32, first index). Pass two, grid ``(B,)``: each program reduces a row's block
results the same way. The comparison is ``torch.argmax``'s: a larger value wins, ties go to the
smaller index, a NaN beats every number (the first NaN wins). Shape-only launches, usable in CUDA
graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..sampling import _check_argmax_rows
from .launch import pdl_launch, pdl_wait_and_release

__all__ = ["argmax_rows_triton"]

_BLOCK_V = 4096


@triton.jit
def _argmax_combine(v1, i1, v2, i2):
    nan1 = v1 != v1
    nan2 = v2 != v2
    smaller_index = i1 < i2
    first = (nan1 & (~nan2 | smaller_index)) | (~nan1 & ~nan2 & ((v1 > v2) | ((v1 == v2) & smaller_index)))
    return tl.where(first, v1, v2), tl.where(first, i1, i2)


@triton.jit(do_not_specialize=["V", "stride_row"])
def _argmax_blocks_kernel(x_ptr, stride_row, V, val_ptr, idx_ptr, NUM_BLOCKS: tl.constexpr, BLOCK_V: tl.constexpr,
                          USE_PDL: tl.constexpr = False):
    pdl_wait_and_release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    cols = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    m = cols < V
    x = tl.load(x_ptr + row * stride_row + cols, mask=m, other=float("-inf")).to(tl.float32)
    idx = tl.where(m, cols, V)  # masked lanes: -inf at an index past every real one
    best, best_idx = tl.reduce((x, idx), 0, _argmax_combine)
    tl.store(val_ptr + row * NUM_BLOCKS + blk, best)
    tl.store(idx_ptr + row * NUM_BLOCKS + blk, best_idx)


@triton.jit
def _argmax_rows_kernel(val_ptr, idx_ptr, out_ptr, NUM_BLOCKS: tl.constexpr, BLOCK_B: tl.constexpr,
                        USE_PDL: tl.constexpr = False):
    pdl_wait_and_release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, BLOCK_B)
    m = b < NUM_BLOCKS
    v = tl.load(val_ptr + row * NUM_BLOCKS + b, mask=m, other=float("-inf"))
    i = tl.load(idx_ptr + row * NUM_BLOCKS + b, mask=m, other=2**31 - 1)
    _, best_idx = tl.reduce((v, i), 0, _argmax_combine)
    tl.store(out_ptr + row, best_idx.to(tl.int64))


def argmax_rows_triton(logits: torch.Tensor) -> torch.Tensor:
    """Triton ``argmax_rows`` (same argument and result as the op)."""
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    num_blocks = triton.cdiv(V, _BLOCK_V)
    vals = torch.empty(B, num_blocks, dtype=torch.float32, device=logits.device)
    idx = torch.empty(B, num_blocks, dtype=torch.int32, device=logits.device)
    pdl = pdl_launch(logits.device)
    _argmax_blocks_kernel[(B, num_blocks)](logits, logits.stride(0), V, vals, idx, NUM_BLOCKS=num_blocks,
                                           BLOCK_V=_BLOCK_V, num_warps=8, **pdl)
    _argmax_rows_kernel[(B,)](vals, idx, out, NUM_BLOCKS=num_blocks, BLOCK_B=triton.next_power_of_2(num_blocks),
                              num_warps=1, **pdl)
    return out


def _argmax_rows_cuda(logits):
    _check_argmax_rows(logits)
    return argmax_rows_triton(logits)


torch.library.register_kernel("hybrid_compile::argmax_rows", "cuda", _argmax_rows_cuda)
