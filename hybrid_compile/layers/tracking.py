"""Prefix-cache checkpoints inside an EXTEND step, shared by the GDN and Mamba2 layer ops.

The scheduler picks, per request of an EXTEND step, a length inside its extend at which the
recurrent state goes to the prefix cache (a whole number of SSM chunks after the request's
first new token: the chunked scans have a state only there) and a fresh Mamba slot for it (``ForwardMetadata.track_slots`` /
``track_lens``). A layer op then

1. gathers the conv window at that offset from the conv *inputs* (``track_conv_window``,
   before ``causal_conv1d_fn`` overwrites the request's window), and
2. copies the chunk state ``h`` at that offset, returned by its chunk kernel with
   ``output_chunk_states=True``, into the slot (``track_chunk_states``).

Nothing here syncs the device: the chunk-state rows are computed from ``query_start_loc``.
"""

from __future__ import annotations

import torch

from .. import ops as _ops  # noqa: F401  (registers the kernel ops)
from ..ops._varlen import chunk_row_offsets
from .context import ForwardMetadata

_kernels = torch.ops.hybrid_compile


def tracking(md: ForwardMetadata) -> bool:
    """Whether this step checkpoints any request's state (host-side flag, no sync)."""
    return md.has_tracking and md.track_slots is not None and md.track_lens is not None


def track_conv_checkpoints(md: ForwardMetadata, conv_states: torch.Tensor, conv_inputs: torch.Tensor) -> None:
    """Write each tracked request's conv window at its checkpoint into its track slot. Call
    before ``causal_conv1d_fn`` on the same step."""
    _kernels.track_conv_window(
        conv_states, conv_inputs, md.query_start_loc, md.mamba_cache_indices, md.has_initial_state,
        md.track_lens, md.track_slots,
    )


def track_ssm_checkpoints(
    md: ForwardMetadata, ssm_states: torch.Tensor, chunk_states: torch.Tensor, chunk_size: int,
    ssm_scales: torch.Tensor | None = None, scale_dim: int = -1,
) -> None:
    """Copy each tracked request's chunk state at its checkpoint (row ``offset_b +
    track_lens[b] // chunk_size`` of the ``_varlen`` layout) into its track slot (quantized into
    an FP8 pool's values and ``ssm_scales``, one scale per vector along ``scale_dim``)."""
    def rows():  # the same for every layer of the step with this chunk size: built once (md.memo)
        offsets = chunk_row_offsets(md.query_start_loc, chunk_size)
        lens = md.track_lens.to(torch.int64)
        slots = md.track_slots.to(torch.int64)
        keep = (slots >= 0) & (lens >= 0) & (md.mamba_cache_indices >= 0)
        src = torch.where(keep, offsets + torch.div(lens, chunk_size, rounding_mode="floor"), -1)
        return src, torch.where(keep, slots, -1)

    src, dst = md.memo(("track_chunk_rows", chunk_size), rows)
    _kernels.track_chunk_states(ssm_states, chunk_states, src, dst, ssm_scales, scale_dim)
