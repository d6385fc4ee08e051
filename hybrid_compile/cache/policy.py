"""Prefix-cache policies: where recurrent states are checkpointed for the cache, and in which order
the cache evicts.

A policy is a small strategy object shared by the radix tree (:class:`~.radix_cache.HybridRadixCache`,
``cache.policy``) and the scheduler, which asks it instead of branching on a name:

- **Checkpoint placement** (:meth:`PrefixCachePolicy.checkpoint_len`): the sequence length inside
  an extend (or after a decode token) whose state goes to the cache. The chunked SSM kernels expose
  states only every ``mamba_align`` tokens of an extend, on a KV page (:func:`aligned_checkpoint_len`).
- **Eviction order** (:meth:`PrefixCachePolicy.rank`, the reference: sort every candidate by the
  policy's key, lowest first, ties by node id) and an incremental :class:`EvictionIndex` that gives
  the same order without looking at every node on each eviction call.

Policies (:data:`POLICIES`, the one registry of names; :func:`make_policy` / :func:`check_policy_name`
validate a name for ``EngineConfig.prefix_cache_policy`` and the cache alike):

- ``"lru"`` (SGLang): checkpoint the branch point if it is on a chunk boundary of the extend, else the
  extend's last chunk boundary; decoding requests every ``decode_interval`` tokens. Evict the least
  recently used first (key ``(last access, id)``); O(log n) per evicted node (a lazy-deletion heap).
- ``"marconi"`` (Marconi, arXiv 2411.19379): checkpoint branch points only (and the finish-time state).
  Evict nodes with at most one child before branch points, each tier lowest
  ``recency + alpha * flop_efficiency`` first, both min-max normalised over the candidates of the
  eviction call. The normalisation changes with every call, so no fixed order exists: the index
  groups the candidates by (tier, efficiency), each group a heap by recency (its first node is its
  best, the score being monotone in both), and a call visits the groups in ascending efficiency only
  while a group's efficiency alone could still beat the best node found (exact; the cost grows with
  the number of groups visited, not with n: O(g log n) for g groups of efficiency below the best
  score, every group only in the worst case).

:class:`NoPrefixCachePolicy` is the policy of the null cache (``enable_prefix_cache=False``): no
checkpoints, nothing to evict.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from typing import Callable, Iterable

_BRANCH_TIER = 1e6  # Marconi: added to a branch point's score (every normalised score is < 2 + alpha)


# ----------------------------------------------------------------------------------------
# checkpoint grid
# ----------------------------------------------------------------------------------------
def last_aligned_boundary(start: int, end: int, mamba_align: int, page_size: int = 1) -> int | None:
    """Largest ``b`` in ``(start, end]`` with ``(b - start) % mamba_align == 0`` (an SSM chunk
    boundary of an extend starting at ``start``) and ``b % page_size == 0`` (a KV page
    boundary, where a tree node may end); ``None`` if there is none."""
    if mamba_align < 1 or page_size < 1:
        raise ValueError(f"mamba_align ({mamba_align}) and page_size ({page_size}) must be >= 1")
    step = mamba_align
    offset = ((end - start) // step) * step
    while offset > 0:
        if (start + offset) % page_size == 0:
            return start + offset
        offset -= step
    return None


def aligned_checkpoint_len(
    prefix_len: int,
    extend_len: int,
    *,
    mamba_align: int,
    page_size: int = 1,
    branching_len: int | None = None,
) -> int | None:
    """Sequence length at which an extend of ``extend_len`` tokens after ``prefix_len`` cached
    ones can checkpoint its recurrent state for the prefix cache, or ``None``.

    The chunked SSM kernels produce the state after every ``mamba_align`` tokens of the extend
    (chunk states ``h``) and at its end, so a checkpoint must lie ``k * mamba_align`` tokens
    after ``prefix_len``; it must also end on a KV page. A branch point (where the request's
    tokens leave a cached path: :attr:`~.radix_cache.MatchResult.branching_len`) inside the
    extend is preferred when it is such a boundary, since other requests share the prefix up to
    it; otherwise the last boundary of the extend is chosen.
    """
    if prefix_len < 0 or extend_len < 0:
        raise ValueError(f"prefix_len ({prefix_len}) and extend_len ({extend_len}) must be >= 0")
    end = prefix_len + extend_len
    if (
        branching_len is not None
        and prefix_len < branching_len < end
        and (branching_len - prefix_len) % mamba_align == 0
        and branching_len % page_size == 0
    ):
        return branching_len
    return last_aligned_boundary(prefix_len, end, mamba_align, page_size)


# ----------------------------------------------------------------------------------------
# policies
# ----------------------------------------------------------------------------------------
class PrefixCachePolicy:
    """Base of the policies: checkpoint placement and eviction order (module docstring)."""

    name = ""
    # the scheduler holds back a request that shares a not yet cached prefix with a running one
    # until that one has checkpointed the shared part (Scheduler._wait_for_shared_prefix)
    waits_for_shared_prefix = True

    # -- checkpoint placement -------------------------------------------------------------
    def checkpoint_len(
        self,
        prefix_len: int,
        extend_len: int,
        *,
        mamba_align: int,
        page_size: int,
        cached_len: int = 0,
        branching_len: int | None = None,
        decode_interval: int = 0,
    ) -> int | None:
        """Sequence length inside an extend of ``extend_len`` tokens after ``prefix_len`` whose
        state goes to the cache, or None. A decode token (one token on top of a state) may
        checkpoint the state after it (:meth:`_decode_checkpoint`); an extend only on the
        checkpoint grid (:func:`aligned_checkpoint_len`, then :meth:`_extend_checkpoint`). Never at
        or below ``cached_len`` (what the request already holds in the cache)."""
        if extend_len <= 1 and prefix_len > 0:
            length = prefix_len + extend_len
            if length <= cached_len or length % page_size or not self._decode_checkpoint(length, decode_interval):
                return None
            return length
        length = aligned_checkpoint_len(
            prefix_len, extend_len, mamba_align=mamba_align, page_size=page_size, branching_len=branching_len
        )
        if length is None or length <= cached_len:
            return None
        return self._extend_checkpoint(length, branching_len)

    def _decode_checkpoint(self, length: int, decode_interval: int) -> bool:
        raise NotImplementedError

    def _extend_checkpoint(self, length: int, branching_len: int | None) -> int | None:
        raise NotImplementedError

    # -- eviction order ---------------------------------------------------------------------
    def rank(self, candidates: Iterable, access: Callable, efficiency: Callable) -> list:
        """Reference order: the candidates sorted by the policy's key, first victim first."""
        raise NotImplementedError

    def eviction_index(self, evictable: Callable, access: Callable, efficiency: Callable) -> "EvictionIndex":
        """An incremental index of one eviction list (KV leaves, or Mamba states)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class LRUPolicy(PrefixCachePolicy):
    """SGLang's policy: checkpoint every chunk boundary (the branch point first) and every
    ``decode_interval`` decode tokens; evict the least recently used first."""

    name = "lru"

    def _decode_checkpoint(self, length: int, decode_interval: int) -> bool:
        return bool(decode_interval) and length % decode_interval == 0

    def _extend_checkpoint(self, length: int, branching_len: int | None) -> int | None:
        return length

    def rank(self, candidates, access, efficiency) -> list:
        return sorted(candidates, key=lambda n: (access(n), n.id))

    def eviction_index(self, evictable, access, efficiency) -> "EvictionIndex":
        return LRUIndex(evictable, access)


class MarconiPolicy(PrefixCachePolicy):
    """Marconi: checkpoint only branch points (the finish-time state covers the rest); evict by
    normalised recency + ``alpha`` x FLOP efficiency, branch points last."""

    name = "marconi"

    def __init__(self, alpha: float = 1.0) -> None:
        self.alpha = float(alpha)

    def _decode_checkpoint(self, length: int, decode_interval: int) -> bool:
        return False

    def _extend_checkpoint(self, length: int, branching_len: int | None) -> int | None:
        return length if length == branching_len else None

    @staticmethod
    def norms(times: list[int], effs: list[float]) -> tuple[int, int, float]:
        """Min-max normalisers over the candidates: (min access, access span, max efficiency)."""
        t0 = min(times)
        return t0, max(max(times) - t0, 1), max(max(effs), 1e-30)

    def score(self, t: int, e: float, tier: int, norms: tuple[int, int, float]) -> float:
        """The score (lower goes first): monotone in ``t`` and ``e`` (for ``alpha >= 0``)."""
        t0, span, eff_max = norms
        score = (t - t0) / span + self.alpha * e / eff_max
        # a branch point (>= 2 children: a prefix several sequences share) goes only after every
        # node with at most one child (Marconi evicts from those first)
        return score + (_BRANCH_TIER if tier else 0.0)

    def rank(self, candidates, access, efficiency) -> list:
        candidates = list(candidates)
        if not candidates:
            return []
        times = [access(n) for n in candidates]
        effs = [efficiency(n) for n in candidates]
        norms = self.norms(times, effs)
        keyed = [
            (self.score(t, e, _tier(n), norms), n.id, n) for n, t, e in zip(candidates, times, effs)
        ]
        return [n for _, _, n in sorted(keyed, key=lambda k: k[:2])]

    def eviction_index(self, evictable, access, efficiency) -> "EvictionIndex":
        return MarconiIndex(self, evictable, access, efficiency)

    def __repr__(self) -> str:
        return f"MarconiPolicy(alpha={self.alpha})"


class NoPrefixCachePolicy(PrefixCachePolicy):
    """The null cache's policy: nothing is checkpointed, nothing held back, nothing evicted."""

    name = "off"
    waits_for_shared_prefix = False

    def checkpoint_len(self, prefix_len, extend_len, *, mamba_align, page_size, cached_len=0, branching_len=None,
                       decode_interval=0) -> None:
        return None

    def rank(self, candidates, access, efficiency) -> list:
        return []


def _tier(node) -> int:
    return 1 if len(node.children) >= 2 else 0


POLICIES: dict[str, type[PrefixCachePolicy]] = {"lru": LRUPolicy, "marconi": MarconiPolicy}
POLICY_NAMES = tuple(POLICIES)


def check_policy_name(name, *, what: str = "prefix_cache_policy") -> str:
    """``name`` if it names a policy of :data:`POLICIES`, else ValueError naming ``what``."""
    if not isinstance(name, str) or name not in POLICIES:
        raise ValueError(f"{what} must be one of {POLICY_NAMES}, got {name!r}")
    return name


def make_policy(policy: "str | PrefixCachePolicy", *, marconi_alpha: float = 1.0,
                what: str = "prefix_cache_policy") -> PrefixCachePolicy:
    """A policy object from its name (``marconi_alpha``: Marconi's weight of FLOP efficiency), or
    ``policy`` itself when it already is one."""
    if isinstance(policy, PrefixCachePolicy):
        return policy
    cls = POLICIES[check_policy_name(policy, what=what)]
    return cls(marconi_alpha) if cls is MarconiPolicy else cls()


# ----------------------------------------------------------------------------------------
# eviction indexes
# ----------------------------------------------------------------------------------------
class EvictionIndex:
    """The candidates of one eviction list, kept up to date by the tree.

    The tree calls :meth:`update` on every node whose candidacy or key may have changed (its
    access time, children, locks, state; removal), and evicts through a ranking
    (``with index.ranking() as r: node = r.pop()``) that hands out the candidates in the order
    :meth:`PrefixCachePolicy.rank` gives at the start of the call. During a ranking, a node that
    stops being a candidate leaves at once, one that becomes a candidate joins with its key at
    that moment, and the key of a node already ranked stays what it was at the start of the call.
    """

    _COMPACT_MIN = 64

    def __init__(self, evictable: Callable, access: Callable) -> None:
        self.evictable = evictable
        self.access = access
        self._ver = itertools.count()
        self.rec: dict[int, tuple] = {}  # node id -> (version, key fields..., node) of the candidates
        self._in_ranking = False

    def __len__(self) -> int:
        return len(self.rec)

    def clear(self) -> None:
        self.rec.clear()
        self._clear_heaps()

    def update(self, node) -> None:
        raise NotImplementedError

    def ranking(self) -> "_Ranking":
        raise NotImplementedError

    def _clear_heaps(self) -> None:
        raise NotImplementedError


class _Ranking:
    def __init__(self, index: EvictionIndex) -> None:
        self.index = index

    def __enter__(self) -> "_Ranking":
        self.index._in_ranking = True
        return self

    def __exit__(self, *exc) -> None:
        self.index._in_ranking = False

    def pop(self):
        raise NotImplementedError


class LRUIndex(EvictionIndex):
    """LRU: one min-heap of ``(access, id, version, node)`` with lazy deletion (an entry counts
    while its version is the node's current one); rebuilt from the candidates when stale entries
    outnumber them, so every operation is O(log n) amortised."""

    def __init__(self, evictable, access) -> None:
        super().__init__(evictable, access)
        self.heap: list[tuple] = []

    def _clear_heaps(self) -> None:
        self.heap = []

    def update(self, node) -> None:
        old = self.rec.get(node.id)
        if not self.evictable(node):
            if old is not None:
                del self.rec[node.id]
            return
        t = self.access(node)
        if old is not None and old[1] == t:
            return
        ver = next(self._ver)
        self.rec[node.id] = (ver, t, node)
        heapq.heappush(self.heap, (t, node.id, ver, node))
        if len(self.heap) > 2 * len(self.rec) + self._COMPACT_MIN:
            self._compact()

    def _compact(self) -> None:
        self.heap = [e for e in self.heap if self.rec.get(e[1], (None,))[0] == e[2]]
        heapq.heapify(self.heap)

    def ranking(self) -> "_Ranking":
        return _LRURanking(self)


class _LRURanking(_Ranking):
    def pop(self):
        index, heap = self.index, self.index.heap
        while heap:
            _, nid, ver, node = heapq.heappop(heap)
            rec = index.rec.get(nid)
            if rec is not None and rec[0] == ver:
                del index.rec[nid]  # handed out: the tree removes it or reindexes it
                return node
        return None


class MarconiIndex(EvictionIndex):
    """Marconi: the candidates grouped by (tier, FLOP efficiency), each group a min-heap by access
    time, the efficiencies of each tier in a sorted list; min- and max-heaps of the access times
    (lazy deletion by version as in :class:`LRUIndex`). A node's score is monotone in its access
    time and its efficiency, so a group's first node is its best, and a group whose efficiency
    alone scores above the best node found cannot hold a better one: a ranking visits groups in
    ascending efficiency only until then (the module docstring)."""

    def __init__(self, policy: MarconiPolicy, evictable, access, efficiency) -> None:
        super().__init__(evictable, access)
        self.policy = policy
        self.efficiency = efficiency
        self._clear_heaps()
        self._deferred: dict[int, object] = {}  # nodes changed during a ranking: reindexed after it
        self._ungrouped: set[int] = set()  # nodes that joined a ranking (in no group until it ends)
        self._emptied: list[tuple[int, float]] = []  # groups emptied during a ranking
        self._session: "_MarconiRanking | None" = None

    def _clear_heaps(self) -> None:
        self.groups: dict[tuple[int, float], list] = {}  # (tier, efficiency) -> [heap of (t, id, ver, node), live]
        self.effs: tuple[list[float], list[float]] = ([], [])  # per tier: the groups' efficiencies, ascending
        self.min_t: list[tuple] = []  # (access, id, ver, node)
        self.max_t: list[tuple] = []  # (-access, id, ver, node)
        self._entries = 0

    def _key(self, node) -> tuple[int, int, float]:
        return _tier(node), self.access(node), self.efficiency(node)

    def update(self, node) -> None:
        old = self.rec.get(node.id)
        if not self.evictable(node):
            if old is not None:
                self._forget(node.id)
            self._deferred.pop(node.id, None)
            return
        if self._in_ranking:
            if old is not None:  # a ranked node keeps its key until the end of the call
                self._deferred[node.id] = node
            else:  # joins this call with its key now
                self._session.join(node, self._key(node))
            return
        key = self._key(node)
        if old is not None:
            if old[1:4] == key:
                return
            self._forget(node.id)
        self._push(node, key)

    def _forget(self, nid: int) -> None:
        _, tier, _, e, _ = self.rec.pop(nid)
        if nid in self._ungrouped:
            self._ungrouped.discard(nid)
        else:
            group = self.groups[(tier, e)]
            group[1] -= 1
            if group[1] == 0:
                if self._in_ranking:
                    self._emptied.append((tier, e))  # (dropped after the call: the ranking walks the lists)
                else:
                    self._drop_group(tier, e)

    def _drop_group(self, tier: int, e: float) -> None:
        del self.groups[(tier, e)]
        effs = self.effs[tier]
        del effs[bisect.bisect_left(effs, e)]

    def _push(self, node, key) -> None:
        tier, t, e = key
        ver = next(self._ver)
        nid = node.id
        self.rec[nid] = (ver, tier, t, e, node)
        group = self.groups.get((tier, e))
        if group is None:
            group = self.groups[(tier, e)] = [[], 0]
            bisect.insort(self.effs[tier], e)
        group[1] += 1
        heapq.heappush(group[0], (t, nid, ver, node))
        heapq.heappush(self.min_t, (t, nid, ver, node))
        heapq.heappush(self.max_t, (-t, nid, ver, node))
        self._entries += 1
        if self._entries > 2 * len(self.rec) + self._COMPACT_MIN:
            self._compact()

    def _valid(self, entry) -> bool:
        rec = self.rec.get(entry[1])
        return rec is not None and rec[0] == entry[2]

    def _compact(self) -> None:
        live = list(self.rec.values())
        self.rec.clear()
        self._clear_heaps()
        for ver, tier, t, e, node in live:
            self._push(node, (tier, t, e))

    def _clean_top(self, heap: list) -> tuple | None:
        while heap and not self._valid(heap[0]):
            heapq.heappop(heap)
        return heap[0] if heap else None

    def ranking(self) -> "_Ranking":
        return _MarconiRanking(self)

    def _end_ranking(self) -> None:
        self._session = None
        emptied, self._emptied = self._emptied, []
        for key in emptied:
            group = self.groups.get(key)
            if group is not None and group[1] == 0:
                self._drop_group(*key)
        deferred, self._deferred = self._deferred, {}
        for node in deferred.values():
            if node.id in self.rec:
                self._forget(node.id)  # its key changed (or it joined): group it afresh
            self.update(node)


class _MarconiRanking(_Ranking):
    def __enter__(self) -> "_MarconiRanking":
        index = self.index
        self.result: list[tuple] = []  # (score, id, ver, node, (group heap, tier, eff) or None): each visited group's best
        self.pos = [0, 0]  # per tier: groups visited (in ascending efficiency)
        self.norms = None
        self.exhaustive = False
        if index.rec:
            t0 = index._clean_top(index.min_t)[0]
            t_max = -index._clean_top(index.max_t)[0]
            e_max = max(effs[-1] for effs in index.effs if effs)
            self.norms = (t0, max(t_max - t0, 1), max(e_max, 1e-30))
            alpha = index.policy.alpha
            if not alpha >= 0:  # the score is not monotone in the efficiency: visit every group now
                self.exhaustive = True
                for k in (0, 1):
                    while self.pos[k] < len(index.effs[k]):
                        self._visit(k)
        index._session = self
        super().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.index._end_ranking()

    def _push_best(self, heap: list, tier: int, e: float) -> None:
        top = self.index._clean_top(heap)  # (pops only: the groups take no push during a call)
        if top is not None:
            t, nid, ver, node = top
            score = self.index.policy.score(t, e, tier, self.norms)
            heapq.heappush(self.result, (score, nid, ver, node, (heap, tier, e)))

    def _visit(self, k: int) -> None:
        e = self.index.effs[k][self.pos[k]]
        self.pos[k] += 1
        self._push_best(self.index.groups[(k, e)][0], k, e)

    def join(self, node, key) -> None:
        tier, t, e = key
        ver = next(self.index._ver)
        self.index.rec[node.id] = (ver, tier, t, e, node)
        self.index._ungrouped.add(node.id)
        self.index._deferred[node.id] = node  # grouped after the call
        if self.norms is None:  # no candidate at the start: the normalisers of this one alone
            self.norms = MarconiPolicy.norms([t], [e])
        heapq.heappush(self.result, (self.index.policy.score(t, e, tier, self.norms), node.id, ver, node, None))

    def _bound(self, k: int) -> float:
        """The lowest score a node of a group of tier ``k`` not visited yet can have."""
        effs = self.index.effs[k]
        if self.pos[k] >= len(effs):
            return math.inf
        return self.index.policy.score(self.norms[0], effs[self.pos[k]], k, self.norms)

    def pop(self):
        index, result = self.index, self.result
        while True:
            while result and not index._valid(result[0]):
                group = heapq.heappop(result)[4]
                if group is not None:  # a group's best left: its next one
                    self._push_best(*group)
            bounds = [self._bound(0), self._bound(1)]
            bound = min(bounds)
            if result and (result[0][0] < bound or bound == math.inf):
                _, nid, _, node, group = heapq.heappop(result)
                index._forget(nid)  # handed out: the tree removes it or reindexes it
                index._deferred.pop(nid, None)
                if group is not None:
                    heapq.heappop(group[0])  # (it was the group's first)
                    self._push_best(*group)
                return node
            if bound == math.inf:
                return None
            self._visit(bounds.index(bound))
