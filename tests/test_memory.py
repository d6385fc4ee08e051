"""Tests of hybrid_compile.memory: allocators, KV / Mamba / request pools, sizing, MemoryPools."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybrid_compile.memory import (
    AttentionLayerSpec,
    InvalidSlotError,
    KVPool,
    MambaLayerSpec,
    MambaPool,
    MemoryPools,
    ReqToTokenPool,
    SlotAllocator,
    TokenSlotAllocator,
    available_device_memory,
    group_layer_specs,
    kv_bytes_per_token,
    mamba_bytes_per_slot,
    plan_memory,
)

# A tiny Qwen3-Next-like layout: layers 3 and 7 full attention, the rest GDN.
ATTN = [AttentionLayerSpec((3, 7), num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)]
GDN = [MambaLayerSpec((0, 1, 2, 4, 5, 6), conv_width=4, conv_dim=24, state_shape=(2, 4, 6), conv_dtype=torch.bfloat16)]
ATTN_BYTES_PER_TOKEN = 2 * 2 * (8 + 8) * 2  # layers * heads * (K + V dims) * bf16
GDN_BYTES_PER_SLOT = 6 * (3 * 24 * 2 + 2 * 4 * 6 * 4)  # layers * (conv bf16 + ssm fp32)


# --------------------------------------------------------------------------------------
# specs
# --------------------------------------------------------------------------------------
def test_spec_bytes_and_defaults():
    spec = AttentionLayerSpec(5, num_kv_heads=4, head_dim=16, dtype=torch.float16, v_head_dim=8)
    assert spec.layer_ids == (5,)
    assert spec.bytes_per_token == 4 * (16 + 8) * 2
    assert AttentionLayerSpec([1], 1, 4, torch.float32).v_head_dim == 4
    assert kv_bytes_per_token(ATTN) == ATTN_BYTES_PER_TOKEN
    assert mamba_bytes_per_slot(GDN) == GDN_BYTES_PER_SLOT
    assert GDN[0].ssm_dtype == torch.float32
    assert GDN[0].conv_window_shape == (3, 24)


def test_spec_validation():
    with pytest.raises(ValueError, match="positive"):
        AttentionLayerSpec(0, num_kv_heads=0, head_dim=8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="duplicate"):
        AttentionLayerSpec((1, 1), 1, 8, torch.bfloat16)
    with pytest.raises(TypeError, match="dtype"):
        MambaLayerSpec(0, 4, 8, (2, 2), conv_dtype="bf16")
    with pytest.raises(ValueError, match="state_shape"):
        MambaLayerSpec(0, 4, 8, (2, 0), torch.bfloat16)
    conv_only = MambaLayerSpec(0, 3, 8, (), torch.bfloat16)  # LFM2's short conv: no SSM state
    assert not conv_only.has_ssm_state and conv_only.ssm_bytes_per_slot_per_layer == 0
    assert conv_only.bytes_per_slot == 2 * 8 * 2


def test_group_layer_specs_merges_identical_and_rejects_overlap():
    per_layer = [AttentionLayerSpec(i, 2, 8, torch.bfloat16) for i in (7, 3)]
    per_layer.append(AttentionLayerSpec(9, 2, 16, torch.bfloat16))
    groups = group_layer_specs(per_layer)
    assert [g.layer_ids for g in groups] == [(3, 7), (9,)]
    with pytest.raises(ValueError, match="more than one"):
        group_layer_specs([AttentionLayerSpec(1, 2, 8, torch.bfloat16), AttentionLayerSpec(1, 2, 16, torch.bfloat16)])


# --------------------------------------------------------------------------------------
# SlotAllocator
# --------------------------------------------------------------------------------------
def test_slot_allocator_accounting_exhaustion_and_recovery():
    a = SlotAllocator(5, name="Mamba slot")
    assert (a.total(), a.available(), a.used()) == (5, 5, 0)
    first = a.alloc(3)
    assert first.dtype == torch.int64 and first.device.type == "cpu"
    assert first.tolist() == [0, 1, 2]
    assert a.alloc(3) is None  # only 2 left: None, nothing changes
    assert a.available() == 2
    rest = a.alloc(2)
    assert sorted(first.tolist() + rest.tolist()) == [0, 1, 2, 3, 4]
    assert a.alloc(1) is None and a.alloc(0).numel() == 0
    a.free(first[1:2])
    assert a.available() == 1
    assert a.alloc(1).tolist() == [1]  # freed slot is reused
    a.free(torch.tensor([0, 1, 2, 3, 4]))
    assert a.available() == 5 and a.used() == 0


def test_slot_allocator_first_index_reserves_low_indices():
    a = SlotAllocator(3, first_index=1, name="request slot")
    assert a.alloc(3).tolist() == [1, 2, 3]
    with pytest.raises(InvalidSlotError, match=r"out of range \[1, 4\)"):
        a.free(0)


def test_slot_allocator_bad_frees_raise_and_change_nothing():
    a = SlotAllocator(4, name="Mamba slot")
    got = a.alloc(2)
    with pytest.raises(InvalidSlotError, match="not allocated"):
        a.free([3])
    with pytest.raises(InvalidSlotError, match="out of range"):
        a.free([4])
    with pytest.raises(InvalidSlotError, match="out of range"):
        a.free([-1])
    with pytest.raises(InvalidSlotError, match="more than once"):
        a.free([0, 0])
    with pytest.raises(InvalidSlotError, match="Mamba slot"):
        a.free([got[0].item(), 3])  # one good, one bad: nothing freed
    assert a.available() == 2
    a.free(got)
    with pytest.raises(InvalidSlotError, match="not allocated"):
        a.free(got[:1])  # double free
    with pytest.raises(ValueError, match="negative"):
        a.alloc(-1)
    with pytest.raises(TypeError):
        a.free(torch.tensor([0.0]))


@settings(max_examples=50, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    capacity=st.integers(0, 12),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 6), st.integers(0, 1000)), max_size=40),
)
def test_slot_allocator_matches_set_model(capacity, ops):
    a = SlotAllocator(capacity, first_index=2)
    model: set[int] = set()
    universe = set(range(2, 2 + capacity))
    for is_alloc, n, pick in ops:
        if is_alloc:
            got = a.alloc(n)
            if n > len(universe - model):
                assert got is None
            else:
                got = got.tolist()
                assert len(set(got)) == n and set(got) <= universe - model
                model |= set(got)
        elif model:
            chosen = sorted(model)[pick % len(model) :][: max(n, 1)]
            a.free(chosen)
            model -= set(chosen)
        else:
            with pytest.raises(InvalidSlotError):
                a.free([2 + pick % max(capacity, 1)] if capacity else [0])
        assert a.available() == capacity - len(model)
        assert a.used() == len(model)
        assert set(torch.nonzero(a.is_allocated(list(universe)) if universe else torch.zeros(0)).flatten().add(2).tolist()) == model


# --------------------------------------------------------------------------------------
# TokenSlotAllocator
# --------------------------------------------------------------------------------------
def test_token_allocator_page_size_one_reserves_slot_zero():
    a = TokenSlotAllocator(num_pages=6, page_size=1)
    assert (a.num_slots, a.total(), a.available()) == (7, 6, 6)
    slots = a.alloc(6)
    assert 0 not in slots.tolist() and sorted(slots.tolist()) == [1, 2, 3, 4, 5, 6]
    assert a.alloc(1) is None
    with pytest.raises(InvalidSlotError, match="padding page"):
        a.free([TokenSlotAllocator.PADDING_SLOT])
    a.free(slots[:2])
    assert a.available() == 2 and a.used() == 4
    # page size 1: decode needs no last slot
    assert a.alloc_decode([3, 9]).numel() == 2
    assert a.available() == 0


def test_token_allocator_pages_and_in_page_offsets():
    ps = 4
    a = TokenSlotAllocator(num_pages=5, page_size=ps)
    assert (a.num_slots, a.total()) == (24, 20)
    s = a.alloc(6)  # positions 0..5: one full page + 2 tokens of a second page
    assert s.tolist() == [4, 5, 6, 7, 8, 9]
    assert a.available() == 3 * ps and a.used() == 6
    # Every position p sits at offset p % ps.
    assert [x % ps for x in s.tolist()] == [p % ps for p in range(6)]
    # Extending fills the partial last page first (offsets 2, 3), then takes a new page.
    e = a.alloc_extend([6], [3], [s[-1]])
    assert e.tolist() == [10, 11, 12]
    assert a.available() == 2 * ps
    # Decode of two requests: one continues its page, one starts a new page.
    t = a.alloc(4)  # a second request, exactly one page
    d = a.alloc_decode([9, 4], [e[-1], t[-1]])
    assert d[0].item() == 13 and d[1].item() % ps == 0 and d[1].item() // ps not in {1, 2, 3, 4}
    assert a.available() == 0
    assert a.alloc(1) is None


def test_token_allocator_batched_extend_packs_request_after_request():
    ps = 4
    a = TokenSlotAllocator(num_pages=8, page_size=ps)
    s1, s2 = a.alloc(3), a.alloc(5)
    out = a.alloc_extend([3, 5, 0], [2, 4, 1], [s1[-1], s2[-1], -1])
    assert out.numel() == 7
    r1, r2, r3 = out[:2].tolist(), out[2:6].tolist(), out[6:].tolist()
    assert r1[0] == s1[-1].item() + 1  # fills the last page of request 1 (offset 3) ...
    assert r1[1] % ps == 0  # ... then position 4 starts a new page
    assert r2[:3] == [s2[-1].item() + 1 + i for i in range(3)] and r2[3] % ps == 0
    assert r3[0] % ps == 0
    assert a.pages_needed([5, 9, 0], [2, 4, 1]) == 0 + 1 + 1


def test_token_allocator_partial_page_reuse_and_page_release():
    ps = 4
    a = TokenSlotAllocator(num_pages=3, page_size=ps)
    s = a.alloc(6)  # pages 1 (full) and 2 (2 tokens)
    # Speculative rejection: free position 5 only; its page stays owned by the request.
    a.free(s[5:])
    assert a.available() == 1 * ps and a.used() == 5
    again = a.alloc_decode([5], [s[4]])
    assert again.item() == s[5].item()  # the same offset of the same page is reused
    # Free the whole second page: it returns to the free pages.
    a.free(torch.cat([s[4:5], again]))
    assert a.available() == 2 * ps
    # Now position 4 starts a fresh page (its old page may be handed out again).
    new = a.alloc_decode([4], [s[3]])
    assert new.item() % ps == 0
    a.free(torch.cat([s[:4], new]))
    assert a.available() == 3 * ps and a.used() == 0


def test_token_allocator_errors():
    ps = 4
    a = TokenSlotAllocator(num_pages=4, page_size=ps)
    s = a.alloc(2)
    with pytest.raises(ValueError, match="last_slots"):
        a.alloc_extend([2], [1])
    with pytest.raises(InvalidSlotError, match="page offset"):
        a.alloc_extend([2], [1], [s[0]])  # s[0] holds position 0, not 1
    with pytest.raises(InvalidSlotError, match="not allocated"):
        a.alloc_extend([2], [1], [s[1] + 4])
    other = a.alloc(1)
    # Two requests both extending from the same page slot -> the second would collide.
    with pytest.raises(InvalidSlotError, match="already in use"):
        a.alloc_extend([2, 2], [1, 1], [s[1], s[1]])
    assert a.used() == 3  # failed calls changed nothing
    with pytest.raises(InvalidSlotError, match="not allocated"):
        a.free([s[1] + 1])  # tail of an owned page, never handed out
    with pytest.raises(InvalidSlotError, match="more than once"):
        a.free([s[0], s[0]])
    with pytest.raises(InvalidSlotError, match="out of range"):
        a.free([a.num_slots])
    with pytest.raises(ValueError, match=">= 0"):
        a.alloc_extend([0], [-1])
    with pytest.raises(ValueError, match="differ"):
        a.alloc_extend([0, 0], [1])
    a.free(torch.cat([s, other]))
    with pytest.raises(InvalidSlotError, match="not allocated"):
        a.free(s)  # double free
    assert a.used() == 0 and a.available() == a.total()


@settings(max_examples=50, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    page_size=st.sampled_from([1, 2, 4]),
    num_pages=st.integers(1, 8),
    ops=st.lists(st.tuples(st.sampled_from(["new", "extend", "trim", "finish"]), st.integers(0, 9), st.integers(0, 99)),
                 max_size=40),
)
def test_token_allocator_matches_request_model(page_size, num_pages, ops):
    """Random request lifecycles against a brute-force model of pages and token slots."""
    ps = page_size
    a = TokenSlotAllocator(num_pages, ps)
    requests: list[list[int]] = []  # token slots of each live request, by position

    def model_pages_in_use() -> set[int]:
        return {slot // ps for r in requests for slot in r}

    def pages_needed(prefix: int, n: int) -> int:
        room = (ps - prefix % ps) % ps
        return -(-max(n - room, 0) // ps)

    for kind, n, pick in ops:
        free_pages = num_pages - len(model_pages_in_use())
        if kind == "new":
            got = a.alloc(n)
            if pages_needed(0, n) > free_pages:
                assert got is None
            else:
                requests.append(got.tolist())
        elif kind == "extend" and requests:
            r = requests[pick % len(requests)]
            last = r[-1] if r else -1
            got = a.alloc_extend([len(r)], [n], [last])
            if pages_needed(len(r), n) > free_pages:
                assert got is None
            else:
                r.extend(got.tolist())
        elif kind == "trim" and requests:
            r = requests[pick % len(requests)]
            k = min(n, len(r))
            if k:
                a.free(r[len(r) - k :])
                del r[len(r) - k :]
        elif kind == "finish" and requests:
            r = requests.pop(pick % len(requests))
            a.free(r)
            if r:
                with pytest.raises(InvalidSlotError, match="not allocated"):
                    a.free(r[:1])  # double free

        every = [s for r in requests for s in r]
        assert len(every) == len(set(every)), "a slot was handed out twice"
        assert all(ps <= s < a.num_slots for s in every)
        for r in requests:
            for p, slot in enumerate(r):
                assert slot % ps == p % ps
                if p % ps:
                    assert slot == r[p - 1] + 1
        assert a.used() == len(every)
        assert a.available() == (num_pages - len(model_pages_in_use())) * ps
    for r in requests:
        a.free(r)
    assert a.used() == 0 and a.available() == a.total()


# --------------------------------------------------------------------------------------
# KVPool
# --------------------------------------------------------------------------------------
def test_kv_pool_shapes_and_layer_map():
    specs = ATTN + [AttentionLayerSpec(9, num_kv_heads=1, head_dim=4, v_head_dim=6, dtype=torch.float32)]
    pool = KVPool(specs, max_total_tokens=8, page_size=2)
    assert pool.num_token_slots == 10  # 4 pages + reserved page 0
    assert pool.layer_ids == [3, 7, 9]
    assert pool.layer_to_kv_index == {3: 0, 7: 1, 9: 2}
    k, v = pool.kv_cache(7)
    assert k.shape == (10, 2, 8) and v.shape == (10, 2, 8) and k.dtype == torch.bfloat16
    assert k.is_contiguous() and k.device.type == "cpu"
    assert pool.k_cache(9).shape == (10, 1, 4) and pool.v_cache(9).shape == (10, 1, 6)
    assert pool.v_cache(9).dtype == torch.float32
    assert len(pool.k_buffers) == 2 and pool.k_buffers[0].shape == (2, 10, 2, 8)  # layers 3 and 7 stacked
    assert pool.k_cache(7).data_ptr() == pool.k_buffers[0][1].data_ptr()
    assert pool.nbytes() == 10 * (ATTN_BYTES_PER_TOKEN + 1 * (4 + 6) * 4)
    with pytest.raises(KeyError, match="no KV cache"):
        pool.k_cache(0)
    with pytest.raises(ValueError, match="multiple of page_size"):
        KVPool(ATTN, max_total_tokens=7, page_size=2)


def test_kv_pool_store_through_slots_and_padding_slot():
    pool = KVPool(ATTN, max_total_tokens=6, page_size=1)
    slots = pool.alloc(3)
    k = torch.randn(3, 2, 8).to(torch.bfloat16)
    padded = torch.cat([slots, torch.tensor([KVPool.PADDING_SLOT])])
    pool.k_cache(3)[padded] = torch.cat([k, torch.ones(1, 2, 8, dtype=torch.bfloat16)])
    assert torch.equal(pool.k_cache(3)[slots], k)
    assert torch.equal(pool.k_cache(7)[slots], torch.zeros_like(k))  # other layer untouched
    pool.free(slots)
    assert pool.available() == pool.total() == 6


def test_kv_pool_copy_slots_moves_every_layer_gather_then_scatter():
    """``copy_slots``: K/V of the sources into the destinations in every layer, all sources read
    before any destination is written (a tree's path: a slot both a source and a destination);
    mismatched counts and unallocated slots refused, nothing copied."""
    pool = KVPool(ATTN, max_total_tokens=6, page_size=1)
    slots = pool.alloc(4)
    for layer in (3, 7):
        pool.k_cache(layer)[slots] = torch.randn(4, 2, 8).to(torch.bfloat16)
        pool.v_cache(layer)[slots] = torch.randn(4, 2, 8).to(torch.bfloat16)
    before = {layer: (pool.k_cache(layer).clone(), pool.v_cache(layer).clone()) for layer in (3, 7)}
    pool.copy_slots(slots[[2, 3]], slots[[1, 2]])  # slot 2 is read, then written
    for layer, (k, v) in before.items():
        assert torch.equal(pool.k_cache(layer)[slots[1]], k[slots[2]]) and torch.equal(pool.k_cache(layer)[slots[2]], k[slots[3]])
        assert torch.equal(pool.v_cache(layer)[slots[1]], v[slots[2]]) and torch.equal(pool.v_cache(layer)[slots[0]], v[slots[0]])
    after = {layer: pool.k_cache(layer).clone() for layer in (3, 7)}
    with pytest.raises(ValueError, match="2 sources but 1 destinations"):
        pool.copy_slots(slots[:2], slots[2:3])
    free = pool.alloc(1)
    pool.free(free)
    with pytest.raises(ValueError, match="must be allocated"):
        pool.copy_slots(slots[:1], free)
    assert all(torch.equal(pool.k_cache(layer), after[layer]) for layer in (3, 7))


# --------------------------------------------------------------------------------------
# MambaPool
# --------------------------------------------------------------------------------------
def test_mamba_pool_shapes_dtypes():
    mamba2 = MambaLayerSpec(10, conv_width=4, conv_dim=40, state_shape=(4, 8, 16), conv_dtype=torch.float16)
    pool = MambaPool(GDN + [mamba2], num_slots=5, num_draft_steps=3, max_draft_batch=2)
    assert pool.layer_ids == [0, 1, 2, 4, 5, 6, 10]
    c = pool.layer_cache(4)
    assert c.conv.shape == (5, 3, 24) and c.conv.dtype == torch.bfloat16
    assert c.ssm.shape == (5, 2, 4, 6) and c.ssm.dtype == torch.float32
    assert c.intermediate_conv.shape == (2, 3, 3, 24) and c.intermediate_ssm.shape == (2, 3, 2, 4, 6)
    assert pool.conv(10).shape == (5, 3, 40) and pool.conv(10).dtype == torch.float16
    assert pool.ssm(10).shape == (5, 4, 8, 16)
    assert pool.intermediate_ssm(10).shape == (2, 3, 4, 8, 16)
    assert pool.intermediate_conv(10).shape == (2, 3, 3, 40)
    assert pool.conv_buffers[0].shape == (6, 5, 3, 24)  # the six GDN layers stacked
    assert all(t.is_contiguous() for t in pool.state_tensors())
    assert len(pool.state_tensors()) == len(pool.intermediate_state_tensors()) == 14
    assert pool.nbytes() == 5 * (GDN_BYTES_PER_SLOT + 3 * 40 * 2 + 4 * 8 * 16 * 4)
    assert pool.speculative_nbytes() == 2 * 3 * pool.bytes_per_slot
    with pytest.raises(KeyError, match="no Mamba state"):
        pool.ssm(3)
    plain = MambaPool(GDN, num_slots=2)
    assert plain.layer_cache(0).intermediate_ssm is None and not plain.has_speculative_buffers
    with pytest.raises(RuntimeError, match="no speculative buffers"):
        plain.intermediate_ssm(0)
    with pytest.raises(ValueError, match="both"):
        MambaPool(GDN, num_slots=2, num_draft_steps=2)


def test_mamba_pool_zeroes_reallocated_slots():
    pool = MambaPool(GDN, num_slots=3)
    slots = pool.alloc(3)
    for layer in pool.layer_ids:
        pool.conv(layer).fill_(1.0)
        pool.ssm(layer).fill_(2.0)
    pool.free(slots[1:2])
    assert pool.alloc(1) is not None  # a slot freed with garbage in it comes back zeroed
    for layer in pool.layer_ids:
        assert torch.all(pool.conv(layer)[slots[1]] == 0) and torch.all(pool.ssm(layer)[slots[1]] == 0)
        assert torch.all(pool.conv(layer)[slots[0]] == 1) and torch.all(pool.ssm(layer)[slots[2]] == 2)
    assert pool.alloc(1) is None


def test_mamba_pool_copy_and_fork():
    pool = MambaPool(GDN, num_slots=4)
    a = pool.alloc(2)
    for i, layer in enumerate(pool.layer_ids):
        pool.ssm(layer)[a[0]] = float(i + 1)
        pool.conv(layer)[a[0]] = float(-i)
    pool.copy_slots(a[:1], a[1:])
    forked = pool.fork([a[0].item(), a[0].item()])  # the same source twice is fine
    assert forked.numel() == 2 and pool.available() == 0
    for i, layer in enumerate(pool.layer_ids):
        for dst in (a[1], forked[0], forked[1]):
            assert torch.all(pool.ssm(layer)[dst] == i + 1) and torch.all(pool.conv(layer)[dst] == -i)
    assert pool.fork(a[:1]) is None  # full
    pool.free(forked)
    with pytest.raises(InvalidSlotError, match="not allocated"):
        pool.copy_slots(a[:1], forked[:1])
    with pytest.raises(InvalidSlotError, match="more than once"):
        pool.copy_slots(a, torch.stack([a[1], a[1]]))
    with pytest.raises(InvalidSlotError, match="not allocated"):
        pool.zero_slots(forked)


def test_mamba_pool_with_state_ops():
    """The per-layer views plug straight into the state kernel ops."""
    ops = pytest.importorskip("hybrid_compile.ops.state")
    pool = MambaPool(GDN, num_slots=3, num_draft_steps=2, max_draft_batch=2)
    slots = pool.alloc(2)
    for t in pool.intermediate_state_tensors():
        t[1, 1] = 5.0
    ops.commit_speculative_state(
        pool.state_tensors(), pool.intermediate_state_tensors(),
        torch.tensor([-1, slots[1].item()], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32),
    )
    assert torch.all(pool.ssm(6)[slots[1]] == 5) and torch.all(pool.ssm(6)[slots[0]] == 0)


def test_mamba_pool_conv_only_layers():
    """Conv-only layers (``state_shape=()``) next to GDN layers: empty SSM views, no SSM bytes, and
    zero / copy / speculative commit move their conv windows (checked against plain indexing)."""
    ops = pytest.importorskip("hybrid_compile.ops.state")
    conv_only = MambaLayerSpec((8, 9), conv_width=3, conv_dim=16, state_shape=(), conv_dtype=torch.float32)
    pool = MambaPool(GDN + [conv_only], num_slots=4, num_draft_steps=2, max_draft_batch=2)
    assert pool.ssm(8).shape == (4, 0) and pool.intermediate_ssm(9).shape == (2, 2, 0)
    assert pool.conv(9).shape == (4, 2, 16) and pool.intermediate_conv(9).shape == (2, 2, 2, 16)
    assert pool.nbytes() == 4 * (GDN_BYTES_PER_SLOT + 2 * 2 * 16 * 4)
    assert len(pool.state_tensors()) == len(pool.intermediate_state_tensors()) == 6 * 2 + 2
    a = pool.alloc(2)
    pool.conv(8)[a[0]] = 3.0
    pool.conv(9)[a[0]] = 4.0
    pool.copy_slots(a[:1], a[1:])
    assert torch.all(pool.conv(8)[a[1]] == 3) and torch.all(pool.conv(9)[a[1]] == 4)
    forked = pool.fork(a[:1])
    assert torch.all(pool.conv(9)[forked[0]] == 4)
    pool.zero_slots(a[:1])
    assert torch.all(pool.conv(8)[a[0]] == 0) and torch.all(pool.conv(8)[a[1]] == 3)
    steps = torch.arange(2 * 2 * 2 * 16, dtype=torch.float32).reshape(2, 2, 2, 16)
    pool.intermediate_conv(9).copy_(steps)
    ops.commit_speculative_state(
        pool.state_tensors(), pool.intermediate_state_tensors(),
        torch.tensor([a[1].item(), -1], dtype=torch.int32), torch.tensor([2, 1], dtype=torch.int32),
    )
    assert torch.equal(pool.conv(9)[a[1]], steps[0, 1])  # row 0, its 2nd accepted step


# --------------------------------------------------------------------------------------
# ReqToTokenPool
# --------------------------------------------------------------------------------------
def test_req_to_token_pool_shapes_and_padding_row():
    mamba = MambaPool(GDN, num_slots=3)
    pool = ReqToTokenPool(4, 16, mamba_pool=mamba)
    assert pool.req_to_token.shape == (5, 16) and pool.req_to_token.dtype == torch.int32
    assert pool.req_to_mamba.shape == (5,) and pool.req_to_mamba.dtype == torch.int32
    assert pool.req_to_mamba[ReqToTokenPool.PADDING_REQUEST].item() == -1
    assert pool.total() == 4 and pool.available() == 3  # limited by the Mamba slots


def test_req_to_token_alloc_binds_mamba_slots_atomically():
    mamba = MambaPool(GDN, num_slots=3)
    pool = ReqToTokenPool(4, 16, mamba_pool=mamba)
    reqs = pool.alloc(2)
    assert 0 not in reqs.tolist()
    held = pool.mamba_slots(reqs)
    assert sorted(held.tolist()) == sorted(set(held.tolist())) and bool((held >= 0).all())
    assert pool.req_to_mamba[reqs].tolist() == held.tolist()
    assert pool.alloc(2) is None  # 2 request slots free but only 1 Mamba slot: nothing taken
    assert pool.allocator.available() == 2 and mamba.available() == 1
    # Finishing with the state handed to the prefix cache: the Mamba slot stays allocated.
    kept = pool.free(reqs[:1], free_mamba=False)
    assert kept.tolist() == held[:1].tolist() and mamba.available() == 1
    assert pool.req_to_mamba[reqs[0]].item() == -1
    mamba.free(kept)
    pool.free(reqs[1:])
    assert mamba.available() == 3 and pool.allocator.available() == 4
    with pytest.raises(InvalidSlotError, match="request slot"):
        pool.free(reqs[1:])  # double free


def test_req_to_token_set_mamba_slots():
    mamba = MambaPool(GDN, num_slots=3)
    pool = ReqToTokenPool(2, 8, mamba_pool=mamba)
    (req,) = pool.alloc(1).tolist()
    old = pool.mamba_slots([req])
    new = mamba.alloc(1)
    pool.set_mamba_slots([req], new)
    assert pool.req_to_mamba[req].item() == new.item() and pool.mamba_slots([req]).tolist() == new.tolist()
    (never_allocated,) = set(range(3)) - {old.item(), new.item()}
    with pytest.raises(InvalidSlotError, match="not allocated"):
        pool.set_mamba_slots([req], [never_allocated])
    mamba.free(old)
    pool.free([req])  # frees `new`, the slot the request points at now
    assert mamba.available() == 3 and pool.allocator.available() == 2


def test_req_to_token_writes_and_reads():
    pool = ReqToTokenPool(3, 10)  # no Mamba pool (pure transformer)
    reqs = pool.alloc(2)
    assert pool.mamba_slots(reqs).tolist() == [-1, -1]
    pool.set_tokens(reqs[0].item(), 0, torch.tensor([5, 6, 7]))
    pool.set_tokens_batch(reqs, [3, 0], [2, 4], torch.tensor([8, 9, 20, 21, 22, 23]))
    assert pool.req_to_token[reqs[0], :5].tolist() == [5, 6, 7, 8, 9]
    assert pool.req_to_token[reqs[1], :4].tolist() == [20, 21, 22, 23]
    assert pool.tokens(reqs[0].item(), 5).tolist() == [5, 6, 7, 8, 9]
    assert pool.tokens(reqs[1].item(), 4, start=2).tolist() == [22, 23]
    assert torch.all(pool.req_to_token[ReqToTokenPool.PADDING_REQUEST] == 0)
    with pytest.raises(ValueError, match="max_context_len"):
        pool.set_tokens(reqs[0].item(), 8, [1, 2, 3])
    with pytest.raises(ValueError, match="sum"):
        pool.set_tokens_batch(reqs, [0, 0], [1, 1], [1])
    with pytest.raises(InvalidSlotError, match="not allocated"):
        pool.set_tokens(3, 0, [1])
    with pytest.raises(InvalidSlotError, match="out of range"):
        pool.tokens(0, 1)  # the padding row is not a request
    with pytest.raises(ValueError, match="this pool has no Mamba pool"):
        pool.set_mamba_slots(reqs[:1], [0])


# --------------------------------------------------------------------------------------
# sizing
# --------------------------------------------------------------------------------------
def _plan(**kw):
    args = dict(max_running_requests=4, max_context_len=32)
    args.update(kw)
    return plan_memory(ATTN, GDN, **args)


def test_plan_from_budget_respects_ratio_and_budget():
    budget = 4_000_000
    for ratio in (0.2, 1.0, 3.0):
        p = _plan(memory_budget_bytes=budget, mamba_full_memory_ratio=ratio)
        assert p.bytes_per_token == ATTN_BYTES_PER_TOKEN and p.bytes_per_mamba_slot == GDN_BYTES_PER_SLOT
        assert p.max_total_tokens_source == p.mamba_cache_size_source == "budget"
        assert p.total_bytes <= budget
        assert p.total_bytes > budget - ATTN_BYTES_PER_TOKEN - GDN_BYTES_PER_SLOT  # nothing wasted
        assert p.mamba_bytes / p.kv_bytes == pytest.approx(ratio, rel=0.02)
        assert p.req_to_token_bytes == 5 * 32 * 4 + 5 * 4
    low, high = _plan(memory_budget_bytes=budget, mamba_full_memory_ratio=0.1), _plan(
        memory_budget_bytes=budget, mamba_full_memory_ratio=1.0
    )
    assert high.mamba_cache_size > low.mamba_cache_size and high.max_total_tokens < low.max_total_tokens


def test_plan_caps_bound_budget_capacities_but_not_explicit_ones():
    free = _plan(memory_budget_bytes=4_000_000)
    capped = _plan(memory_budget_bytes=4_000_000, kv_token_cap=100, mamba_slot_cap=6)
    assert free.max_total_tokens > 100 and free.mamba_cache_size > 6
    assert (capped.max_total_tokens, capped.mamba_cache_size) == (100, 6)
    explicit = _plan(max_total_tokens=300, mamba_cache_size=9, kv_token_cap=100, mamba_slot_cap=6)
    assert (explicit.max_total_tokens, explicit.mamba_cache_size) == (300, 9)


def test_plan_page_size_rounds_to_whole_pages():
    p = _plan(memory_budget_bytes=1_000_000, page_size=16)
    assert p.max_total_tokens % 16 == 0 and p.num_pages == p.max_total_tokens // 16
    assert p.kv_bytes == (p.max_total_tokens + 16) * ATTN_BYTES_PER_TOKEN  # padding page counted
    assert _plan(max_total_tokens=100, mamba_cache_size=8, page_size=16).max_total_tokens == 96


def test_plan_explicit_capacities_win():
    p = _plan(max_total_tokens=64, mamba_cache_size=9, memory_budget_bytes=1)  # budget ignored
    assert (p.max_total_tokens, p.mamba_cache_size, p.budget_bytes) == (64, 9, None)
    assert p.max_total_tokens_source == p.mamba_cache_size_source == "explicit"
    budget = 2_000_000
    only_kv = _plan(max_total_tokens=64, memory_budget_bytes=budget)
    assert only_kv.max_total_tokens == 64 and only_kv.mamba_cache_size_source == "budget"
    assert budget - GDN_BYTES_PER_SLOT < only_kv.total_bytes <= budget  # Mamba gets the rest
    only_mamba = _plan(mamba_cache_size=6, memory_budget_bytes=budget)
    assert only_mamba.mamba_cache_size == 6 and only_mamba.max_total_tokens_source == "budget"
    assert budget - ATTN_BYTES_PER_TOKEN < only_mamba.total_bytes <= budget


def test_plan_bounds_raise_clear_errors():
    with pytest.raises(ValueError, match="max_context_len=32"):
        _plan(max_total_tokens=16, mamba_cache_size=8)
    with pytest.raises(ValueError, match="mamba_prefix_cache_slots=2 need 6"):
        _plan(max_total_tokens=64, mamba_cache_size=5, mamba_prefix_cache_slots=2)
    # by how much: slots and bytes short, and the concurrency the pool allows
    with pytest.raises(ValueError, match=r"1 slot\(s\) \(.* MiB\) short, so the Mamba pool caps concurrency at 3 "
                                         r"running request\(s\) instead of 4"):
        _plan(max_total_tokens=64, mamba_cache_size=5, mamba_prefix_cache_slots=2)
    with pytest.raises(ValueError, match="leaves nothing"):
        _plan(memory_budget_bytes=100)
    # Enough for the maps but the Mamba share is too small for 4 requests.
    with pytest.raises(ValueError, match="Mamba pool holds .* raise memory_fraction"):
        _plan(memory_budget_bytes=60_000, mamba_full_memory_ratio=0.05)
    with pytest.raises(ValueError, match="KV pool holds .* lower mamba_full_memory_ratio"):
        _plan(memory_budget_bytes=60_000, mamba_full_memory_ratio=50.0)
    with pytest.raises(ValueError, match="max_running_requests"):
        _plan(max_running_requests=0)
    with pytest.raises(ValueError, match="mamba_full_memory_ratio"):
        _plan(mamba_full_memory_ratio=0)
    with pytest.raises(ValueError, match="both as attention"):
        plan_memory(ATTN, [MambaLayerSpec(3, 4, 8, (2,), torch.float32)], max_running_requests=1, max_context_len=4)


def test_plan_speculative_buffers_are_a_fixed_cost():
    p = _plan(memory_budget_bytes=2_000_000, num_draft_steps=3)
    assert p.max_draft_batch == 4 and p.speculative_bytes == 4 * 3 * GDN_BYTES_PER_SLOT
    assert p.total_bytes <= 2_000_000
    assert _plan(memory_budget_bytes=2_000_000, num_draft_steps=3, max_draft_batch=1).speculative_bytes == 3 * GDN_BYTES_PER_SLOT


def test_plan_models_without_one_kind_of_layer():
    pure_ssm = plan_memory([], GDN, max_running_requests=2, max_context_len=8, memory_budget_bytes=1_000_000)
    assert pure_ssm.bytes_per_token == 0 and pure_ssm.max_total_tokens == 16
    assert pure_ssm.max_total_tokens_source == "no-kv-layers"
    assert pure_ssm.mamba_cache_size == (1_000_000 - pure_ssm.req_to_token_bytes) // GDN_BYTES_PER_SLOT
    transformer = plan_memory(ATTN, [], max_running_requests=2, max_context_len=8, memory_budget_bytes=100_000,
                              mamba_prefix_cache_slots=3)
    assert transformer.mamba_cache_size == 5 and transformer.mamba_cache_size_source == "no-mamba-layers"
    assert transformer.total_bytes > 100_000 - 2 * ATTN_BYTES_PER_TOKEN


def test_plan_from_free_device_memory():
    free = available_device_memory("cpu")
    assert free > 0
    p = _plan(memory_fraction=1e-4)
    assert p.budget_bytes == pytest.approx(free * 1e-4, rel=0.5)
    assert p.total_bytes <= p.budget_bytes


# --------------------------------------------------------------------------------------
# MemoryPools
# --------------------------------------------------------------------------------------
def test_memory_pools_end_to_end_lifecycle():
    pools = MemoryPools.from_specs(
        ATTN, GDN, max_running_requests=3, max_context_len=16, page_size=4,
        max_total_tokens=32, mamba_cache_size=4, num_draft_steps=2,
    )
    s = pools.summary()
    assert s["capacity"] == {"kv_tokens": 32, "kv_pages": 8, "mamba_slots": 4, "request_slots": 3}
    assert s["free"] == {"kv_tokens": 32, "kv_pages": 8, "mamba_slots": 4, "request_slots": 3}
    assert s["bytes"]["kv"] == pools.plan.kv_bytes == 36 * ATTN_BYTES_PER_TOKEN
    assert s["bytes"]["mamba"] == pools.plan.mamba_bytes and s["bytes"]["speculative"] == pools.plan.speculative_bytes
    assert s["bytes"]["total"] == pools.plan.total_bytes == pools.nbytes()
    assert s["layers"] == {"full_attention": [3, 7], "linear": [0, 1, 2, 4, 5, 6]}
    pools.check_all_free()

    # Two requests: prefill 6 and 3 tokens, then one decode step each.
    reqs = pools.req_to_token.alloc(2)
    slots = pools.token_allocator.alloc_extend([0, 0], [6, 3])
    pools.req_to_token.set_tokens_batch(reqs, [0, 0], [6, 3], slots)
    last = torch.stack([slots[5], slots[8]])
    step = pools.token_allocator.alloc_decode([6, 3], last)
    pools.req_to_token.set_tokens_batch(reqs, [6, 3], [1, 1], step)
    assert pools.req_to_token.req_to_token[reqs[1], :4].tolist() == slots[6:].tolist() + [step[1].item()]
    assert pools.used_counts() == {"kv_tokens": 11, "kv_pages": 3, "mamba_slots": 2, "request_slots": 2}
    with pytest.raises(AssertionError, match="kv_tokens: 11 in use"):
        pools.check_all_free()

    for i, r in enumerate(reqs.tolist()):
        n = 7 if i == 0 else 4
        pools.token_allocator.free(pools.req_to_token.tokens(r, n))
    pools.req_to_token.free(reqs)
    pools.check_all_free()
    assert pools.free_counts() == s["free"]


def test_memory_pools_reject_a_plan_for_other_specs():
    plan = plan_memory(ATTN, GDN, max_running_requests=2, max_context_len=8, max_total_tokens=8, mamba_cache_size=2)
    with pytest.raises(ValueError, match="other layer specs"):
        MemoryPools(ATTN, [], plan)


@pytest.mark.gpu
@pytest.mark.smoke
def test_memory_pools_on_cuda_allocate_without_host_sync():
    pools = MemoryPools.from_specs(
        ATTN, GDN, device="cuda", max_running_requests=4, max_context_len=32, page_size=4, memory_fraction=0.001,
        mamba_full_memory_ratio=0.5, num_draft_steps=2,
    )
    assert pools.kv.k_cache(3).device.type == "cuda" and pools.mamba.ssm(0).device.type == "cuda"
    assert pools.req_to_token.req_to_token.device.type == "cuda"
    assert pools.plan.budget_bytes is not None and pools.plan.total_bytes <= pools.plan.budget_bytes
    for layer in pools.mamba.layer_ids:
        pools.mamba.ssm(layer).fill_(3.0)
        pools.mamba.conv(layer).fill_(3.0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        reqs = pools.req_to_token.alloc(2)  # zeroes the Mamba slots and writes req_to_mamba on the device
        slots = pools.token_allocator.alloc_extend([0, 0], [5, 2])
        pools.req_to_token.set_tokens_batch(reqs, [0, 0], [5, 2], slots)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    mamba_slots = pools.req_to_token.mamba_slots(reqs)
    assert pools.req_to_token.req_to_mamba[reqs.cuda()].cpu().tolist() == mamba_slots.tolist()
    assert pools.req_to_token.req_to_token[reqs[0], :5].cpu().tolist() == slots[:5].tolist()
    for layer in pools.mamba.layer_ids:
        assert bool((pools.mamba.ssm(layer)[mamba_slots.cuda()] == 0).all())
        assert bool((pools.mamba.conv(layer)[mamba_slots.cuda()] == 0).all())
    pools.token_allocator.free(slots)
    pools.req_to_token.free(reqs)
    pools.check_all_free()


def test_host_index_arithmetic_equals_torch():
    """``repeat_counts`` / ``segment_arange`` (the numpy path of a step's host index arithmetic) give
    torch's ``repeat_interleave`` / concatenated ``arange`` results, zero counts and empty inputs included."""
    from hybrid_compile.memory.allocator import repeat_counts, segment_arange

    g = torch.Generator().manual_seed(0)
    for n in (0, 1, 5, 40):
        counts = torch.randint(0, 4, (n,), generator=g)
        values = torch.randint(-5, 100, (n,), generator=g)
        got = repeat_counts(values, counts)
        assert got.dtype == torch.int64 and torch.equal(got, torch.repeat_interleave(values, counts))
        assert torch.equal(repeat_counts(values.tolist(), counts.tolist()), got)
        arange = segment_arange(counts)
        want = torch.cat([torch.arange(int(c)) for c in counts]) if n else torch.zeros(0, dtype=torch.int64)
        assert arange.dtype == torch.int64 and torch.equal(arange, want)
