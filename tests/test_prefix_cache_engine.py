"""The prefix cache (``EngineConfig.enable_prefix_cache``) wired into the engine.

Finished requests leave their KV and final recurrent state in the :class:`HybridRadixCache`;
a later request whose tokens extend such a sequence starts from it (copy-on-write of the
state). Only finished requests are cached (no chunk-boundary checkpoints yet), so hits happen
at the end of a finished request's ``prompt + output[:-1]`` (page-aligned with page_size > 1).
Every output must equal HF greedy generate on the same weights, and after
``clear_prefix_cache()`` every pool slot is free.
"""

from __future__ import annotations

import functools

import pytest
import torch

import mamba2_models as mm
from engine_models import (
    assert_greedy_equal,
    cached_model,
    hf_greedy_cached,
    make_engine,
    random_prompts,
    single_threaded,
    vocab_size,
)

MODELS = ("qwen3_next_dense", "qwen3_next_moe", "bamba")
MAX_NEW = 8


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from single_threaded()


@functools.lru_cache(maxsize=None)
def _model(name: str):
    if name == "bamba":
        return mm.build_bamba(4)
    return cached_model(name, 0)


def _hf(name, prompt, max_new=MAX_NEW):
    return hf_greedy_cached(_model(name), ("prefix-cache", name), prompt, max_new)


def _engine(name, **kw):
    args = dict(enable_prefix_cache=True, max_running_requests=3, mamba_cache_size=15, chunked_prefill_size=32)
    args.update(kw)
    return make_engine(_model(name), **args)


def _check(name, prompts, outputs, max_new=MAX_NEW):
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        assert_greedy_equal(_model(name), p, o, _hf(name, p, max_new), what=f"{name} prompt {i}")


def _clear_and_check_free(engine):
    engine.prefix_cache.check_invariants()
    engine.clear_prefix_cache()
    engine.pools.check_all_free()
    assert engine.stats()["prefix_cache"]["cached_tokens"] == 0
    engine.close()


@pytest.mark.parametrize("name", MODELS)
def test_extension_of_finished_request_hits(name):
    vocab = vocab_size(_model(name))
    p, extra = random_prompts([40, 10], vocab, seed=1)
    engine = _engine(name)
    out = engine.generate_batch([p], max_new_tokens=MAX_NEW)[0]
    _check(name, [p], [out])
    stats = engine.stats()["prefix_cache"]
    assert stats["hits"] == 0 and stats["cached_tokens"] == len(p) + MAX_NEW - 1 and stats["mamba_slots"] == 1
    q = p + out + extra
    out2 = engine.generate_batch([q], max_new_tokens=MAX_NEW)[0]
    _check(name, [q], [out2])
    stats = engine.stats()["prefix_cache"]
    assert stats["hits"] == 1 and stats["hit_tokens"] == len(p) + MAX_NEW - 1 and stats["mamba_hits"] == 1
    # the request slots / running states are back; only the tree holds slots
    used = engine.pools.used_counts()
    assert used["request_slots"] == 0 and used["mamba_slots"] == stats["mamba_slots"]
    _clear_and_check_free(engine)


@pytest.mark.parametrize("name", MODELS)
def test_batch_with_shared_prefixes(name):
    vocab = vocab_size(_model(name))
    base, a, b, c, d, e, f = random_prompts([70, 10, 15, 5, 20, 3, 3], vocab, seed=2)
    p0, p1 = base + a, base + b
    p3 = p0 + _hf(name, p0) + c
    p4 = p1 + _hf(name, p1) + d
    p5 = p3 + _hf(name, p3) + e
    prompts = [p0, p1, list(p0), p3, p4, p5, list(p4), base + f]
    engine = _engine(name)
    outputs = engine.generate_batch(prompts, max_new_tokens=MAX_NEW)
    _check(name, prompts, outputs)
    stats = engine.stats()["prefix_cache"]
    assert stats["hits"] > 0 and stats["hit_tokens"] > 0
    _clear_and_check_free(engine)


@pytest.mark.parametrize("name", ("qwen3_next_dense", "bamba"))
def test_kv_pressure_evicts_before_retracting(name):
    vocab = vocab_size(_model(name))
    fill = random_prompts([60, 61, 62], vocab, seed=3)
    engine = _engine(name, max_total_tokens=400, max_running_requests=3)
    for p in fill:  # one at a time: ~200 tokens end up cached
        _check(name, [p], engine.generate_batch([p], max_new_tokens=MAX_NEW))
    cached = engine.stats()["prefix_cache"]["cached_tokens"]
    assert cached == sum(len(p) + MAX_NEW - 1 for p in fill)
    # three requests of 106 tokens each do not fit next to the cache: it must give way
    batch = random_prompts([90, 91, 89], vocab, seed=4)
    outputs = engine.generate_batch(batch, max_new_tokens=16)
    _check(name, batch, outputs, max_new=16)
    stats = engine.stats()
    assert stats["prefix_cache"]["kv_evicted_tokens"] > 0
    assert stats["retractions"] == 0
    # more than fits even with an empty cache: retraction still works with the cache on
    more = random_prompts([100, 101, 99], vocab, seed=5)
    outputs = engine.generate_batch(more, max_new_tokens=60)
    _check(name, more, outputs, max_new=60)
    assert engine.stats()["retractions"] > 0
    _clear_and_check_free(engine)


@pytest.mark.parametrize("name", ("qwen3_next_dense", "bamba"))
def test_page_size_4_hits_at_page_aligned_lengths(name):
    vocab = vocab_size(_model(name))
    p, r, extra = random_prompts([37, 38, 6], vocab, seed=6)  # 37 + 8 - 1 = 44 (aligned); 38 + 7 = 45 (not)
    engine = _engine(name, page_size=4)
    out_p, out_r = engine.generate_batch([p, r], max_new_tokens=MAX_NEW)
    _check(name, [p, r], [out_p, out_r])
    stats = engine.stats()["prefix_cache"]
    assert stats["mamba_slots"] == 1 and stats["cached_tokens"] == 44
    q, s = p + out_p + extra, r + out_r + extra
    outputs = engine.generate_batch([q, s], max_new_tokens=MAX_NEW)
    _check(name, [q, s], outputs)
    stats = engine.stats()["prefix_cache"]
    assert stats["hits"] == 1 and stats["hit_tokens"] == 44
    _clear_and_check_free(engine)


def test_close_resets_the_cache():
    engine = _engine("qwen3_next_dense")
    p = random_prompts([20], vocab_size(_model("qwen3_next_dense")), seed=7)[0]
    engine.generate_batch([p], max_new_tokens=4)
    assert engine.stats()["prefix_cache"]["cached_tokens"] > 0
    engine.close()
    engine.pools.check_all_free()


def test_prefix_cache_off_by_default():
    import hybrid_compile as hc

    assert hc.EngineConfig().enable_prefix_cache is False
    engine = make_engine(_model("qwen3_next_dense"))
    assert engine.prefix_cache is None and "prefix_cache" not in engine.stats()
    engine.clear_prefix_cache()  # no-op
    engine.close()
