"""Argument checks shared by every kernel op.

Each op validates its arguments at the top of both its real and its fake implementation,
so a bad call fails with a clear message at trace time as well as at run time. Checks on
shapes, dtypes and devices are metadata-only and always on. Checks on index *values*
(slot indices in range) need to read the tensor: on CPU they always run; on CUDA they
would force a device sync on the hot path, so they run only when debug checks are on
(``HYBRID_COMPILE_DEBUG=1`` in the environment, or :func:`set_debug_checks`).
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence

import torch
from torch._subclasses.fake_tensor import is_fake

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)

_debug_checks = os.environ.get("HYBRID_COMPILE_DEBUG", "0") not in ("", "0", "false", "False")


def set_debug_checks(enabled: bool) -> None:
    """Turn on/off the value checks (index ranges) that would sync the device on CUDA."""
    global _debug_checks
    _debug_checks = bool(enabled)


def debug_checks_enabled() -> bool:
    return _debug_checks


def _is_fake(t: torch.Tensor) -> bool:
    return t.device.type == "meta" or is_fake(t)


def check_tensor(
    op: str,
    name: str,
    t: torch.Tensor,
    *,
    ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    shape: Sequence[object] | None = None,
) -> None:
    """Check rank, dtype and (partially) shape of one tensor argument.

    ``shape`` entries may be ints (or symbolic ints) to match exactly, or ``None`` to skip.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: `{name}` must be a tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{op}: `{name}` must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{op}: `{name}` must have dtype in ({names}), got {t.dtype}")
    if shape is not None:
        size = t.shape  # (read once: these checks run at every op call)
        if len(shape) != len(size):
            raise ValueError(f"{op}: `{name}` must have {len(shape)} dims, got shape {tuple(size)}")
        for i, want in enumerate(shape):
            if want is not None and size[i] != want:
                expected = tuple("*" if s is None else s for s in shape)
                raise ValueError(
                    f"{op}: `{name}` has shape {tuple(size)}, expected {expected} (dim {i} must be {want})"
                )


def check_same_device(op: str, **tensors: torch.Tensor | None) -> None:
    """All given (non-None) tensors must live on one device."""
    first = None
    for t in tensors.values():  # (every op call runs this: the common case without building anything)
        if t is not None:
            if first is None:
                first = t.device
            elif t.device != first:
                listing = ", ".join(f"{n}={t.device}" for n, t in tensors.items() if t is not None)
                raise RuntimeError(f"{op}: all tensors must be on the same device, got {listing}")


def check_divisible(op: str, what: str, a: int, b: int) -> None:
    if b == 0 or a % b != 0:
        raise ValueError(f"{op}: {what}: {a} is not divisible by {b}")


def should_check_values(*tensors: torch.Tensor) -> bool:
    """True when value checks may read these tensors: real CPU tensors, or debug mode."""
    on_cpu = all(t.device.type == "cpu" for t in tensors)
    if not (on_cpu or _debug_checks):  # (a device's hot path: decided without the fake-tensor test)
        return False
    return not any(_is_fake(t) for t in tensors)


def check_slot_indices(op: str, name: str, indices: torch.Tensor, num_slots: int, *, allow_pad: bool = True) -> None:
    """Slot indices must lie in [0, num_slots) (or be -1 = padding when allowed)."""
    if indices.numel() == 0 or not should_check_values(indices):
        return
    lo = int(indices.min())
    hi = int(indices.max())
    low_bound = -1 if allow_pad else 0
    if lo < low_bound or hi >= num_slots:
        pad = " or -1 (padding)" if allow_pad else ""
        raise IndexError(
            f"{op}: `{name}` has values in [{lo}, {hi}], must be in [0, {num_slots}){pad}"
        )


def check_cu_seqlens(op: str, name: str, cu_seqlens: torch.Tensor, total: int) -> None:
    """cu_seqlens[0] == 0, non-decreasing, cu_seqlens[-1] == total number of tokens."""
    if not should_check_values(cu_seqlens):
        return
    if cu_seqlens.numel() == 0:
        raise ValueError(f"{op}: `{name}` must have at least one entry (batch + 1)")
    first = int(cu_seqlens[0])
    last = int(cu_seqlens[-1])
    if first != 0:
        raise ValueError(f"{op}: `{name}` must start at 0, got {first}")
    if last != total:
        raise ValueError(f"{op}: `{name}` must end at the number of tokens ({total}), got {last}")
    if cu_seqlens.numel() > 1 and bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError(f"{op}: `{name}` must be non-decreasing, got {cu_seqlens.tolist()}")


def check_unique_slots(op: str, name: str, indices: torch.Tensor) -> None:
    """Non-padding slot indices must be distinct (two requests writing one slot is a bug)."""
    if indices.numel() < 2 or not should_check_values(indices):
        return
    valid = indices[indices >= 0]
    if valid.numel() != torch.unique(valid).numel():
        raise ValueError(f"{op}: `{name}` has repeated slot indices {indices.tolist()}")


def check_varlen_requests(op: str, cu_seqlens: torch.Tensor, state_indices: torch.Tensor,
                          has_initial_state: torch.Tensor) -> int:
    """Shapes and dtypes of a packed varlen batch's per-request tensors (``cu_seqlens [B + 1]``,
    ``state_indices [B]``, ``has_initial_state [B]`` bool); returns B. Shared by the varlen scans."""
    check_tensor(op, "cu_seqlens", cu_seqlens, ndim=1, dtypes=INDEX_DTYPES)
    if cu_seqlens.shape[0] < 1:
        raise ValueError(f"{op}: `cu_seqlens` must have batch + 1 >= 1 entries")
    batch = cu_seqlens.shape[0] - 1
    check_tensor(op, "state_indices", state_indices, dtypes=INDEX_DTYPES, shape=(batch,))
    check_tensor(op, "has_initial_state", has_initial_state, dtypes=(torch.bool,), shape=(batch,))
    return batch


def check_varlen_values(op: str, cu_seqlens: torch.Tensor, num_tokens: int, state_indices: torch.Tensor,
                        num_slots: int) -> None:
    """Values of a packed varlen batch (when value checks run): offsets cover the ``num_tokens``
    tokens, slots are in range and distinct."""
    check_cu_seqlens(op, "cu_seqlens", cu_seqlens, num_tokens)
    check_slot_indices(op, "state_indices", state_indices, num_slots)
    check_unique_slots(op, "state_indices", state_indices)


def check_intermediate_states(op: str, intermediate_states: torch.Tensor, batch: int, steps: int,
                              state_shape: Sequence[int]) -> None:
    """The per-step state buffer of a verify op: ``[>= batch, steps, *state_shape]`` (rows by batch row)."""
    if intermediate_states.shape[0] < batch or tuple(intermediate_states.shape[1:]) != (steps, *state_shape):
        expected = ", ".join(str(d) for d in (steps, *state_shape))
        raise ValueError(
            f"{op}: `intermediate_states` has shape {tuple(intermediate_states.shape)}, expected [>= {batch}, {expected}]"
        )


def names_of(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tree_parents(
    op: str, parents: torch.Tensor | None, batch: int, steps: int, *, has_intermediate: bool,
    disable_state_update: bool, fp8: bool,
) -> None:
    """``parent_indices`` of a speculative draft TREE verify (``[B, L]`` int32/int64; node ``t``'s
    recurrence starts from the state after node ``parents[b, t]``, ``-1`` = the slot's state; a
    chain is ``parents[b, t] = t - 1``). Parents come before their children (``-1 <= parent < t``),
    the per-node states go to the intermediate buffer (needed: a child reads its parent's there)
    and the slot's own state is left alone."""
    if parents is None:
        return
    check_tensor(op, "parent_indices", parents, ndim=2, dtypes=INDEX_DTYPES, shape=(batch, steps))
    if not has_intermediate:
        raise ValueError(f"{op}: `parent_indices` (a draft tree) needs the intermediate buffer: each node starts "
                         "from its parent's state there")
    if not disable_state_update:
        raise ValueError(f"{op}: `parent_indices` (a draft tree) needs disable_state_update=True: a tree has no "
                         "single final state to write back")
    if fp8:
        raise ValueError(f"{op}: `parent_indices` (a draft tree) is not supported with FP8 state buffers")
    if parents.numel() and should_check_values(parents):
        t = torch.arange(steps, device=parents.device)
        bad = ((parents < -1) | (parents >= t)).nonzero()
        if bad.numel():
            b, s = bad[0].tolist()
            raise ValueError(f"{op}: `parent_indices[{b}, {s}]` = {int(parents[b, s])}, must be in [-1, {s}) "
                             "(a parent precedes its children)")


def tree_start_states(initial: torch.Tensor, history: list[torch.Tensor], parents: torch.Tensor) -> torch.Tensor:
    """The state each row starts node ``t = len(history)`` from (plain-torch impls of the tree verify):
    ``initial[b]`` where ``parents[b] == -1``, else ``history[parents[b]][b]`` (the state stored
    after that node). ``initial``: ``[B, ...]``; ``history``: the states after nodes ``0 .. t-1``;
    ``parents``: ``[B]``."""
    stacked = torch.stack([initial, *history])  # [t + 1, B, ...]
    pick = (parents.to(torch.int64) + 1).to(initial.device)
    return stacked[pick, torch.arange(initial.shape[0], device=initial.device)]
