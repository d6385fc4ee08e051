"""Launch options shared by the Triton kernels: programmatic dependent launch (PDL).

On Hopper and later a kernel launched as a *programmatic dependent* of the kernel before it in
the stream may start while that kernel is still finishing; it must wait
(``griddepcontrol.wait``) before it touches memory the earlier kernel writes or reads. The decode
kernels (and Inductor's, through ``triton.enable_pdl``, which the engine turns on with them)
launch this way, so that the few-microsecond kernels of a decode step overlap their launch and
tail: measured on an H200 (reference Qwen3-Next, batch-1 decode under a CUDA graph) 1.75 ->
1.66 ms/step with both sides on. Either side alone was slower (1.80-1.82 ms).

``HYBRID_COMPILE_PDL=0`` turns it off (for our kernels here and for Inductor's, see
``engine/graph_setup.py``).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

__all__ = ["pdl_launch", "pdl_wait_and_release", "programmatic_launch_supported"]


def programmatic_launch_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch as programmatic dependents (a CUDA device of compute
    capability 9.0 or later, not under the Triton interpreter, and ``HYBRID_COMPILE_PDL`` not 0)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get("HYBRID_COMPILE_PDL", "1") == "0":
        return False
    return _capability_major(device.index if device.index is not None else torch.cuda.current_device()) >= 9


@functools.lru_cache(maxsize=None)
def _capability_major(index: int) -> int:
    """(cached: this is asked at every kernel launch)"""
    return torch.cuda.get_device_capability(index)[0]


def pdl_launch(device: torch.device, enabled: bool | None = None) -> dict:
    """Launch keywords for a kernel with a ``USE_PDL`` constexpr: ``USE_PDL`` and, when on, Triton's
    ``launch_pdl`` (the interpreter knows no such option). ``enabled`` None: as
    :func:`programmatic_launch_supported`."""
    if enabled is None:
        enabled = programmatic_launch_supported(device)
    return {"USE_PDL": True, "launch_pdl": True} if enabled else {"USE_PDL": False}


@triton.jit
def pdl_wait_and_release(USE_PDL: tl.constexpr):
    """First statement of a kernel that launches as a programmatic dependent: wait until the kernel
    before it has finished (and its writes are visible), then let the next kernel start launching
    (it waits in turn before touching memory, so releasing early is safe)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
