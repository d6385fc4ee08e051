"""ElasticPools: move memory between the KV pool and the Mamba pool at run time.

With ``EngineConfig(elastic_pools=True)`` the KV and Mamba capacities still start from one budget
split by ``mamba_full_memory_ratio`` (``memory/sizing.py``), but the split is not fixed: when the
scheduler is about to retract a request or cannot admit one because the KV pool is full while
Mamba slots sit free, free Mamba slots become KV pages; when a request waits for a Mamba slot
while KV pages sit free, free KV pages become Mamba slots. No request is lost (a move only takes
free entries) and nothing new is allocated beyond the budget (the bytes given up pay for the bytes
gained; a remainder smaller than a page or a slot is kept as ``spare_bytes`` for the next move).

The design: resize the two pools' tensors at a safe point (while the scheduler builds a step,
before its forward), taking free entries off the *top* of the shrinking pool's index range and
appending entries at the top of the growing one, and copying the entries both sizes have. Every
slot in use keeps its number, so nothing that names slots (requests, ``req_to_token`` /
``req_to_mamba``, the prefix-cache tree, host-tier copies) has to be rewritten; only holders of the
per-layer *views* refresh them (the runner's forward-context views, the tree's ownership masks,
the host tier's device buffers). One exception keeps the top free: a running request on a Mamba slot
above the free ones a move needs is lowered to a free slot below them (its state copied,
``req_to_mamba`` and the request pointed at it, between steps); the Mamba allocator hands out the
lowest free slots first, so this is rare (a request admitted while the lower slots were busy). The alternative — one arena carved into units that either pool
can own — needs slot-major pool layouts (a slot's bytes of every layer together), which the
attention and state kernels do not take (they read per-layer ``[slots, ...]`` views); resizing
keeps every kernel as it is. The cost: a move copies the pools' live range once (device-to-device,
at the copy bandwidth) and holds the growing pool's old and new buffers at once while it copies,
and a CUDA graph captured on the old buffers would read freed memory: the full graphs (and the
speculative commit graphs) are captured again after every move, while the piecewise graphs stay
(the layer ops between their pieces read the pools at run time). Under tensor parallelism rank 0
decides and the other ranks resize in step (``distributed/step.py``'s ``RESIZE``: the sizes rank
0's pools took; then every rank refreshes its views and captures its full graphs again).
Speculative decoding refreshes its views after a move (the slot-indexed state views of its commit,
an MTP head's KV views; its intermediate buffers are by batch row and stay).
"""

from __future__ import annotations

import contextlib
import time


class ElasticPools:
    """The scheduler's hook to re-partition the pools (see the module docstring).

    Args:
        pools: the engine's :class:`~hybrid_compile.memory.MemoryPools`.
        on_resize: called after every move (the engine refreshes the views it keeps).
        cache: the prefix cache (or ``None``): before KV is moved to Mamba or back, cached states
            that sit at the top of the Mamba pool are evicted so that its free slots are at the top.
        running: returns the running requests (or ``None``): a running request whose Mamba slot
            sits above the free ones a move to the KV pool needs is moved to a free slot below
            them (its state copied, ``req_to_mamba`` pointed at it), the one renumbering a move
            makes: a request admitted while the lower slots held other requests or cached states
            would otherwise pin the top of the pool for as long as it runs.
        mamba_reserve: free Mamba slots a move to the KV pool leaves (the next admission's).
        kv_reserve: free KV token slots a move to the Mamba pool leaves.
    """

    def __init__(self, pools, on_resize, *, cache=None, running=None, mamba_reserve: int = 2,
                 kv_reserve: int = 0) -> None:
        if not pools.kv.bytes_per_token or not pools.mamba.bytes_per_slot:
            raise ValueError("EngineConfig.elastic_pools needs a model with both full-attention and linear layers")
        self.pools = pools
        # running requests then take the lowest Mamba slots and leave the top ones free to move
        # (without it a request admitted after others finished may sit on the top slot)
        pools.mamba.allocator.set_lowest_first()
        self.on_resize = on_resize
        self.cache = cache
        self.running = running
        self.mamba_reserve = mamba_reserve
        self.kv_reserve = kv_reserve
        # scheduler asks (a move or not) and the host time spent answering them
        self.asks = {"grow_kv": 0, "grow_mamba": 0}
        self.ask_seconds = 0.0

    def grow_kv(self, kv_tokens: int) -> bool:
        """At least ``kv_tokens`` more KV token slots from free Mamba slots; True if any came."""
        with self._ask("grow_kv"):
            return self._grow_kv(kv_tokens)

    @contextlib.contextmanager
    def _ask(self, name: str):
        """Counts one ask of the scheduler and the host time it takes (``stats()``)."""
        t0 = time.perf_counter()
        self.asks[name] += 1
        try:
            yield
        finally:
            self.ask_seconds += time.perf_counter() - t0

    def _grow_kv(self, kv_tokens: int) -> bool:
        mamba = self.pools.mamba
        wanted = min(-(-kv_tokens * self.pools.kv.bytes_per_token // mamba.bytes_per_slot) + self.mamba_reserve,
                     mamba.total())
        if self.cache is not None:
            # cached states (the last workload's) in the top slots keep the free ones from moving
            while mamba.allocator.free_at_top() < wanted and self.cache.mamba_evictable_size():
                self.cache.evict_mamba(1)
        if self.running is not None and mamba.allocator.free_at_top() < wanted:
            self._lower_running_slots(mamba.total() - wanted)
        gained = self.pools.move_mamba_to_kv(kv_tokens, keep_mamba_free=self.mamba_reserve)
        if gained:
            self.on_resize()
        return gained > 0

    def _lower_running_slots(self, limit: int) -> None:
        """Move running requests' Mamba slots at or above ``limit`` to free slots below it (the
        lowest first: the allocator hands those out), highest first, while there are any."""
        mamba, r2t = self.pools.mamba, self.pools.req_to_token
        for r in sorted((r for r in self.running() if r.mamba_slot is not None and r.mamba_slot >= limit),
                        key=lambda r: -r.mamba_slot):
            new = mamba.fork([r.mamba_slot])  # (a copy of its state, in stream order after its last step)
            if new is None:
                return
            if int(new[0]) >= limit:
                mamba.free(new)
                return
            old = r.mamba_slot
            r2t.set_mamba_slots([r.req_slot], new)
            mamba.free([old])
            r.mamba_slot = int(new[0])
            self.pools.moves["requests_relocated"] += 1

    def grow_mamba(self, slots: int) -> bool:
        """At least ``slots`` more Mamba slots from free KV pages; True if any came."""
        with self._ask("grow_mamba"):
            gained = self.pools.move_kv_to_mamba(slots, keep_kv_free=self.kv_reserve)
            if gained:
                self.on_resize()
            return gained > 0

    def stats(self) -> dict:
        p = self.pools
        return {
            "kv_tokens": p.kv.total(),
            "mamba_slots": p.mamba.total(),
            "kv_bytes": p.kv.nbytes(),
            "mamba_bytes": p.mamba.nbytes(),
            "spare_bytes": p.spare_bytes,
            **p.moves,
            "asks": dict(self.asks),  # the scheduler's calls, moves or not
            "ask_seconds": self.ask_seconds,  # host time in them, moves and re-captures included
        }
