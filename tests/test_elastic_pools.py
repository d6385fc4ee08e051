"""Elastic pools (``EngineConfig.elastic_pools``): memory moves between the KV and Mamba pools at run time.

The allocators grow and shrink at the top of their index range, the pools resize with every live
entry kept, :class:`MemoryPools` moves budget bytes both ways (never taking an entry in use), and
the engine, on a workload that flips from many short chats to a few long documents, gives the
greedy tokens of transformers' ``generate`` with fewer retractions than the fixed split.
"""

from __future__ import annotations

import pytest
import torch

from engine_models import assert_greedy_equal, cached_model, hf_greedy_cached, make_engine, random_prompts, \
    single_threaded, vocab_size
from hybrid_compile.memory import AttentionLayerSpec, MambaLayerSpec, MemoryPools
from hybrid_compile.memory.allocator import InvalidSlotError, SlotAllocator, TokenSlotAllocator

ATTN = [AttentionLayerSpec((1,), num_kv_heads=1, head_dim=2, dtype=torch.float32)]
LINEAR = [MambaLayerSpec((0,), conv_width=2, conv_dim=2, state_shape=(3,), conv_dtype=torch.float32)]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from single_threaded()


def test_allocators_resize_at_the_top_and_keep_every_index_in_use():
    a = SlotAllocator(6, first_index=1, name="Mamba slot")
    used = a.alloc(3)  # 1, 2, 3
    assert a.free_at_top() == 3
    a.resize(4)  # takes 5 and 6
    assert (a.total(), a.available(), a.alloc(2)) == (4, 1, None)
    with pytest.raises(ValueError, match="cannot shrink to 2"):
        a.resize(2)
    a.resize(7)
    assert a.available() == 4 and bool(a.is_allocated(used).all())
    assert sorted(a.alloc(4).tolist()) == [4, 5, 6, 7]
    with pytest.raises(InvalidSlotError, match="out of range"):
        a.free([8])
    t = TokenSlotAllocator(4, page_size=2)
    slots = t.alloc(3)  # pages 1, 2
    assert t.free_pages_at_top() == 2
    t.resize(2)
    assert (t.available(), t.num_slots) == (0, 6) and bool(t.is_allocated(slots).all())
    t.resize(5)
    assert t.available() == 6 and t.alloc(6).tolist() == list(range(6, 12))


def test_memory_pools_move_bytes_both_ways_keeping_live_entries():
    pools = MemoryPools.from_specs(ATTN, LINEAR, max_running_requests=1, max_context_len=8, max_total_tokens=32,
                                   mamba_cache_size=10)
    kv, mamba = pools.kv, pools.mamba
    bpt, bps = kv.bytes_per_token, mamba.bytes_per_slot
    budget = kv.nbytes() + mamba.nbytes()
    kv_slots = kv.alloc(5)
    kv.k_cache(1)[kv_slots] = torch.arange(5.0)[:, None, None] + 1
    m_slots = mamba.alloc(3)
    mamba.ssm(0)[m_slots] = torch.tensor([7.0, 8.0, 9.0])[:, None]
    gained = pools.move_mamba_to_kv(40, keep_mamba_free=1)
    assert gained >= 1 and mamba.total() < 10 and kv.total() == 32 + gained
    assert kv.nbytes() + mamba.nbytes() + pools.spare_bytes == budget  # the budget is conserved
    assert torch.equal(kv.k_cache(1)[kv_slots, 0, 0], torch.arange(5.0) + 1)
    assert torch.equal(mamba.ssm(0)[m_slots, 0], torch.tensor([7.0, 8.0, 9.0]))
    assert mamba.available() >= 1 and mamba.total() >= 3  # the entries in use and the reserve stay
    back = pools.move_kv_to_mamba(2)
    assert back >= 2 and kv.nbytes() + mamba.nbytes() + pools.spare_bytes == budget
    assert torch.equal(kv.k_cache(1)[kv_slots, 0, 0], torch.arange(5.0) + 1)
    assert torch.equal(mamba.ssm(0)[m_slots, 0], torch.tensor([7.0, 8.0, 9.0]))
    moves = pools.summary()["moves"]
    assert (moves["to_kv"], moves["to_mamba"]) == (1, 1) and moves["mamba_slots_gained"] == back
    assert pools.summary()["split"]["kv_bytes"] == kv.nbytes()
    # nothing in use is ever taken: all KV in use -> no move to Mamba
    kv.free(kv_slots)
    held = kv.alloc(kv.available())
    assert pools.move_kv_to_mamba(4) == 0
    kv.free(held)
    mamba.free(m_slots)
    assert bpt and bps


def test_lowest_first_allocator_hands_out_the_lowest_free_slots():
    a = SlotAllocator(6, name="Mamba slot", lowest_first=True)
    first = a.alloc(4)  # 0..3
    a.free([0])
    a.free([2])
    assert a.alloc(1).tolist() == [0]  # the lowest, not the last freed (2)
    a.free([3])
    assert a.alloc(2).tolist() == [2, 3]
    a.resize(8)
    assert a.alloc(3).tolist() == [4, 5, 6] and a.free_at_top() == 1
    plain = SlotAllocator(6)
    plain.alloc(4)
    plain.free([0])
    plain.free([2])
    assert plain.alloc(1).tolist() == [2]  # LIFO without it
    plain.set_lowest_first()
    assert plain.alloc(1).tolist() == [0]
    assert first.numel() == 4


class _Running:
    """A running request as ElasticPools sees it: its request slot and its Mamba slot."""

    def __init__(self, req_slot, mamba_slot):
        self.req_slot, self.mamba_slot = req_slot, mamba_slot


def test_move_to_kv_lowers_a_running_request_off_the_top_slot():
    """A request admitted while the lower slots were busy holds the top Mamba slot; the others
    finished since. A move to the KV pool copies its state to a free low slot (``req_to_mamba``
    follows) instead of finding no free slot at the top."""
    from hybrid_compile.engine.elastic import ElasticPools

    pools = MemoryPools.from_specs(ATTN, LINEAR, max_running_requests=3, max_context_len=8, max_total_tokens=16,
                                   mamba_cache_size=8)
    mamba, r2t = pools.mamba, pools.req_to_token
    reqs = r2t.alloc(3)  # Mamba slots 0, 1, 2
    slots = r2t.mamba_slots(reqs).tolist()
    top = mamba.alloc(mamba.available())  # the rest, up to the top
    mamba.free(top[:-1])
    mamba.free(r2t.mamba_slots(reqs[:2]))  # two requests finished: their slots free, the third runs
    r2t.set_mamba_slots(reqs[:2], [-1, -1])
    r2t.free(reqs[:2])
    r2t.set_mamba_slots(reqs[2:], top[-1:])  # the running one sits on the top slot
    mamba.free([slots[2]])
    running = [_Running(int(reqs[2]), int(top[-1]))]
    mamba.ssm(0)[top[-1]] = torch.tensor([5.0])
    resized = []
    elastic = ElasticPools(pools, lambda: resized.append(1), running=lambda: running)
    assert mamba.allocator.free_at_top() == 0
    assert elastic.grow_kv(4)
    new = running[0].mamba_slot
    assert new < mamba.total() - 1 and int(r2t.mamba_slots(reqs[2:])[0]) == new
    assert float(mamba.ssm(0)[new, 0]) == 5.0 and resized and pools.moves["requests_relocated"] == 1
    assert pools.kv.total() > 16 and bool(mamba.allocator.is_allocated([new]).all())
    # without the running requests to lower, the same move finds no free slot at the top
    pools2 = MemoryPools.from_specs(ATTN, LINEAR, max_running_requests=1, max_context_len=8, max_total_tokens=16,
                                    mamba_cache_size=8)
    held = pools2.mamba.alloc(8)
    pools2.mamba.free(held[:-1])
    assert not ElasticPools(pools2, lambda: None).grow_kv(4)


NAME = "qwen3_next_dense"
ARGS = dict(max_running_requests=8, max_total_tokens=112, mamba_cache_size=32, chunked_prefill_size=64)


def _flip_workload(vocab: int):
    chats = random_prompts([12] * 8, vocab, seed=5)  # state-bound: 8 requests at once, a state each
    docs = random_prompts([40, 44, 42], vocab, seed=6)  # KV-bound: 3 long ones outgrow the KV pool
    return [(chats, 3), (docs, 28)]


def test_flip_from_chats_to_documents_needs_fewer_retractions_than_the_fixed_split():
    model = cached_model(NAME, 0)
    phases = _flip_workload(vocab_size(model))
    runs = {}
    for elastic in (False, True):
        engine = make_engine(model, elastic_pools=elastic, **ARGS)
        outs = [engine.generate_batch(prompts, max_new_tokens=n) for prompts, n in phases]
        st = engine.stats()
        runs[elastic] = (outs, st["retractions"], st)
        engine.prefix_cache.check_invariants()
        engine.clear_prefix_cache()
        engine.pools.check_all_free()
        engine.close()
    assert runs[True][0] == runs[False][0]
    for (prompts, n), outs in zip(phases, runs[True][0]):
        for p, o in zip(prompts, outs):
            assert_greedy_equal(model, p, o, hf_greedy_cached(model, ("elastic", NAME), p, n))
    fixed, elastic = runs[False][1], runs[True][1]
    assert fixed > 0 and elastic < fixed, (fixed, elastic)
    el = runs[True][2]["elastic_pools"]
    assert el["to_kv"] > 0 and el["kv_tokens_gained"] > 0 and el["kv_tokens"] > ARGS["max_total_tokens"], el
    assert runs[True][2]["memory"]["moves"]["to_kv"] == el["to_kv"]
    # every move answered an ask of the scheduler, and the asks' host time is counted
    assert el["asks"]["grow_kv"] >= el["to_kv"] and el["asks"]["grow_mamba"] >= el["to_mamba"], el
    assert el["ask_seconds"] > 0, el


def test_elastic_pools_with_the_host_tier_move_the_host_views_too():
    model = cached_model(NAME, 0)
    phases = _flip_workload(vocab_size(model))
    engine = make_engine(model, elastic_pools=True, prefix_cache_host_tier=True, prefix_cache_host_bytes=1 << 20,
                         **ARGS)
    outs = [engine.generate_batch(prompts, max_new_tokens=n) for prompts, n in phases]
    for (prompts, n), o in zip(phases, outs):
        for p, out in zip(prompts, o):
            assert_greedy_equal(model, p, out, hf_greedy_cached(model, ("elastic", NAME), p, n))
    assert engine.stats()["elastic_pools"]["to_kv"] > 0
    host = engine.host_pool
    assert host.kv_buffers[0][0] is engine.pools.kv.k_buffers[0]
    assert host.mamba_buffers[0][0] is engine.pools.mamba.conv_buffers[0]
    engine.prefix_cache.check_invariants()
    engine.clear_prefix_cache()
    engine.pools.check_all_free()
    engine.close()


def _check_flip(engine, model, phases, key) -> dict:
    """Serve the flip workload; every output equals HF greedy; memory moved to the KV pool; the
    pools are whole afterwards. Returns the engine's stats."""
    outs = [engine.generate_batch(prompts, max_new_tokens=n) for prompts, n in phases]
    for (prompts, n), o in zip(phases, outs):
        for p, out in zip(prompts, o):
            assert_greedy_equal(model, p, out, hf_greedy_cached(model, key, p, n))
    st = engine.stats()
    assert st["elastic_pools"]["to_kv"] > 0, st["elastic_pools"]
    engine.prefix_cache.check_invariants()
    engine.clear_prefix_cache()
    engine.pools.check_all_free()
    return st


def test_elastic_pools_with_ngram_speculative_decoding():
    """Speculative decoding across pool moves: the commit's state views are taken again after
    every resize (a stale view would commit into the freed buffers)."""
    model = cached_model(NAME, 0)
    phases = _flip_workload(vocab_size(model))
    # repetitive prompts: the n-gram drafts get accepted
    phases = [([p[:4] * 3 for p in prompts], n) for prompts, n in phases]
    engine = make_engine(model, elastic_pools=True, **ARGS,
                         speculative={"method": "ngram", "num_draft_tokens": 2, "ngram_max": 3, "ngram_min": 1})
    st = _check_flip(engine, model, phases, ("elastic", NAME))
    assert st["speculative"]["verify_steps"] > 0 and st["speculative"]["accepted"] > 0, st["speculative"]
    engine.close()


def test_elastic_pools_with_mtp_drafts(tmp_path):
    """An MTP head's attention KV lives in the target's KV pool: its views follow the moves too."""
    import hybrid_compile as hc
    from mtp_models import write_mtp_checkpoint

    write_mtp_checkpoint(NAME, 0, str(tmp_path), model=cached_model(NAME, 0))
    engine = hc.from_pretrained(str(tmp_path), dtype=torch.float32, device="cpu", tokenizer=False,
                                elastic_pools=True, speculative={"method": "mtp", "num_draft_tokens": 2}, **ARGS)
    model = engine.model
    phases = _flip_workload(vocab_size(model))
    st = _check_flip(engine, model, phases, ("elastic_mtp", NAME))
    assert st["speculative"]["verify_steps"] > 0 and st["speculative"]["draft_source"]["head_decode_steps"] > 0
    engine.close()


def test_elastic_pools_refusals_name_the_option():
    from hybrid_compile.memory.sizing import plan_memory

    for elastic, words in ((False, "unless elastic_pools=True"), (True, "elastic pools move memory")):
        with pytest.raises(ValueError, match=words):
            plan_memory(ATTN, LINEAR, max_running_requests=4, max_context_len=8, max_total_tokens=32,
                        mamba_cache_size=2, elastic=elastic)


def test_benchmark_elastic_tiny_run(tmp_path):
    """``benchmarks/prefix_cache.py --tiny --elastic``: the flip workload with the start-up split and
    with elastic pools (same outputs, checked by the script), fewer retractions with elastic, and the
    other fixed splits of the same bytes: none with fewer retractions, each with more steps."""
    import importlib.util
    import json
    import pathlib
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    try:
        spec = importlib.util.spec_from_file_location("prefix_cache_bench_elastic", root / "benchmarks" / "prefix_cache.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
        out = tmp_path / "run.json"
        bench.main(["--tiny", "--elastic", "--systems", "lru", "--no-pressure", "--groups", "2", "--prompts-per-group",
                    "2", "--system-len", "140", "--output-len", "2", "--out", str(out)])
    finally:
        sys.path.remove(str(root))
    r = json.loads(out.read_text())["elastic"]
    assert r["fixed"]["retractions"] > r["elastic"]["retractions"], r
    assert r["elastic"]["moves"]["to_kv"] > 0 and r["fixed"]["moves"]["to_kv"] == 0
    assert r["elastic"]["elastic_asks"]["grow_kv"] >= r["elastic"]["moves"]["to_kv"] and r["fixed"]["elastic_asks"] is None
    # the other fixed splits of the same bytes: none beats elastic pools in retractions or steps
    assert len(r["fixed_splits"]) == 3 and all(f["moves"]["to_kv"] == 0 for f in r["fixed_splits"]), r
    # (the start-up split is sized for the chats: the splits with fewer Mamba slots run fewer chats
    # at once, the one with more does not leave the documents' KV; elastic pools take both phases
    # at full width, lowering a running document off the top slot to move it)
    assert r["elastic"]["retractions"] <= r["fewest_fixed_retractions"]
    assert r["elastic"]["steps"] < min(f["steps"] for f in [r["fixed"]] + r["fixed_splits"]), r
    assert r["elastic"]["moves"]["requests_relocated"] >= 1
    # each run's rebuilds: no Dynamo recompile; Triton kernels counted (none run on the CPU)
    assert all(x["recompiles"] == 0 and x["triton_kernels_built"] == 0 for x in [r["fixed"], r["elastic"]]), r


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "compiled", "piecewise", "full", "full_ngram"])
def test_elastic_pools_on_cuda_equal_the_fixed_split(mode):
    """On CUDA: the flip workload's tokens with elastic pools equal the fixed split's, with memory
    moved to the KV pool, eager, compiled without graphs, with piecewise graphs (they stay: the
    layer ops between the pieces read the pools at run time), and with full graphs (captured again
    after every move: a replay reads the addresses it captured), also with n-gram speculative
    decoding (verify graphs and commit graphs captured again)."""
    import copy

    model = copy.deepcopy(cached_model(NAME, 0)).to("cuda")
    phases = _flip_workload(vocab_size(model))
    options = dict(eager=dict(compile=False, cuda_graphs=False), compiled=dict(compile=True, cuda_graphs=False),
                   piecewise=dict(cuda_graphs="piecewise"), full=dict(cuda_graphs=True),
                   full_ngram=dict(cuda_graphs=True, cuda_graph_batch_sizes=(1, 2, 4, 8),
                                   speculative={"method": "ngram", "num_draft_tokens": 2, "ngram_max": 3,
                                                "ngram_min": 1}))[mode]
    if mode == "full_ngram":
        phases = [([p[:4] * 3 for p in prompts], n) for prompts, n in phases]
    outs = {}
    for elastic in (False, True):
        engine = make_engine(model, elastic_pools=elastic, **options, **ARGS)
        outs[elastic] = [engine.generate_batch(p, max_new_tokens=n) for p, n in phases]
        st = engine.stats()
        if elastic:
            assert st["elastic_pools"]["to_kv"] > 0
            c = st["compile"]
            if mode.startswith("full"):
                moves = st["elastic_pools"]["to_kv"] + st["elastic_pools"]["to_mamba"]
                assert c["full_graph_recaptures"] == moves, c
            if mode == "full":
                assert c["cuda_graph_replays"] > 0, c
            if mode == "full_ngram":  # (every decode step of the repetitive prompts is a verify step)
                assert c["verify_graph_replays"] > 0 and st["speculative"]["commit_graph_replays"] > 0, st
            if mode in ("compiled", "piecewise", "full", "full_ngram"):
                assert c["recompiles"] == 0 and c["graph_breaks"] == 0, c
        engine.clear_prefix_cache()
        engine.pools.check_all_free()
        engine.close()
    assert outs[True] == outs[False]
