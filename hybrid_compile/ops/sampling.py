"""Sampling ops: ``argmax_rows``, the greedy token of each row of a batch of logits.

Greedy decoding takes the argmax of every request's logits row in the vocabulary's own dtype (a
bf16 -> fp32 conversion changes no order). On CUDA a two-pass Triton kernel
(:mod:`.triton.sampling`) spreads each row over many programs, where ``torch.argmax`` reduces a
batch-1 row of 152k logits in one block (about 8 us plus a 4 us fp32 copy on an H100).
"""

from __future__ import annotations

import torch

from ._validation import FLOAT_DTYPES, check_tensor
from .registration import kernel_op

__all__ = ["argmax_rows"]


def _check_argmax_rows(logits):
    check_tensor("argmax_rows", "logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    if logits.shape[1] == 0:
        raise ValueError("argmax_rows: `logits` rows are empty (vocabulary of 0)")


@kernel_op("hybrid_compile::argmax_rows", mutates_args=())
def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Index of the largest entry of each row: ``logits [B, V]`` fp32/bf16/fp16 (rows may be a
    strided view) -> ``[B]`` int64. Ties go to the first index and a NaN counts as larger than
    every number (the first NaN wins), as ``torch.argmax``."""
    _check_argmax_rows(logits)
    return logits.argmax(dim=-1)


@argmax_rows.register_fake
def _(logits):
    _check_argmax_rows(logits)
    return logits.new_empty(logits.shape[:1], dtype=torch.int64)
