"""Tests of hybrid_compile.cache: the hybrid radix tree (KV + Mamba states) on real pools.

Every test runs on a tiny :class:`MemoryPools` (one attention layer, one linear layer). The
harness writes into each KV slot's K the token it holds and stamps every Mamba state
with the id of the prefix it belongs to (so host-tier copies and load backs carry them too), so a test can check that a hit's KV slots hold
exactly the hit's tokens and that its state is exactly the state of that prefix. The random
test drives request lifecycles (match, lock, copy-on-write, chunked prefill, finish, abort)
and evictions against a brute-force model (the sets of cached prefixes with KV and with a
state; with the host tier, on each tier and their union) and checks every invariant after every step.
"""

from __future__ import annotations

import heapq
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybrid_compile.cache import HybridRadixCache, aligned_checkpoint_len, last_aligned_boundary
from hybrid_compile.cache.policy import MarconiPolicy
from hybrid_compile.memory import AttentionLayerSpec, MambaLayerSpec, MemoryPools
from hybrid_compile.memory.host_pool import HostPool

ATTN = [AttentionLayerSpec((1,), num_kv_heads=1, head_dim=2, dtype=torch.float32)]
LINEAR = [MambaLayerSpec((0,), conv_width=2, conv_dim=2, state_shape=(1,), conv_dtype=torch.float32)]


class Harness:
    """Pools + cache + ground truth of what every KV slot and Mamba slot holds."""

    def __init__(self, *, page_size: int = 1, kv_tokens: int = 64, mamba_slots: int = 8, mamba_align: int = 4,
                 policy: str = "lru", host_kv_tokens: int | None = None, host_mamba_slots: int = 0):
        self.pools = MemoryPools.from_specs(
            ATTN, LINEAR, max_running_requests=1, max_context_len=page_size * 4,
            page_size=page_size, max_total_tokens=kv_tokens, mamba_cache_size=mamba_slots,
        )
        self.host = (
            None if host_kv_tokens is None
            else HostPool(self.pools.kv, self.pools.mamba, host_kv_tokens, host_mamba_slots)
        )
        self.cache = HybridRadixCache(self.pools, mamba_align=mamba_align, policy=policy, host_pool=self.host)
        self.ps = page_size
        self.alloc = self.pools.kv.allocator
        self.k.fill_(-1)
        self._ids: dict[tuple, int] = {(): 0}

    @property
    def k(self) -> torch.Tensor:
        """K of the attention layer: ``K[slot, 0, 0]`` = the token the slot holds (asked for anew:
        elastic pools replace the buffers)."""
        return self.pools.kv.k_cache(1)

    # -- ground truth ---------------------------------------------------------------------
    def prefix_id(self, tokens) -> int:
        return self._ids.setdefault(tuple(tokens), len(self._ids))

    def write_state(self, slot: int, tokens) -> None:
        """Stamp a Mamba slot with 'the state after `tokens`' (in the conv window and the SSM state)."""
        v = float(self.prefix_id(tokens))
        self.pools.mamba.ssm(0)[slot] = v
        self.pools.mamba.conv(0)[slot] = v

    def state_of(self, slot: int) -> int:
        ssm, conv = self.pools.mamba.ssm(0)[slot], self.pools.mamba.conv(0)[slot]
        assert bool((conv == ssm[0]).all()), "conv window and SSM state of a slot disagree"
        return int(ssm[0])

    def tokens_at(self, kv: torch.Tensor) -> list[int]:
        return self.k[kv, 0, 0].long().tolist()

    def host_tokens_at(self, start: int, n: int) -> list[int]:
        host_k = self.host.kv_buffers[0][2]  # [host slots, layers, heads, dim]: K of the one attention layer
        return host_k[start : start + n, 0, 0, 0].long().tolist()

    def host_state_of(self, host_slot: int) -> int:
        conv, ssm = (h for _, _, h in self.host.mamba_buffers)
        assert bool((conv[host_slot] == ssm[host_slot][0, 0]).all()), "host conv window and SSM state disagree"
        return int(ssm[host_slot][0, 0])

    # -- a request's own KV -----------------------------------------------------------------
    def alloc_kv(self, tokens, start: int, evict: bool = True) -> torch.Tensor | None:
        """Slots for ``tokens[start:]`` (``start`` page-aligned), written with those tokens."""
        n = len(tokens) - start
        if evict:
            self.cache.ensure_free(kv_tokens=self.alloc.pages_needed([start], [n]) * self.ps)
        kv = self.alloc.alloc_extend([start], [n])
        if kv is not None:
            self.k[kv, 0, 0] = torch.tensor(list(tokens[start:]), dtype=torch.float32)
        return kv

    def new_state(self, tokens) -> int:
        slot = int(self.pools.mamba.alloc(1)[0])
        self.write_state(slot, tokens)
        return slot

    def cache_seq(self, tokens, state_at: int | None = None) -> int:
        """A whole request: match, lock, copy the hit's state, compute the rest, finish."""
        tokens = list(tokens)
        m = self.cache.match_prefix(tokens)
        self.cache.inc_lock_ref(m.last_node)
        slot = self.cache.cow_mamba(m)
        kv = torch.cat([m.kv_indices, self.alloc_kv(tokens, m.prefix_len)])
        end = len(tokens) if state_at is None else state_at
        self.write_state(slot, tokens[:end])
        return self.cache.cache_finished_req(tokens, kv, m.last_node, slot, mamba_len=end)

    # -- tree content ---------------------------------------------------------------------
    def content(self) -> tuple[set, set]:
        """(page-aligned prefixes with KV, prefixes with a state) held by the tree, checking
        on the way that every slot holds the right token / state."""
        return self.tier_content()[0]

    def tier_content(self) -> tuple[tuple[set, set], tuple[set, set]]:
        """:meth:`content` of the device and of the host tier, checking every host copy too."""
        kv_prefixes, state_prefixes = set(), set()
        host_kv, host_states = set(), set()
        for node in self.cache.nodes():
            path = self.cache.path_tokens(node)
            start = len(path) - len(node.key)
            ends = [path[:end] for end in range(start + self.ps, len(path) + 1, self.ps)]
            if node.value is not None:
                assert self.tokens_at(node.value) == list(node.key)
                kv_prefixes.update(ends)
            if node.mamba_slot is not None:
                state_prefixes.add(path)
                assert self.state_of(node.mamba_slot) == self.prefix_id(path), "cached state is not its prefix's"
            if node.host_start is not None:
                assert self.host_tokens_at(node.host_start, len(node.key)) == list(node.key), "host KV copy"
                host_kv.update(ends)
            if node.host_mamba is not None:
                host_states.add(path)
                assert self.host_state_of(node.host_mamba) == self.prefix_id(path), "host state copy"
        return (kv_prefixes, state_prefixes), (host_kv, host_states)


def seq(*parts) -> list[int]:
    out = []
    for p in parts:
        out.extend(p)
    return out


# ----------------------------------------------------------------------------------------
# checkpoint policy
# ----------------------------------------------------------------------------------------
def test_aligned_checkpoint_len_follows_chunk_boundaries_of_the_extend():
    # seed 003 §6.3.2: prefix 100, extend 210, chunk 64 -> track 192 tokens into the extend
    assert aligned_checkpoint_len(100, 210, mamba_align=64) == 292
    assert aligned_checkpoint_len(0, 128, mamba_align=64) == 128  # aligned end: the final state
    assert aligned_checkpoint_len(0, 63, mamba_align=64) is None  # shorter than a chunk: none
    assert aligned_checkpoint_len(64, 0, mamba_align=64) is None
    # a branch point on a chunk boundary of the extend wins over the last boundary
    assert aligned_checkpoint_len(0, 300, mamba_align=64, branching_len=128) == 128
    assert aligned_checkpoint_len(0, 300, mamba_align=64, branching_len=100) == 256  # not a boundary
    assert aligned_checkpoint_len(0, 300, mamba_align=64, branching_len=300) == 256  # not inside
    # the checkpoint must also end on a KV page: 8 + 8 * k with page 16 -> k odd (40 is skipped)
    assert aligned_checkpoint_len(8, 32, mamba_align=8, page_size=16) == 32
    assert aligned_checkpoint_len(10, 250, mamba_align=64, page_size=16) is None  # never on a page
    assert last_aligned_boundary(8, 72, 64, 16) is None
    # mamba_align is independent of the page size (a page larger than a chunk too)
    assert aligned_checkpoint_len(0, 200, mamba_align=64, page_size=128) == 128
    with pytest.raises(ValueError):
        aligned_checkpoint_len(-1, 5, mamba_align=64)


def test_cache_checkpoint_len_uses_its_alignment_and_page_size():
    h = Harness(page_size=4, mamba_align=8)
    assert h.cache.checkpoint_len(4, 21) == 20
    assert h.cache.checkpoint_len(4, 7) is None
    with pytest.raises(ValueError):
        HybridRadixCache(h.pools, mamba_align=0)


# ----------------------------------------------------------------------------------------
# match / insert / split
# ----------------------------------------------------------------------------------------
def test_empty_tree_matches_nothing_and_root_locks_are_no_ops():
    h = Harness()
    m = h.cache.match_prefix([1, 2, 3])
    assert (m.prefix_len, m.kv_match_len, m.mamba_node, m.branching_len) == (0, 0, None, None)
    assert m.last_node is h.cache.root and m.kv_indices.numel() == 0
    h.cache.inc_lock_ref(m.last_node)
    h.cache.dec_lock_ref(m.last_node)
    assert h.cache.protected_size() == 0
    h.cache.check_invariants()


def test_insert_then_match_returns_tree_slots_and_state():
    h = Harness()
    tokens = [5, 6, 7, 8, 9]
    assert h.cache_seq(tokens) == 0
    m = h.cache.match_prefix(tokens + [1, 2])
    assert m.prefix_len == 5 and m.kv_match_len == 5 and m.mamba_node is m.last_node
    assert h.tokens_at(m.kv_indices) == tokens
    assert h.state_of(m.mamba_node.mamba_slot) == h.prefix_id(tokens)
    assert h.cache.stats()["hits"] == 1 and h.cache.stats()["hit_tokens"] == 5
    # the same sequence again: everything is a duplicate; the second state is freed
    used = h.pools.used_counts()
    assert h.cache_seq(tokens) == 5
    assert h.pools.used_counts() == used
    assert h.cache.stats()["duplicate_mamba_freed"] == 1
    h.cache.check_invariants()


def test_kv_beyond_the_last_state_does_not_count_and_partial_match_splits():
    h = Harness(mamba_align=2)
    h.cache_seq([1, 2, 3, 4, 5, 6])
    m = h.cache.match_prefix([1, 2, 3, 4, 9])  # KV for 4 tokens, but the state is at 6
    assert (m.prefix_len, m.kv_match_len, m.mamba_node) == (0, 4, None)
    assert m.branching_len == 4  # checkpoint here and the next such request hits 4 tokens
    # the match split the edge: new parent [1,2,3,4] holds KV only (a tombstone)
    nodes = sorted(h.cache.nodes(), key=lambda n: len(n.key))
    assert [n.key for n in nodes] == [(5, 6), (1, 2, 3, 4)]
    assert nodes[1].is_tombstone and nodes[1].mamba_slot is None and nodes[0].mamba_slot is not None
    st = h.cache.stats()
    assert (st["nodes"], st["tombstones"], st["cached_tokens"], st["mamba_slots"]) == (2, 1, 6, 1)
    # a checkpoint at the branch point revives the tombstone
    assert h.cache_seq([1, 2, 3, 4, 9, 9], state_at=4) == 4
    m = h.cache.match_prefix([1, 2, 3, 4, 7])
    assert m.prefix_len == 4 and h.state_of(m.mamba_node.mamba_slot) == h.prefix_id([1, 2, 3, 4])
    assert h.cache.stats()["tombstones"] == 0
    h.cache.check_invariants()
    assert h.content()[1] == {(1, 2, 3, 4), (1, 2, 3, 4, 5, 6)}


def test_branches_share_the_prefix_node():
    h = Harness()
    h.cache_seq([1, 2, 3, 4, 5])
    h.cache_seq([1, 2, 3, 6, 7])
    kv_prefixes, states = h.content()
    assert states == {(1, 2, 3, 4, 5), (1, 2, 3, 6, 7)}
    assert h.cache.cached_tokens() == 7 and h.pools.used_counts()["kv_tokens"] == 7
    for tail in ([4, 5], [6, 7]):
        m = h.cache.match_prefix([1, 2, 3] + tail + [0])
        assert m.prefix_len == 5 and h.tokens_at(m.kv_indices) == [1, 2, 3] + tail
    assert h.cache.match_prefix([1, 2, 3]).prefix_len == 0
    h.cache.check_invariants()


def test_insert_without_state_keeps_nothing_new_and_frees_duplicates():
    h = Harness()
    h.cache_seq([1, 2, 3])
    m = h.cache.match_prefix([1, 2, 3])
    h.cache.inc_lock_ref(m.last_node)
    own = h.alloc_kv([1, 2, 3, 4, 5], 3)
    kv = torch.cat([m.kv_indices, own])
    assert h.cache.cache_finished_req([1, 2, 3, 4, 5], kv, m.last_node, None) == 3
    assert h.cache.cached_tokens() == 3 and h.pools.used_counts()["kv_tokens"] == 3
    # plain insert: tokens the tree holds are freed when they are the request's own copies
    dup = h.alloc_kv([1, 2, 3], 0)
    assert h.cache.insert([1, 2, 3], dup) == 3
    assert h.pools.used_counts()["kv_tokens"] == 3
    h.cache.check_invariants()


def test_insert_validates_slots_before_changing_anything():
    h = Harness()
    h.cache_seq([1, 2, 3])
    hit = h.cache.match_prefix([1, 2, 3])
    tree_kv, tree_state = hit.kv_indices, hit.mamba_node.mamba_slot
    own = h.alloc_kv([9, 9, 9], 0)
    slot = h.new_state([9, 9, 9])
    before = (h.pools.used_counts(), h.cache.stats())
    with pytest.raises(ValueError, match="other positions"):  # tree slots at the wrong positions
        h.cache.insert([7, 1, 2, 3], torch.cat([own[:1], tree_kv]), slot)
    with pytest.raises(ValueError, match="not allocated"):
        h.cache.insert([7, 7], torch.tensor([60, 61]), slot)
    with pytest.raises(ValueError, match="more than once"):
        h.cache.insert([7, 7], own[[0, 0]], slot)
    with pytest.raises(ValueError, match="token ids but"):
        h.cache.insert([7, 7], own, slot)
    with pytest.raises(ValueError, match="already belongs"):
        h.cache.insert([9, 9, 9], own, tree_state)
    assert (h.pools.used_counts(), h.cache.stats()) == before
    h.cache.check_invariants()


# ----------------------------------------------------------------------------------------
# locks
# ----------------------------------------------------------------------------------------
def test_locks_cover_the_path_and_keep_full_at_least_mamba():
    h = Harness()
    h.cache_seq([1, 2, 3, 4, 5])
    h.cache_seq([1, 2, 3, 6, 7])
    h.cache_seq([1, 2, 3], state_at=3)  # the shared node gets a state
    a = h.cache.match_prefix([1, 2, 3, 4, 5])
    b = h.cache.match_prefix([1, 2, 3, 6])
    h.cache.inc_lock_ref(a.last_node)
    h.cache.inc_lock_ref(b.last_node)
    shared = b.last_node
    assert (shared.full_lock_ref, shared.mamba_lock_ref) == (2, 1)
    assert (a.last_node.full_lock_ref, a.last_node.mamba_lock_ref) == (1, 1)
    assert h.cache.protected_size() == 5 and h.cache.evictable_size() == 2
    assert h.cache.mamba_protected_size() == 2 and h.cache.mamba_evictable_size() == 1
    h.cache.check_invariants()
    # nothing locked is evicted, whatever is asked
    assert h.cache.evict_kv(100) == 2
    assert h.cache.evict_mamba(100) == 0
    assert h.content()[1] == {(1, 2, 3), (1, 2, 3, 4, 5)}
    h.cache.dec_lock_ref(a.last_node)
    h.cache.dec_lock_ref(b.last_node)
    assert h.cache.protected_size() == 0 and h.cache.mamba_protected_size() == 0
    with pytest.raises(ValueError, match="not locked"):
        h.cache.dec_lock_ref(b.last_node)
    h.cache.check_invariants()


def test_tombstones_cannot_be_locked_and_removed_nodes_are_rejected():
    h = Harness()
    h.cache_seq([1, 2, 3, 4])
    h.cache.match_prefix([1, 2, 9])  # split: [1, 2] is a tombstone
    tomb = next(n for n in h.cache.nodes() if n.is_tombstone)
    with pytest.raises(ValueError, match="no Mamba state"):
        h.cache.inc_lock_ref(tomb)
    leaf = h.cache.match_prefix([1, 2, 3, 4]).last_node
    h.cache.evict_kv(1)
    assert leaf.removed and h.cache.stats()["nodes"] == 0  # the tombstone parent went with it
    with pytest.raises(ValueError, match="removed"):
        h.cache.inc_lock_ref(leaf)


# ----------------------------------------------------------------------------------------
# eviction
# ----------------------------------------------------------------------------------------
def test_evict_kv_takes_lru_leaves_and_prunes_tombstones():
    h = Harness()
    h.cache_seq([1, 2, 3, 4])
    h.cache_seq([1, 2, 5, 6])
    h.cache_seq([7, 8])
    h.cache.match_prefix([1, 2, 3, 4])  # [1..4] becomes most recent
    order = [h.cache.path_tokens(n) for n in h.cache.kv_eviction_order()]
    assert order == [(1, 2, 5, 6), (7, 8), (1, 2, 3, 4)]  # leaves only, least recent first
    assert h.cache.evict_kv(1) == 2  # LRU leaf: [1,2,5,6]'s edge [5,6]
    assert h.content()[1] == {(1, 2, 3, 4), (7, 8)}
    assert h.cache.evict_kv(1) == 2  # next: [7, 8]
    assert h.content()[1] == {(1, 2, 3, 4)}
    # [1,2] is now a tombstone with one child; evicting the child removes it as well
    assert h.cache.evict_kv(1) == 4
    assert h.cache.stats()["nodes"] == 0
    h.pools.check_all_free()
    st = h.cache.stats()
    assert (st["kv_evicted_tokens"], st["kv_evicted_nodes"], st["kv_evicted_mamba"]) == (8, 3, 3)


def test_evict_kv_frees_parents_that_become_leaves():
    h = Harness()
    h.cache_seq([1, 2], state_at=2)
    h.cache_seq([1, 2, 3, 4])
    assert h.cache.evict_kv(3) == 4  # the leaf, then its parent (now a leaf)
    h.pools.check_all_free()


def test_evict_mamba_tombstones_internal_nodes_and_removes_leaves():
    h = Harness()
    h.cache_seq([1, 2], state_at=2)
    h.cache_seq([1, 2, 3, 4])
    h.cache_seq([9, 9])
    h.cache.match_prefix([9, 9, 1])
    h.cache.match_prefix([1, 2, 3, 4])  # [1,2,3,4] most recent; [1,2]'s state least recent
    order = [h.cache.path_tokens(n) for n in h.cache.mamba_eviction_order()]
    assert order == [(1, 2), (9, 9), (1, 2, 3, 4)]  # internal nodes too
    assert h.cache.evict_mamba(1) == 1
    kv_prefixes, states = h.content()
    assert states == {(1, 2, 3, 4), (9, 9)} and (1, 2) in kv_prefixes  # tombstone keeps its KV
    assert h.cache.stats()["tombstones"] == 1 and h.cache.stats()["tombstones_created"] == 1
    assert h.cache.evict_mamba(1) == 1  # leaf [9,9]: removed with its KV
    assert h.content() == ({(1,), (1, 2), (1, 2, 3), (1, 2, 3, 4)}, {(1, 2, 3, 4)})
    assert h.cache.evict_mamba(1) == 1  # the last leaf goes, and the tombstone above it
    assert h.cache.stats()["nodes"] == 0 and h.cache.stats()["mamba_evicted_tokens"] == 6
    h.pools.check_all_free()


def test_ensure_free_evicts_for_kv_and_mamba():
    h = Harness(kv_tokens=8, mamba_slots=3)
    h.cache_seq([1, 2, 3])
    h.cache_seq([4, 5, 6])
    assert h.pools.free_counts()["kv_tokens"] == 2 and h.pools.free_counts()["mamba_slots"] == 1
    assert h.cache.ensure_free(kv_tokens=4)
    assert h.pools.free_counts()["kv_tokens"] == 5 and h.cache.cached_tokens() == 3
    assert h.cache.ensure_free(mamba_slots=3)
    assert h.cache.stats()["nodes"] == 0
    assert not h.cache.ensure_free(kv_tokens=9)


# ----------------------------------------------------------------------------------------
# copy-on-write
# ----------------------------------------------------------------------------------------
def test_cow_mamba_gives_the_request_a_private_copy():
    h = Harness()
    h.cache_seq([1, 2, 3])
    m = h.cache.match_prefix([1, 2, 3, 4])
    h.cache.inc_lock_ref(m.last_node)
    slot = h.cache.cow_mamba(m)
    assert slot != m.mamba_node.mamba_slot and h.state_of(slot) == h.prefix_id([1, 2, 3])
    h.write_state(slot, [1, 2, 3, 4])  # the request runs on: the cached state is untouched
    assert h.state_of(m.mamba_node.mamba_slot) == h.prefix_id([1, 2, 3])
    # into a slot the request already owns (from req_to_token.alloc)
    own = int(h.pools.mamba.alloc(1)[0])
    assert h.cache.cow_mamba(m, own) == own and h.state_of(own) == h.prefix_id([1, 2, 3])
    with pytest.raises(ValueError, match="belongs to the prefix cache"):
        h.cache.cow_mamba(m, m.mamba_node.mamba_slot)
    assert h.cache.stats()["mamba_hits"] == 2
    # no hit: a fresh zero state, or the given slot untouched
    miss = h.cache.match_prefix([8])
    fresh = h.cache.cow_mamba(miss)
    assert h.state_of(fresh) == 0 and h.cache.cow_mamba(miss, own) == own
    h.cache.dec_lock_ref(m.last_node)


def test_cow_mamba_evicts_another_state_when_the_pool_is_full_but_never_the_source():
    h = Harness(mamba_slots=2)
    h.cache_seq([1, 2])
    h.cache_seq([3, 4])
    m = h.cache.match_prefix([1, 2])  # the hit is the most recent: LRU would pick [3, 4]...
    h.cache.match_prefix([3, 4])  # ...make the hit the least recent instead
    slot = h.cache.cow_mamba(m)  # not locked by the caller: cow protects the source itself
    assert slot is not None and h.state_of(slot) == h.prefix_id([1, 2])
    assert h.content()[1] == {(1, 2)}
    assert h.cache.cow_mamba(m) is None  # pool full, the only cached state is the source
    h.pools.mamba.free([slot])
    h.cache.evict_mamba(1)
    with pytest.raises(ValueError, match="removed"):
        h.cache.cow_mamba(m)


# ----------------------------------------------------------------------------------------
# chunked prefill and finished requests
# ----------------------------------------------------------------------------------------
def test_cache_unfinished_req_moves_the_lock_and_dedupes_kv():
    h = Harness(mamba_align=2)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    h.cache_seq(tokens[:2])
    m = h.cache.match_prefix(tokens)
    h.cache.inc_lock_ref(m.last_node)
    work = h.cache.cow_mamba(m)
    kv = torch.cat([m.kv_indices, h.alloc_kv(tokens, 2)])
    # chunk 1 computed up to 4: fork the working state into the tree
    h.write_state(work, tokens[:4])
    r = h.cache.cache_unfinished_req(tokens[:4], kv[:4], m.last_node, work)
    assert r.inserted and r.prefix_len == 4 and r.cached_before == 2
    assert torch.equal(r.kv_indices, kv[:4])  # nothing was a duplicate
    assert (m.last_node.full_lock_ref, m.last_node.mamba_lock_ref) == (1, 0)
    assert (r.last_node.full_lock_ref, r.last_node.mamba_lock_ref) == (1, 1)
    assert h.state_of(r.last_node.mamba_slot) == h.prefix_id(tokens[:4]) and r.last_node.mamba_slot != work
    # another request caches [1..6] meanwhile; our chunk 2 duplicates its KV
    h.cache_seq(tokens[:6])
    h.write_state(work, tokens[:6])
    r2 = h.cache.cache_unfinished_req(tokens[:6], kv[:6], r.last_node, work)
    assert r2.cached_before == 6 and h.tokens_at(r2.kv_indices) == tokens[:6]
    assert not torch.equal(r2.kv_indices[4:], kv[4:6])  # ours were freed: switch to the tree's
    assert not bool(h.alloc.is_allocated(kv[4:6]).any())
    kv = torch.cat([r2.kv_indices, kv[6:]])
    # a checkpoint slot (from tracking) is adopted instead of forked
    ckpt = h.new_state(tokens[:8])
    used = h.pools.used_counts()["mamba_slots"]
    r3 = h.cache.cache_unfinished_req(tokens, kv, r2.last_node, ckpt, adopt_mamba=True)
    assert r3.last_node.mamba_slot == ckpt and h.pools.used_counts()["mamba_slots"] == used
    h.write_state(work, tokens)
    assert h.cache.cache_finished_req(tokens, kv, r3.last_node, work) == 8
    assert h.cache.protected_size() == 0
    assert h.pools.used_counts()["kv_tokens"] == h.cache.cached_tokens() == 8
    assert h.pools.used_counts()["mamba_slots"] == h.cache.mamba_size() == 4
    h.cache.check_invariants()
    h.content()


def test_cache_unfinished_req_without_a_free_slot_changes_nothing():
    h = Harness(mamba_slots=1)
    m = h.cache.match_prefix([1, 2, 3])
    work = h.cache.cow_mamba(m)
    kv = h.alloc_kv([1, 2, 3], 0)
    r = h.cache.cache_unfinished_req([1, 2], kv[:2], m.last_node, work)
    assert not r.inserted and r.last_node is h.cache.root and torch.equal(r.kv_indices, kv[:2])
    assert h.cache.cached_tokens() == 0


def test_cache_unfinished_req_never_shortens_the_locked_prefix():
    h = Harness()
    h.cache_seq([1, 2, 3, 4])
    m = h.cache.match_prefix([1, 2, 3, 4, 5])
    h.cache.inc_lock_ref(m.last_node)
    work = h.cache.cow_mamba(m)
    with pytest.raises(ValueError, match="shorter than the request's locked prefix"):
        h.cache.cache_unfinished_req([1, 2], m.kv_indices[:2], m.last_node, work)
    h.cache.check_invariants()


def test_cache_finished_req_keeps_a_checkpoint_and_frees_the_tail():
    h = Harness(mamba_align=4)
    tokens = list(range(1, 11))
    m = h.cache.match_prefix(tokens)
    h.cache.inc_lock_ref(m.last_node)
    slot = h.cache.cow_mamba(m)
    kv = h.alloc_kv(tokens, 0)
    h.write_state(slot, tokens[:8])  # a tracked checkpoint at 8 tokens
    assert h.cache.cache_finished_req(tokens, kv, m.last_node, slot, mamba_len=8) == 0
    assert h.content()[1] == {tuple(tokens[:8])}
    assert h.pools.used_counts()["kv_tokens"] == 8 and h.pools.used_counts()["mamba_slots"] == 1
    hit = h.cache.match_prefix(tokens)
    with pytest.raises(ValueError, match="not locked"):  # the request's lock was dropped already
        h.cache.cache_finished_req(tokens[:8], hit.kv_indices, hit.last_node)


# ----------------------------------------------------------------------------------------
# pages
# ----------------------------------------------------------------------------------------
def test_pages_matches_and_splits_at_page_boundaries():
    h = Harness(page_size=4, kv_tokens=64, mamba_align=4)
    a = list(range(1, 13))  # 3 pages
    h.cache_seq(a)
    m = h.cache.match_prefix(a[:6] + [0, 0])  # diverges inside page 2: KV match floors to 4
    assert (m.prefix_len, m.kv_match_len, m.branching_len) == (0, 4, 4)
    assert sorted(len(n.key) for n in h.cache.nodes()) == [4, 8]
    b = a[:10] + [0, 0]
    assert h.cache_seq(b) == 8
    assert h.content()[1] == {tuple(a), tuple(b)}
    m = h.cache.match_prefix(b + [5])
    assert m.prefix_len == 12 and h.tokens_at(m.kv_indices) == b
    assert bool((m.kv_indices.view(-1, 4)[:, 0] % 4 == 0).all())
    # a finished request of 10 tokens: only whole pages can be cached, so no state at 10
    assert h.cache_seq(a[:4] + [7] * 6) == 4
    assert (*a[:4], 7, 7, 7, 7) not in h.content()[0]
    with pytest.raises(ValueError, match="whole number of pages"):
        h.cache.insert([1, 2, 3], torch.tensor([4, 5, 6]))
    h.cache.check_invariants()
    assert h.cache.evict_kv(1000) == 16
    h.pools.check_all_free()


def test_pages_reject_slots_out_of_page_order():
    h = Harness(page_size=4)
    kv = h.alloc_kv([1, 2, 3, 4], 0)
    with pytest.raises(ValueError, match="whole pages"):
        h.cache.insert([1, 2, 3, 4], kv.flip(0), h.new_state([1, 2, 3, 4]))


# ----------------------------------------------------------------------------------------
# stats and reset
# ----------------------------------------------------------------------------------------
def test_stats_and_reset_free_everything():
    h = Harness()
    h.cache_seq([1, 2, 3])
    h.cache_seq([1, 2, 4])
    h.cache.match_prefix([1, 2, 3, 5])
    st = h.cache.stats()
    assert st["cached_tokens"] == 4 and st["nodes"] == 3 and st["leaves"] == 2 and st["tombstones"] == 1
    assert st["mamba_slots"] == 2 and st["evictable_tokens"] == 4 and st["protected_tokens"] == 0
    assert st["lookups"] == 3 and st["hits"] == 1 and st["hit_tokens"] == 3
    assert st["kv_bytes"] == 4 * h.pools.kv.bytes_per_token and st["mamba_bytes"] == 2 * h.pools.mamba.bytes_per_slot
    m = h.cache.match_prefix([1, 2, 3])
    h.cache.inc_lock_ref(m.last_node)
    with pytest.raises(RuntimeError, match="locked"):
        h.cache.reset()
    h.cache.reset(force=True)
    assert m.last_node.removed
    h.pools.check_all_free()
    assert h.cache.stats()["nodes"] == 0 and h.cache.stats()["lookups"] == 0
    h.cache_seq([1, 2, 3])  # usable again
    h.cache.reset()
    h.pools.check_all_free()


# ----------------------------------------------------------------------------------------
# host tier
# ----------------------------------------------------------------------------------------
def test_range_allocator_first_fit_and_coalescing():
    from hybrid_compile.memory.host_pool import RangeAllocator

    a = RangeAllocator(10)
    assert (a.alloc(4), a.alloc(3), a.alloc(3)) == (0, 4, 7) and a.alloc(1) is None
    a.free(4, 3)
    a.free(0, 2)
    assert (a.available(), a.largest_free()) == (5, 3) and a.alloc(4) is None
    a.free(2, 2)  # joins [0, 2) and [4, 7) into [0, 7)
    assert a.largest_free() == 7 and a.alloc(7) == 0
    with pytest.raises(ValueError, match="not allocated"):
        RangeAllocator(4).free(0, 1)


def test_host_tier_offloads_on_eviction_and_loads_back_on_a_hit():
    h = Harness(kv_tokens=8, mamba_slots=3, host_kv_tokens=16, host_mamba_slots=4)
    h.cache_seq([1, 2, 3, 4])
    h.cache_seq([1, 2, 5, 6])
    h.cache.match_prefix([1, 2, 3, 4])
    assert h.cache.evict_kv(2) == 2  # LRU device leaf [5, 6] goes to the host, the node stays
    (kv, states), (host_kv, host_states) = h.tier_content()
    assert states == {(1, 2, 3, 4)} and host_states == {(1, 2, 5, 6)} and (1, 2, 5, 6) in host_kv
    node = next(n for n in h.cache.nodes() if h.cache.path_tokens(n) == (1, 2, 5, 6))
    assert node.tier == "host" and node.mamba_slot is None and node.host_mamba is not None
    assert h.cache.kv_eviction_order()[0] is not node  # a host-only node is no device candidate
    m = h.cache.match_prefix([1, 2, 5, 6, 7])  # a hit on the host-only node: loaded back
    assert m.prefix_len == 4 and m.last_node is node and node.tier == "both"
    assert h.tokens_at(m.kv_indices) == [1, 2, 5, 6]
    assert h.state_of(node.mamba_slot) == h.prefix_id([1, 2, 5, 6])
    st = h.cache.stats()
    assert (st["host_hits"], st["host_loaded_tokens"], st["host_loaded_states"], st["host_hit_tokens"]) == (1, 2, 1, 4)
    assert st["nodes_both"] == 1 and st["host_pool"]["load_bytes"] > 0
    # evicting it again costs no copy (its host copies are still there)
    written = st["host_written_tokens"]
    h.cache.evict_kv(8)
    assert h.cache.stats()["host_written_tokens"] == written + 4  # edges [3, 4] and [1, 2]; [5, 6] was there
    assert h.cache.stats()["nodes_host_only"] == 3
    h.cache.check_invariants()
    # a request that recomputes a host-only prefix gives the tree its own slots (no load back)
    tokens = [1, 2, 3, 4, 9, 9]
    kv = h.alloc_kv(tokens, 0)
    slot = h.new_state(tokens)
    h.cache.insert(tokens, kv, slot)
    (kv_p, _), _ = h.tier_content()
    assert {(1, 2), (1, 2, 3, 4), tuple(tokens)} <= kv_p
    h.cache.check_invariants()
    h.cache.reset()
    h.pools.check_all_free()
    assert h.host.kv_allocator.used() == 0 and h.host.mamba_allocator.used() == 0


def test_host_tier_full_drops_the_victim_and_a_full_device_gives_the_device_hit():
    h = Harness(kv_tokens=8, mamba_slots=3, host_kv_tokens=2, host_mamba_slots=1)
    h.cache_seq([1, 2, 3, 4])  # one edge of 4 tokens: never fits 2 host slots
    assert h.cache.evict_kv(1) == 4
    assert h.cache.stats()["nodes"] == 0 and h.cache.stats()["host_write_failed"] == 1
    h.pools.check_all_free()
    # a host hit whose load back cannot get device room falls back to the device hit
    h = Harness(kv_tokens=6, mamba_slots=3, host_kv_tokens=16, host_mamba_slots=4)
    h.cache_seq([1, 2])
    h.cache_seq([1, 2, 3, 4])
    h.cache.evict_kv(2)  # [3, 4] to the host
    m = h.cache.match_prefix([1, 2])
    h.cache.inc_lock_ref(m.last_node)
    own = h.alloc_kv([1, 2, 7, 7, 7, 7], 2)  # the rest of the device pool, held by a request
    assert own is not None and h.alloc.available() == 0
    m2 = h.cache.match_prefix([1, 2, 3, 4, 5])
    assert m2.prefix_len == 2 and h.cache.stats()["host_load_failed"] == 1
    h.cache.check_invariants()


# ----------------------------------------------------------------------------------------
# random request lifecycles against a brute-force model
# ----------------------------------------------------------------------------------------
class FakeRequest:
    def __init__(self, tokens, kv, node, slot, cached):
        self.tokens = tokens
        self.kv = kv  # slots of tokens[:len(kv)]; the first `cached` are the tree's
        self.node = node  # the locked node
        self.slot = slot  # private working state
        self.cached = cached


def run_random_lifecycles(seed: int | random.Random, page_size: int, steps: int, policy: str = "lru",
                          host_tier: bool = False, host_pages: int = 20, elastic: bool = False) -> None:
    """Random request lifecycles (start = match + lock + copy-on-write + KV allocation, chunk =
    cache_unfinished_req, finish = cache_finished_req, abort = unlock, probe = match, and explicit
    evictions) on a small cache, checked against a brute-force model after every step. ``seed``
    may be a ``random.Random`` (hypothesis' ``st.randoms()``: hypothesis then drives and shrinks
    the operation sequence).

    With ``host_tier`` the cache has a small host pool (host eviction happens too): the model's
    sets are then the prefixes held on either tier, a match must return the deepest of them with
    a state (loaded back, checked against the stamped tokens and states) unless the device could
    not make room (``host_load_failed`` counted: then the deepest device hit), and every host copy
    is checked against the data it copied. A small ``host_pages`` makes host writes fail (the
    device victim is then dropped as without the tier). With ``elastic`` the pools also move free
    entries' bytes between KV and Mamba (``MemoryPools.move_*`` + ``pools_resized``) at random:
    the tree's content, every slot's data and every invariant must survive."""
    rng = seed if isinstance(seed, random.Random) else random.Random(seed)
    ps = page_size
    h = Harness(page_size=ps, kv_tokens=24 * ps, mamba_slots=7, mamba_align=2 * ps, policy=policy,
                host_kv_tokens=host_pages * ps if host_tier else None, host_mamba_slots=max(1, host_pages // 4))
    cache = h.cache
    kv_model: set[tuple] = set()  # page-aligned prefixes whose KV the tree holds (either tier)
    state_model: set[tuple] = set()  # prefixes whose state the tree holds (either tier)

    def view() -> tuple[set, set]:
        """What the model tracks: the device content, or with the host tier the union of both."""
        (kv, states), (host_kv, host_states) = h.tier_content()
        return (kv | host_kv, states | host_states) if host_tier else (kv, states)
    running: list[FakeRequest] = []
    bases = [[rng.randrange(4) for _ in range(rng.randrange(0, 4 * ps))] for _ in range(3)]

    def new_tokens() -> list[int]:
        t = rng.choice(bases) + [rng.randrange(4) for _ in range(rng.randrange(1, 3 * ps))]
        if rng.random() < 0.6:  # often a whole number of pages
            t = t[: max(ps, len(t) - len(t) % ps)]
        return t

    def add_to_model(tokens, length) -> None:
        for end in range(ps, length + 1, ps):
            kv_model.add(tuple(tokens[:end]))
        state_model.add(tuple(tokens[:length]))

    def expected_hit(tokens) -> tuple[int, int]:
        hit = max((n for n in range(1, len(tokens) + 1) if tuple(tokens[:n]) in state_model), default=0)
        kv = max((n for n in range(ps, len(tokens) + 1, ps) if tuple(tokens[:n]) in kv_model), default=0)
        return hit, kv

    def check_match(tokens):
        device = h.content()
        failed = cache.stats()["host_load_failed"] if host_tier else 0
        m = cache.match_prefix(tokens)
        hit, kv_len = expected_hit(tokens)
        if host_tier and cache.stats()["host_load_failed"] > failed:  # no device room: the device hit
            hit = max((n for n in range(1, len(tokens) + 1) if tuple(tokens[:n]) in device[1]), default=0)
        assert (m.prefix_len, m.kv_match_len) == (hit, kv_len)
        if host_tier:  # a load back may have evicted elsewhere (never on the matched path) to make room
            kv_after, states_after = view()
            assert kv_after <= kv_model and states_after <= state_model
            assert {tuple(tokens[:e]) for e in range(ps, m.prefix_len + 1, ps)} <= h.content()[0], "hit not loaded"
            kv_model.clear(); kv_model.update(kv_after)
            state_model.clear(); state_model.update(states_after)
        assert h.tokens_at(m.kv_indices) == tokens[: m.prefix_len]
        if m.mamba_node is not None:
            assert h.state_of(m.mamba_node.mamba_slot) == h.prefix_id(tokens[: m.prefix_len])
        return m

    def snapshot():
        return h.content(), view()

    def locked_prefixes() -> tuple[set, set]:
        kv, states = set(), set()
        for r in running:
            path = cache.path_tokens(r.node)
            kv.update(path[:e] for e in range(ps, len(path) + 1, ps))
            if path:
                states.add(path)
        return kv, states

    def check_eviction(before, freed_tokens=None, freed_states=None) -> None:
        device_before, before = before
        device_after = h.content()
        kv_after, states_after = view()
        kv_before, states_before = before
        locked_kv, locked_states = locked_prefixes()
        assert kv_after <= kv_before and states_after <= states_before
        assert device_after[0] <= device_before[0] and device_after[1] <= device_before[1]
        assert locked_kv <= device_after[0] and locked_states <= device_after[1], "a locked prefix was evicted"
        if freed_tokens is not None:
            lost = (len(device_before[0]) - len(device_after[0])) * ps
            # with the host tier, making host room may also drop a device leaf whose only state was a host copy
            assert freed_tokens == lost if not host_tier else freed_tokens <= lost
            lost_states = device_before[1] - device_after[1]
            assert all(p not in device_after[0] for p in lost_states), "evict_kv made a tombstone"
        if freed_states is not None:
            assert freed_states == len(device_before[1] - device_after[1])
        kv_model.clear(); kv_model.update(kv_after)
        state_model.clear(); state_model.update(states_after)

    def start() -> None:
        tokens = new_tokens()
        if len(tokens) < 2:
            return
        m = check_match(tokens[:-1])
        cache.inc_lock_ref(m.last_node)
        before = snapshot()
        slot = cache.cow_mamba(m)  # may evict one state
        check_eviction(before)
        if slot is None:
            cache.dec_lock_ref(m.last_node)
            return
        assert h.state_of(slot) == h.prefix_id(tokens[: m.prefix_len])
        before = snapshot()
        own = h.alloc_kv(tokens, m.prefix_len)  # may evict KV
        check_eviction(before)
        if own is None:
            h.pools.mamba.free([slot])
            cache.dec_lock_ref(m.last_node)
            return
        running.append(FakeRequest(tokens, torch.cat([m.kv_indices, own]), m.last_node, slot, m.prefix_len))

    def chunk(r: FakeRequest) -> None:
        ends = list(range(r.cached + ps, len(r.tokens) + 1, ps))
        if not ends:
            return
        end = rng.choice(ends)
        h.write_state(r.slot, r.tokens[:end])
        adopt = rng.random() < 0.3 and h.pools.mamba.available() > 0
        state = h.new_state(r.tokens[:end]) if adopt else r.slot
        before = snapshot()
        res = cache.cache_unfinished_req(r.tokens[:end], r.kv[:end], r.node, state, adopt_mamba=adopt)
        if res.inserted:
            assert res.prefix_len == end and h.tokens_at(res.kv_indices) == r.tokens[:end]
            r.kv = torch.cat([res.kv_indices, r.kv[end:]])
            r.node, r.cached = res.last_node, end
            kv_new = {tuple(r.tokens[:e]) for e in range(ps, end + 1, ps)}
            state_new = {tuple(r.tokens[:end])}
            before = ((before[0][0] | kv_new, before[0][1] | state_new), (before[1][0] | kv_new, before[1][1] | state_new))
        check_eviction(before)  # forking the state may have evicted one cached state

    def finish(r: FakeRequest) -> None:
        running.remove(r)
        n = len(r.tokens)
        state_len = n if rng.random() < 0.6 else rng.randrange(0, n + 1)
        h.write_state(r.slot, r.tokens[:state_len])
        device_kv = h.content()[0]
        already = cache.cache_finished_req(r.tokens, r.kv, r.node, r.slot, mamba_len=state_len)
        kept = state_len if state_len % ps == 0 else 0  # 0: no state kept
        kv_prefix = max((e for e in range(ps, n - n % ps + 1, ps) if tuple(r.tokens[:e]) in device_kv), default=0)
        assert already == (kv_prefix if kept == 0 else min(kv_prefix, kept))
        if kept:
            add_to_model(r.tokens, kept)

    def abort(r: FakeRequest) -> None:
        running.remove(r)
        h.alloc.free(r.kv[r.cached :])
        h.pools.mamba.free([r.slot])
        cache.dec_lock_ref(r.node)

    for _ in range(steps):
        op = rng.choices(
            ["start", "chunk", "finish", "abort", "probe", "evict_kv", "evict_mamba", "ensure_free", "resize"],
            weights=[6, 3, 4, 1, 2, 1, 1, 1, 2 if elastic else 0],
        )[0]
        if op == "start" and len(running) < 4:
            start()
        elif op in ("chunk", "finish", "abort") and running:
            r = rng.choice(running)
            {"chunk": chunk, "finish": finish, "abort": abort}[op](r)
        elif op == "probe":
            check_match(new_tokens())
        elif op == "evict_kv":
            before = snapshot()
            want = rng.randrange(1, 8 * ps)
            freed = cache.evict_kv(want)
            assert freed >= want or cache.evictable_size() == 0
            check_eviction(before, freed_tokens=freed)
        elif op == "evict_mamba":
            before = snapshot()
            want = rng.randrange(1, 4)
            freed = cache.evict_mamba(want)
            assert freed >= want or cache.mamba_evictable_size() == 0
            check_eviction(before, freed_states=freed)
        elif op == "resize":
            before = h.tier_content()
            if rng.random() < 0.5:
                moved = h.pools.move_mamba_to_kv(rng.randrange(1, 8 * ps), keep_mamba_free=1)
            else:
                moved = h.pools.move_kv_to_mamba(rng.randrange(1, 3))
            if moved:
                cache.pools_resized()
            assert h.tier_content() == before  # only free entries moved; every slot kept its data
        elif op == "ensure_free":
            before = snapshot()
            kv_want, mamba_want = rng.randrange(0, 24 * ps), rng.randrange(0, 7)
            ok = cache.ensure_free(kv_tokens=kv_want, mamba_slots=mamba_want)
            free = h.pools.free_counts()
            assert ok == (free["kv_tokens"] >= kv_want and free["mamba_slots"] >= mamba_want)
            check_eviction(before)

        # invariants after every step
        cache.check_invariants()
        nodes = list(cache.nodes())
        assert set(cache.kv_eviction_order()) == {
            n for n in nodes
            if n.value is not None and n.full_lock_ref == 0 and all(c.value is None for c in n.children.values())
        }
        assert set(cache.mamba_eviction_order()) == {
            n for n in nodes if n.mamba_slot is not None and n.mamba_lock_ref == 0 and (n.children or n.full_lock_ref == 0)
        }
        kv_content, state_content = view()
        assert (kv_content, state_content) == (kv_model, state_model)
        used, free = h.pools.used_counts(), h.pools.free_counts()
        assert used["kv_tokens"] == cache.cached_tokens() + sum(len(r.kv) - r.cached for r in running)
        assert used["mamba_slots"] == cache.mamba_size() + len(running)
        # pool free counts + tree usage (+ the running requests' own slots) == capacity, in pages
        held = torch.cat([n.value for n in nodes if n.value is not None] + [r.kv[r.cached :] for r in running] + [torch.zeros(0, dtype=torch.int64)])
        assert free["kv_tokens"] + torch.unique(held // ps).numel() * ps == h.pools.kv.total()
        assert free["mamba_slots"] + cache.mamba_size() + len(running) == h.pools.mamba.total()
        assert cache.protected_size() == len({p for p in locked_prefixes()[0]}) * ps
        for r in running:
            assert not r.node.removed and h.tokens_at(r.kv) == r.tokens[: len(r.kv)]

    for r in list(running):
        abort(r)
    assert cache.protected_size() == 0
    if not isinstance(seed, random.Random):  # hypothesis may draw a sequence without lookups
        assert cache.stats()["lookups"] > 0
    if host_tier and not isinstance(seed, random.Random):  # (hypothesis may draw a sequence that never evicts)
        st_ = cache.stats()
        assert st_["host_written_tokens"] > 0 and st_["host_evicted_tokens"] > 0, "the workload never used the host tier"
        assert st_["host_hits"] > 0 and st_["host_loaded_tokens"] > 0
    cache.reset()
    h.pools.check_all_free()
    if host_tier:
        assert h.host.kv_allocator.used() == 0 and h.host.mamba_allocator.used() == 0


@pytest.mark.parametrize("policy", ["lru", "marconi"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(4))
def test_random_request_lifecycles_with_the_host_tier_match_the_brute_force_model(seed, page_size, policy):
    run_random_lifecycles(seed, page_size, steps=200, policy=policy, host_tier=True)


@pytest.mark.parametrize("host_tier", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(3))
def test_random_request_lifecycles_with_elastic_pools(seed, page_size, host_tier):
    run_random_lifecycles(seed, page_size, steps=200, host_tier=host_tier, elastic=True)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(3))
def test_random_request_lifecycles_with_a_tiny_host_tier_drop_what_does_not_fit(seed, page_size):
    run_random_lifecycles(seed, page_size, steps=200, host_tier=True, host_pages=2)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rng=st.randoms(use_true_random=False), page_size=st.sampled_from([1, 2, 4]),
       policy=st.sampled_from(["lru", "marconi"]))
def test_random_request_lifecycles_with_the_host_tier_hypothesis_drives_the_operations(rng, page_size, policy):
    run_random_lifecycles(rng, page_size, steps=60, policy=policy, host_tier=True)


@pytest.mark.parametrize("policy", ["lru", "marconi"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(4))
def test_random_request_lifecycles_match_the_brute_force_model(seed, page_size, policy):
    run_random_lifecycles(seed, page_size, steps=200, policy=policy)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), page_size=st.sampled_from([1, 2, 4]))
def test_random_request_lifecycles_hypothesis_seeds(seed, page_size):
    run_random_lifecycles(seed, page_size, steps=100)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rng=st.randoms(use_true_random=False), page_size=st.sampled_from([1, 2, 4]),
       policy=st.sampled_from(["lru", "marconi"]))
def test_random_request_lifecycles_hypothesis_drives_the_operations(rng, page_size, policy):
    """Every operation and argument is drawn from hypothesis' own random source, so a failing
    sequence shrinks to a minimal one."""
    run_random_lifecycles(rng, page_size, steps=60, policy=policy)


def test_marconi_evicts_branch_points_last_and_prefers_long_prefixes():
    h = Harness(kv_tokens=64, mamba_slots=8, policy="marconi")
    h.cache_seq([1, 2, 3, 4, 5, 6])
    h.cache_seq([1, 2, 3, 4, 7, 8])  # splits at 4: a KV-only branch node
    (branch,) = [n for n in h.cache.nodes() if len(n.children) == 2]
    assert branch.mamba_slot is None and h.cache.path_tokens(branch) == (1, 2, 3, 4)
    h.cache.insert([1, 2, 3, 4], h.cache.path_kv_indices(branch), h.new_state([1, 2, 3, 4]))
    h.cache_seq([5, 6])  # short and most recent
    order = h.cache.mamba_eviction_order()
    assert order[-1] is branch, order  # the branch point goes last although it is the oldest
    assert h.cache.path_tokens(order[0]) == (1, 2, 3, 4, 5, 6)  # the oldest of equal efficiency first
    h.cache.marconi_alpha = 10.0  # FLOP efficiency dominates: the short prefix goes first
    assert h.cache.path_tokens(h.cache.mamba_eviction_order()[0]) == (5, 6)
    assert h.cache.evict_mamba(1) == 1 and h.cache.match_prefix([5, 6, 7]).prefix_len == 0
    h.cache.check_invariants()


# ----------------------------------------------------------------------------------------
# eviction index vs ranking every candidate on each call
# ----------------------------------------------------------------------------------------
class FullRankCache(HybridRadixCache):
    """The oracle: each eviction call sorts every evictable node of the tree by the policy's key
    (its score over the call's candidates for Marconi) and evicts in that order, a leaf exposed
    on the way joining with its key then (the eviction before the incremental index)."""

    def _full_rank(self, evictable, access, efficiency):
        cands = [n for n in self.nodes() if evictable(n)]
        if self.policy.name == "marconi" and cands:
            norms = MarconiPolicy.norms([access(n) for n in cands], [efficiency(n) for n in cands])

            def key(n):
                return self.policy.score(access(n), efficiency(n), 1 if len(n.children) >= 2 else 0, norms)
        else:
            key = access
        heap = [(key(n), n.id, n) for n in cands]
        heapq.heapify(heap)
        return heap, key

    def evict_kv(self, num_tokens):
        if num_tokens <= 0:
            return 0
        heap, key = self._full_rank(self._kv_evictable, lambda n: n.last_access, self._kv_efficiency)
        freed, c = 0, self._counters
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)[2]
            if not self._kv_evictable(leaf):
                continue
            parent = leaf.parent
            tokens, states = self._remove_leaf(leaf)
            freed += tokens
            c["kv_evicted_nodes"] += 1
            c["kv_evicted_mamba"] += states
            pruned, kept = self._prune_stateless_leaves(parent)
            freed += pruned
            if self._kv_evictable(kept):
                heapq.heappush(heap, (key(kept), kept.id, kept))
        c["kv_evicted_tokens"] += freed
        return freed

    def evict_mamba(self, num_slots):
        if num_slots <= 0:
            return 0
        heap, _ = self._full_rank(self._mamba_evictable, lambda n: n.mamba_last_access, self._mamba_efficiency)
        freed, c = 0, self._counters
        while freed < num_slots and heap:
            node = heapq.heappop(heap)[2]
            if not self._mamba_evictable(node):
                continue
            if node.children:
                self._drop_mamba(node)
                c["tombstones_created"] += 1
            else:
                parent = node.parent
                tokens = self._remove_leaf(node)[0] + self._prune_stateless_leaves(parent)[0]
                c["mamba_evicted_tokens"] += tokens
            freed += 1
        c["mamba_evicted"] += freed
        return freed


@pytest.mark.parametrize("policy,alpha", [("lru", 1.0), ("marconi", 1.0), ("marconi", 0.05), ("marconi", 20.0),
                                          ("marconi", -0.5)])
@pytest.mark.parametrize("seed", range(3))
def test_eviction_order_matches_ranking_every_candidate(seed, policy, alpha):
    """A random workload (inserts with states at random lengths, hits, locks held across steps,
    single and bulk evictions of both lists) runs on the indexed cache and on one that ranks
    every candidate on each call: the same victims every time (same trees, same counters), and a
    one-victim eviction takes the first node of the brute-force order."""
    rng = random.Random(seed)
    ps = rng.choice([1, 2])
    new, ref = Harness(page_size=ps, kv_tokens=96, mamba_slots=24), Harness(page_size=ps, kv_tokens=96, mamba_slots=24)
    new.cache = HybridRadixCache(new.pools, mamba_align=2, policy=policy, marconi_alpha=alpha)
    ref.cache = FullRankCache(ref.pools, mamba_align=2, policy=policy, marconi_alpha=alpha)
    locks: list[int] = []  # ids of locked nodes, the same in both trees

    def both(fn):
        a, b = fn(new), fn(ref)
        assert a == b
        return a

    def node_by_id(h, nid):
        return next(n for n in h.cache.nodes() if n.id == nid)

    evictions = 0
    for _ in range(260):
        op = rng.choices(["insert", "hit", "lock", "unlock", "kv1", "mamba1", "kv", "mamba"],
                         weights=[6, 3, 2, 2, 2, 2, 1, 1])[0]
        if op == "insert" and new.pools.free_counts()["mamba_slots"] > 0:
            tokens = [rng.randint(1, 3) for _ in range(ps * rng.randint(1, 6))]
            state_at = rng.choice([len(tokens), ps * rng.randint(1, len(tokens) // ps)])
            if new.alloc.available() >= len(tokens) + ps:
                both(lambda h: h.cache_seq(tokens, state_at=state_at))
        elif op == "hit":
            tokens = [rng.randint(1, 3) for _ in range(rng.randint(1, 12))]
            both(lambda h: h.cache.match_prefix(tokens).prefix_len)
        elif op == "lock":
            tokens = [rng.randint(1, 3) for _ in range(rng.randint(1, 12))]
            ms = [h.cache.match_prefix(tokens) for h in (new, ref)]
            if ms[0].mamba_node is not None:
                assert ms[0].last_node.id == ms[1].last_node.id
                for h, m in zip((new, ref), ms):
                    h.cache.inc_lock_ref(m.last_node)
                locks.append(ms[0].last_node.id)
        elif op == "unlock" and locks:
            nid = locks.pop(rng.randrange(len(locks)))
            for h in (new, ref):
                h.cache.dec_lock_ref(node_by_id(h, nid))
        elif op in ("kv1", "mamba1"):
            order = new.cache.kv_eviction_order() if op == "kv1" else new.cache.mamba_eviction_order()
            freed = both(lambda h: h.cache.evict_kv(1) if op == "kv1" else h.cache.evict_mamba(1))
            if order:
                evictions += 1
                first = order[0]
                assert freed >= 1 and (first.removed or (op == "mamba1" and first.mamba_slot is None))
        elif op == "kv":
            want = rng.randint(1, 40)
            evictions += both(lambda h: h.cache.evict_kv(want)) > 0
        elif op == "mamba":
            want = rng.randint(1, 8)
            evictions += both(lambda h: h.cache.evict_mamba(want)) > 0
        assert new.content() == ref.content()
        assert new.cache.stats() == ref.cache.stats()
        assert [n.id for n in new.cache.nodes()] == [n.id for n in ref.cache.nodes()]
        new.cache.check_invariants()
    assert evictions >= 20


def test_policy_registry_validates_names_once_for_config_and_cache():
    import hybrid_compile as hc

    for bad in ("fifo", None, "LRU"):
        with pytest.raises(ValueError, match=r"must be one of \('lru', 'marconi'\)") as cfg:
            hc.EngineConfig.from_args(prefix_cache_policy=bad)
        assert "EngineConfig.prefix_cache_policy" in str(cfg.value)
        with pytest.raises(ValueError, match=r"HybridRadixCache: policy must be one of \('lru', 'marconi'\)"):
            HybridRadixCache(Harness().pools, policy=bad)
    h = Harness(policy="marconi")
    assert isinstance(h.cache.policy, MarconiPolicy) and h.cache.stats()["policy"] == "marconi"
    h.cache.marconi_alpha = 3.0
    assert h.cache.policy.alpha == 3.0 and h.cache.marconi_alpha == 3.0


def test_policies_place_checkpoints():
    from hybrid_compile.cache import LRUPolicy, NoPrefixCachePolicy

    grid = dict(mamba_align=4, page_size=2)
    lru, marconi, off = LRUPolicy(), MarconiPolicy(), NoPrefixCachePolicy()
    # extend 0 -> 14: the last chunk boundary (12), or the branch point 8 when it is on the grid
    assert lru.checkpoint_len(0, 14, **grid) == 12
    assert lru.checkpoint_len(0, 14, branching_len=8, **grid) == 8
    assert marconi.checkpoint_len(0, 14, **grid) is None  # branch points only
    assert marconi.checkpoint_len(0, 14, branching_len=8, **grid) == 8
    assert lru.checkpoint_len(0, 14, cached_len=12, **grid) is None  # already cached
    # a decode token: every decode_interval tokens (LRU) on a page; never for Marconi
    assert lru.checkpoint_len(15, 1, decode_interval=8, **grid) == 16
    assert lru.checkpoint_len(14, 1, decode_interval=8, **grid) is None
    assert lru.checkpoint_len(15, 1, **grid) is None  # interval 0: none
    assert marconi.checkpoint_len(15, 1, decode_interval=8, **grid) is None
    assert off.checkpoint_len(0, 14, branching_len=8, **grid) is None and not off.waits_for_shared_prefix


def test_null_prefix_cache_holds_nothing_and_frees_what_it_is_handed():
    from hybrid_compile.cache import NullPrefixCache

    h = Harness(kv_tokens=16, mamba_slots=2)
    cache = NullPrefixCache(h.pools)
    m = cache.match_prefix([1, 2, 3])
    assert (m.prefix_len, m.kv_match_len, m.mamba_node, m.branching_len) == (0, 0, None, None)
    assert m.kv_indices.numel() == 0
    cache.inc_lock_ref(m.last_node)
    slot = int(h.pools.mamba.alloc(1)[0])
    assert cache.cow_mamba(m, slot) == slot
    kv = h.alloc.alloc(5)
    assert cache.evictable_size() == 0 and cache.evict_kv(5) == 0 and cache.evict_mamba(1) == 0
    assert cache.ensure_free(kv_tokens=11, mamba_slots=1) and not cache.ensure_free(kv_tokens=12)
    assert cache.cache_finished_req([1, 2, 3, 4, 5], kv, m.last_node, slot, mamba_len=5) == 0
    h.pools.check_all_free()
    cache.reset()
