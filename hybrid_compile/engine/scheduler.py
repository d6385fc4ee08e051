"""Continuous-batching scheduler: which requests run in the next step, and with how many tokens.

Every step builds one mixed batch: each running request contributes its pending tokens
(one sampled token when decoding, the next chunk of its prompt while prefilling), then
waiting requests are admitted in arrival order while request slots, Mamba slots, KV slots
and the step's prefill-token budget (``chunked_prefill_size``) allow. Long prompts are
therefore prefilled in chunks, interleaved with other requests' decode steps.

Pools never grow. When the running requests need more KV slots than are free, the most
recently admitted request is retracted: its slots are freed and it goes back to the front
of the queue with its output so far, to be recomputed later (SGLang's ``retract_decode``).
Nothing is lost and no exception reaches the caller. To avoid thrashing, admission keeps a
reserve of KV slots for the decode tokens the running requests will still need, estimated as
``new_token_ratio`` x their remaining ``max_new_tokens``; the ratio jumps to 1 after a
retraction and decays back step by step (SGLang's ``new_token_ratio``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from ..layers.context import ForwardMode
from ..memory import MemoryPools
from .request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    """The requests of one step and their token counts (host-side)."""

    requests: list[Request]
    prefix_lens: list[int]
    extend_lens: list[int]
    out_cache_loc: torch.Tensor  # CPU int64 KV slots of the new tokens, packed
    mode: ForwardMode

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)


class Scheduler:
    INITIAL_NEW_TOKEN_RATIO = 0.5
    MIN_NEW_TOKEN_RATIO = 0.1
    NEW_TOKEN_RATIO_DECAY = 0.01

    def __init__(self, pools: MemoryPools, *, chunked_prefill_size: int, max_running_requests: int) -> None:
        self.pools = pools
        self.chunked_prefill_size = chunked_prefill_size
        self.max_running_requests = max_running_requests
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_retractions = 0
        self.new_token_ratio = self.INITIAL_NEW_TOKEN_RATIO

    # -- queue -----------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- resources -------------------------------------------------------------------------
    def _last_slots(self, reqs: list[Request]) -> torch.Tensor:
        """Slot of each request's last computed token (-1 if none): page continuation."""
        return torch.tensor(
            [int(r.kv_slots[-1]) if r.kv_slots.numel() else -1 for r in reqs], dtype=torch.int64
        )

    def _alloc_kv(self, reqs: list[Request], extend_lens: list[int]) -> torch.Tensor | None:
        prefix = [r.num_computed for r in reqs]
        return self.pools.kv.allocator.alloc_extend(prefix, extend_lens, self._last_slots(reqs))

    def release(self, request: Request) -> None:
        """Free everything a request holds (finish or retraction)."""
        if request.kv_slots.numel():
            self.pools.kv.allocator.free(request.kv_slots)
        if request.req_slot is not None:
            self.pools.req_to_token.free([request.req_slot])
        request.kv_slots = torch.zeros(0, dtype=torch.int64)
        request.req_slot = None
        request.mamba_slot = None
        request.num_computed = 0

    def _retract(self, request: Request) -> None:
        self.running.remove(request)
        self.release(request)
        request.num_retractions += 1
        self.num_retractions += 1
        self.new_token_ratio = 1.0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def finish(self, request: Request) -> None:
        self.running.remove(request)
        self.release(request)
        request.status = RequestStatus.FINISHED

    # -- one step --------------------------------------------------------------------------
    def _expected_new_tokens(self, r: Request) -> int:
        """KV slots a request is expected to take beyond what it holds (one per decode step)."""
        remaining = r.params.max_new_tokens - len(r.output)
        return max(1, int(self.new_token_ratio * remaining + 0.999))

    def _running_work(self) -> tuple[list[Request], list[int], int]:
        """Running requests of the next step with their token counts, and the budget left:
        decodes take one token; prefills take a chunk of the prefill budget."""
        budget = self.chunked_prefill_size
        reqs: list[Request] = []
        lens: list[int] = []
        for r in self.running:
            if r.pending == 1 and r.num_computed > 0:
                reqs.append(r)
                lens.append(1)
            elif budget > 0:
                n = min(r.pending, budget)
                budget -= n
                reqs.append(r)
                lens.append(n)
        return reqs, lens, budget

    def schedule(self) -> ScheduledBatch | None:
        # 1. running requests; while their KV does not fit, retract the newest and retry
        while True:
            reqs, lens, budget = self._running_work()
            slots = self._alloc_kv(reqs, lens) if reqs else torch.zeros(0, dtype=torch.int64)
            if slots is not None:
                break
            self._retract(max(self.running, key=lambda r: r.arrival))
        out = [slots]

        # 2. admit waiting requests while everything fits, keeping a reserve of KV slots for
        #    the decode tokens the running requests (and this one) are expected to need
        self.new_token_ratio = max(self.MIN_NEW_TOKEN_RATIO, self.new_token_ratio - self.NEW_TOKEN_RATIO_DECAY)
        reserve = sum(self._expected_new_tokens(r) for r in self.running)
        while self.waiting and budget > 0 and len(self.running) < self.max_running_requests:
            r = self.waiting[0]
            n = min(r.pending, budget)
            own = self._expected_new_tokens(r) + (r.pending - n)
            if self.pools.kv.allocator.available() < n + reserve + own:
                break
            req_slots = self.pools.req_to_token.alloc(1)
            if req_slots is None:
                break
            kv = self._alloc_kv([r], [n])
            if kv is None:
                self.pools.req_to_token.free(req_slots)
                break
            self.waiting.popleft()
            r.req_slot = int(req_slots[0])
            r.mamba_slot = int(self.pools.req_to_token.mamba_slots(req_slots)[0])
            r.status = RequestStatus.RUNNING
            self.running.append(r)
            reqs.append(r)
            lens.append(n)
            out.append(kv)
            budget -= n
            reserve += own

        if not reqs:
            return None
        out_cache_loc = torch.cat(out)
        offset = 0
        for r, n in zip(reqs, lens):
            # the slots belong to the request from now on (freed with it on finish/retraction)
            r.kv_slots = torch.cat([r.kv_slots, out_cache_loc[offset : offset + n]])
            offset += n
        prefix = [r.num_computed for r in reqs]
        decode = all(n == 1 for n in lens) and all(p > 0 for p in prefix)
        return ScheduledBatch(
            requests=reqs,
            prefix_lens=prefix,
            extend_lens=lens,
            out_cache_loc=out_cache_loc,
            mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
        )
