"""RecurrentGemma (``recurrent_gemma``: RG-LRU recurrent blocks + local attention) through the engine.

The RG-LRU runs on the Mamba1 scan ops (one state per channel, see models/recurrent_gemma.py): the
mapping is checked against HF's own ``RecurrentGemmaRglru`` module (prefill from zeros, then decode
steps from HF's carried state; a channel whose recurrent gate underflows the floor included).
Greedy tokens equal transformers' ``generate`` on a tiny random model (tests/recurrent_gemma_models.py)
for single prompts, a continuous batch with chunked prefill, prefix-cache hits, speculative
decoding (the target as its own draft, n-gram); the compiled engine is in
tests/test_compile_families.py, the Triton kernels at the RG-LRU shape in tests/test_triton_mamba1.py,
tensor parallelism in tests/test_tensor_parallel.py.
GPU (``@pytest.mark.gpu``): compile + CUDA graphs give the eager GPU engine's tokens, which equal
HF's on the CPU up to CPU/GPU near-ties.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import hybrid_compile as hc
from hybrid_compile.models import recurrent_gemma as rg

from engine_models import (
    assert_greedy_equal,
    assert_pools_restored,
    make_engine,
    random_prompts,
    record_prefix_hits,
    single_threaded,
)
from recurrent_gemma_models import VOCAB, build_recurrent_gemma, hf_greedy_fresh

MAX_NEW = 8
ENGINE_ARGS = dict(max_running_requests=3, chunked_prefill_size=32, max_context_len=320, mamba_cache_size=8)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from single_threaded()


@functools.lru_cache(maxsize=None)
def _model():
    return build_recurrent_gemma(0)


@functools.lru_cache(maxsize=None)
def _hf(prompt: tuple, max_new: int) -> list[int]:
    return hf_greedy_fresh(_model(), list(prompt), max_new)


def _assert_hf(prompts, got, what, max_new=MAX_NEW):
    for i, (p, g) in enumerate(zip(prompts, got)):
        assert_greedy_equal(_model(), p, g, _hf(tuple(p), max_new), f"recurrent_gemma {what}: prompt {i} (length {len(p)})")


def test_rg_lru_on_the_mamba1_ops_equals_hf_module():
    """Prefill of 11 tokens from zeros through ``mamba1_selective_scan``, then 3 decode tokens
    through ``mamba1_state_update``, against HF's ``RecurrentGemmaRglru`` (which carries its own
    state). Channel 0's recurrent gate is pushed below the floor (``a_t`` = 1 in fp32)."""
    lru = copy.deepcopy(_model().model.layers[0].temporal_block.rg_lru)
    with torch.no_grad():
        lru.recurrent_gate_bias[0, 0] = -80.0
    width = lru.recurrent_param.shape[0]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(14, width, generator=g)
    pos = torch.arange(14)
    ops = torch.ops.hybrid_compile
    with torch.no_grad():
        lru.recurrent_states = None
        want = [lru(x[None, :11], pos[None, :11])[0]]
        for t in range(11, 14):
            want.append(lru(x[None, t:t + 1], pos[None, t:t + 1])[0])
        want = torch.cat(want)
        u, r, a_log = rg._rg_lru_scan_inputs(lru, x, pos)
    assert r[:, 0].max() == rg._MIN_RECURRENT_GATE  # the floor is exercised
    ones = torch.ones(14, 1, 1)
    states = torch.zeros(2, width, 1)
    got, _ = ops.mamba1_selective_scan(u[:11], r[:11], a_log, ones[:11], ones[:11], None, None, None, False, states,
                                       torch.tensor([0, 11]), torch.tensor([1]), torch.tensor([False]), 4, False,
                                       True, None)
    steps = [got]
    for t in range(11, 14):
        steps.append(ops.mamba1_state_update(u[t, None, None], r[t, None, None], a_log, ones[t, None, None],
                                             ones[t, None, None], None, None, None, False, states, torch.tensor([1]),
                                             False, None, True, None, None)[0])
    torch.testing.assert_close(torch.cat(steps), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[1, :, 0], lru.recurrent_states[0], rtol=1e-5, atol=1e-5)


def test_registered_layout_and_window_matters():
    assert "recurrent_gemma" in hc.supported_model_types()
    model = _model()
    with make_engine(model, **ENGINE_ARGS) as engine:
        assert [s.layer_ids for s in engine.layout.attention] == [(1,)]
        assert [s.layer_ids for s in engine.layout.mamba] == [(0,), (2,)]
        spec = engine.layout.mamba[0]
        assert spec.conv_window_shape == (2, 32) and spec.state_shape == (32, 1)
        assert engine.layout.ssm_chunk_size == rg.RG_LRU_CHECKPOINT_ALIGN
    prompt = random_prompts((90,), VOCAB, seed=21)[0]
    unwindowed = build_recurrent_gemma(0, window=4096)  # same weights, the window beyond every prompt
    assert hf_greedy_fresh(unwindowed, prompt, MAX_NEW) != _hf(tuple(prompt), MAX_NEW), "the window should matter here"


def test_generate_single_prompts_and_batch_with_chunked_prefill():
    prompts = random_prompts((1, 150, 17, 64, 5, 90), VOCAB, seed=11)
    with make_engine(_model(), **ENGINE_ARGS) as engine:
        initial_free = engine.pools.free_counts()
        for i in (1, 0):
            out = engine.generate(torch.tensor([prompts[i]]), max_new_tokens=MAX_NEW)
            _assert_hf([prompts[i]], [out[0, len(prompts[i]):].tolist()], "single")
        engine.clear_prefix_cache()  # the batch below starts cold
        got = engine.generate_batch(prompts, max_new_tokens=MAX_NEW)
        stats = engine.stats()
        _assert_hf(prompts, got, "batch")
        assert stats["decode_steps"] > 0 and stats["extend_steps"] > 0
        assert_pools_restored(engine, initial_free)


def test_prefix_cache_hits_at_checkpoints():
    """Prompts sharing a 140-token prefix continue from the RG-LRU + conv checkpoint at 128; a
    finished request's follow-up hits at its full length."""
    base, a, b, c = random_prompts((140, 9, 20, 3), VOCAB, seed=12)
    first, second = [base + a], [base + b, base + c]
    with make_engine(_model(), **ENGINE_ARGS) as engine:
        initial_free = engine.pools.free_counts()
        hits = record_prefix_hits(engine)
        got_first = engine.generate_batch(first, max_new_tokens=MAX_NEW)
        got_second = engine.generate_batch(second, max_new_tokens=MAX_NEW)
        follow = [first[0] + got_first[0]]
        got_follow = engine.generate_batch(follow, max_new_tokens=MAX_NEW // 2)
        stats = engine.stats()["prefix_cache"]
        assert_pools_restored(engine, initial_free)
    _assert_hf(first + second, got_first + got_second, "prefix")
    _assert_hf(follow, got_follow, "follow-up", MAX_NEW // 2)
    assert hits[0] == 0 and hits[1:3] == [128, 128], hits
    assert hits[3] == len(follow[0]) - 1, hits
    assert stats["checkpoints_tracked"] > 0


@pytest.mark.parametrize("method", ["draft_self", "ngram"])
def test_speculative_greedy_equals_hf(method):
    model = _model()
    spec = (dict(method="draft_model", draft_model=model, num_draft_tokens=3) if method == "draft_self"
            else dict(method="ngram", num_draft_tokens=3, ngram_max=3, ngram_min=1))
    prompts = random_prompts((1, 40, 9), VOCAB, seed=13)
    prompts.append((prompts[2] * 5)[:37])  # a repeated pattern: n-gram lookup finds drafts in it
    with make_engine(model, speculative=spec, **ENGINE_ARGS) as engine:
        initial_free = engine.pools.free_counts()
        got = engine.generate_batch(prompts, max_new_tokens=MAX_NEW)
        stats = engine.stats()
        assert_pools_restored(engine, initial_free)
    _assert_hf(prompts, got, method)
    assert stats["speculative"]["verify_steps"] > 0
    if method == "draft_self":
        assert stats["speculative"]["acceptance_rate"] == 1.0


@pytest.mark.gpu
def test_gpu_graphs_match_eager_and_hf():
    from test_cuda_graphs import _assert_greedy_close  # HF-on-CPU oracle with a CPU/GPU near-tie allowance

    model = copy.deepcopy(_model()).to("cuda")
    prompts = random_prompts((37, 1, 90, 5, 64, 3), VOCAB, seed=16)
    graphs = dict(compile=True, cuda_graphs=True, cuda_graph_batch_sizes=(1, 4), piecewise_cuda_graph_tokens=(4, 16, 64))
    outs, stats = {}, {}
    for name, kw in {"eager": dict(compile=False), "graphs": graphs,
                     "graphs+speculative": dict(graphs, speculative=dict(method="draft_model", draft_model=model,
                                                                         num_draft_tokens=3))}.items():
        with make_engine(model, max_running_requests=8, **kw) as engine:
            outs[name] = engine.generate_batch(prompts, max_new_tokens=MAX_NEW)
            stats[name] = engine.stats()
    for name in ("eager", "graphs+speculative"):
        for p, got in zip(prompts, outs[name]):
            _assert_greedy_close(_model(), p, got, _hf(tuple(p), MAX_NEW), f"recurrent_gemma {name} GPU")
    assert outs["graphs"] == outs["eager"], outs
    c = stats["graphs"]["compile"]
    assert c["recompiles"] == 0 and c["graph_breaks"] == 0 and c["cuda_graph_replays"] > 0, c
    assert stats["graphs+speculative"]["speculative"]["verify_steps"] > 0
