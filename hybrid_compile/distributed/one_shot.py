"""One-shot all-reduce over symmetric memory: the small all-reduces of a rank's model in one kernel.

A decode step all-reduces a few KB twice per layer; NCCL's ring all-reduce spends 15-25 us on each
of them whatever the size (the 80B shape at batch 1: 96 of them per token). With symmetric memory
(``torch.distributed._symmetric_memory``: every rank maps the other ranks' buffers over NVLink /
P2P) an all-reduce is one kernel of torch's, ``symm_mem::one_shot_all_reduce_copy``: the rank copies
its input into its own buffer, the ranks meet at a barrier of signal pads, and each rank sums every
rank's buffer itself (in rank order, so every rank gets the same bits). On 4 H200s: 8 us against
NCCL's 16 us at 4 KB inside a CUDA graph; batch-1 decode of 8 of the 80B shape's layers at TP 4
1.08x and 1.23x faster in two runs (README, Tensor parallelism).

``EngineConfig.tensor_parallel_all_reduce`` picks it (:func:`resolve`): ``"one_shot"``, ``"nccl"``
(every all-reduce on the device group: NCCL, gloo on CPU) or ``"auto"`` (one-shot where it can run:
CUDA, 2 / 4 / 8 ranks whose GPUs reach each other by P2P, a bf16 or fp32 model). Each rank then
allocates one buffer of :data:`MAX_BYTES` (64 KiB; :func:`enable`, a collective of the group) and the model's
all-reduces go through the custom op ``hybrid_compile::tp_all_reduce`` (opaque to Dynamo and
Inductor, captured like any kernel in the CUDA graphs). The op takes the one-shot kernel for a
bf16 / fp32 tensor of at most the buffer's size (a multiple of 16 bytes, the kernel's vector
width): decode steps and small prefill chunks. Anything else (large prefill chunks, where NCCL's
ring moves fewer bytes per rank; fp16, which the kernel does not take) is an NCCL all-reduce in the
same op. The rule depends only on the shape and dtype, so every rank takes the same path.
"""

from __future__ import annotations

import warnings

import torch

from ..ops.registration import kernel_op

MODES = ("auto", "nccl", "one_shot")
# the symmetric buffer per rank: all-reduces up to this size take the one-shot kernel. On 4 H200s (NVLink,
# 2026-11-27) it took 8-12 us in a CUDA graph against NCCL's 16-20 us from 4 KB to 256 KB, but inside
# the 80B shape's decode steps it won at 64 KB (batch 16) and lost at 256 KB (batch 64: 45 us a call
# against NCCL's 31, the ranks' skew included), so the largest size measured to win
MAX_BYTES = 64 << 10
_WORLD_SIZES = (2, 4, 8)  # the group sizes torch's one-shot kernel is built for
_DTYPES = (torch.bfloat16, torch.float32)  # the dtypes it sums
_ALIGN = 16

# group name -> this rank's symmetric buffer (uint8, MAX_BYTES): set by enable(), read by the op
_buffers: dict[str, torch.Tensor] = {}
# enable() calls of this process: torch numbers its symmetric-memory exchanges per process, so ranks
# pair up only when each has mapped as many buffers before (unpaired_reason)
_mappings = 0


def mappings() -> int:
    """How many times this process mapped a group's symmetric buffer (:func:`enable`)."""
    return _mappings


def unpaired_reason(mappings_by_rank: list[int]) -> str | None:
    """Why the ranks, which mapped ``mappings_by_rank`` buffers before (:func:`mappings`, by rank),
    cannot map one together now, or None. Torch's symmetric memory numbers each exchange of a rank's
    buffer handles per process: a process that served an earlier tensor-parallel engine (rank 0 of a
    second engine whose other ranks are new processes) waits for keys the others never write."""
    if len(set(mappings_by_rank)) <= 1:
        return None
    return (f"the ranks' processes mapped {mappings_by_rank} symmetric buffers before (an earlier tensor-parallel "
            "engine of this process, its other ranks new processes): torch numbers symmetric-memory exchanges "
            "per process, so theirs would not pair up")


def unsupported_reason(device: torch.device, size: int, dtype: torch.dtype | None) -> str | None:
    """Why the one-shot all-reduce cannot serve a group of ``size`` ranks on ``device`` (rank r on
    GPU r) for a model of ``dtype``, or None when it can."""
    if device.type != "cuda":
        return f"symmetric memory needs CUDA devices (the ranks run on {device.type})"
    if size not in _WORLD_SIZES:
        return f"torch's one-shot kernel is built for 2, 4 or 8 ranks, not {size}"
    if dtype is not None and dtype not in _DTYPES:
        return f"torch's one-shot kernel sums bfloat16 and float32 tensors, not {dtype}"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError as e:
        return f"this torch build has no symmetric memory ({e})"
    if torch.cuda.device_count() < size:
        return f"this host has {torch.cuda.device_count()} GPUs, fewer than {size}"
    for a in range(size):
        for b in range(size):
            if a != b and not torch.cuda.can_device_access_peer(a, b):
                return f"GPU {a} cannot access GPU {b}'s memory (no P2P between them)"
    return None


def resolve(mode: str, device: torch.device, size: int, dtype: torch.dtype | None) -> bool:
    """Whether the group's all-reduces take the one-shot path (module docstring). An explicit
    ``"one_shot"`` that cannot run raises ValueError with the reason; ``"auto"`` then keeps NCCL."""
    if mode == "nccl":
        return False
    reason = unsupported_reason(device, size, dtype)
    if reason is not None and mode == "one_shot":
        raise ValueError(f"EngineConfig.tensor_parallel_all_reduce='one_shot' cannot run here: {reason}; pass "
                         "'nccl' (or 'auto', which picks it only where it runs)")
    return reason is None


def enable(group_name: str, device: torch.device, max_bytes: int = MAX_BYTES) -> None:
    """Allocate this rank's symmetric buffer of ``max_bytes`` and map every rank's (a collective:
    every rank of the group calls it at the same point)."""
    from torch.distributed import _symmetric_memory as symm_mem

    global _mappings
    _mappings += 1
    try:
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch, deprecated in newer
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(group_name)
        buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(buffer, group_name)
    except Exception as e:  # (e.g. a container that forbids sharing CUDA memory between processes)
        raise RuntimeError(f"tensor parallelism: mapping the one-shot all-reduce's symmetric memory failed on "
                           f"{device} ({type(e).__name__}: {e}); pass EngineConfig.tensor_parallel_all_reduce='nccl' "
                           "to all-reduce on NCCL alone") from e
    _buffers[group_name] = buffer


def buffer(group_name: str) -> torch.Tensor | None:
    """This rank's symmetric buffer of the group (None: the one-shot path is not enabled for it)."""
    return _buffers.get(group_name)


def functional_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of ``x`` over the group by the functional collective (NCCL, gloo on CPU), waited
    right away: the all-reduce of the group without the one-shot path, and the op's other path."""
    ops = torch.ops._c10d_functional
    return ops.wait_tensor(ops.all_reduce(x, "sum", group_name))


def disable(group_name: str) -> None:
    """Forget the group's buffer (at shutdown, after the CUDA graphs that use it are dropped)."""
    _buffers.pop(group_name, None)


def takes_one_shot(x: torch.Tensor, buffer: torch.Tensor | None) -> bool:
    """The op's rule: the one-shot kernel for a bf16 / fp32 tensor that fits the buffer in whole vectors."""
    nbytes = x.numel() * x.element_size()
    return buffer is not None and x.dtype in _DTYPES and 0 < nbytes <= buffer.numel() and nbytes % _ALIGN == 0


@kernel_op("hybrid_compile::tp_all_reduce", mutates_args=())
def tp_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of ``x`` over the ranks of the group ``group_name``: the one-shot kernel where
    :func:`takes_one_shot`, else an NCCL (gloo) all-reduce."""
    symm = buffer(group_name)
    if takes_one_shot(x, symm):
        x = x.contiguous()
        if x.data_ptr() % _ALIGN:  # the kernel wants the input aligned as the buffer is
            x = x.clone()
        slot = symm.view(x.dtype).narrow(0, 0, x.numel()).view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(slot, x, "sum", group_name)
    return functional_all_reduce(x.contiguous(), group_name)


@tp_all_reduce.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)
