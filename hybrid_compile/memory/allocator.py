"""Slot allocators: host-side bookkeeping of which pool slots are in use.

Two allocators, both exact (every slot is either free or handed out exactly once) and both
pure CPU bookkeeping — they never touch a device tensor, so allocating never syncs the GPU:

- :class:`SlotAllocator` hands out single indices from a contiguous range (request slots,
  Mamba slots, and the pages of the KV allocator). Free slots sit on a stack (LIFO reuse),
  and a bool "in use" mask catches double frees and frees of slots never handed out.
- :class:`TokenSlotAllocator` hands out KV token slots in whole pages of ``page_size``
  tokens: ``slot = page * page_size + offset``, and a request's token at position ``p``
  always sits at offset ``p % page_size`` of its page (the page-table layout of paged
  attention kernels). A request's tokens fill its last page before a new page is taken. A
  page goes back to the free pages when its last in-use token is freed. Page 0 (slots
  ``0 .. page_size-1``) is reserved: slot 0 is the dummy slot that padded tokens write to.

Running out is not an error: ``alloc*`` returns ``None`` and changes nothing, so the
scheduler can wait, evict the prefix cache or retract a request. Misuse is an error:
freeing a slot that is out of range, not in use, or named twice raises
:class:`InvalidSlotError` before any state changes.

Indices come back as CPU int64 tensors; pass CPU tensors (or ints / lists) to ``free``.
"""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np
import torch

IndexLike = Union[int, Sequence[int], torch.Tensor]


class InvalidSlotError(ValueError):
    """A slot index given to an allocator is out of range, not in use, or named twice."""


# frees of at most this many KV slots are checked on a host list (the common per-step case)
_FEW_SLOTS = 256

# The in-use flags are read and written with index_select / index_fill_ / index_copy_, not with
# advanced indexing (``flags[idx]``, ``flags[idx] = True``): torch's CPU index kernel goes
# multi-threaded from a few thousand indices, and beside busy processes (the other ranks of a
# tensor-parallel engine) its threads thrash: a prefill's 4,096 slots took ~3-4 ms that way on the
# loaded 2-core CPU machine against ~0.02 ms (memory/req_to_token.py does the same for its host map).


def as_index_tensor(indices: IndexLike) -> torch.Tensor:
    """Any int / sequence of ints / tensor -> 1-D CPU int64 tensor (a device tensor is copied)."""
    if isinstance(indices, torch.Tensor):
        t = indices.detach()
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"slot indices must be an integer tensor, got dtype {t.dtype}")
        return t.reshape(-1).to(device="cpu", dtype=torch.int64)
    if isinstance(indices, int):
        return torch.tensor([indices], dtype=torch.int64)
    return torch.as_tensor(list(indices), dtype=torch.int64).reshape(-1)


# Host index arithmetic of a step (allocation, the token map, the forward batch) goes through numpy:
# torch's CPU repeat_interleave with a tensor of counts runs an OpenMP parallel region per call (grain
# 1), which cost ~4 ms a call on a 16-core GPU host beside the CUDA driver's threads (cProfile of an
# extend step on an H200 host, 2026-11-30: 6 calls, 23 of the forward's 105 ms), 30 us here.


def repeat_counts(values, counts) -> torch.Tensor:
    """``values[i]`` repeated ``counts[i]`` times (host, int64): torch's ``repeat_interleave`` of
    1-D integer values without its per-call thread-pool region."""
    return torch.from_numpy(np.repeat(np.asarray(values, dtype=np.int64), np.asarray(counts, dtype=np.int64)))


def segment_arange(lengths) -> torch.Tensor:
    """Concatenation of ``arange(n)`` for every ``n`` in ``lengths`` (host, int64)."""
    lens = np.asarray(lengths, dtype=np.int64)
    total = int(lens.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    return torch.from_numpy(np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens))


class SlotAllocator:
    """Exact allocator of the indices ``first_index .. first_index + capacity - 1``.

    Args:
        capacity: number of indices that can be handed out.
        first_index: lowest index handed out; indices below it are reserved and never
            allocated (e.g. 1 to keep index 0 as a padding entry).
        name: what the slots are, used in error messages ("Mamba slot", "request slot").
        lowest_first: hand out the lowest free indices (the free stack kept sorted, O(free) per
            free) instead of the last freed: elastic pools shrink a pool from its top, which then
            stays free as long as the pool is not full (see :meth:`free_at_top`).
    """

    def __init__(self, capacity: int, *, first_index: int = 0, name: str = "slot", lowest_first: bool = False) -> None:
        if capacity < 0 or first_index < 0:
            raise ValueError(f"{name} allocator: capacity and first_index must be >= 0, got {capacity}, {first_index}")
        self.name = name
        self.first_index = first_index
        self.capacity = capacity
        self.end_index = first_index + capacity
        # Free indices form a stack: the top is self._free_stack[self._num_free - 1]. Lowest
        # indices are handed out first at the start; freed indices are reused first (LIFO).
        self._free_stack = torch.arange(self.end_index - 1, first_index - 1, -1, dtype=torch.int64)
        self._num_free = capacity
        self._in_use = torch.zeros(self.end_index, dtype=torch.bool)
        self.lowest_first = lowest_first

    def total(self) -> int:
        """Number of indices this allocator manages."""
        return self.capacity

    def available(self) -> int:
        """Number of indices free right now."""
        return self._num_free

    def used(self) -> int:
        return self.capacity - self._num_free

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` free indices (CPU int64, ascending on a fresh allocator), or ``None`` if fewer are free."""
        n = int(n)
        if n < 0:
            raise ValueError(f"{self.name} allocator: cannot allocate a negative number ({n}) of slots")
        if n > self._num_free:
            return None
        out = self._free_stack[self._num_free - n : self._num_free].flip(0)
        self._num_free -= n
        self._in_use.index_fill_(0, out, True)
        return out

    def free(self, indices: IndexLike) -> None:
        """Return indices to the free stack; raises InvalidSlotError on a bad or double free."""
        idx = as_index_tensor(indices)
        if idx.numel() == 0:
            return
        self.check_allocated(idx, action="free")
        self._release(idx)

    def _release(self, idx: torch.Tensor) -> None:
        """:meth:`free` of indices already checked (in range, in use, named once)."""
        self._in_use.index_fill_(0, idx, False)
        self._free_stack[self._num_free : self._num_free + idx.numel()] = idx.flip(0)
        self._num_free += idx.numel()
        if self.lowest_first:
            self._sort_free()

    def set_lowest_first(self) -> None:
        """From now on hand out the lowest free indices first (``lowest_first``)."""
        self.lowest_first = True
        self._sort_free()

    def _sort_free(self) -> None:
        # descending: the stack's top (its end) is the lowest free index
        self._free_stack[: self._num_free] = torch.sort(self._free_stack[: self._num_free], descending=True).values

    def is_allocated(self, indices: IndexLike) -> torch.Tensor:
        """Bool tensor: which of the (in-range) indices are in use."""
        idx = as_index_tensor(indices)
        self._check_range(idx, action="query")
        return self._in_use.index_select(0, idx)

    def check_allocated(self, indices: IndexLike, *, action: str = "use", unique: bool = True) -> torch.Tensor:
        """Raise InvalidSlotError unless every index is in range, in use and (if ``unique``)
        named once; returns the indices as a CPU int64 tensor."""
        if isinstance(indices, list) and indices:
            # host list (a step's few request slots): range and uniqueness in Python, one tensor op
            if (
                min(indices) >= self.first_index and max(indices) < self.end_index
                and (not unique or len(set(indices)) == len(indices))
            ):
                idx = torch.tensor(indices, dtype=torch.int64)
                if bool(self._in_use.index_select(0, idx).all()):
                    return idx
            # else the checks below name what is wrong
        idx = as_index_tensor(indices)
        self._check_range(idx, action=action)
        if idx.numel() == 0:
            return idx
        not_in_use = ~self._in_use.index_select(0, idx)
        if bool(not_in_use.any()):
            bad = idx[not_in_use][:8].tolist()
            raise InvalidSlotError(
                f"cannot {action} {self.name}(s) {bad}: not allocated (already freed, or never handed out)"
            )
        if unique and idx.numel() > 1:
            uniq, counts = torch.unique(idx, return_counts=True)
            if bool((counts > 1).any()):
                dup = uniq[counts > 1][:8].tolist()
                raise InvalidSlotError(f"cannot {action} {self.name}(s) {dup}: named more than once in one call")
        return idx

    def free_at_top(self) -> int:
        """How many of the highest indices are free in a row (what :meth:`resize` can take away)."""
        used = torch.nonzero(self._in_use[self.first_index : self.end_index]).reshape(-1)
        return self.capacity - (int(used[-1]) + 1 if used.numel() else 0)

    def resize(self, capacity: int) -> None:
        """Grow to ``capacity`` indices (the new ones free) or shrink to it (the indices taken away
        must be free: :meth:`free_at_top`); every index in use keeps its number. Elastic pools."""
        if capacity < 0:
            raise ValueError(f"{self.name} allocator: capacity must be >= 0, got {capacity}")
        if capacity < self.capacity and self.free_at_top() < self.capacity - capacity:
            raise ValueError(
                f"{self.name} allocator: cannot shrink to {capacity}: only the top {self.free_at_top()} "
                "indices are free"
            )
        end = self.first_index + capacity
        free = self._free_stack[: self._num_free]
        free = free[free < end]
        if capacity > self.capacity:  # the new indices go under the free stack (freed ones stay first)
            free = torch.cat([torch.arange(end - 1, self.end_index - 1, -1, dtype=torch.int64), free])
        self._free_stack = torch.empty(capacity, dtype=torch.int64)
        self._free_stack[: free.numel()] = free
        self._num_free = free.numel()
        if self.lowest_first:
            self._sort_free()
        in_use = torch.zeros(end, dtype=torch.bool)
        keep = min(end, self.end_index)
        in_use[:keep] = self._in_use[:keep]
        self._in_use = in_use
        self.capacity, self.end_index = capacity, end

    def _check_range(self, idx: torch.Tensor, *, action: str) -> None:
        if idx.numel() == 0:
            return
        bad = (idx < self.first_index) | (idx >= self.end_index)
        if bool(bad.any()):
            raise InvalidSlotError(
                f"cannot {action} {self.name}(s) {idx[bad][:8].tolist()}: out of range "
                f"[{self.first_index}, {self.end_index})"
            )


class TokenSlotAllocator:
    """Exact allocator of KV token slots in pages of ``page_size`` tokens.

    Slots ``0 .. page_size - 1`` (page 0) are reserved; slot :attr:`PADDING_SLOT` (0) is where
    padded tokens write their K/V. Usable slots are ``page_size .. (num_pages + 1) * page_size - 1``.

    Args:
        num_pages: usable pages (excluding the reserved page 0).
        page_size: tokens per page (1 = token-granular allocation).
    """

    PADDING_SLOT = 0

    def __init__(self, num_pages: int, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"KV allocator: page_size must be >= 1, got {page_size}")
        if num_pages < 0:
            raise ValueError(f"KV allocator: num_pages must be >= 0, got {num_pages}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_slots = (num_pages + 1) * page_size
        self._pages = SlotAllocator(num_pages, first_index=1, name="KV page")
        self._in_use = torch.zeros(self.num_slots, dtype=torch.bool)
        self._num_used = 0

    # -- accounting ---------------------------------------------------------------------
    def total(self) -> int:
        """Usable token slots (excluding the reserved page 0)."""
        return self.num_pages * self.page_size

    def available(self) -> int:
        """Token slots in free pages (what fresh allocations can still get)."""
        return self._pages.available() * self.page_size

    def available_pages(self) -> int:
        return self._pages.available()

    def used(self) -> int:
        """Token slots handed out and not yet freed."""
        return self._num_used

    def is_allocated(self, slots: IndexLike) -> torch.Tensor:
        idx = as_index_tensor(slots)
        self._check_range(idx, action="query")
        return self._in_use.index_select(0, idx)

    def pages_needed(self, prefix_lens: IndexLike, extend_lens: IndexLike) -> int:
        """Fresh pages :meth:`alloc_extend` would take for these requests."""
        prefix, extend = self._lens(prefix_lens, extend_lens)
        _, fresh = self._split_in_page(prefix, extend)
        return int(((fresh + self.page_size - 1) // self.page_size).sum())

    # -- allocation ---------------------------------------------------------------------
    def alloc(self, n: int) -> torch.Tensor | None:
        """Slots for positions ``0 .. n-1`` of a new sequence (fresh pages), or ``None``."""
        return self.alloc_extend([0], [int(n)])

    def alloc_decode(self, seq_lens: IndexLike, last_slots: IndexLike | None = None) -> torch.Tensor | None:
        """One slot per request for the token at position ``seq_lens[i]``; see :meth:`alloc_extend`."""
        seq = as_index_tensor(seq_lens)
        return self.alloc_extend(seq, torch.ones_like(seq), last_slots)

    def alloc_extend(
        self, prefix_lens: IndexLike, extend_lens: IndexLike, last_slots: IndexLike | None = None
    ) -> torch.Tensor | None:
        """Slots for positions ``prefix_lens[i] .. prefix_lens[i] + extend_lens[i] - 1`` of each request.

        Args:
            prefix_lens: ``[B]`` tokens each request already holds (0 for a new request).
            extend_lens: ``[B]`` new tokens per request.
            last_slots: ``[B]`` slot of each request's token at position ``prefix_lens[i] - 1``.
                Needed only for requests whose prefix ends inside a page (``prefix_lens[i] %
                page_size != 0``): their new tokens first fill that page. Other entries are
                ignored (pass -1); with ``page_size == 1`` it may be ``None``.

        Returns:
            The slots of all new tokens, packed request after request (CPU int64,
            ``sum(extend_lens)`` long), or ``None`` (nothing allocated) if not enough pages are free.
        """
        if self.page_size == 1 and isinstance(prefix_lens, list) and isinstance(extend_lens, list):
            return self._alloc_extend_token_pages(prefix_lens, extend_lens)
        prefix, extend = self._lens(prefix_lens, extend_lens)
        ps = self.page_size
        in_page, fresh = self._split_in_page(prefix, extend)
        pages_per_req = (fresh + ps - 1) // ps
        pages_needed = int(pages_per_req.sum()) if pages_per_req.numel() else 0
        if pages_needed > self._pages.available():
            return None

        # Tokens that continue a request's partly filled last page: validate before changing state.
        continuing = in_page > 0
        cont_slots = torch.zeros(0, dtype=torch.int64)
        if bool(continuing.any()):
            if last_slots is None:
                raise ValueError(
                    "KV allocator: `last_slots` is required when a request's prefix ends inside a page "
                    f"(page_size={ps}, prefix_lens={prefix[continuing][:8].tolist()})"
                )
            last = as_index_tensor(last_slots)
            if last.numel() != prefix.numel():
                raise ValueError(f"KV allocator: `last_slots` has {last.numel()} entries, expected {prefix.numel()}")
            last_cont = last[continuing]
            self._check_range(last_cont, action="extend from")
            held = self._in_use.index_select(0, last_cont)
            if not bool(held.all()):
                bad = last_cont[~held][:8].tolist()
                raise InvalidSlotError(f"cannot extend from KV slot(s) {bad}: not allocated")
            misaligned = (last_cont % ps) != ((prefix[continuing] - 1) % ps)
            if bool(misaligned.any()):
                raise InvalidSlotError(
                    f"KV slot(s) {last_cont[misaligned][:8].tolist()} cannot hold position(s) "
                    f"{(prefix[continuing] - 1)[misaligned][:8].tolist()}: a position p must sit at page offset "
                    f"p % page_size ({ps})"
                )
            n_cont = in_page[continuing]
            cont_slots = repeat_counts(last_cont, n_cont) + 1 + segment_arange(n_cont)
            taken = self._in_use.index_select(0, cont_slots)
            if bool(taken.any()) or torch.unique(cont_slots).numel() != cont_slots.numel():
                bad = cont_slots[taken][:8].tolist() if bool(taken.any()) else cont_slots[:8].tolist()
                raise InvalidSlotError(
                    f"cannot continue a page into KV slot(s) {bad}: already in use (is the page shared with "
                    "another request or the prefix cache? shared prefixes must end on a page boundary)"
                )

        pages = self._pages.alloc(pages_needed)
        assert pages is not None  # checked above
        fresh_total = int(fresh.sum()) if fresh.numel() else 0
        if fresh_total:
            # Slots of every new page in order; request i owns pages_per_req[i] consecutive pages
            # and uses their first fresh[i] slots.
            page_slots = (pages[:, None] * ps + torch.arange(ps, dtype=torch.int64)).reshape(-1)
            owner_span = pages_per_req * ps
            within = segment_arange(owner_span)
            keep = within < repeat_counts(fresh, owner_span)
            fresh_slots = page_slots[keep]
        else:
            fresh_slots = torch.zeros(0, dtype=torch.int64)

        # Pack: request i's continuing tokens, then its fresh ones.
        total = int(extend.sum()) if extend.numel() else 0
        out = torch.empty(total, dtype=torch.int64)
        req_start = torch.cumsum(extend, 0) - extend
        if cont_slots.numel():
            n_cont = in_page[continuing]
            out.index_copy_(0, repeat_counts(req_start[continuing], n_cont) + segment_arange(n_cont), cont_slots)
        if fresh_total:
            out.index_copy_(0, repeat_counts(req_start + in_page, fresh) + segment_arange(fresh), fresh_slots)
        self._in_use.index_fill_(0, out, True)
        self._num_used += total
        return out

    def _alloc_extend_token_pages(self, prefix_lens: list[int], extend_lens: list[int]) -> torch.Tensor | None:
        """:meth:`alloc_extend` with ``page_size == 1`` from host lists (every decode step): each
        token is a fresh page of its own, so the slots are the pages taken, packed in order."""
        if len(prefix_lens) != len(extend_lens):
            raise ValueError(
                f"KV allocator: prefix_lens ({len(prefix_lens)}) and extend_lens ({len(extend_lens)}) differ in length"
            )
        if prefix_lens and min(min(prefix_lens), min(extend_lens)) < 0:
            raise ValueError("KV allocator: prefix_lens and extend_lens must be >= 0")
        total = sum(extend_lens)
        out = self._pages.alloc(total)
        if out is None:
            return None
        self._in_use.index_fill_(0, out, True)
        self._num_used += total
        return out

    def free(self, slots: IndexLike) -> None:
        """Free token slots; a page returns to the free pages once none of its slots is in use."""
        idx = as_index_tensor(slots)
        n = idx.numel()
        if n == 0:
            return
        # a step's few slots (every verify step frees its rejected drafts' slots): range and
        # uniqueness on the host list, one tensor op; anything else, or a bad free, the checks below
        fine = False
        if n <= _FEW_SLOTS:
            vals = idx.tolist()
            fine = min(vals) >= self.page_size and max(vals) < self.num_slots and len(set(vals)) == n \
                and bool(self._in_use.index_select(0, idx).all())
        if not fine:
            self._check_range(idx, action="free")
            not_in_use = ~self._in_use.index_select(0, idx)
            if bool(not_in_use.any()):
                raise InvalidSlotError(
                    f"cannot free KV slot(s) {idx[not_in_use][:8].tolist()}: not allocated (already freed, or never handed out)"
                )
            if n > 1:
                uniq, counts = torch.unique(idx, return_counts=True)
                if bool((counts > 1).any()):
                    raise InvalidSlotError(
                        f"cannot free KV slot(s) {uniq[counts > 1][:8].tolist()}: named more than once in one call"
                    )
        self._in_use.index_fill_(0, idx, False)
        self._num_used -= n
        if self.page_size == 1:
            self._pages._release(idx)  # (each slot its own page: checked above)
            return
        pages = torch.unique(idx // self.page_size)
        empty = ~self._in_use.view(-1, self.page_size)[pages].any(dim=1)
        self._pages.free(pages[empty])

    def free_pages_at_top(self) -> int:
        return self._pages.free_at_top()

    def resize(self, num_pages: int) -> None:
        """Grow or shrink to ``num_pages`` usable pages (shrinking takes free pages off the top
        only: :meth:`free_pages_at_top`); slots in use keep their numbers. Elastic pools."""
        self._pages.resize(num_pages)
        self.num_pages = num_pages
        self.num_slots = (num_pages + 1) * self.page_size
        in_use = torch.zeros(self.num_slots, dtype=torch.bool)
        keep = min(self.num_slots, self._in_use.numel())
        in_use[:keep] = self._in_use[:keep]
        self._in_use = in_use

    # -- helpers ------------------------------------------------------------------------
    def _lens(self, prefix_lens: IndexLike, extend_lens: IndexLike) -> tuple[torch.Tensor, torch.Tensor]:
        prefix = as_index_tensor(prefix_lens)
        extend = as_index_tensor(extend_lens)
        if prefix.numel() != extend.numel():
            raise ValueError(
                f"KV allocator: prefix_lens ({prefix.numel()}) and extend_lens ({extend.numel()}) differ in length"
            )
        if bool((prefix < 0).any()) or bool((extend < 0).any()):
            raise ValueError("KV allocator: prefix_lens and extend_lens must be >= 0")
        return prefix, extend

    def _split_in_page(self, prefix: torch.Tensor, extend: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per request: tokens that go into its current last page, and tokens needing fresh pages."""
        offset = prefix % self.page_size
        room = torch.where(offset > 0, self.page_size - offset, torch.zeros_like(offset))
        in_page = torch.minimum(room, extend)
        return in_page, extend - in_page

    def _check_range(self, idx: torch.Tensor, *, action: str) -> None:
        if idx.numel() == 0:
            return
        bad = (idx < self.page_size) | (idx >= self.num_slots)
        if bool(bad.any()):
            raise InvalidSlotError(
                f"cannot {action} KV slot(s) {idx[bad][:8].tolist()}: out of range [{self.page_size}, "
                f"{self.num_slots}) (page 0 is the reserved padding page)"
            )
