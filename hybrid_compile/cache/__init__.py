"""Prefix cache: the hybrid radix tree over token ids whose nodes hold KV indices and
optional Mamba-state slots, with locks, copy-on-write, tombstones and dual LRU eviction.
(Filled by the prefix-cache issue.)

Modules, one job each:

- ``radix_cache``  :class:`HybridRadixCache` on a :class:`~hybrid_compile.memory.MemoryPools`:
  ``match_prefix`` / ``cow_mamba`` / ``inc_lock_ref`` / ``dec_lock_ref`` / ``insert`` /
  ``cache_finished_req`` / ``cache_unfinished_req`` / ``evict_kv`` / ``evict_mamba`` /
  ``ensure_free`` / ``stats`` / ``reset``; and :func:`aligned_checkpoint_len`, where an
  extend may checkpoint its SSM state (chunk-aligned, page-aligned).
"""

from .radix_cache import (
    HybridRadixCache,
    MatchResult,
    TreeNode,
    UnfinishedCacheResult,
    aligned_checkpoint_len,
    last_aligned_boundary,
)

__all__ = [
    "HybridRadixCache",
    "MatchResult",
    "TreeNode",
    "UnfinishedCacheResult",
    "aligned_checkpoint_len",
    "last_aligned_boundary",
]
