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
request hands its KV and final state to the cache (exact at its full length); a retracted one
frees only its own slots and drops its lock. Prefills checkpoint their state at chunk-aligned
lengths (the cache's policy says where: :meth:`Scheduler._checkpoint_len`):
the step's :class:`ScheduledBatch` carries the slots the layer ops track into, and
:meth:`Scheduler.commit_checkpoints` hands them to the cache after the forward, so a long
prompt's first chunks are reusable while it still runs. Requests that arrive together and share
a prefix the tree does not hold yet (no branch point is known before one of them is cached) are
not prefilled side by side: the first is admitted and checkpoints at the last chunk boundary of
the shared part (its ``branching_len``); the others wait in the queue (later arrivals may pass
them) until that state is cached, then start from it (:meth:`Scheduler._wait_for_shared_prefix`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from ..cache import HybridRadixCache, NullPrefixCache
from ..layers.context import ForwardMode
from ..memory import MemoryPools
from .request import Request, RequestStatus

WAIT_FOR_SHARED_PREFIX = "wait_for_shared_prefix"  # Scheduler._admit: admit the request in a later step


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (slice compares: C speed)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class ScheduledBatch:
    """The requests of one step and their token counts (host-side)."""

    requests: list[Request]
    prefix_lens: list[int]
    extend_lens: list[int]
    out_cache_loc: torch.Tensor  # CPU int64 KV slots of the new tokens, packed
    mode: ForwardMode
    # prefix-cache checkpoints inside the extend, per request (None: none this step): a fresh
    # Mamba slot (-1 = none) and the new tokens before the checkpoint (-1 = none)
    track_slots: list[int] | None = None
    track_lens: list[int] | None = None
    # a DECODE step's input ids already on the device (int64 [B]: the tokens the step before
    # sampled, not yet appended to the requests; engine overlap), or None: from the requests
    input_ids: torch.Tensor | None = None
    # a mixed EXTEND step: requests [start, end) decode one token each, after the prefills
    # (ForwardMetadata.decode_rows: the layer ops run them through their decode path)
    decode_rows: tuple[int, int] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)


def _decodes_last(reqs: list[Request], lens: list[int], slots: torch.Tensor):
    """A mixed step's requests reordered prefills first, decoding requests after them (each keeping
    its KV slots), so that the layer ops take the decode rows as one DECODE part:
    ``(requests, lengths, slots, (first decode row, end))``."""
    ends = torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()
    pieces = [slots[e - n: e] for e, n in zip(ends, lens)]
    order = [i for i, r in enumerate(reqs) if not r.decoding] + [i for i, r in enumerate(reqs) if r.decoding]
    first = sum(1 for r in reqs if not r.decoding)
    return ([reqs[i] for i in order], [lens[i] for i in order], torch.cat([pieces[i] for i in order]),
            (first, len(reqs)))


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
        prefix_cache: HybridRadixCache | NullPrefixCache | None = None,
        decode_checkpoint_interval: int = 0,
        split_mixed_steps: bool = True,
    ) -> None:
        self.pools = pools
        # a mixed step's decoding requests packed after its prefill chunks, as its decode rows (the
        # layer ops' decode paths run them: ForwardMetadata.mixed_parts); False: in running order, run
        # through the extend paths with the prefills (EngineConfig.extra["split_mixed_steps"])
        self.split_mixed_steps = split_mixed_steps
        # None: no prefix cache (a NullPrefixCache: one code path); its policy places checkpoints
        self.cache = prefix_cache if prefix_cache is not None else NullPrefixCache(pools)
        self.decode_checkpoint_interval = decode_checkpoint_interval  # 0: no decode checkpoints
        # checkpoints of the last scheduled step, committed to the cache after its forward: the
        # batch and its (request, sequence length, tracked Mamba slot or None = fork the request's slot)
        self._pending_checkpoints: tuple[ScheduledBatch | None, list[tuple[Request, int, int | None]]] = (None, [])
        # what engine.stats()["prefix_cache"] adds to the cache's own counters (admitted requests only:
        # a request that waits is matched again on every attempt)
        self.cache_counters = dict(admitted_requests=0, admitted_tokens=0, admitted_hit_tokens=0,
                                   checkpoints_tracked=0, checkpoints_forked=0, checkpoints_skipped=0,
                                   admissions_held=0)
        self.chunked_prefill_size = chunked_prefill_size
        self.max_running_requests = max_running_requests
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_retractions = 0
        # elastic pools (engine/elastic.py): asked for KV before a retraction / a refused admission,
        # and for a Mamba slot when one is missing; None: the split is fixed
        self.elastic = None
        self.new_token_ratio = self.INITIAL_NEW_TOKEN_RATIO

    # -- queue -----------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- resources -------------------------------------------------------------------------
    def _last_slots(self, reqs: list[Request]) -> torch.Tensor | None:
        """Slot of each request's last computed token (-1 if none): page continuation (None with
        pages of one token: nothing continues a page)."""
        if self.pools.kv.allocator.page_size == 1:
            return None
        return torch.tensor(
            [int(r.kv_slots[-1]) if r.kv_slots.numel() else -1 for r in reqs], dtype=torch.int64
        )

    def _alloc_kv(self, reqs: list[Request], extend_lens: list[int]) -> torch.Tensor | None:
        prefix = [r.num_computed for r in reqs]
        return self.pools.kv.allocator.alloc_extend(prefix, extend_lens, self._last_slots(reqs))

    def _kv_room(self) -> int:
        """KV slots that can be had now: free ones plus what the prefix cache could evict."""
        return self.pools.kv.allocator.available() + self.cache.evictable_size()

    def _make_room(self, reqs: list[Request], extend_lens: list[int]) -> None:
        """Evict cached prefixes until the KV of this extend fits (no-op when nothing is evictable,
        e.g. without a cache)."""
        if not reqs or not self.cache.evictable_size():
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
        request.branching_len = None

    def release(self, request: Request) -> None:
        """Free everything a request holds (retraction, abort, roll-back). Slots of a matched
        prefix belong to the cache: only the request's lock on them is dropped."""
        own = request.kv_slots[request.cached_len :]
        if own.numel():
            self.pools.kv.allocator.free(own)
        if request.req_slot is not None:
            self.pools.req_to_token.free([request.req_slot])
        if request.last_node is not None:
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

    def free_uncomputed_kv(self, requests: list[Request]) -> None:
        """Free each request's KV slots past its ``num_computed`` tokens (a verify step's rejected
        drafts, or all its drafts when it failed before its commit); one free for the batch."""
        rejected = []
        for r in requests:
            if r.kv_slots.numel() > r.num_computed:
                rejected.append(r.kv_slots[r.num_computed:])
                r.kv_slots = r.kv_slots[: r.num_computed]
        if rejected:  # (last request first: the free stack ends as after one free per request in order)
            self.pools.kv.allocator.free(torch.cat(rejected[::-1]) if len(rejected) > 1 else rejected[0])

    def requeue(self, requests: list[Request]) -> None:
        """Send the requests of a step that failed before its commit back to be recomputed (the
        engine's roll-back): everything they hold is freed (:meth:`release`: the step's KV slots
        too), checkpoints planned for the step are dropped, and they return to the front of the
        queue in arrival order with their output so far, like a retraction (but not counted as
        one). Idempotent: a request already back in the queue holds nothing."""
        self._drop_pending_checkpoints()
        for r in sorted(requests, key=lambda r: r.arrival, reverse=True):
            if r in self.running:
                self.running.remove(r)
            if r in self.waiting:
                self.waiting.remove(r)
            self.release(r)
            r.status = RequestStatus.WAITING
            self.waiting.appendleft(r)

    def abort(self, request: Request) -> None:
        """Drop a waiting or running request between steps: its slots freed, its lock released."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.release(request)
        request.status = RequestStatus.FINISHED

    def finish(self, request: Request) -> None:
        self.running.remove(request)
        # the tree takes the computed tokens' KV and the final recurrent state (exact: it is
        # the state after exactly num_computed tokens); the request slot is freed without it
        n = request.num_computed
        self.cache.cache_finished_req(
            request.token_ids(0, n), request.kv_slots[:n], request.last_node, request.mamba_slot, mamba_len=n
        )
        self.pools.req_to_token.free([request.req_slot], free_mamba=False)
        self._reset(request)
        request.status = RequestStatus.FINISHED

    def fork(self, parent: Request, child: Request) -> bool:
        """Start ``child`` (the same prompt, nothing generated) as a running request from copies of
        ``parent``'s KV and recurrent state after its ``num_computed`` tokens (``n > 1``: the prompt
        is prefilled once). KV of a prefix the cache holds is shared under a lock (as a prefix-cache
        hit); the rest is copied into the child's own slots, and the state into its own Mamba slot
        (``MambaPool.copy_slots``, the cache's copy-on-write). False, changing nothing, when the
        child does not fit now (it is then prefilled by itself)."""
        n = parent.num_computed
        shared = parent.cached_len
        page = self.pools.kv.allocator.page_size
        if shared % page:
            raise AssertionError(f"a cached prefix of {shared} tokens is not a whole number of pages of {page}")
        if len(self.running) >= self.max_running_requests or \
                self._kv_room() < n - shared + self._expected_new_tokens(child):
            return False
        self.cache.ensure_free(mamba_slots=1)
        req_slots = self.pools.req_to_token.alloc(1)
        if req_slots is None:
            return False
        child.req_slot = int(req_slots[0])
        child.mamba_slot = int(self.pools.req_to_token.mamba_slots(req_slots)[0])
        child.kv_slots = parent.kv_slots[:shared].clone()
        child.num_computed = shared
        self.cache.inc_lock_ref(parent.last_node)
        child.last_node, child.cached_len = parent.last_node, shared
        self._make_room([child], [n - shared])
        kv = self._alloc_kv([child], [n - shared])
        if kv is None:
            self.release(child)
            return False
        self.pools.kv.copy_slots(parent.kv_slots[shared:n], kv)
        self.pools.mamba.copy_slots([parent.mamba_slot], [child.mamba_slot])
        child.kv_slots = torch.cat([child.kv_slots, kv])
        child.num_computed = n
        self.pools.req_to_token.set_tokens(child.req_slot, 0, child.kv_slots)
        child.status = RequestStatus.RUNNING
        self.running.append(child)
        return True

    # -- admission -------------------------------------------------------------------------
    def _wait_for_shared_prefix(self, r: Request, prefix: int) -> bool:
        """Whether waiting request ``r`` should wait because a running request that shares a longer
        aligned prefix with it (a branch point the tree cannot know yet: neither is cached) has not
        computed that prefix yet. If so, that request checkpoints its state at the branch point
        (its ``branching_len``, Marconi's speculative branch point) and ``r`` is admitted once it is
        cached, skipping it instead of recomputing it in parallel."""
        if not self.cache.policy.waits_for_shared_prefix:
            return False
        align = self.cache.mamba_align
        tokens = r.token_ids(0, r.seq_len - 1)
        for other in self.running:
            if other.num_computed >= len(other.prompt) or other.prompt[:align] != tokens[:align]:
                continue
            shared = common_prefix_len(tokens, other.prompt)
            point = self.cache.page_floor(shared - shared % align)
            if point - prefix < align or point <= other.num_computed:
                continue
            if other.branching_len not in (None, point) and other.branching_len > other.num_computed:
                continue  # it checkpoints at another branch point first
            other.branching_len = point
            return True
        return False

    def _admit(self, r: Request, budget: int, reserve: int) -> torch.Tensor | None | str:
        """Give a waiting request its request slot, Mamba slot and the KV slots of its first
        chunk (after the prefix-cache hit, whose KV and state it starts from); returns the new
        KV slots, None (nothing held) when something does not fit, or ``WAIT_FOR_SHARED_PREFIX``
        when a running request is about to cache a longer prefix of it
        (:meth:`_wait_for_shared_prefix`)."""
        # everything but the last token may come from the cache (its logits are needed);
        # a retracted request matches its prompt + output so far
        match = self.cache.match_prefix(r.token_ids(0, r.seq_len - 1))
        if self._wait_for_shared_prefix(r, match.prefix_len):
            self.cache_counters["admissions_held"] += 1
            self._reset(r)
            return WAIT_FOR_SHARED_PREFIX
        self.cache.inc_lock_ref(match.last_node)
        prefix = match.prefix_len
        pending = r.seq_len - prefix
        n = self._chunk_len(prefix, pending, budget)
        own = self._expected_new_tokens(r) + (pending - n)

        def give_up(req_slots=None):
            if req_slots is not None:
                self.pools.req_to_token.free(req_slots)
            self.cache.dec_lock_ref(match.last_node)
            self._reset(r)
            return None

        if n == 0:  # the budget left does not reach the next checkpoint boundary: next step
            return give_up()
        short = n + reserve + own - self._kv_room()
        if short > 0 and self.elastic is not None and self.elastic.grow_kv(short):  # free Mamba slots -> KV
            short = n + reserve + own - self._kv_room()
        if short > 0:
            return give_up()
        self.cache.ensure_free(mamba_slots=1)
        if self.pools.mamba.available() == 0 and self.elastic is not None:
            self.elastic.grow_mamba(1)
        req_slots = self.pools.req_to_token.alloc(1)
        if req_slots is None:
            return give_up()
        r.req_slot = int(req_slots[0])
        r.mamba_slot = int(self.pools.req_to_token.mamba_slots(req_slots)[0])
        r.num_cached_tokens = min(prefix, len(r.prompt))
        r.num_computed = prefix
        r.kv_slots = match.kv_indices.clone()
        r.cached_len = prefix
        r.last_node = match.last_node
        r.branching_len = match.branching_len
        self._make_room([r], [n])
        kv = self._alloc_kv([r], [n])
        if kv is None:
            return give_up(req_slots)
        self.cache.cow_mamba(match, r.mamba_slot)
        c = self.cache_counters
        c["admitted_requests"] += 1
        c["admitted_tokens"] += r.seq_len
        c["admitted_hit_tokens"] += prefix
        if prefix:
            self.pools.req_to_token.set_tokens(r.req_slot, 0, match.kv_indices)
        return kv

    # -- one step --------------------------------------------------------------------------
    def _expected_new_tokens(self, r: Request) -> int:
        """KV slots a request is expected to take beyond what it holds (one per decode step)."""
        remaining = r.params.max_new_tokens - len(r.output)
        return max(1, int(self.new_token_ratio * remaining + 0.999))

    def _chunk_len(self, prefix: int, pending: int, budget: int) -> int:
        """Tokens of a prefill chunk: what the budget allows. With a prefix cache (and a prefill
        budget of at least ``mamba_align``), a chunk that does not finish the request ends on a
        multiple of ``mamba_align`` (0 tokens, i.e. wait for the next step, when the budget left
        does not reach one), so chunks start on the global checkpoint grid and the states at
        grid lengths, branch points included, can be cached by any request."""
        n = min(pending, budget)
        if n == pending:
            return n
        align = self.cache.mamba_align
        if self.chunked_prefill_size < align:
            return n
        return max(0, n - (prefix + n) % align)

    def _running_work(self, decodes: bool = True) -> tuple[list[Request], list[int], int]:
        """Running requests of the next step with their token counts, and the budget left:
        decodes take one token (none with ``decodes=False``); prefills take a chunk of the
        prefill budget."""
        budget = self.chunked_prefill_size
        reqs: list[Request] = []
        lens: list[int] = []
        for r in self.running:
            if r.decoding:
                if decodes:
                    reqs.append(r)
                    lens.append(1)
            elif budget > 0:
                n = self._chunk_len(r.num_computed, r.pending, budget)
                if n == 0:  # waits for a budget that reaches its next checkpoint boundary
                    continue
                budget -= n
                reqs.append(r)
                lens.append(n)
        return reqs, lens, budget

    def schedule_verify(self, draft_len: int) -> ScheduledBatch | None:
        """A speculative TARGET_VERIFY step of every decoding running request (its pending token
        + ``draft_len - 1`` drafts), or None when none decodes. KV slots for all ``draft_len``
        tokens are allocated (the engine frees those of rejected drafts); while they do not fit,
        cached prefixes are evicted, then the newest request is retracted, as in :meth:`schedule`.
        Waiting requests are not admitted (the engine alternates with :meth:`schedule`)."""
        while True:
            reqs = [r for r in self.running if r.decoding]
            if not reqs:
                return None
            lens = [draft_len] * len(reqs)
            self._make_room(reqs, lens)
            slots = self._alloc_kv(reqs, lens)
            if slots is not None:
                break
            self._retract(max(self.running, key=lambda r: r.arrival))
        for i, r in enumerate(reqs):
            r.kv_slots = torch.cat([r.kv_slots, slots[i * draft_len : (i + 1) * draft_len]])
        return ScheduledBatch(
            requests=reqs,
            prefix_lens=[r.num_computed for r in reqs],
            extend_lens=lens,
            out_cache_loc=slots,
            mode=ForwardMode.TARGET_VERIFY,
        )

    def schedule_decode_ahead(self, reqs: list[Request]) -> ScheduledBatch | None:
        """Overlap (engine ``step``): the DECODE step that :meth:`schedule` will return after the
        step of ``reqs`` now in flight, planned before that step's sampled tokens are appended
        (each request has just advanced ``num_computed`` past all its tokens; the batch's input
        ids are the in-flight tokens, on the device). The caller guarantees that none of ``reqs``
        finishes with its in-flight token. None, changing nothing, unless the result is exactly
        :meth:`schedule`'s: ``reqs`` are all the running requests (in order) and nothing waits
        for admission, their KV slots are free without evicting cached prefixes or retracting,
        and no prefix-cache checkpoint falls on the step."""
        if self.waiting or len(reqs) != len(self.running) or any(a is not b for a, b in zip(reqs, self.running)):
            return None
        if any(r.pending != 0 or r.num_computed == 0 for r in reqs):
            return None
        if any(self._checkpoint_len(r, r.num_computed, 1) is not None for r in reqs):
            return None
        n = len(reqs)
        if self.pools.kv.allocator.available() < n:  # (what a page > 1 needs is checked by the allocator)
            return None
        prefix = [r.num_computed for r in reqs]
        slots = self.pools.kv.allocator.alloc_extend(prefix, [1] * n, self._last_slots(reqs))
        if slots is None:
            return None
        # what schedule() does besides: the admission reserve's ratio decays every step
        self.new_token_ratio = max(self.MIN_NEW_TOKEN_RATIO, self.new_token_ratio - self.NEW_TOKEN_RATIO_DECAY)
        for i, r in enumerate(reqs):
            r.kv_slots = torch.cat([r.kv_slots, slots[i : i + 1]])
        batch = ScheduledBatch(requests=list(reqs), prefix_lens=prefix, extend_lens=[1] * n, out_cache_loc=slots,
                               mode=ForwardMode.DECODE)
        self._drop_pending_checkpoints()
        self._pending_checkpoints = (batch, [])
        return batch

    def schedule(self, decodes: bool = True) -> ScheduledBatch | None:
        """The next mixed step; ``decodes=False`` leaves decoding requests out (speculative
        decoding advances them in :meth:`schedule_verify` steps)."""
        # 1. running requests; while their KV does not fit, evict cached prefixes, then retract
        #    the newest and retry
        while True:
            reqs, lens, budget = self._running_work(decodes)
            self._make_room(reqs, lens)
            slots = self._alloc_kv(reqs, lens) if reqs else torch.zeros(0, dtype=torch.int64)
            if slots is not None:
                break
            if self.elastic is not None:  # free Mamba slots become KV pages before anything is retracted
                alloc = self.pools.kv.allocator
                need = alloc.pages_needed([r.num_computed for r in reqs], lens) * alloc.page_size - alloc.available()
                if self.elastic.grow_kv(need):
                    continue
            self._retract(max(self.running, key=lambda r: r.arrival))
        out = [slots]

        # 2. admit waiting requests while everything fits, keeping a reserve of KV slots for
        #    the decode tokens the running requests (and this one) are expected to need
        self.new_token_ratio = max(self.MIN_NEW_TOKEN_RATIO, self.new_token_ratio - self.NEW_TOKEN_RATIO_DECAY)
        reserve = sum(self._expected_new_tokens(r) for r in self.running)
        position = 0  # in the queue, past requests waiting for a shared prefix
        while position < len(self.waiting) and budget > 0 and len(self.running) < self.max_running_requests:
            r = self.waiting[position]
            kv = self._admit(r, budget, reserve)
            if kv is None:
                break
            if isinstance(kv, str):
                position += 1
                continue
            del self.waiting[position]
            r.status = RequestStatus.RUNNING
            self.running.append(r)
            n = self._chunk_len(r.num_computed, r.pending, budget)
            reqs.append(r)
            lens.append(n)
            out.append(kv)
            budget -= n
            reserve += self._expected_new_tokens(r) + (r.pending - n)

        if not reqs:
            return None
        out_cache_loc = torch.cat(out)
        decode = all(r.decoding for r in reqs)
        decode_rows = None
        if self.split_mixed_steps and not decode and any(r.decoding for r in reqs):
            reqs, lens, out_cache_loc, decode_rows = _decodes_last(reqs, lens, out_cache_loc)
        offset = 0
        for r, n in zip(reqs, lens):
            # the slots belong to the request from now on (freed with it on finish/retraction)
            r.kv_slots = torch.cat([r.kv_slots, out_cache_loc[offset : offset + n]])
            offset += n
        prefix = [r.num_computed for r in reqs]
        batch = ScheduledBatch(
            requests=reqs,
            prefix_lens=prefix,
            extend_lens=lens,
            out_cache_loc=out_cache_loc,
            mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            decode_rows=decode_rows,
        )
        self._drop_pending_checkpoints()
        self._plan_checkpoints(batch)
        return batch

    # -- prefix-cache checkpoints -------------------------------------------------------------
    def _checkpoint_len(self, r: Request, prefix: int, n: int) -> int | None:
        """Sequence length inside this extend whose state goes to the cache, or None: the cache's
        policy decides (``cache/policy.py``: ``lru`` the branch point or the extend's last chunk
        boundary, and every ``decode_checkpoint_interval`` decode tokens; ``marconi`` branch points
        only; none without a cache)."""
        return self.cache.policy.checkpoint_len(
            prefix, n, mamba_align=self.cache.mamba_align, page_size=self.cache.page_size,
            cached_len=r.cached_len, branching_len=r.branching_len, decode_interval=self.decode_checkpoint_interval,
        )

    def _plan_checkpoints(self, batch: ScheduledBatch) -> None:
        """Pick each request's checkpoint of this EXTEND. One at the end of its extend is the
        request's own state after the step (forked into the cache then); one inside it is
        tracked by the layer ops into a fresh Mamba slot (``track_slots`` / ``track_lens``)."""
        track_slots, track_lens, planned = [], [], []
        for r, p, n in zip(batch.requests, batch.prefix_lens, batch.extend_lens):
            length = self._checkpoint_len(r, p, n)
            slot = None
            if length is not None and length < p + n:
                self.cache.ensure_free(mamba_slots=1)
                got = self.pools.mamba.alloc(1)
                if got is None:
                    self.cache_counters["checkpoints_skipped"] += 1
                    length = None
                else:
                    slot = int(got[0])
            if length is not None:
                planned.append((r, length, slot))
            track_slots.append(-1 if slot is None else slot)
            track_lens.append(-1 if slot is None else length - p)
        if any(s >= 0 for s in track_slots):
            batch.track_slots, batch.track_lens = track_slots, track_lens
        self._pending_checkpoints = (batch, planned)

    def _drop_pending_checkpoints(self) -> None:
        """Forget checkpoints of a batch whose forward was never committed (free tracked slots)."""
        _, planned = self._pending_checkpoints
        slots = [slot for _, _, slot in planned if slot is not None]
        if slots:
            self.pools.mamba.free(slots)
        self._pending_checkpoints = (None, [])

    def commit_checkpoints(self, batch: ScheduledBatch) -> None:
        """After ``batch``'s forward (before its requests' ``num_computed`` advance): hand each
        checkpoint planned for it to the cache (``cache_unfinished_req``; chunked prefill,
        docstring step 5 of ``cache/radix_cache.py``), move the request's lock to the new node and
        switch its first KV slots to the tree's."""
        planned_for, pending = self._pending_checkpoints
        if planned_for is not batch:
            return
        self._pending_checkpoints = (None, [])
        for r, length, slot in pending:
            res = self.cache.cache_unfinished_req(
                r.token_ids(0, length), r.kv_slots[:length], r.last_node,
                r.mamba_slot if slot is None else slot, adopt_mamba=slot is not None,
            )
            if not res.inserted:  # no Mamba slot for the fork
                self.cache_counters["checkpoints_skipped"] += 1
                continue
            self.cache_counters["checkpoints_forked" if slot is None else "checkpoints_tracked"] += 1
            r.kv_slots = torch.cat([res.kv_indices, r.kv_slots[length:]])
            self.pools.req_to_token.set_tokens(r.req_slot, 0, res.kv_indices)
            r.last_node = res.last_node
            r.cached_len = length
