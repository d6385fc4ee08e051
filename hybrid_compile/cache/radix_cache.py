"""HybridRadixCache: prefix cache of a hybrid model (KV of the attention layers + Mamba states).

A radix tree over token ids (the design of SGLang's ``MambaRadixCache``, extended to KV pages):

- **Node.** ``key`` is the token ids of the edge from its parent, ``value`` the KV token
  slots of those tokens (CPU int64, same length), ``mamba_slot`` the Mamba-pool slot holding
  the recurrent state (conv window + SSM state) *after the last token of the edge*, or
  ``None``. Children are indexed by the first token of their edge (the first page of tokens
  when ``page_size > 1``: every edge then holds whole pages, and matches, splits and inserts
  happen at page boundaries only).
- **Hybrid hit.** Attention KV can be truncated, a recurrent state cannot be rolled back: a
  prefix is reusable only up to a node that *ends* with a Mamba state. :meth:`match_prefix`
  returns the longest such prefix; KV-only nodes beyond it do not count.
- **Tombstones.** A non-root internal node without a Mamba state (created by a split, or by
  Mamba eviction of an internal node) keeps its KV for its children. Every non-root *leaf*
  has a Mamba state: a leaf that loses it is removed with its KV, and a parent left as a
  state-less leaf is removed too.
- **Locks.** :meth:`inc_lock_ref` on a node locks its Mamba state (``mamba_lock_ref``) and the
  KV of the whole path to the root (``full_lock_ref`` of every node on it); so on every node
  ``full_lock_ref == mamba_lock_ref + sum(child.full_lock_ref)`` and ``full >= mamba``.
  Locked KV is never evicted; a locked Mamba state is never evicted.
- **Copy-on-write.** A request never runs on a cached state: :meth:`cow_mamba` copies the hit
  node's state into the request's private slot; :meth:`cache_unfinished_req` forks the
  request's state into a fresh slot for the tree.
- **Dual LRU eviction.** :meth:`evict_kv` removes unlocked *leaves* (KV + state) in LRU order
  of ``last_access``; :meth:`evict_mamba` frees the state of any unlocked node in LRU order of
  ``mamba_last_access`` (internal node -> tombstone, leaf -> removed with its KV).
  :meth:`ensure_free` evicts until the pools can satisfy an allocation (proactive Mamba
  eviction when the scheduler allocates request slots). The order is the policy's
  (``policy.py``: LRU, or Marconi's FLOP-aware score), kept by two eviction indexes that every
  change of a node's candidacy or key updates (:meth:`HybridRadixCache._reindex`), so an eviction
  call does not look at every node; :meth:`~HybridRadixCache.kv_eviction_order` /
  :meth:`~HybridRadixCache.mamba_eviction_order` rank every candidate (the reference order).
- **Ownership.** Every KV slot and Mamba slot in the tree is allocated in ``pools`` and owned
  by the tree alone; a request owns the slots it allocated beyond its matched prefix. Handing
  slots to :meth:`insert` / :meth:`cache_finished_req` transfers them: the tree adopts what is
  new and frees duplicates of what it already holds. :meth:`reset` frees everything.
- **Chunk-aligned checkpoints.** The tree stores a state at any length it is
  given; *where* states are taken is the policy's (``cache.policy.checkpoint_len``, asked by the
  scheduler). The chunked SSM kernels expose
  states only every ``mamba_align`` tokens from the start of an extend, so
  :func:`aligned_checkpoint_len` says which length of an extend can be checkpointed (the
  branch point of :attr:`MatchResult.branching_len` first, else the last aligned boundary).
  ``mamba_align`` is independent of the KV page size.

- **Host tier** (``host_pool``, a :class:`~hybrid_compile.memory.host_pool.HostPool`). Device
  eviction (:meth:`evict_kv`, and :meth:`evict_mamba` of a leaf) does not drop a node: it writes
  the edge's KV and the node's state to the host pool (asynchronously on CUDA, see
  ``memory/host_pool.py``), frees the device slots and keeps the node, now host-only
  (:attr:`TreeNode.tier`: ``"device"``, ``"host"`` or ``"both"``; a state likewise has a device
  slot, a host slot or both). Host-only nodes form whole subtrees below the device part of the
  tree, so the device-eviction candidates are the leaves *of the device part*. A match may end
  at a host-only node or at a node whose state is on the host only: :meth:`match_prefix` then
  allocates device slots (evicting on the device, with the matched path held), copies the KV of
  the path's host-only nodes and the state back, and returns a device hit as before — the load
  is queued before the request's first extend step. The host copies stay (``"both"``), so a
  second device eviction of the node costs no copy. If the device cannot make room, the hit is
  the device-only part of the path. An insert over host-only nodes gives them the request's
  device slots (no copy). Host space is freed by :meth:`evict_host` in the policy's order
  (:meth:`host_eviction_order`): host copies of nodes that are also on the device first in line
  with host-only leaves; when the host cannot make room, the device victim is dropped as without
  the tier (with its host-only subtree). ``stats()`` adds the host counters.

Everything here is host-side bookkeeping plus :meth:`MambaPool.copy_slots` /
:meth:`MambaPool.fork` for state copies; nothing syncs the device.

How the scheduler uses it (``engine/scheduler.py``, with ``EngineConfig(enable_prefix_cache=True)``,
the default):

1. Build with ``mamba_align`` = the kernel's chunk size (64 for GDN, the Mamba2 chunk size);
   plan memory with ``mamba_prefix_cache_slots > 0``.
2. Admission: ``m = match_prefix(tokens[:-1])`` (once per attempt: it bumps the hit counters),
   ``inc_lock_ref(m.last_node)``, ``ensure_free(mamba_slots=1)`` before ``req_to_token.alloc``,
   ``cow_mamba(m, request_mamba_slot)``, write ``m.kv_indices`` into ``req_to_token`` and start
   at ``num_computed = m.prefix_len`` (page-aligned). Count room as ``available() +
   evictable_size()`` and ``ensure_free(kv_tokens=...)`` before allocating; evict before retracting.
3. Finish: ``cache_finished_req(tokens[:num_computed], kv_slots, last_node, mamba_slot,
   mamba_len=...)`` then ``req_to_token.free(req_slot, free_mamba=False)``.
4. Retract / abort: free only the request's own ``kv_slots[cached_len:]`` and its slots, then
   ``dec_lock_ref(last_node)``.
5. Chunked prefill: prefill chunks that do not finish a prompt are cut to whole ``mamba_align``
   chunks; after each EXTEND step, ``cache_unfinished_req`` at the step's checkpoint and rewrite
   the request's ``req_to_token`` row and ``kv_slots`` with the returned indices (duplicates
   were freed).
6. Checkpoints: at ``policy.checkpoint_len(...)`` of each extend (``lru``: the branch point, else
   the last aligned boundary; ``marconi``: branch points only). One at the end of the extend is
   the request's own state (forked); one inside it is written by the layer ops (chunk state ``h``
   + conv window gathered from the inputs, ``layers/tracking.py``) into a fresh slot handed over
   with ``adopt_mamba=True``. Decoding requests fork their state every
   ``EngineConfig.prefix_cache_track_interval`` tokens (``lru``; the request's state after the
   step, so no double buffer is needed); the finish-time state (the last decoded token, all
   Marconi admits) covers multi-turn reuse.
7. ``engine.stats()`` merges ``stats()``; ``reset()`` before ``pools.check_all_free()``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence, Union

import torch

from ..memory.allocator import IndexLike, as_index_tensor
from ..memory.host_pool import HostPool
from ..memory.pools import MemoryPools
from .policy import PrefixCachePolicy, aligned_checkpoint_len, last_aligned_boundary, make_policy  # noqa: F401

TokenIds = Union[Sequence[int], torch.Tensor]

_NO_SLOTS = torch.zeros(0, dtype=torch.int64)


def _kv_access(node: "TreeNode") -> int:
    return node.last_access


def _mamba_access(node: "TreeNode") -> int:
    return node.mamba_last_access


# ----------------------------------------------------------------------------------------
# tree
# ----------------------------------------------------------------------------------------
class TreeNode:
    """One edge of the radix tree (see the module docstring). The root has an empty key."""

    __slots__ = (
        "id",
        "key",
        "value",
        "mamba_slot",
        "children",
        "parent",
        "full_lock_ref",
        "mamba_lock_ref",
        "last_access",
        "mamba_last_access",
        "removed",
        "prefix_len",
        "host_start",
        "host_mamba",
        "host_pin",
    )

    def __init__(self, node_id: int, key: tuple[int, ...], value: torch.Tensor, parent: "TreeNode | None") -> None:
        self.id = node_id
        self.key = key
        self.value = value
        self.mamba_slot: int | None = None
        self.children: dict = {}
        self.parent = parent
        self.full_lock_ref = 0
        self.mamba_lock_ref = 0
        self.last_access = 0
        self.mamba_last_access = 0
        self.removed = False
        self.prefix_len = len(key) + (parent.prefix_len if parent is not None else 0)  # tokens from the root
        # host tier (``host_pool``): start of the edge's KV in the host pool's token ranges, the
        # host Mamba slot of its state, and a pin that keeps both while a load back runs
        self.host_start: int | None = None
        self.host_mamba: int | None = None
        self.host_pin = 0

    @property
    def is_root(self) -> bool:
        return self.parent is None and not self.removed

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def has_state(self) -> bool:
        """A Mamba state on the device or on the host."""
        return self.mamba_slot is not None or self.host_mamba is not None

    @property
    def tier(self) -> str:
        """Where the edge's KV lives: ``"device"``, ``"host"`` or ``"both"``."""
        if self.value is None:
            return "host"
        return "device" if self.host_start is None else "both"

    @property
    def is_tombstone(self) -> bool:
        """Non-root internal node without a Mamba state (keeps KV for its children)."""
        return self.parent is not None and bool(self.children) and not self.has_state

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, len={len(self.key)}, mamba={self.mamba_slot}, kv={self.tier}, "
            f"host_mamba={self.host_mamba}, locks={self.full_lock_ref}/{self.mamba_lock_ref}, children={len(self.children)})"
        )


@dataclass(frozen=True)
class MatchResult:
    """Answer of :meth:`HybridRadixCache.match_prefix`.

    Attributes:
        kv_indices: KV slots of the hit (CPU int64, ``prefix_len`` long), owned by the tree.
        prefix_len: length of the hybrid hit: the longest matched prefix whose end has a Mamba
            state (page-aligned); 0 when there is none.
        last_node: node where the hit ends (the root when ``prefix_len == 0``); the request
            locks it (:meth:`~HybridRadixCache.inc_lock_ref`) and hands it back to
            ``cache_finished_req`` / ``cache_unfinished_req``.
        mamba_node: ``last_node`` when it holds the hit's Mamba state, else ``None`` (no hit).
        kv_match_len: tokens whose KV the tree holds (>= ``prefix_len``; the tokens between
            the two have KV but no state at their end and are recomputed).
        branching_len: where the request should checkpoint its state so the KV-only part
            becomes reusable: the last ``mamba_align`` boundary after ``prefix_len`` not beyond
            ``kv_match_len`` (and on a page), or ``None``.
    """

    kv_indices: torch.Tensor
    prefix_len: int
    last_node: TreeNode
    mamba_node: TreeNode | None
    kv_match_len: int
    branching_len: int | None


@dataclass(frozen=True)
class UnfinishedCacheResult:
    """Answer of :meth:`HybridRadixCache.cache_unfinished_req`.

    Attributes:
        kv_indices: the KV slots the request must use for its first ``prefix_len`` tokens from
            now on (the tree's; the request's duplicates were freed).
        last_node: the node the request now holds a lock on (the old one was unlocked).
        prefix_len: tokens of the request now in the tree and locked for it.
        cached_before: how many of them the tree already held before the call.
        inserted: False when nothing was cached (no Mamba slot could be found for the state):
            then ``kv_indices`` / ``last_node`` are what the request passed in.
    """

    kv_indices: torch.Tensor
    last_node: TreeNode
    prefix_len: int
    cached_before: int
    inserted: bool


class HybridRadixCache:
    """Prefix cache over token ids for a hybrid model, on the pools of one engine.

    Args:
        pools: the engine's :class:`~hybrid_compile.memory.MemoryPools`; KV token slots come
            from ``pools.kv.allocator`` (its ``page_size`` is the tree's), Mamba slots from
            ``pools.mamba``.
        mamba_align: the SSM kernel's chunk size (64 for the GDN chunk kernel): the
            granularity of checkpoints (:meth:`checkpoint_len`, :attr:`MatchResult.branching_len`).
        policy: a name of :data:`~hybrid_compile.cache.policy.POLICIES` or a
            :class:`~hybrid_compile.cache.policy.PrefixCachePolicy`; it orders eviction and tells
            the scheduler where to checkpoint (``cache.policy``). ``"lru"``: least recently used
            first. ``"marconi"`` (Marconi, arXiv 2411.19379): nodes with at most one child before
            branch points, each tier lowest ``recency + marconi_alpha * flop_efficiency`` first,
            both min-max normalised over the candidates, where the FLOP efficiency of a node is the
            compute a hit on it saves (``prefix_flops`` of its prefix length; default: the
            length, the linear layers' share) per byte it holds (its Mamba state + its edge's KV).
        marconi_alpha: Marconi's weight of FLOP efficiency (settable later: ``cache.marconi_alpha``).
        prefix_flops: fixed at construction (the eviction indexes keep each node's efficiency).
        host_pool: a :class:`~hybrid_compile.memory.host_pool.HostPool` on the same pools turns
            on the host tier (see the module docstring); ``None``: evicted nodes are dropped.

    Token ids are any sequence of ints (or a 1-D integer tensor). Sequences given to
    :meth:`insert` and :meth:`cache_unfinished_req` must be a whole number of pages.
    """

    def __init__(
        self,
        pools: MemoryPools,
        *,
        mamba_align: int = 64,
        policy: str | PrefixCachePolicy = "lru",
        marconi_alpha: float = 1.0,
        prefix_flops: Callable[[int], float] | None = None,
        host_pool: HostPool | None = None,
    ) -> None:
        if mamba_align < 1:
            raise ValueError(f"HybridRadixCache: mamba_align must be >= 1, got {mamba_align}")
        self.policy = make_policy(policy, marconi_alpha=marconi_alpha, what="HybridRadixCache: policy")
        self._marconi_alpha = float(marconi_alpha)
        self.prefix_flops = prefix_flops or float
        self.pools = pools
        self.kv_allocator = pools.kv.allocator
        self.mamba_pool = pools.mamba
        self.page_size = self.kv_allocator.page_size
        self.mamba_align = mamba_align
        if host_pool is not None and host_pool.device != pools.kv.device:
            raise ValueError("HybridRadixCache: host_pool was built for pools on another device")
        self.host = host_pool
        self._node_ids = itertools.count()
        # Which slots the tree owns (host masks, for validation and exact accounting). The KV mask has
        # a flag per KV slot (millions): read and written with index_select / index_fill_, never with
        # advanced indexing (memory/allocator.py says why: a prefill's slots cost ms that way).
        self._kv_owned = torch.zeros(self.kv_allocator.num_slots, dtype=torch.bool)
        self._mamba_owned = torch.zeros(self.mamba_pool.total(), dtype=torch.bool)
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = TreeNode(next(self._node_ids), (), _NO_SLOTS, None)
        # the eviction candidates, kept up to date by _reindex (policy.EvictionIndex)
        self._kv_index = self.policy.eviction_index(self._kv_evictable, _kv_access, self._kv_efficiency)
        self._mamba_index = self.policy.eviction_index(self._mamba_evictable, _mamba_access, self._mamba_efficiency)
        self._host_index = (
            self.policy.eviction_index(self._host_evictable, _kv_access, self._kv_efficiency)
            if self.host is not None else None
        )
        self._host_tokens = 0  # KV tokens with a host copy
        self._host_states = 0  # states with a host copy
        self._clock = 0
        self._num_nodes = 0  # non-root nodes
        self._cached_tokens = 0
        self._protected_tokens = 0  # tokens of nodes with full_lock_ref > 0
        self._mamba_held = 0
        self._mamba_protected = 0  # Mamba states with mamba_lock_ref > 0
        self._counters = dict.fromkeys(
            (
                "lookups",
                "lookup_tokens",
                "hits",
                "hit_tokens",
                "kv_match_tokens",
                "mamba_hits",
                "inserted_tokens",
                "inserted_mamba",
                "duplicate_tokens_freed",
                "duplicate_mamba_freed",
                "kv_evicted_tokens",
                "kv_evicted_nodes",
                "kv_evicted_mamba",
                "mamba_evicted",
                "mamba_evicted_tokens",
                "tombstones_created",
                # host tier
                "host_hits",
                "host_hit_tokens",
                "host_loaded_tokens",
                "host_loaded_states",
                "host_load_failed",
                "host_written_tokens",
                "host_written_states",
                "host_write_failed",
                "host_evicted_tokens",
                "host_evicted_states",
            ),
            0,
        )

    # ------------------------------------------------------------------------------------
    # small helpers
    # ------------------------------------------------------------------------------------
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _as_key(self, token_ids: TokenIds) -> tuple[int, ...]:
        if isinstance(token_ids, torch.Tensor):
            return tuple(token_ids.reshape(-1).tolist())
        key = tuple(token_ids)
        # plain ints (the engine's token lists) as they are; anything else (numpy or bool ints) through
        # int(): one type scan in C instead of a Python call per token (a 32k-token prompt's key is
        # built at every prefill chunk)
        return key if set(map(type, key)) <= {int} else tuple(map(int, key))

    def _child_key(self, key: tuple[int, ...], pos: int = 0):
        """Children-dict key of the edge starting at ``key[pos]`` (None: less than a page left)."""
        if self.page_size == 1:
            return key[pos] if pos < len(key) else None
        if len(key) - pos < self.page_size:
            return None
        return key[pos : pos + self.page_size]

    def _common_len(self, edge: tuple[int, ...], key: tuple[int, ...], pos: int) -> int:
        """Length of the common prefix of ``edge`` and ``key[pos:]``, floored to whole pages."""
        n = min(len(edge), len(key) - pos)
        if edge[:n] == key[pos : pos + n]:
            common = n
        else:
            common = next(i for i in range(n) if edge[i] != key[pos + i])
        return common - common % self.page_size

    def page_floor(self, n: int) -> int:
        return n - n % self.page_size

    def _check_attached(self, node: TreeNode) -> None:
        if node.removed:
            raise ValueError(f"{node!r} was removed from the tree (evicted or reset)")

    def _check_locked(self, node: TreeNode) -> None:
        """A request's ``last_node``: attached, and the root or locked (by the request)."""
        self._check_attached(node)
        if node is not self.root and node.mamba_lock_ref <= 0:
            raise ValueError(f"{node!r} is not locked: pass the node the request locked")

    def _path(self, node: TreeNode) -> list[TreeNode]:
        """Nodes from the root's child down to ``node`` (empty for the root)."""
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    def path_kv_indices(self, node: TreeNode) -> torch.Tensor:
        """KV slots of the whole prefix ending at ``node`` (CPU int64)."""
        self._check_attached(node)
        path = self._path(node)
        return torch.cat([n.value for n in path]) if path else _NO_SLOTS.clone()

    def path_tokens(self, node: TreeNode) -> tuple[int, ...]:
        """Token ids of the whole prefix ending at ``node``."""
        self._check_attached(node)
        return tuple(t for n in self._path(node) for t in n.key)

    def nodes(self) -> Iterator[TreeNode]:
        """Every non-root node, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def checkpoint_len(self, prefix_len: int, extend_len: int, branching_len: int | None = None) -> int | None:
        """:func:`aligned_checkpoint_len` with this cache's ``mamba_align`` and page size."""
        return aligned_checkpoint_len(
            prefix_len, extend_len, mamba_align=self.mamba_align, page_size=self.page_size, branching_len=branching_len
        )

    # ------------------------------------------------------------------------------------
    # structure
    # ------------------------------------------------------------------------------------
    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Cut ``child``'s edge after ``k`` tokens: a new KV-only parent takes the first ``k``."""
        assert 0 < k < len(child.key) and k % self.page_size == 0
        parent = child.parent
        on_device = child.value is not None
        mid = TreeNode(next(self._node_ids), child.key[:k], child.value[:k].clone() if on_device else None, parent)
        mid.full_lock_ref = child.full_lock_ref  # every lock through child passes through mid
        mid.last_access = child.last_access
        mid.mamba_last_access = child.mamba_last_access
        if child.host_start is not None:  # the host range splits with the edge
            mid.host_start = child.host_start
            child.host_start += k
        child.key = child.key[k:]
        child.value = child.value[k:].clone() if on_device else None
        child.parent = mid
        mid.children[self._child_key(child.key)] = child
        parent.children[self._child_key(mid.key)] = mid
        self._num_nodes += 1
        self._reindex(child)  # a shorter edge: less KV to free (Marconi's efficiency)
        self._reindex(mid)  # with the host tier mid may be a candidate (its only child on the host)
        return mid

    def _add_leaf(self, parent: TreeNode, key: tuple[int, ...], value: torch.Tensor, mamba_slot: int) -> TreeNode:
        node = TreeNode(next(self._node_ids), key, value.clone(), parent)
        parent.children[self._child_key(key)] = node
        self._mark_kv(value, True)
        self._cached_tokens += len(key)
        self._num_nodes += 1
        self._set_mamba(node, mamba_slot)
        self._counters["inserted_tokens"] += len(key)
        self._reindex(parent)
        return node

    def _set_mamba(self, node: TreeNode, slot: int) -> None:
        node.mamba_slot = int(slot)
        self._mamba_owned[slot] = True
        self._mamba_held += 1
        self._counters["inserted_mamba"] += 1
        self._reindex(node)

    def _drop_mamba(self, node: TreeNode) -> None:
        """Free a node's (unlocked) Mamba state."""
        assert node.mamba_lock_ref == 0 and node.mamba_slot is not None
        self.mamba_pool.free([node.mamba_slot])
        self._mamba_owned[node.mamba_slot] = False
        node.mamba_slot = None
        self._mamba_held -= 1
        self._reindex(node)

    def _remove_leaf(self, node: TreeNode) -> tuple[int, int]:
        """Remove an unlocked leaf, freeing its KV and state on both tiers; returns the device
        (tokens, states) freed."""
        assert node.is_leaf and node.full_lock_ref == 0 and node.parent is not None
        freed_states = 0
        if node.mamba_slot is not None:
            self._drop_mamba(node)
            freed_states = 1
        self._drop_host(node)
        tokens = 0
        if node.value is not None:
            if node.value.numel():
                self.kv_allocator.free(node.value)
                self._mark_kv(node.value, False)
            tokens = len(node.key)
            self._cached_tokens -= tokens
        self._num_nodes -= 1
        parent = node.parent
        del parent.children[self._child_key(node.key)]
        node.parent = None
        node.removed = True
        node.value = _NO_SLOTS
        self._reindex(node)
        self._reindex(parent)
        return tokens, freed_states

    def _prune_stateless_leaves(self, node: TreeNode) -> tuple[int, TreeNode]:
        """Remove ``node`` and its ancestors while each is an unlocked non-root leaf without a
        state (a tombstone left childless); returns the tokens freed and the first node kept."""
        freed = 0
        while (
            node.parent is not None and node.is_leaf and not node.has_state and node.full_lock_ref == 0
            and node.host_pin == 0
        ):
            parent = node.parent
            freed += self._remove_leaf(node)[0]
            node = parent
        return freed, node

    # ------------------------------------------------------------------------------------
    # locks
    # ------------------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock ``node``'s Mamba state and the KV of its path to the root (no-op on the root).

        Only the root or a node holding a state can be locked (what :meth:`match_prefix` and
        :meth:`cache_unfinished_req` hand out), so every lock is undone by :meth:`dec_lock_ref`.
        """
        self._check_attached(node)
        if node is self.root:
            return
        if node.mamba_slot is None:
            raise ValueError(f"cannot lock {node!r}: it holds no Mamba state (lock the node of a hit)")
        if node.mamba_lock_ref == 0:
            self._mamba_protected += 1
        node.mamba_lock_ref += 1
        locked = node
        while node.parent is not None:
            if node.full_lock_ref == 0:
                self._protected_tokens += len(node.key)
            node.full_lock_ref += 1
            node = node.parent
        self._reindex(locked)  # (its ancestors have children: their candidacy does not change)

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one :meth:`inc_lock_ref` of ``node``."""
        self._check_attached(node)
        if node is self.root:
            return
        if node.mamba_lock_ref <= 0:
            raise ValueError(f"cannot unlock {node!r}: it is not locked")
        node.mamba_lock_ref -= 1
        if node.mamba_lock_ref == 0:
            self._mamba_protected -= 1
        unlocked = node
        while node.parent is not None:
            node.full_lock_ref -= 1
            if node.full_lock_ref == 0:
                self._protected_tokens -= len(node.key)
            node = node.parent
        self._reindex(unlocked)

    # ------------------------------------------------------------------------------------
    # match
    # ------------------------------------------------------------------------------------
    def match_prefix(self, token_ids: TokenIds) -> MatchResult:
        """Longest cached prefix of ``token_ids`` whose end has a Mamba state (see
        :class:`MatchResult`). A match ending inside an edge splits it there (the new parent
        holds KV only), so the branch point becomes a node. Marks the hit path as recently used.

        The caller limits ``token_ids`` to what may be skipped (a request must compute at
        least its last prompt token: pass ``prompt[:-1]``), and locks ``last_node`` before
        anything can evict (:meth:`inc_lock_ref`).
        """
        key = self._as_key(token_ids)
        node, pos = self.root, 0
        best, best_pos = self.root, 0  # deepest node with a state on either tier
        dev_best, dev_pos = self.root, 0  # deepest node with a device state (its path is on the device)
        while True:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            common = self._common_len(child.key, key, pos)
            if common < len(child.key):
                child = self._split(child, common)
            pos += common
            node = child
            if child.has_state:
                best, best_pos = child, pos
            if child.mamba_slot is not None:
                dev_best, dev_pos = child, pos
        if best is not dev_best and not self._load_back(best, dev_best):
            best, best_pos = dev_best, dev_pos  # the device cannot make room: the device-only hit
        now = self._tick()
        for n in self._path(best):
            n.last_access = now
            if self.host is not None:  # inner nodes are candidates too (host copies; host-only children)
                self._reindex(n)
        if best is not self.root:
            best.mamba_last_access = now
            self._reindex(best)  # (the rest of the path has children: not a candidate of either list)
        kv = self.path_kv_indices(best)
        branching = None
        if pos > best_pos:
            branching = last_aligned_boundary(best_pos, pos, self.mamba_align, self.page_size)
        c = self._counters
        c["lookups"] += 1
        c["lookup_tokens"] += len(key)
        c["kv_match_tokens"] += pos
        if best_pos:
            c["hits"] += 1
            c["hit_tokens"] += best_pos
            if best is not dev_best:
                c["host_hit_tokens"] += best_pos
        return MatchResult(
            kv_indices=kv,
            prefix_len=best_pos,
            last_node=best,
            mamba_node=None if best is self.root else best,
            kv_match_len=pos,
            branching_len=branching,
        )

    def _alloc_mamba_slot(self, protect: TreeNode | None) -> int | None:
        """One fresh (zeroed) Mamba slot, evicting one cached state if the pool is full while
        ``protect`` (the state about to be copied) stays locked; ``None`` if none can be had."""
        slots = self.mamba_pool.alloc(1)
        if slots is None:
            if protect is not None:
                self.inc_lock_ref(protect)
            try:
                self.evict_mamba(1)
            finally:
                if protect is not None:
                    self.dec_lock_ref(protect)
            slots = self.mamba_pool.alloc(1)
        return None if slots is None else int(slots[0])

    def cow_mamba(self, match: MatchResult, dst_slot: int | None = None) -> int | None:
        """Copy-on-write of a hit's Mamba state into the request's private slot.

        With ``dst_slot`` (a slot the request owns, e.g. from ``req_to_token.alloc``) the hit's
        state is copied into it. Without, a fresh slot is allocated (evicting one cached state
        if the pool is full) and returned; ``None`` if no slot can be had. With no hit
        (``match.mamba_node is None``) nothing is copied: ``dst_slot`` is returned as is, or a
        fresh zeroed slot (the state of the empty prefix).
        """
        node = match.mamba_node
        if node is not None:
            self._check_attached(node)
            if node.mamba_slot is None:
                raise RuntimeError(f"the state of {node!r} was evicted since the match: lock the node first")
        if dst_slot is None:
            dst = self._alloc_mamba_slot(protect=node)
            if dst is None:
                return None
        else:
            dst = int(dst_slot)
            self.mamba_pool.allocator.check_allocated(dst, action="copy a cached state into")
            if bool(self._mamba_owned[dst]):
                raise ValueError(f"Mamba slot {dst} belongs to the prefix cache, not to a request")
        if node is not None:
            self.mamba_pool.copy_slots([node.mamba_slot], [dst])
            node.mamba_last_access = self._tick()
            self._reindex(node)
            self._counters["mamba_hits"] += 1
        return dst

    # ------------------------------------------------------------------------------------
    # insert
    # ------------------------------------------------------------------------------------
    def _walk(self, key: tuple[int, ...]) -> tuple[int, torch.Tensor]:
        """Read-only: tokens of ``key`` whose KV the tree holds on the device (page-floored) and
        their slots."""
        node, pos = self.root, 0
        values: list[torch.Tensor] = []
        while True:
            child = node.children.get(self._child_key(key, pos))
            if child is None or child.value is None:
                break
            common = self._common_len(child.key, key, pos)
            values.append(child.value[:common])
            pos += common
            if common < len(child.key):
                break
            node = child
        return pos, (torch.cat(values) if values else _NO_SLOTS.clone())

    def _validate_request_kv(self, key: tuple[int, ...], kv: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Check a request's KV slots for ``key`` before the tree takes them: each is the tree's
        own slot for that position, or allocated, not the tree's and named once. Returns the
        tree's matched length and a mask of the request's own slots among the first ones."""
        if kv.numel() != len(key):
            raise ValueError(f"{len(key)} token ids but {kv.numel()} KV slots")
        matched, tree_kv = self._walk(key)
        own = torch.ones(len(key), dtype=torch.bool)
        own[:matched] = kv[:matched] != tree_kv
        own_slots = kv.masked_select(own)
        if own_slots.numel():
            allocated = self.kv_allocator.is_allocated(own_slots)  # raises on out-of-range slots
            if not bool(allocated.all()):
                raise ValueError(f"KV slot(s) {own_slots[~allocated][:8].tolist()} are not allocated")
            owned = self._kv_owned_at(own_slots)
            if bool(owned.any()):
                bad = own_slots[owned][:8].tolist()
                raise ValueError(f"KV slot(s) {bad} belong to the prefix cache at other positions")
            if own_slots.numel() > 1 and torch.unique(own_slots).numel() != own_slots.numel():
                raise ValueError("KV slots named more than once")
        return matched, own[:matched]

    def _kv_owned_at(self, slots: torch.Tensor) -> torch.Tensor:
        """The tree's ownership flags of KV ``slots``."""
        return self._kv_owned.index_select(0, slots.to(torch.int64))

    def _mark_kv(self, slots: torch.Tensor, owned: bool) -> None:
        self._kv_owned.index_fill_(0, slots.to(torch.int64), owned)

    def _check_page_layout(self, kv: torch.Tensor) -> None:
        ps = self.page_size
        if ps == 1 or kv.numel() == 0:
            return
        pages = kv.view(-1, ps)
        if bool((pages[:, 0] % ps != 0).any()) or bool((pages - pages[:, :1] != torch.arange(ps)).any()):
            raise ValueError(f"KV slots must fill whole pages in order (page_size={ps})")

    def _check_state_slot(self, slot: int) -> int:
        slot = int(slot)
        self.mamba_pool.allocator.check_allocated(slot, action="cache")
        if bool(self._mamba_owned[slot]):
            raise ValueError(f"Mamba slot {slot} already belongs to the prefix cache")
        return slot

    def _free_request_kv(self, kv: torch.Tensor) -> int:
        """Free the slots among ``kv`` that the tree does not own; returns how many."""
        own = kv.masked_select(~self._kv_owned_at(kv)) if kv.numel() else kv
        if own.numel():
            self.kv_allocator.free(own)
        return own.numel()

    def _insert_checked(
        self, key: tuple[int, ...], kv: torch.Tensor, mamba_slot: int | None, matched: int, dup: torch.Tensor
    ) -> tuple[int, TreeNode | None]:
        """Insert validated input; returns (tokens already cached, node ending at ``len(key)``
        or ``None`` when nothing holds a state there)."""
        now = self._tick()
        dup_slots = kv[:matched].masked_select(dup)
        if dup_slots.numel():
            self.kv_allocator.free(dup_slots)
            self._counters["duplicate_tokens_freed"] += dup_slots.numel()
        if mamba_slot is None:
            # KV without a state at its end can never be a hit: keep nothing new.
            self._free_request_kv(kv[matched:])
            return matched, None
        node, pos = self.root, 0
        while pos < matched:
            child = node.children[self._child_key(key, pos)]
            common = min(len(child.key), matched - pos)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = now
            if self.host is not None:
                self._reindex(child)
            pos += common
            node = child
        node, pos = self._adopt_host_only(node, key, kv, pos, now)
        if pos < len(key):
            end = self._add_leaf(node, key[pos:], kv[pos:], mamba_slot)
        elif node is self.root:
            self.mamba_pool.free([mamba_slot])  # empty sequence: nothing to cache
            return 0, None
        elif node.mamba_slot is None:
            self._set_mamba(node, mamba_slot)
            end = node
        else:
            self.mamba_pool.free([mamba_slot])
            self._counters["duplicate_mamba_freed"] += 1
            end = node
        end.last_access = now
        end.mamba_last_access = now
        self._reindex(end)
        return matched, end

    def _adopt_host_only(
        self, node: TreeNode, key: tuple[int, ...], kv: torch.Tensor, pos: int, now: int
    ) -> tuple[TreeNode, int]:
        """Below the device part of ``key``'s path: host-only nodes on the rest of it take the
        request's (validated, request-owned) device slots for their tokens, so they are on both
        tiers without a load back. Returns the last node and the tokens of ``key`` now covered."""
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            assert child.value is None, f"{child!r}: a device node below the device-matched prefix"
            common = self._common_len(child.key, key, pos)
            if common < len(child.key):
                child = self._split(child, common)
            slots = kv[pos : pos + common]
            child.value = slots.clone()
            self._mark_kv(slots, True)
            self._cached_tokens += common
            child.last_access = now
            self._reindex(child)
            self._reindex(node)
            pos += common
            node = child
        return node, pos

    def _prepare(self, token_ids: TokenIds, kv_indices: IndexLike) -> tuple[tuple[int, ...], torch.Tensor]:
        key = self._as_key(token_ids)
        kv = as_index_tensor(kv_indices)
        if kv.numel() != len(key):
            raise ValueError(f"{len(key)} token ids but {kv.numel()} KV slots")
        return key, kv

    def insert(self, token_ids: TokenIds, kv_indices: IndexLike, mamba_slot: int | None = None) -> int:
        """Cache a sequence (``cache_finished_req`` semantics); returns how many of its tokens
        the tree already held.

        Ownership of every slot passes to the tree: KV slots of tokens it already holds are
        freed (unless they are its own slots, i.e. the request's matched prefix), new tokens
        are adopted as a new leaf whose state is ``mamba_slot`` (the state after the last
        token). If the sequence ends at an existing node, ``mamba_slot`` becomes its state
        (a tombstone revives) or is freed if it has one. Without ``mamba_slot`` new tokens are
        freed, since KV with no state at its end can never be a hybrid hit.

        ``len(token_ids)`` must be a whole number of pages.
        """
        key, kv = self._prepare(token_ids, kv_indices)
        if len(key) % self.page_size:
            raise ValueError(f"insert: {len(key)} tokens is not a whole number of pages (page_size={self.page_size})")
        matched, dup = self._validate_request_kv(key, kv)
        self._check_page_layout(kv[matched:])
        if mamba_slot is not None:
            mamba_slot = self._check_state_slot(mamba_slot)
        return self._insert_checked(key, kv, mamba_slot, matched, dup)[0]

    def cache_finished_req(
        self,
        token_ids: TokenIds,
        kv_indices: IndexLike,
        last_node: TreeNode,
        mamba_slot: int | None = None,
        *,
        mamba_len: int | None = None,
    ) -> int:
        """A request is done: cache what it computed, free the rest, drop its lock.

        Args:
            token_ids, kv_indices: every token the request has KV for (``prompt + output[:-1]``)
                and its slots, the matched prefix (the tree's slots) included.
            last_node: the node the request locked (``match.last_node`` or the last
                ``cache_unfinished_req`` result's).
            mamba_slot: a slot (owned by the request, handed over here) holding the state after
                the first ``mamba_len`` tokens (default: all of them), or ``None``.

        The first ``mamba_len`` tokens are inserted with the state (see :meth:`insert`); a
        state at length 0 or at a length that is not a whole number of pages cannot be kept
        and is freed (then only duplicates of cached KV are resolved).
        Every other slot is freed. Returns the tokens the tree already held. Afterwards the
        request owns no KV slot and no Mamba slot (free its request slot with
        ``free_mamba=False``).
        """
        key, kv = self._prepare(token_ids, kv_indices)
        self._check_locked(last_node)
        cache_len = len(key) if mamba_len is None else int(mamba_len)
        if not 0 <= cache_len <= len(key):
            raise ValueError(f"mamba_len ({cache_len}) must lie in [0, {len(key)}]")
        if mamba_slot is not None:
            mamba_slot = self._check_state_slot(mamba_slot)
        keep_state = mamba_slot is not None and cache_len > 0 and cache_len % self.page_size == 0
        if not keep_state:
            cache_len = self.page_floor(len(key))
        self._validate_request_kv(key, kv)
        matched, dup = self._validate_request_kv(key[:cache_len], kv[:cache_len])
        self._check_page_layout(kv[matched:cache_len])
        # validated: from here on nothing raises
        if mamba_slot is not None and not keep_state:
            self.mamba_pool.free([mamba_slot])
        state = mamba_slot if keep_state else None
        cached, _ = self._insert_checked(key[:cache_len], kv[:cache_len], state, matched, dup)
        self._free_request_kv(kv[cache_len:])
        self.dec_lock_ref(last_node)
        return cached

    def cache_unfinished_req(
        self,
        token_ids: TokenIds,
        kv_indices: IndexLike,
        last_node: TreeNode,
        mamba_slot: int,
        *,
        adopt_mamba: bool = False,
    ) -> UnfinishedCacheResult:
        """Cache the computed prefix of a running request (chunked prefill) and move its lock.

        Args:
            token_ids, kv_indices: the prefix to cache (a whole number of pages) and the
                request's slots for it; the request keeps its slots beyond it.
            last_node: the node the request holds a lock on.
            mamba_slot: a slot holding the state after exactly ``token_ids``. By default it is
                the request's working slot and is forked (copied into a fresh slot for the
                tree, evicting one cached state if the pool is full); with ``adopt_mamba=True``
                it is a checkpoint slot (from chunk-boundary tracking) handed over to the tree.

        The request's duplicates of cached KV are freed: it must switch to the returned
        ``kv_indices`` (write them into ``req_to_token``) and keep the returned ``last_node``
        for the next call or :meth:`cache_finished_req`.
        """
        key, kv = self._prepare(token_ids, kv_indices)
        self._check_locked(last_node)
        if len(key) % self.page_size:
            raise ValueError(
                f"cache_unfinished_req: {len(key)} tokens is not a whole number of pages (page_size={self.page_size})"
            )
        locked_len = sum(len(n.key) for n in self._path(last_node))
        if len(key) < locked_len:
            raise ValueError(
                f"cache_unfinished_req: {len(key)} tokens is shorter than the request's locked prefix ({locked_len})"
            )
        unchanged = UnfinishedCacheResult(kv, last_node, locked_len, 0, False)
        if not key:
            if adopt_mamba:
                self.mamba_pool.free([self._check_state_slot(mamba_slot)])
            return unchanged
        if adopt_mamba:
            state = self._check_state_slot(mamba_slot)
        else:
            self.mamba_pool.allocator.check_allocated(int(mamba_slot), action="fork")
            state = self._alloc_mamba_slot(protect=None if last_node is self.root else last_node)
            if state is None:
                return unchanged
            self.mamba_pool.copy_slots([int(mamba_slot)], [state])
        try:
            matched, dup = self._validate_request_kv(key, kv)
            self._check_page_layout(kv[matched:])
        except ValueError:
            if not adopt_mamba:
                self.mamba_pool.free([state])
            raise
        cached, end = self._insert_checked(key, kv, state, matched, dup)
        assert end is not None
        if end is not last_node:
            self.inc_lock_ref(end)
            self.dec_lock_ref(last_node)
        return UnfinishedCacheResult(self.path_kv_indices(end), end, len(key), cached, True)

    # ------------------------------------------------------------------------------------
    # host tier
    # ------------------------------------------------------------------------------------
    def _drop_host(self, node: TreeNode) -> None:
        """Free a node's host copies (KV range and state)."""
        if node.host_start is not None:
            self.host.free_kv(node.host_start, len(node.key))
            node.host_start = None
            self._host_tokens -= len(node.key)
            self._counters["host_evicted_tokens"] += len(node.key)
        if node.host_mamba is not None:
            self.host.free_mamba(node.host_mamba)
            node.host_mamba = None
            self._host_states -= 1
            self._counters["host_evicted_states"] += 1
        self._reindex(node)

    def evict_host(self, kv_tokens: int = 0, mamba_slots: int = 0) -> bool:
        """Free host space until a range of ``kv_tokens`` host token slots and ``mamba_slots``
        host Mamba slots are free, in the policy's order (:meth:`host_eviction_order`): a node
        whose KV is on the device loses its host copies; a host-only leaf is removed (and so are
        ancestors it leaves as state-less leaves). True if the room is there afterwards."""
        host = self.host

        def room() -> bool:
            return (kv_tokens <= 0 or host.kv_allocator.largest_free() >= kv_tokens) and (
                host.mamba_allocator.available() >= mamba_slots
            )

        with self._host_index.ranking() as ranking:
            while not room():
                node = ranking.pop()
                if node is None:
                    break
                if not self._host_evictable(node):
                    continue
                parent = node.parent
                if node.value is None:
                    self._remove_leaf(node)
                    self._prune_stateless_leaves(parent)
                else:
                    self._drop_host(node)
                    self._prune_stateless_leaves(node)  # a device leaf whose only state was on the host
        return room()

    def host_eviction_order(self) -> list[TreeNode]:
        """The nodes :meth:`evict_host` may free now, first victim first (the reference order)."""
        eligible = [n for n in self.nodes() if self._host_evictable(n)]
        return self.policy.rank(eligible, _kv_access, self._kv_efficiency)

    def _write_state_to_host(self, node: TreeNode, *, evict: bool) -> bool:
        """Give ``node``'s device state a host copy (evicting host space first with ``evict``);
        True if it has one afterwards."""
        if self.host is None or node.host_mamba is not None:
            return node.host_mamba is not None
        if evict and not self.evict_host(mamba_slots=1):
            return False
        slot = self.host.write_mamba(node.mamba_slot)
        if slot is None:
            return False
        node.host_mamba = slot
        self._host_states += 1
        self._counters["host_written_states"] += 1
        return True

    def _offload(self, node: TreeNode) -> bool:
        """Move an unlocked device-leaf node (KV and state) to the host: write what has no host
        copy yet, free the device slots, keep the node. False (nothing changed) without a host
        tier or when the host cannot make room."""
        if self.host is None:
            return False
        need_kv = node.host_start is None
        need_state = node.mamba_slot is not None and node.host_mamba is None
        node.host_pin += 1  # its own host copies must survive the host eviction below
        self._reindex(node)
        try:
            ok = self.evict_host(len(node.key) if need_kv else 0, int(need_state))
        finally:
            node.host_pin -= 1
            self._reindex(node)
        if not ok:
            self._counters["host_write_failed"] += 1
            return False
        if not node.children and not node.has_state:  # its host-only children were evicted just now
            parent = node.parent
            self._remove_leaf(node)
            self._prune_stateless_leaves(parent)
            return True
        if need_kv:
            node.host_start = self.host.write_kv(node.value)
            self._host_tokens += len(node.key)
            self._counters["host_written_tokens"] += len(node.key)
        if need_state:
            self._write_state_to_host(node, evict=False)
        if node.mamba_slot is not None:
            self._drop_mamba(node)
        self.kv_allocator.free(node.value)
        self._mark_kv(node.value, False)
        self._cached_tokens -= len(node.key)
        node.value = None
        self._reindex(node)
        self._reindex(node.parent)  # it may be a leaf of the device part now
        return True

    def _remove_with_host_descendants(self, node: TreeNode) -> tuple[int, int]:
        """Remove a device-leaf node with its host-only subtree (its host copies lost); returns
        the device (tokens, states) freed."""
        for child in list(node.children.values()):
            self._remove_with_host_descendants(child)
        return self._remove_leaf(node)

    def _pin_path(self, node: TreeNode, delta: int) -> None:
        """Count one more (``delta=1``) or one less full lock on the path to ``node``: its KV
        stays on the device while a load back allocates (no Mamba lock: it may hold no state)."""
        while node.parent is not None:
            if delta > 0 and node.full_lock_ref == 0:
                self._protected_tokens += len(node.key)
            node.full_lock_ref += delta
            if delta < 0 and node.full_lock_ref == 0:
                self._protected_tokens -= len(node.key)
            self._reindex(node)
            node = node.parent

    def _load_back(self, best: TreeNode, dev_best: TreeNode) -> bool:
        """Bring the KV of the path to ``best`` and ``best``'s state onto the device (fresh
        device slots, copied from the host; the host copies stay). ``dev_best`` (the deepest
        node of the path with a device state) keeps its state meanwhile. False when the device
        pools cannot make room (nothing loaded)."""
        path = self._path(best)
        to_load = [n for n in path if n.value is None]
        anchor = path[len(path) - len(to_load) - 1] if len(to_load) < len(path) else self.root
        tokens = sum(len(n.key) for n in to_load)
        need_state = best.mamba_slot is None
        for n in path:
            n.host_pin += 1
            self._reindex(n)
        self.inc_lock_ref(dev_best)
        self._pin_path(anchor, 1)
        try:
            ok = self.ensure_free(kv_tokens=tokens, mamba_slots=int(need_state))
            if ok:
                kv = self.kv_allocator.alloc(tokens) if tokens else _NO_SLOTS
                state = self.mamba_pool.alloc(1) if need_state else None
                assert kv is not None and (state is not None or not need_state)
        finally:
            self._pin_path(anchor, -1)
            self.dec_lock_ref(dev_best)
            for n in path:
                n.host_pin -= 1
        if not ok:
            for n in path:
                self._reindex(n)
            self._counters["host_load_failed"] += 1
            return False
        pos = 0
        for n in to_load:
            slots = kv[pos : pos + len(n.key)]
            pos += len(n.key)
            self.host.load_kv(n.host_start, slots)
            n.value = slots.clone()
            self._mark_kv(slots, True)
            self._cached_tokens += len(n.key)
        if need_state:
            slot = int(state[0])
            self.host.load_mamba(best.host_mamba, slot)
            best.mamba_slot = slot
            self._mamba_owned[slot] = True
            self._mamba_held += 1
        for n in (anchor, *path):
            self._reindex(n)
        c = self._counters
        c["host_hits"] += 1
        c["host_loaded_tokens"] += tokens
        c["host_loaded_states"] += int(need_state)
        return True

    # ------------------------------------------------------------------------------------
    # eviction
    # ------------------------------------------------------------------------------------
    @property
    def marconi_alpha(self) -> float:
        """Marconi's weight of FLOP efficiency in its eviction score (unused by other policies)."""
        return getattr(self.policy, "alpha", self._marconi_alpha)

    @marconi_alpha.setter
    def marconi_alpha(self, value: float) -> None:
        self._marconi_alpha = float(value)
        if hasattr(self.policy, "alpha"):
            self.policy.alpha = float(value)

    def flop_efficiency(self, node: TreeNode, with_kv: bool = True) -> float:
        """Compute a hit at ``node`` saves per byte evicting it frees (Marconi): its state, and
        with ``with_kv`` (KV eviction of a leaf) its edge's KV too."""
        held = len(node.key) * self.pools.kv.bytes_per_token if with_kv else 0
        if node.mamba_slot is not None:
            held += self.mamba_pool.bytes_per_slot
        return self.prefix_flops(node.prefix_len) / max(held, 1)

    def _kv_efficiency(self, node: TreeNode) -> float:
        return self.flop_efficiency(node, with_kv=True)

    def _mamba_efficiency(self, node: TreeNode) -> float:
        return self.flop_efficiency(node, with_kv=False)

    def _kv_evictable(self, node: TreeNode) -> bool:
        # a leaf of the device part of the tree (its children, if any, live on the host only)
        if node.removed or node.parent is None or node.value is None or node.full_lock_ref:
            return False
        if self.host is None:
            return node.is_leaf
        return not any(c.value is not None for c in node.children.values())

    def _host_evictable(self, node: TreeNode) -> bool:
        # a host-only leaf, or a node whose host copies duplicate the device (dropping them is free)
        if node.removed or node.parent is None or node.host_pin:
            return False
        if node.host_start is None and node.host_mamba is None:
            return False
        return node.value is not None or not node.children

    def _mamba_evictable(self, node: TreeNode) -> bool:
        if node.removed or node.mamba_slot is None or node.mamba_lock_ref:
            return False
        return bool(node.children) or node.full_lock_ref == 0

    def _reindex(self, node: TreeNode) -> None:
        """Tell the eviction indexes that ``node``'s candidacy or key may have changed."""
        self._kv_index.update(node)
        self._mamba_index.update(node)
        if self._host_index is not None:
            self._host_index.update(node)

    def kv_eviction_order(self) -> list[TreeNode]:
        """The leaves :meth:`evict_kv` may remove now, first victim first (the KV LRU list):
        every node of the tree sorted by the policy's key (the reference the index follows)."""
        eligible = [n for n in self.nodes() if self._kv_evictable(n)]
        return self.policy.rank(eligible, _kv_access, self._kv_efficiency)

    def mamba_eviction_order(self) -> list[TreeNode]:
        """The nodes whose state :meth:`evict_mamba` may free now, first victim first (the
        Mamba LRU list): every node of the tree sorted by the policy's key."""
        eligible = [n for n in self.nodes() if self._mamba_evictable(n)]
        return self.policy.rank(eligible, _mamba_access, self._mamba_efficiency)

    def evict_kv(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` KV slots if possible by removing unlocked leaves (KV
        and state) in the policy's order (:meth:`kv_eviction_order` at the start of the call); a
        parent left as a leaf becomes a candidate (removed at once if it is a tombstone).
        Returns the KV tokens freed."""
        if num_tokens <= 0:
            return 0
        freed = 0
        c = self._counters
        with self._kv_index.ranking() as ranking:
            while freed < num_tokens:
                leaf = ranking.pop()
                if leaf is None:
                    break
                if not self._kv_evictable(leaf):
                    continue
                parent = leaf.parent
                tokens, states = len(leaf.key), int(leaf.mamba_slot is not None)
                if not self._offload(leaf):  # no host tier, or no room there: drop it
                    tokens, states = self._remove_with_host_descendants(leaf)
                    # a parent left as a leaf joins the ranking (_reindex); a tombstone one goes now
                    freed += self._prune_stateless_leaves(parent)[0]
                freed += tokens
                c["kv_evicted_nodes"] += 1
                c["kv_evicted_mamba"] += states
        c["kv_evicted_tokens"] += freed
        return freed

    def evict_mamba(self, num_slots: int) -> int:
        """Free at least ``num_slots`` cached states if possible, in the policy's order of use
        (:meth:`mamba_eviction_order` at the start of the call): an internal node becomes a
        tombstone (its KV stays for its children); a leaf is removed with its KV (and so are
        tombstone ancestors it leaves childless). Returns states freed."""
        if num_slots <= 0:
            return 0
        freed = 0
        c = self._counters
        with self._mamba_index.ranking() as ranking:
            while freed < num_slots:
                node = ranking.pop()
                if node is None:
                    break
                if not self._mamba_evictable(node):
                    continue
                if node.children:
                    self._write_state_to_host(node, evict=False)  # kept if the host has a free slot
                    self._drop_mamba(node)
                    c["tombstones_created"] += not node.has_state
                elif self._offload(node):
                    c["mamba_evicted_tokens"] += len(node.key)
                else:
                    parent = node.parent
                    tokens = self._remove_leaf(node)[0]
                    tokens += self._prune_stateless_leaves(parent)[0]
                    c["mamba_evicted_tokens"] += tokens
                freed += 1
        c["mamba_evicted"] += freed
        return freed

    def ensure_free(self, kv_tokens: int = 0, mamba_slots: int = 0) -> bool:
        """Evict until the KV allocator has ``kv_tokens`` free slots (count whole pages:
        ``pages * page_size``) and the Mamba pool ``mamba_slots`` free slots; True if both
        hold afterwards (the scheduler's proactive eviction before allocating)."""
        short = kv_tokens - self.kv_allocator.available()
        if short > 0:
            self.evict_kv(short)
        short = mamba_slots - self.mamba_pool.available()
        if short > 0:
            self.evict_mamba(short)
        return self.kv_allocator.available() >= kv_tokens and self.mamba_pool.available() >= mamba_slots

    # ------------------------------------------------------------------------------------
    # accounting
    # ------------------------------------------------------------------------------------
    def cached_tokens(self) -> int:
        """KV tokens held by the tree."""
        return self._cached_tokens

    def evictable_size(self) -> int:
        """KV tokens :meth:`evict_kv` could free now (all unlocked nodes)."""
        return self._cached_tokens - self._protected_tokens

    def protected_size(self) -> int:
        """KV tokens locked by running requests."""
        return self._protected_tokens

    def mamba_size(self) -> int:
        """Mamba slots held by the tree."""
        return self._mamba_held

    def mamba_evictable_size(self) -> int:
        """Cached states :meth:`evict_mamba` could free now."""
        return self._mamba_held - self._mamba_protected

    def mamba_protected_size(self) -> int:
        return self._mamba_protected

    def stats(self) -> dict:
        """Tree size, lock totals and counters since construction / :meth:`reset`."""
        nodes = list(self.nodes())
        return {
            "policy": self.policy.name,
            "page_size": self.page_size,
            "mamba_align": self.mamba_align,
            "cached_tokens": self._cached_tokens,
            "nodes": len(nodes),
            "leaves": sum(1 for n in nodes if n.is_leaf),
            "tombstones": sum(1 for n in nodes if n.is_tombstone),
            "mamba_slots": self._mamba_held,
            "evictable_tokens": self.evictable_size(),
            "protected_tokens": self._protected_tokens,
            "evictable_mamba_slots": self.mamba_evictable_size(),
            "protected_mamba_slots": self._mamba_protected,
            "kv_bytes": self._cached_tokens * self.pools.kv.bytes_per_token,
            "mamba_bytes": self._mamba_held * self.mamba_pool.bytes_per_slot,
            "memory_bytes": self._cached_tokens * self.pools.kv.bytes_per_token
            + self._mamba_held * self.mamba_pool.bytes_per_slot,
            **self._counters,
            "host_tier": self.host is not None,
            **(self._host_stats(nodes) if self.host is not None else {}),
        }

    def _host_stats(self, nodes: list[TreeNode]) -> dict:
        tiers = [n.tier for n in nodes]
        c = self._counters
        return {
            "host_cached_tokens": self._host_tokens,
            "host_mamba_slots": self._host_states,
            "host_bytes_held": self._host_tokens * self.host.bytes_per_token
            + self._host_states * self.host.bytes_per_mamba_slot,
            "nodes_device_only": tiers.count("device"),
            "nodes_host_only": tiers.count("host"),
            "nodes_both": tiers.count("both"),
            "host_hit_rate": c["host_hit_tokens"] / c["lookup_tokens"] if c["lookup_tokens"] else 0.0,
            "host_pool": self.host.summary(),
        }

    def pools_resized(self) -> None:
        """The pools grew or shrank (elastic pools: free entries only, at the top): resize the
        ownership masks (the entries taken away were free, so owned by nobody) and the host
        tier's device buffers."""
        for name, n in (("_kv_owned", self.kv_allocator.num_slots), ("_mamba_owned", self.mamba_pool.total())):
            old = getattr(self, name)
            new = torch.zeros(n, dtype=torch.bool)
            keep = min(n, old.numel())
            assert not bool(old[keep:].any()), f"{name}: an entry taken away belongs to the tree"
            new[:keep] = old[:keep]
            setattr(self, name, new)
        if self.host is not None:
            self.host.refresh_device_buffers(self.pools.kv, self.mamba_pool)

    def reset(self, *, force: bool = False) -> None:
        """Free every slot the tree holds and empty it (counters too). Raises RuntimeError while
        a node is locked unless ``force`` (the lockers' nodes become invalid)."""
        if self._protected_tokens and not force:
            raise RuntimeError(f"reset: {self._protected_tokens} cached tokens are locked by running requests")
        kv = [n.value for n in self.nodes() if n.value is not None]
        states = [n.mamba_slot for n in self.nodes() if n.mamba_slot is not None]
        for n in self.nodes():
            n.removed = True
            if n.host_start is not None:
                self.host.free_kv(n.host_start, len(n.key))
            if n.host_mamba is not None:
                self.host.free_mamba(n.host_mamba)
        if kv:
            self.kv_allocator.free(torch.cat(kv))
        if states:
            self.mamba_pool.free(states)
        self._kv_owned.zero_()
        self._mamba_owned.zero_()
        self._init_tree()

    def check_invariants(self) -> None:
        """Walk the whole tree and raise AssertionError on any broken invariant: structure,
        page alignment, locks (``full == mamba + sum(children.full)``, so ``full >= mamba``),
        every non-root leaf holds a state, ownership masks and pool allocation, counters."""
        ps = self.page_size
        assert self.root.mamba_slot is None and self.root.full_lock_ref == 0 and self.root.mamba_lock_ref == 0
        kv_parts, states = [], []
        host_ranges, host_states = [], []
        tokens = protected = mamba_protected = count = 0
        for node in self.nodes():
            count += 1
            assert not node.removed and node.parent is not None
            assert node.parent.children.get(self._child_key(node.key)) is node, f"{node!r}: bad child key"
            assert len(node.key) > 0 and len(node.key) % ps == 0, f"{node!r}: edge not whole pages"
            assert node.host_pin == 0, f"{node!r}: pinned outside a load back"
            if node.host_start is not None:
                host_ranges.append((node.host_start, len(node.key)))
            if node.host_mamba is not None:
                host_states.append(node.host_mamba)
            if node.value is None:  # host only: so are its children; no lock, no device state
                assert node.host_start is not None, f"{node!r}: KV on neither tier"
                assert node.full_lock_ref == 0 and node.mamba_slot is None, f"{node!r}: host-only but locked / device state"
                assert all(c.value is None for c in node.children.values()), f"{node!r}: device child of a host-only node"
                assert node.children or node.has_state, f"{node!r}: a leaf without a state"
            for ck, child in node.children.items():
                assert child.parent is node and self._child_key(child.key) == ck
            if node.value is None:
                continue
            assert node.value.dtype == torch.int64 and node.value.numel() == len(node.key)
            children_full = sum(ch.full_lock_ref for ch in node.children.values())
            assert node.mamba_lock_ref >= 0
            assert node.full_lock_ref == node.mamba_lock_ref + children_full, f"{node!r}: lock counts"
            if node.mamba_slot is None:
                assert node.mamba_lock_ref == 0
                assert node.children or node.host_mamba is not None, f"{node!r}: a leaf without a Mamba state"
            else:
                states.append(node.mamba_slot)
                mamba_protected += node.mamba_lock_ref > 0
            self._check_page_layout(node.value)
            kv_parts.append(node.value)
            tokens += len(node.key)
            protected += len(node.key) if node.full_lock_ref else 0
        kv = torch.cat(kv_parts) if kv_parts else _NO_SLOTS
        assert torch.unique(kv).numel() == kv.numel(), "a KV slot is in two nodes"
        assert bool(self.kv_allocator.is_allocated(kv).all()), "the tree holds a freed KV slot"
        mask = torch.zeros_like(self._kv_owned)
        mask[kv] = True
        assert torch.equal(mask, self._kv_owned), "KV ownership mask out of step"
        assert len(set(states)) == len(states), "a Mamba slot is in two nodes"
        if states:
            assert bool(self.mamba_pool.allocator.is_allocated(states).all()), "the tree holds a freed Mamba slot"
        mmask = torch.zeros_like(self._mamba_owned)
        mmask[torch.tensor(states, dtype=torch.int64)] = True
        assert torch.equal(mmask, self._mamba_owned), "Mamba ownership mask out of step"
        assert (count, tokens, protected) == (self._num_nodes, self._cached_tokens, self._protected_tokens)
        assert (len(states), mamba_protected) == (self._mamba_held, self._mamba_protected)
        nodes = list(self.nodes())
        for node in nodes:
            assert node.prefix_len == node.parent.prefix_len + len(node.key), f"{node!r}: prefix length"
        indexes = [(self._kv_index, self._kv_evictable, _kv_access), (self._mamba_index, self._mamba_evictable, _mamba_access)]
        if self.host is None:
            assert not host_ranges and not host_states, "host copies without a host tier"
        else:
            indexes.append((self._host_index, self._host_evictable, _kv_access))
            host_mask = torch.zeros(self.host.kv_capacity(), dtype=torch.bool)
            for start, n in host_ranges:
                assert not bool(host_mask[start : start + n].any()), "a host KV slot is in two nodes"
                host_mask[start : start + n] = True
            assert torch.equal(host_mask, self.host.kv_allocator._in_use), "host KV ranges out of step with the host pool"
            assert sum(n for _, n in host_ranges) == self._host_tokens
            assert len(set(host_states)) == len(host_states) == self._host_states, "host Mamba slots"
            assert self.host.mamba_allocator.used() == len(host_states)
            if host_states:
                assert bool(self.host.mamba_allocator.is_allocated(host_states).all())
        for index, evictable, access in indexes:
            expected = {n.id: access(n) for n in nodes if evictable(n)}
            assert {nid: rec[2] if len(rec) > 3 else rec[1] for nid, rec in index.rec.items()} == expected, \
                "eviction index out of step with the tree"


__all__ = [
    "HybridRadixCache",
    "MatchResult",
    "TreeNode",
    "UnfinishedCacheResult",
    "aligned_checkpoint_len",
    "last_aligned_boundary",
]
