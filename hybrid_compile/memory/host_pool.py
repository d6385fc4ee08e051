"""HostPool: the host-memory copies of KV token slots and Mamba slots (the prefix cache's second tier).

The prefix cache (``cache/radix_cache.py``) writes the KV and the recurrent state of a node it
evicts from the device pools here, and loads them back into freshly allocated device slots when a
request hits the node again. This module only stores and moves bytes; which node lives where is
the tree's business.

Layout: for every slot-indexed device buffer of the :class:`~.kv_pool.KVPool` (K, V, FP8 scales;
slot dimension 1, or 2 for the scales) and of the :class:`~.mamba_pool.MambaPool` (conv windows,
SSM states, FP8 state scales; slot dimension 1) one host tensor with the slot dimension moved to
the front: ``[host_slots, *rest]``. A node's KV takes one contiguous range of host token slots
(:class:`RangeAllocator`, first fit, freed ranges coalesce), so the device -> host copy of a node is
one gather on the device plus one contiguous copy into pinned memory per buffer, and the load back
is one contiguous host -> device copy plus one scatter, with no host-side gather or scatter.

Streams (CUDA): a write (:meth:`HostPool.write_kv` / :meth:`~HostPool.write_mamba`) gathers and
copies on a side stream that first waits for the current stream (the slots hold what the last
forward wrote); the current stream then waits only for the gather, not for the copy to the host,
so the device slots can be reused at once while the transfer runs on. A load waits for the writes
still in flight (an event per write) and runs on the current stream, so the next forward sees the
loaded K/V and state in stream order, with no host sync. The side stream waits for the current
stream before every write, so a host range is never overwritten while a load from it is pending.
On the CPU every copy is a plain synchronous copy ("host" and "device" are two tensor pools).
"""

from __future__ import annotations

import bisect

import torch

from .allocator import SlotAllocator
from .kv_pool import KVPool
from .mamba_pool import MambaPool
from .sizing import available_device_memory

DEFAULT_HOST_FRACTION = 0.25  # of the available host memory, when no size is given
KV, MAMBA = 0, 1  # what a copy moves: KV token slots, Mamba slots (write_at / load_at)


class RangeAllocator:
    """Exact first-fit allocator of contiguous ranges of ``0 .. capacity - 1``.

    Free space is a sorted list of disjoint ``(start, length)`` ranges; freeing coalesces with
    its neighbours. ``alloc`` returns ``None`` (nothing changed) when no free range is long
    enough; freeing anything not handed out raises ValueError before any change.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"RangeAllocator: capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._starts: list[int] = [0] if capacity else []
        self._lens: list[int] = [capacity] if capacity else []
        self._free = capacity
        self._in_use = torch.zeros(capacity, dtype=torch.bool)

    def available(self) -> int:
        """Free slots in all ranges."""
        return self._free

    def largest_free(self) -> int:
        return max(self._lens, default=0)

    def used(self) -> int:
        return self.capacity - self._free

    def alloc(self, n: int) -> int | None:
        """Start of a free range of ``n`` slots (the lowest that fits), or ``None``."""
        if n <= 0:
            raise ValueError(f"RangeAllocator: cannot allocate {n} slots")
        for i, length in enumerate(self._lens):
            if length >= n:
                start = self._starts[i]
                if length == n:
                    del self._starts[i], self._lens[i]
                else:
                    self._starts[i] += n
                    self._lens[i] -= n
                self._free -= n
                self._in_use[start : start + n] = True
                return start
        return None

    def free(self, start: int, n: int) -> None:
        """Free ``start .. start + n - 1`` (any part of ranges handed out)."""
        if n <= 0 or start < 0 or start + n > self.capacity or not bool(self._in_use[start : start + n].all()):
            raise ValueError(f"RangeAllocator: cannot free [{start}, {start + n}): not allocated")
        self._in_use[start : start + n] = False
        self._free += n
        i = bisect.bisect_left(self._starts, start)
        if i > 0 and self._starts[i - 1] + self._lens[i - 1] == start:  # merge with the left range
            i -= 1
            self._lens[i] += n
        else:
            self._starts.insert(i, start)
            self._lens.insert(i, n)
        if i + 1 < len(self._starts) and self._starts[i] + self._lens[i] == self._starts[i + 1]:
            self._lens[i] += self._lens[i + 1]
            del self._starts[i + 1], self._lens[i + 1]


def _bits(t: torch.Tensor) -> torch.Tensor:
    # no CPU index_copy_ / index_select for float8: move its bits
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


class HostPool:
    """Host copies of KV token slots and Mamba slots (see the module docstring).

    Args:
        kv, mamba: the device pools whose slots are copied.
        kv_tokens: host KV token slots.
        mamba_slots: host Mamba slots.
        pin: pinned host memory (default: when the device pools are on CUDA).
    """

    def __init__(self, kv: KVPool, mamba: MambaPool, kv_tokens: int, mamba_slots: int, *, pin: bool | None = None) -> None:
        if kv_tokens < 0 or mamba_slots < 0:
            raise ValueError(f"HostPool: kv_tokens and mamba_slots must be >= 0, got {kv_tokens}, {mamba_slots}")
        self.device = kv.device
        self.cuda = self.device.type == "cuda"
        self.pin = self.cuda if pin is None else bool(pin)
        # (device buffer, its slot dimension, host buffer)
        self.kv_buffers = [(b, 1, self._host_like(b, 1, kv_tokens)) for b in (*kv.k_buffers, *kv.v_buffers)]
        self.kv_buffers += [(b, 2, self._host_like(b, 2, kv_tokens)) for b in kv.scale_buffers]
        self.mamba_buffers = [(b, 1, self._host_like(b, 1, mamba_slots)) for b in mamba._slot_buffers()]
        self.kv_allocator = RangeAllocator(kv_tokens)
        self.mamba_allocator = SlotAllocator(mamba_slots, name="host Mamba slot")
        self.bytes_per_token = kv.bytes_per_token
        self.bytes_per_mamba_slot = mamba.bytes_per_slot
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._pending: list = []  # (event, gathered device tensors kept alive until the copy ends)
        self.counters = dict.fromkeys(("write_bytes", "load_bytes", "writes", "loads"), 0)
        # told every copy with its host position (tensor parallelism: rank 0's step broadcaster, so that
        # the other ranks copy their shards' slots to and from the same positions: write_at / load_at)
        self.observer = None

    def refresh_device_buffers(self, kv: KVPool, mamba: MambaPool) -> None:
        """Point at the device pools' buffers again after elastic pools resized them (the host
        buffers do not depend on the device slot counts)."""
        devices = [*kv.k_buffers, *kv.v_buffers, *kv.scale_buffers]
        self.kv_buffers = [(b, dim, h) for b, (_, dim, h) in zip(devices, self.kv_buffers, strict=True)]
        self.mamba_buffers = [(b, dim, h) for b, (_, dim, h) in zip(mamba._slot_buffers(), self.mamba_buffers,
                                                                      strict=True)]

    @classmethod
    def from_budget(
        cls, kv: KVPool, mamba: MambaPool, budget_bytes: int | None = None, *, fraction: float | None = None,
        pin: bool | None = None,
    ) -> "HostPool":
        """A host pool of ``budget_bytes`` (default: ``fraction`` of the available host memory, by
        default :data:`DEFAULT_HOST_FRACTION`),
        split between KV tokens and Mamba slots in the device pools' proportion. Raises
        ValueError naming the option when the budget exceeds the available host memory or
        cannot hold one page of KV and one state."""
        available = available_device_memory("cpu")
        what = "prefix_cache_host_bytes"
        if budget_bytes is None:
            fraction = DEFAULT_HOST_FRACTION if fraction is None else fraction
            budget_bytes, what = int(available * fraction), f"prefix_cache_host_fraction ({fraction})"
        elif budget_bytes > available:
            raise ValueError(
                f"prefix_cache_host_bytes ({budget_bytes / 2**20:.1f} MiB) exceeds the available host memory "
                f"({available / 2**20:.1f} MiB)"
            )
        per_token, per_slot = kv.bytes_per_token, mamba.bytes_per_slot
        device_kv, device_mamba = kv.total() * per_token, mamba.total() * per_slot
        kv_share = device_kv / (device_kv + device_mamba) if device_kv + device_mamba else 1.0
        page = kv.page_size
        # (no attention layers: token slots are bookkeeping only, as many as the device pool's)
        tokens = int(budget_bytes * kv_share) // per_token // page * page if per_token else kv.total()
        slots = int(budget_bytes * (1 - kv_share)) // max(per_slot, 1) if per_slot else 0
        if (per_token and tokens < page) or (per_slot and slots < 1):
            raise ValueError(
                f"{what}: a host tier of {budget_bytes} bytes cannot hold one KV page ({page * per_token} bytes) "
                f"and one Mamba state ({per_slot} bytes) in the device pools' proportion"
            )
        return cls(kv, mamba, tokens, slots, pin=pin)

    def _host_like(self, buf: torch.Tensor, dim: int, n: int) -> torch.Tensor:
        shape = (n, *buf.shape[:dim], *buf.shape[dim + 1 :])
        return torch.zeros(shape, dtype=buf.dtype, device="cpu", pin_memory=self.pin)

    def nbytes(self) -> int:
        return sum(h.numel() * h.element_size() for _, _, h in (*self.kv_buffers, *self.mamba_buffers))

    def kv_capacity(self) -> int:
        return self.kv_allocator.capacity

    def mamba_capacity(self) -> int:
        return self.mamba_allocator.total()

    # -- device -> host ---------------------------------------------------------------
    def _write(self, buffers, dev_idx: torch.Tensor, host_start: int) -> None:
        n = dev_idx.numel()
        if not self.cuda:
            for buf, dim, host in buffers:
                _bits(host)[host_start : host_start + n].copy_(_bits(buf).index_select(dim, dev_idx).movedim(dim, 0))
            return
        current = torch.cuda.current_stream(self.device)
        idx = dev_idx.to(self.device, non_blocking=True)
        self._stream.wait_stream(current)  # the slots hold the last forward's writes; loads of this range are done
        with torch.cuda.stream(self._stream):
            gathered = [_bits(buf).index_select(dim, idx).movedim(dim, 0).contiguous() for buf, dim, _ in buffers]
            gather_done = torch.cuda.Event()
            gather_done.record(self._stream)
            for g, (_, _, host) in zip(gathered, buffers):
                _bits(host)[host_start : host_start + n].copy_(g, non_blocking=True)
            copy_done = torch.cuda.Event()
            copy_done.record(self._stream)
        current.wait_event(gather_done)  # the device slots may be reused after the gather only
        idx.record_stream(self._stream)
        self._pending.append((copy_done, gathered))
        self._poll()

    def _poll(self) -> None:
        """Drop the finished writes' gathered tensors (no sync: ``Event.query``)."""
        self._pending = [p for p in self._pending if not p[0].query()]

    def write_kv(self, dev_slots: torch.Tensor) -> int | None:
        """Copy these device KV slots (one node's, in order) to a fresh host range; its start,
        or ``None`` when no free host range is long enough."""
        start = self.kv_allocator.alloc(dev_slots.numel())
        if start is not None:
            self.write_at(KV, dev_slots, start)
        return start

    def write_mamba(self, dev_slot: int) -> int | None:
        """Copy one device Mamba slot to a fresh host slot; its index, or ``None`` when full."""
        got = self.mamba_allocator.alloc(1)
        if got is None:
            return None
        host_slot = int(got[0])
        self.write_at(MAMBA, torch.tensor([int(dev_slot)], dtype=torch.int64), host_slot)
        return host_slot

    def _of(self, kind: int) -> tuple[list, int]:
        """(the buffers, the bytes of one slot) that a copy of ``kind`` (:data:`KV` / :data:`MAMBA`) moves."""
        return (self.kv_buffers, self.bytes_per_token) if kind == KV else (self.mamba_buffers, self.bytes_per_mamba_slot)

    def write_at(self, kind: int, dev_idx: torch.Tensor, host_start: int) -> None:
        """Copy device slots ``dev_idx`` (``kind``: :data:`KV` token slots or :data:`MAMBA` slots) to
        the host positions from ``host_start`` on, which the caller allocated (the other ranks of a
        tensor-parallel engine: the positions rank 0's allocators chose)."""
        buffers, unit_bytes = self._of(kind)
        self._write(buffers, dev_idx, host_start)
        self.counters["writes"] += 1
        self.counters["write_bytes"] += dev_idx.numel() * unit_bytes
        if self.observer is not None:
            self.observer.host_write(kind, dev_idx, host_start)

    # -- host -> device ---------------------------------------------------------------
    def _load(self, buffers, host_start: int, dev_idx: torch.Tensor) -> None:
        n = dev_idx.numel()
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            self.wait_for_writes(current)  # maybe of this very range
            idx = dev_idx.to(self.device, non_blocking=True)
        else:
            idx = dev_idx
        for buf, dim, host in buffers:
            src = _bits(host)[host_start : host_start + n].to(self.device, non_blocking=True).movedim(0, dim)
            _bits(buf).index_copy_(dim, idx, src)

    def wait_for_writes(self, stream: "torch.cuda.Stream") -> None:
        """Make ``stream`` wait (on the device, no host sync) for every write still in flight: what
        a load does first (a benchmark timing the loads alone calls it before its start event)."""
        for done, _ in self._pending:
            stream.wait_event(done)

    def load_kv(self, host_start: int, dev_slots: torch.Tensor) -> None:
        """Copy the host range starting at ``host_start`` into these device KV slots."""
        self.load_at(KV, host_start, dev_slots)

    def load_mamba(self, host_slot: int, dev_slot: int) -> None:
        """Copy one host Mamba slot into a device Mamba slot."""
        self.load_at(MAMBA, int(host_slot), torch.tensor([int(dev_slot)], dtype=torch.int64))

    def load_at(self, kind: int, host_start: int, dev_idx: torch.Tensor) -> None:
        """Copy the host positions from ``host_start`` on into device slots ``dev_idx`` (``kind``:
        :data:`KV` or :data:`MAMBA`)."""
        buffers, unit_bytes = self._of(kind)
        self._load(buffers, host_start, dev_idx)
        self.counters["loads"] += 1
        self.counters["load_bytes"] += dev_idx.numel() * unit_bytes
        if self.observer is not None:
            self.observer.host_load(kind, host_start, dev_idx)

    def free_kv(self, start: int, n: int) -> None:
        self.kv_allocator.free(start, n)

    def free_mamba(self, slot: int) -> None:
        self.mamba_allocator.free([int(slot)])

    def synchronize(self) -> None:
        """Wait for every write in flight (tests, benchmarks)."""
        for done, _ in self._pending:
            done.synchronize()
        self._pending = []

    def summary(self) -> dict:
        return {
            "pinned": self.pin,
            "kv_tokens": self.kv_capacity(),
            "kv_tokens_free": self.kv_allocator.available(),
            "mamba_slots": self.mamba_capacity(),
            "mamba_slots_free": self.mamba_allocator.available(),
            "bytes": self.nbytes(),
            **self.counters,
        }


__all__ = ["HostPool", "KV", "MAMBA", "RangeAllocator"]
