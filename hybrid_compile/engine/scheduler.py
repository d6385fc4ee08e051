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

With a prefix cache (:class:`~hybrid_compile.cache.HybridRadixCache`), admission starts a
request at its longest cached prefix that ends with a Mamba state (``match_prefix`` of its
tokens but the last, locked, state copied into the request's own slot); KV room counts the
cache's evictable tokens, and the cache is evicted before anything is retracted. A finished
request hands its KV and final state to the cache (exact at its full length; no chunk-boundary
checkpoints yet); a retracted one frees only its own slots and drops its lock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from ..cache import HybridRadixCache
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

    def __init__(
        self,
        pools: MemoryPools,
        *,
        chunked_prefill_size: int,
        max_running_requests: int,
        prefix_cache: HybridRadixCache | None = None,
    ) -> None:
        self.pools = pools
        self.cache = prefix_cache
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

    def _kv_room(self) -> int:
        """KV slots that can be had now: free ones plus what the prefix cache could evict."""
        room = self.pools.kv.allocator.available()
        if self.cache is not None:
            room += self.cache.evictable_size()
        return room

    def _make_room(self, reqs: list[Request], extend_lens: list[int]) -> None:
        """Evict cached prefixes until the KV of this extend fits (no-op without a cache)."""
        if self.cache is None or not reqs:
            return
        alloc = self.pools.kv.allocator
        pages = alloc.pages_needed([r.num_computed for r in reqs], extend_lens)
        self.cache.ensure_free(kv_tokens=pages * alloc.page_size)

    def _reset(self, request: Request) -> None:
        request.kv_slots = torch.zeros(0, dtype=torch.int64)
        request.req_slot = None
        request.mamba_slot = None
        request.num_computed = 0
        request.last_node = None
        request.cached_len = 0

    def release(self, request: Request) -> None:
        """Free everything a request holds (retraction; finish without a prefix cache). Slots
        of a matched prefix belong to the cache: only the request's lock on them is dropped."""
        own = request.kv_slots[request.cached_len :]
        if own.numel():
            self.pools.kv.allocator.free(own)
        if request.req_slot is not None:
            self.pools.req_to_token.free([request.req_slot])
        if self.cache is not None and request.last_node is not None:
            self.cache.dec_lock_ref(request.last_node)
        self._reset(request)

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
        if self.cache is None:
            self.release(request)
        else:
            # the tree takes the computed tokens' KV and the final recurrent state (exact: it is
            # the state after exactly num_computed tokens); the request slot is freed without it
            n = request.num_computed
            self.cache.cache_finished_req(
                request.token_ids(0, n), request.kv_slots[:n], request.last_node, request.mamba_slot, mamba_len=n
            )
            self.pools.req_to_token.free([request.req_slot], free_mamba=False)
            self._reset(request)
        request.status = RequestStatus.FINISHED

    # -- admission -------------------------------------------------------------------------
    def _admit(self, r: Request, budget: int, reserve: int) -> torch.Tensor | None:
        """Give a waiting request its request slot, Mamba slot and the KV slots of its first
        chunk (after the prefix-cache hit, whose KV and state it starts from); returns the new
        KV slots, or None (nothing held) when something does not fit."""
        match = None
        prefix = 0
        if self.cache is not None:
            # everything but the last token may come from the cache (its logits are needed);
            # a retracted request matches its prompt + output so far
            match = self.cache.match_prefix(r.token_ids(0, r.seq_len - 1))
            self.cache.inc_lock_ref(match.last_node)
            prefix = match.prefix_len
        pending = r.seq_len - prefix
        n = min(pending, budget)
        own = self._expected_new_tokens(r) + (pending - n)

        def give_up(req_slots=None):
            if req_slots is not None:
                self.pools.req_to_token.free(req_slots)
            if match is not None:
                self.cache.dec_lock_ref(match.last_node)
            self._reset(r)
            return None

        if self._kv_room() < n + reserve + own:
            return give_up()
        if self.cache is not None:
            self.cache.ensure_free(mamba_slots=1)
        req_slots = self.pools.req_to_token.alloc(1)
        if req_slots is None:
            return give_up()
        r.req_slot = int(req_slots[0])
        r.mamba_slot = int(self.pools.req_to_token.mamba_slots(req_slots)[0])
        if match is not None:
            r.num_computed = prefix
            r.kv_slots = match.kv_indices.clone()
            r.cached_len = prefix
            r.last_node = match.last_node
        self._make_room([r], [n])
        kv = self._alloc_kv([r], [n])
        if kv is None:
            return give_up(req_slots)
        if match is not None:
            self.cache.cow_mamba(match, r.mamba_slot)
            if prefix:
                self.pools.req_to_token.set_tokens(r.req_slot, 0, match.kv_indices)
        return kv

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
        # 1. running requests; while their KV does not fit, evict cached prefixes, then retract
        #    the newest and retry
        while True:
            reqs, lens, budget = self._running_work()
            self._make_room(reqs, lens)
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
            kv = self._admit(r, budget, reserve)
            if kv is None:
                break
            self.waiting.popleft()
            r.status = RequestStatus.RUNNING
            self.running.append(r)
            n = min(r.pending, budget)
            reqs.append(r)
            lens.append(n)
            out.append(kv)
            budget -= n
            reserve += self._expected_new_tokens(r) + (r.pending - n)

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
