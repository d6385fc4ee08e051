"""Prefix cache: the hybrid radix tree over token ids whose nodes hold KV indices and
optional Mamba-state slots, with locks, copy-on-write, tombstones and dual eviction lists, the
policies that place its checkpoints and order its evictions, and the null cache used when it is off.

Modules, one job each:

- ``radix_cache``  :class:`HybridRadixCache` on a :class:`~hybrid_compile.memory.MemoryPools`:
  ``match_prefix`` / ``cow_mamba`` / ``inc_lock_ref`` / ``dec_lock_ref`` / ``insert`` /
  ``cache_finished_req`` / ``cache_unfinished_req`` / ``evict_kv`` / ``evict_mamba`` /
  ``ensure_free`` / ``stats`` / ``reset``.
- ``policy``  the policies (:class:`LRUPolicy`, :class:`MarconiPolicy`; :data:`POLICIES` is the one
  registry of names, :func:`make_policy` / :func:`check_policy_name` validate one): where the
  scheduler checkpoints SSM states (:meth:`PrefixCachePolicy.checkpoint_len`, on the grid of
  :func:`aligned_checkpoint_len`) and the eviction order, kept by incremental eviction indexes
  (no pass over every node per eviction call).
- ``null_cache``  :class:`NullPrefixCache`: the same interface, caching nothing
  (``enable_prefix_cache=False``), so the scheduler has one code path.
"""

from .null_cache import NullPrefixCache
from .policy import (
    POLICIES,
    LRUPolicy,
    MarconiPolicy,
    NoPrefixCachePolicy,
    PrefixCachePolicy,
    aligned_checkpoint_len,
    check_policy_name,
    last_aligned_boundary,
    make_policy,
)
from .radix_cache import HybridRadixCache, MatchResult, TreeNode, UnfinishedCacheResult

__all__ = [
    "POLICIES",
    "HybridRadixCache",
    "LRUPolicy",
    "MarconiPolicy",
    "MatchResult",
    "NoPrefixCachePolicy",
    "NullPrefixCache",
    "PrefixCachePolicy",
    "TreeNode",
    "UnfinishedCacheResult",
    "aligned_checkpoint_len",
    "check_policy_name",
    "last_aligned_boundary",
    "make_policy",
]
