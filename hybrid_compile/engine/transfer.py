"""Host->device transfer of small host tensors: several of them packed into one buffer and moved
by one copy (from pinned memory on CUDA: asynchronous, no sync per tensor), each result starting
16-byte aligned. The runner's step metadata, the sampler's and the logits processors' per-step
tensors all go through :func:`to_device_packed`."""

from __future__ import annotations

import torch

# Metadata views start at 16-byte aligned offsets of their packed buffer: Triton specialises a
# kernel on the 16-byte alignment of each pointer, so offsets that depend on the batch size would
# JIT-compile a new variant of every kernel reading them in the middle of serving.
ALIGN_BYTES = 16


def aligned(n: int, dtype: torch.dtype) -> int:
    """``n`` elements of ``dtype`` rounded up to a whole number of 16-byte units."""
    per = max(1, ALIGN_BYTES // dtype.itemsize)
    return -(-n // per) * per


def to_device_packed(tensors: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Host tensors -> ``dtype`` tensors on ``device`` through one host->device copy (from pinned
    memory on CUDA: asynchronous, no sync per tensor); the results are views of one tensor, each
    starting 16-byte aligned."""
    sizes = [t.numel() for t in tensors]
    padded = [aligned(n, dtype) for n in sizes]
    host = torch.zeros(sum(padded), dtype=dtype, pin_memory=device.type == "cuda")
    for t, view in zip(tensors, host.split(padded)):
        view[: t.numel()] = t.reshape(-1)
    return [v[:n] for v, n in zip(host.to(device, non_blocking=True).split(padded), sizes)]
