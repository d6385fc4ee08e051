"""LFM3 (``lfm3``: LFM2's short convs + sliding-window and full attention) through the engine.

Greedy tokens equal transformers' own ``generate`` on a tiny random model (tests/lfm3_models.py)
for single prompts and a continuous batch with chunked prefill, prefix-cache hits (conv-window
checkpoints + the KV of both attention kinds), speculative decoding (the target as its own draft,
n-gram drafts); the compiled engine is in tests/test_compile_families.py. A guard checks that the
window changes HF's tokens on these prompts, so the parity really tests the sliding window.
Skipped on a transformers without LFM3 (5.17). GPU (``@pytest.mark.gpu``): compile + full and
piecewise CUDA graphs give the eager GPU engine's tokens, which equal HF's on the CPU up to
CPU/GPU near-ties.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import hybrid_compile as hc

from engine_models import (
    assert_greedy_equal,
    assert_pools_restored,
    hf_greedy,
    make_engine,
    random_prompts,
    record_prefix_hits,
    single_threaded,
)
from lfm3_models import SLIDING_WINDOW, VOCAB, build_lfm3

MAX_NEW = 8
ENGINE_ARGS = dict(max_running_requests=3, chunked_prefill_size=32, max_context_len=320, mamba_cache_size=8)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from single_threaded()


@functools.lru_cache(maxsize=None)
def _model():
    return build_lfm3(0)


@functools.lru_cache(maxsize=None)
def _hf(prompt: tuple, max_new: int) -> list[int]:
    return hf_greedy(_model(), list(prompt), max_new)


def _assert_hf(prompts, got, what, max_new=MAX_NEW):
    for i, (p, g) in enumerate(zip(prompts, got)):
        assert_greedy_equal(_model(), p, g, _hf(tuple(p), max_new), f"lfm3 {what}: prompt {i} (length {len(p)})")


def test_registered_layout_and_window_matters():
    assert "lfm3" in hc.supported_model_types()
    model = _model()
    with make_engine(model, **ENGINE_ARGS) as engine:
        assert [s.layer_ids for s in engine.layout.attention] == [(1,), (3,)]
        assert [s.layer_ids for s in engine.layout.mamba] == [(0,), (2,), (4,)]
        assert engine.layout.mamba[0].conv_window_shape == (2, 32) and not engine.layout.mamba[0].has_ssm_state
    prompt = random_prompts((90,), VOCAB, seed=21)[0]
    unwindowed = build_lfm3(0, sliding_window=4096)  # same weights, the window beyond every prompt
    assert hf_greedy(unwindowed, prompt, MAX_NEW) != _hf(tuple(prompt), MAX_NEW), "the window should matter here"
    assert model.model.layers[1].self_attn.sliding_window == SLIDING_WINDOW


def test_generate_single_prompts_and_batch_with_chunked_prefill():
    """A 150-token prompt (five prefill chunks, far past the 16-token window) and a 1-token one,
    then a continuous batch of six with chunked prefill (mixed prefill + decode steps)."""
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
    """Prompts sharing a 140-token prefix continue from the conv-window checkpoint at 128 (the
    attention layers read the shared prefix's KV, windowed or not); a finished request's follow-up
    hits at its full length."""
    base, a, b, c = random_prompts((140, 9, 20, 3), VOCAB, seed=12)
    first, second = [base + a], [base + b, base + c]
    with make_engine(_model(), **ENGINE_ARGS) as engine:
        initial_free = engine.pools.free_counts()
        hits = record_prefix_hits(engine)
        got_first = engine.generate_batch(first, max_new_tokens=MAX_NEW)
        got_second = engine.generate_batch(second, max_new_tokens=MAX_NEW)
        follow = [first[0] + got_first[0]]
        got_follow = engine.generate_batch(follow, max_new_tokens=MAX_NEW // 2)
        assert_pools_restored(engine, initial_free)
    _assert_hf(first + second, got_first + got_second, "prefix")
    _assert_hf(follow, got_follow, "follow-up", MAX_NEW // 2)
    assert hits[0] == 0 and hits[1:3] == [128, 128], hits
    assert hits[3] == len(follow[0]) - 1, hits


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
    for name, kw in {"eager": dict(compile=False), "graphs": graphs}.items():
        with make_engine(model, max_running_requests=8, **kw) as engine:
            outs[name] = engine.generate_batch(prompts, max_new_tokens=MAX_NEW)
            stats[name] = engine.stats()["compile"]
    for p, got in zip(prompts, outs["eager"]):
        _assert_greedy_close(_model(), p, got, _hf(tuple(p), MAX_NEW), "lfm3 eager GPU")
    assert outs["graphs"] == outs["eager"], outs
    c = stats["graphs"]
    assert c["recompiles"] == 0 and c["graph_breaks"] == 0 and c["cuda_graph_replays"] > 0, c
