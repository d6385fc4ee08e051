"""NullPrefixCache: the prefix cache of ``EngineConfig(enable_prefix_cache=False)``.

It answers the calls the scheduler makes on a :class:`~.radix_cache.HybridRadixCache` and holds
nothing: a lookup hits nothing, locks and evictions do nothing, a finished request's slots are
freed (the tree would adopt them; this cache keeps none), and its policy
(:class:`~.policy.NoPrefixCachePolicy`) places no checkpoint and holds no request back. So the
scheduler runs one code path with the cache on or off.
"""

from __future__ import annotations

import torch

from ..memory.allocator import IndexLike, as_index_tensor
from ..memory.pools import MemoryPools
from .policy import NoPrefixCachePolicy
from .radix_cache import MatchResult, TokenIds, TreeNode, UnfinishedCacheResult


class NullPrefixCache:
    """A prefix cache that caches nothing, on the pools of one engine (see the module docstring).

    ``mamba_align`` is 1: with no states cached there is no checkpoint grid, so prefill chunks
    need no alignment.
    """

    mamba_align = 1

    def __init__(self, pools: MemoryPools) -> None:
        self.pools = pools
        self.kv_allocator = pools.kv.allocator
        self.mamba_pool = pools.mamba
        self.page_size = self.kv_allocator.page_size
        self.policy = NoPrefixCachePolicy()
        self.root = TreeNode(0, (), torch.zeros(0, dtype=torch.int64), None)

    def page_floor(self, n: int) -> int:
        return n - n % self.page_size

    # -- lookups and locks: nothing is cached ----------------------------------------------
    def match_prefix(self, token_ids: TokenIds) -> MatchResult:
        return MatchResult(kv_indices=torch.zeros(0, dtype=torch.int64), prefix_len=0, last_node=self.root,
                           mamba_node=None, kv_match_len=0, branching_len=None)

    def inc_lock_ref(self, node: TreeNode) -> None:
        pass

    def dec_lock_ref(self, node: TreeNode) -> None:
        pass

    def cow_mamba(self, match: MatchResult, dst_slot: int | None = None) -> int | None:
        """No hit to copy: ``dst_slot`` as is, or a fresh zeroed slot (None if the pool is full)."""
        if dst_slot is not None:
            return int(dst_slot)
        slots = self.mamba_pool.alloc(1)
        return None if slots is None else int(slots[0])

    # -- handing slots over: the cache keeps none, so it frees them ------------------------
    def cache_finished_req(self, token_ids: TokenIds, kv_indices: IndexLike, last_node: TreeNode,
                           mamba_slot: int | None = None, *, mamba_len: int | None = None) -> int:
        """Free the request's KV slots and its Mamba slot (what the tree would have adopted or
        freed); returns 0 (no token was cached)."""
        self.kv_allocator.free(as_index_tensor(kv_indices))
        if mamba_slot is not None and mamba_slot >= 0:
            self.mamba_pool.free([int(mamba_slot)])
        return 0

    def cache_unfinished_req(self, token_ids: TokenIds, kv_indices: IndexLike, last_node: TreeNode,
                             mamba_slot: int, *, adopt_mamba: bool = False) -> UnfinishedCacheResult:
        """Nothing cached (``inserted=False``); an adopted checkpoint slot is freed."""
        if adopt_mamba:
            self.mamba_pool.free([int(mamba_slot)])
        return UnfinishedCacheResult(as_index_tensor(kv_indices), last_node, 0, 0, False)

    # -- eviction and accounting: nothing to evict ------------------------------------------
    def evict_kv(self, num_tokens: int) -> int:
        return 0

    def evict_mamba(self, num_slots: int) -> int:
        return 0

    def ensure_free(self, kv_tokens: int = 0, mamba_slots: int = 0) -> bool:
        return self.kv_allocator.available() >= kv_tokens and self.mamba_pool.available() >= mamba_slots

    def evictable_size(self) -> int:
        return 0

    def cached_tokens(self) -> int:
        return 0

    def reset(self, *, force: bool = False) -> None:
        pass


__all__ = ["NullPrefixCache"]
