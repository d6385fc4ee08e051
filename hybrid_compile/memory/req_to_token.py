"""Request-to-token and request-to-Mamba maps (SGLang's HybridReqToTokenPool).

Every running request holds one request slot ``r`` (1 .. max_running_requests):

- ``req_to_token[r, p]`` (int32, on the device) is the KV token slot of its position ``p``;
- ``req_to_mamba[r]`` (int32, on the device) is its Mamba slot, -1 when it has none.

Row 0 is reserved as the padding request (:attr:`ReqToTokenPool.PADDING_REQUEST`): its
``req_to_token`` row is all zeros (the dummy KV slot) and its ``req_to_mamba`` entry is -1
(skipped by every kernel), so padded rows of a CUDA-graph batch can point at it safely. Both
tensors therefore have ``max_running_requests + 1`` rows.

Host mirrors of both maps are kept in step, so the scheduler and the prefix cache can read
a request's token slots or Mamba slot without a device sync. Allocating a request slot also
allocates (and zeroes) its Mamba slot, atomically: either both succeed or ``alloc`` returns
``None`` and nothing changes. Freeing may hand the Mamba slot over to the caller (the prefix
cache keeps a finished request's final state) instead of freeing it.
"""

from __future__ import annotations

import torch

from .allocator import IndexLike, InvalidSlotError, SlotAllocator, as_index_tensor, repeat_counts, segment_arange
from .mamba_pool import MambaPool


class ReqToTokenPool:
    """Request slots with their token map and Mamba slot.

    Args:
        max_running_requests: request slots (excluding the padding row 0).
        max_context_len: positions per request (columns of ``req_to_token``).
        device: where ``req_to_token`` / ``req_to_mamba`` live.
        mamba_pool: if given, each request slot gets a Mamba slot from it on ``alloc``.
    """

    PADDING_REQUEST = 0

    def __init__(
        self,
        max_running_requests: int,
        max_context_len: int,
        *,
        device: torch.device | str = "cpu",
        mamba_pool: MambaPool | None = None,
    ) -> None:
        if max_running_requests < 1 or max_context_len < 1:
            raise ValueError(
                f"ReqToTokenPool: max_running_requests ({max_running_requests}) and max_context_len "
                f"({max_context_len}) must be >= 1"
            )
        self.max_running_requests = max_running_requests
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.mamba_pool = mamba_pool
        rows = max_running_requests + 1
        self.allocator = SlotAllocator(max_running_requests, first_index=1, name="request slot")
        self.req_to_token = torch.zeros((rows, max_context_len), dtype=torch.int32, device=self.device)
        self.req_to_mamba = torch.full((rows,), -1, dtype=torch.int32, device=self.device)
        self._req_to_token_host = torch.zeros((rows, max_context_len), dtype=torch.int32)
        self._req_to_mamba_host = torch.full((rows,), -1, dtype=torch.int64)

    # -- accounting ---------------------------------------------------------------------
    def total(self) -> int:
        return self.allocator.total()

    def available(self) -> int:
        """Request slots that can be allocated now (limited by free Mamba slots too)."""
        free = self.allocator.available()
        if self.mamba_pool is not None:
            free = min(free, self.mamba_pool.available())
        return free

    def nbytes(self) -> int:
        """Device bytes of ``req_to_token`` and ``req_to_mamba``."""
        return sum(t.numel() * t.element_size() for t in (self.req_to_token, self.req_to_mamba))

    # -- request slots ------------------------------------------------------------------
    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` request slots (CPU int64), each with a fresh zeroed Mamba slot when the pool
        has a Mamba pool; ``None`` (nothing allocated) if either runs short."""
        if self.mamba_pool is not None and self.mamba_pool.available() < n:
            return None
        reqs = self.allocator.alloc(n)
        if reqs is None or reqs.numel() == 0 or self.mamba_pool is None:
            return reqs
        mamba_slots = self.mamba_pool.alloc(n)
        assert mamba_slots is not None  # checked above
        self._set_mamba(reqs, mamba_slots)
        return reqs

    def free(self, req_slots: IndexLike, *, free_mamba: bool = True) -> torch.Tensor:
        """Free request slots. Their Mamba slots are freed too, unless ``free_mamba=False``:
        then they are detached and returned (the caller, e.g. the prefix cache, owns them).

        Returns the Mamba slots the requests held (CPU int64, -1 where a request had none).
        """
        reqs = self.allocator.check_allocated(req_slots, action="free")
        held = self._req_to_mamba_host[reqs].clone()
        if self.mamba_pool is not None and free_mamba:
            self.mamba_pool.free(held[held >= 0])
        if reqs.numel():
            self._set_mamba(reqs, torch.full_like(reqs, -1))
        self.allocator.free(reqs)
        return held

    def mamba_slots(self, req_slots: IndexLike) -> torch.Tensor:
        """Mamba slot of each request (CPU int64 from the host mirror, -1 = none)."""
        reqs = self.allocator.check_allocated(req_slots, action="read", unique=False)
        return self._req_to_mamba_host[reqs].clone()

    def set_mamba_slots(self, req_slots: IndexLike, mamba_slots: IndexLike) -> None:
        """Point requests at other Mamba slots (-1 detaches). The caller owns the previous
        slots (read them with :meth:`mamba_slots` first) and the new ones' allocation."""
        reqs = self.allocator.check_allocated(req_slots, action="update")
        slots = as_index_tensor(mamba_slots)
        if slots.numel() != reqs.numel():
            raise ValueError(f"set_mamba_slots: {reqs.numel()} requests but {slots.numel()} Mamba slots")
        if self.mamba_pool is None and bool((slots >= 0).any()):
            raise ValueError("set_mamba_slots: this pool has no Mamba pool")
        if self.mamba_pool is not None:
            attached = slots[slots >= 0]
            if attached.numel():
                self.mamba_pool.allocator.check_allocated(attached, action="attach")
        self._set_mamba(reqs, slots)

    def _set_mamba(self, reqs: torch.Tensor, slots: torch.Tensor) -> None:
        self._req_to_mamba_host[reqs] = slots
        self.req_to_mamba.index_copy_(
            0, reqs.to(self.device, non_blocking=True), slots.to(device=self.device, dtype=torch.int32, non_blocking=True)
        )

    # -- token map ----------------------------------------------------------------------
    def set_tokens(self, req_slot: int, start: int, token_slots: IndexLike) -> None:
        """``req_to_token[req_slot, start : start + len(token_slots)] = token_slots``."""
        self.set_tokens_batch([req_slot], [start], None, token_slots)

    def set_tokens_batch(
        self, req_slots: IndexLike, starts: IndexLike, lengths: IndexLike | None, token_slots: IndexLike
    ) -> None:
        """For each request ``i``: positions ``starts[i] .. starts[i] + lengths[i] - 1`` get the
        next ``lengths[i]`` entries of the packed ``token_slots`` (as returned by
        ``TokenSlotAllocator.alloc_extend``). ``lengths`` may be ``None`` for one request."""
        reqs = self.allocator.check_allocated(req_slots, action="write tokens of", unique=False)
        start = as_index_tensor(starts)
        values = as_index_tensor(token_slots)
        lens = torch.tensor([values.numel()], dtype=torch.int64) if lengths is None else as_index_tensor(lengths)
        if not (reqs.numel() == start.numel() == lens.numel()):
            raise ValueError(
                f"set_tokens_batch: req_slots ({reqs.numel()}), starts ({start.numel()}) and lengths "
                f"({lens.numel()}) must have one entry per request"
            )
        if int(lens.sum()) != values.numel():
            raise ValueError(f"set_tokens_batch: lengths sum to {int(lens.sum())} but {values.numel()} token slots given")
        if bool((start < 0).any()) or bool((lens < 0).any()) or bool((start + lens > self.max_context_len).any()):
            raise ValueError(
                f"set_tokens_batch: positions must lie in [0, max_context_len={self.max_context_len}); got starts "
                f"{start.tolist()[:8]} with lengths {lens.tolist()[:8]}"
            )
        if values.numel() == 0:
            return
        if bool((values < 0).any()) or bool((values > torch.iinfo(torch.int32).max).any()):
            raise InvalidSlotError("set_tokens_batch: token slots must be in [0, 2**31)")
        rows = repeat_counts(reqs, lens)
        cols = repeat_counts(start, lens) + segment_arange(lens)
        vals32 = values.to(torch.int32)
        flat = rows * self.max_context_len + cols
        # (index_copy_, not an advanced-index assignment: torch's CPU index kernel goes multi-threaded
        # from a few thousand entries, and in a process beside busy ranks its threads thrash: 4 ms
        # instead of 0.04 for a 4k-token prefill on a loaded 2-core machine)
        self._req_to_token_host.view(-1).index_copy_(0, flat, vals32)
        self.req_to_token.view(-1).index_copy_(
            0, flat.to(self.device, non_blocking=True), vals32.to(self.device, non_blocking=True)
        )

    def set_decode_tokens(
        self, req_slots: list[int], positions: list[int], token_slots: list[int], write_device: bool = True,
        steps: int = 1,
    ) -> None:
        """A decode step's :meth:`set_tokens_batch` (one token per request, distinct requests),
        checked on the host lists: ``req_to_token[req_slots[i], positions[i]] = token_slots[i]``.
        ``steps`` > 1: a uniform step of ``steps`` tokens per request (a verify step, an MTP
        proposal) in one call: ``positions[i]`` the first of request ``i``'s, ``token_slots``
        request-major (``[i * steps + j]`` at ``positions[i] + j``). ``write_device=False``: only
        the checks and the host mirror; the caller writes the device map itself (the
        ``uniform_step_metadata`` op of ``engine/forward_batch.py`` does, with the rest of the
        step's metadata)."""
        n = len(req_slots)
        if steps < 1 or not (n == len(positions) and n * steps == len(token_slots)):
            raise ValueError(
                f"set_decode_tokens: {n} request slots, {len(positions)} positions and {len(token_slots)} "
                f"token slots: need one of each per request ({steps} token slots per request, steps >= 1)"
            )
        if n == 0:
            return
        if min(positions) < 0 or max(positions) + steps > self.max_context_len:
            raise ValueError(f"set_decode_tokens: positions must lie in [0, max_context_len={self.max_context_len}); "
                             f"got {positions[:8]}" + (f" (+ {steps - 1} more each)" if steps > 1 else ""))
        if min(token_slots) < 0 or max(token_slots) > torch.iinfo(torch.int32).max:
            raise InvalidSlotError("set_decode_tokens: token slots must be in [0, 2**31)")
        self.allocator.check_allocated(list(req_slots), action="write tokens of", unique=True)
        width = self.max_context_len
        flat = [r * width + p + j for r, p in zip(req_slots, positions) for j in range(steps)]
        flat_t = torch.tensor(flat, dtype=torch.int64)
        vals32 = torch.tensor(token_slots, dtype=torch.int32)
        self._req_to_token_host.view(-1).index_copy_(0, flat_t, vals32)  # (see set_tokens_batch)
        if write_device:
            self.req_to_token.view(-1).index_copy_(0, flat_t.to(self.device, non_blocking=True),
                                                   vals32.to(self.device, non_blocking=True))

    def tokens(self, req_slot: int, end: int, start: int = 0) -> torch.Tensor:
        """Token slots of positions ``start .. end - 1`` of a request, from the host mirror
        (CPU int64 copy; no device sync). The device map is :attr:`req_to_token`."""
        req = self.allocator.check_allocated(req_slot, action="read tokens of")
        if not 0 <= start <= end <= self.max_context_len:
            raise ValueError(f"tokens: need 0 <= start ({start}) <= end ({end}) <= max_context_len ({self.max_context_len})")
        return self._req_to_token_host[int(req[0]), start:end].to(torch.int64)
