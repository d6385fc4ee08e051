"""Index arithmetic for packed variable-length batches, shared by the chunked ops.

A packed batch holds the tokens of B requests back to back; ``cu_seqlens`` (a.k.a.
``query_start_loc``) is ``[B + 1]`` with ``cu_seqlens[b]:cu_seqlens[b+1]`` the tokens of
request ``b``. The chunked scans (GDN delta rule, Mamba2 SSD) cut every request into
chunks aligned to *that request's* first new token, so a chunk boundary is always a whole
number of chunks into the extend; this is what makes chunk-boundary states reusable by the
prefix cache (``cache/radix_cache.py`` stores states only at such lengths).

Chunk-state rows: an op that returns chunk states returns ``max_chunk_rows(T, B, C)`` rows,
a bound that depends on shapes only (so the fake impl needs no data-dependent size).
Request ``b`` owns rows ``chunk_row_offsets[b] : chunk_row_offsets[b] + ceil(len_b / C)``;
row ``chunk_row_offsets[b] + j`` holds the state *before* chunk ``j`` of that request (the
state after ``j * C`` of its new tokens; row ``+0`` is its initial state). Unused rows are
zero.
"""

from __future__ import annotations

import torch


def max_chunk_rows(num_tokens: int, batch: int, chunk_size: int) -> int:
    """Upper bound of sum_b ceil(len_b / chunk_size) over any split of num_tokens into batch requests."""
    return num_tokens // chunk_size + batch


def chunks_per_request(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[B] number of chunks of each request, ceil(len_b / chunk_size) (0 for an empty request)."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    return (lens + chunk_size - 1) // chunk_size


def chunk_row_offsets(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[B] first chunk-state row of each request (exclusive cumsum of chunks_per_request)."""
    n = chunks_per_request(cu_seqlens, chunk_size)
    return torch.cumsum(n, 0) - n
