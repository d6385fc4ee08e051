"""LFM3 (``lfm3``: LFM2's short convs + sliding-window and full attention) through the engine.

Greedy tokens equal transformers' own ``generate`` on a tiny random model (tests/lfm3_models.py)
for single prompts and a continuous batch with chunked prefill, prefix-cache hits (conv-window
checkpoints + the KV of both attention kinds), speculative decoding (the target as its own draft,
n-gram drafts): the scenarios of tests/family_parity.py. The compiled engine is in
tests/test_compile_families.py, tensor parallelism in tests/test_tensor_parallel.py. A guard checks
that the window changes HF's tokens on these prompts, so the parity really tests the sliding window.
Skipped on a transformers without LFM3 (5.17). GPU (``@pytest.mark.gpu``): compile + CUDA graphs
(and speculative decoding under them) against the eager GPU engine and HF.
"""

from __future__ import annotations

import pytest

import hybrid_compile as hc

import family_parity as fp
from engine_models import hf_greedy, make_engine, random_prompts, single_threaded
from lfm3_models import SLIDING_WINDOW, VOCAB, build_lfm3


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from single_threaded()


FAMILY = fp.make_family("lfm3", build_lfm3, hf_greedy, VOCAB)


def test_registered_layout_and_window_matters():
    assert "lfm3" in hc.supported_model_types()
    model = FAMILY.model()
    with make_engine(model, **fp.ENGINE_ARGS) as engine:
        assert [s.layer_ids for s in engine.layout.attention] == [(1,), (3,)]
        assert [s.layer_ids for s in engine.layout.mamba] == [(0,), (2,), (4,)]
        assert engine.layout.mamba[0].conv_window_shape == (2, 32) and not engine.layout.mamba[0].has_ssm_state
    prompt = random_prompts((90,), VOCAB, seed=21)[0]
    unwindowed = build_lfm3(0, sliding_window=4096)  # same weights, the window beyond every prompt
    assert hf_greedy(unwindowed, prompt, fp.MAX_NEW) != FAMILY.hf(tuple(prompt), fp.MAX_NEW), "the window should matter"
    assert model.model.layers[1].self_attn.sliding_window == SLIDING_WINDOW


def test_generate_single_prompts_and_batch_with_chunked_prefill():
    fp.check_batch_with_chunked_prefill(FAMILY)


def test_prefix_cache_hits_at_checkpoints():
    assert fp.check_prefix_cache_hits(FAMILY)["checkpoints_tracked"] > 0


@pytest.mark.parametrize("method", ["draft_self", "ngram"])
def test_speculative_greedy_equals_hf(method):
    fp.check_speculative(FAMILY, method)


@pytest.mark.parametrize("topk", [2, 4])
def test_draft_trees_greedy_equal_hf(topk):
    """Draft trees (topk > 1) with sliding-window and full attention layers: each node's window
    counted from its depth's position, the short convs from each node's parent's window."""
    fp.check_speculative_tree(FAMILY, topk)


@pytest.mark.gpu
def test_gpu_graphs_match_eager_and_hf():
    fp.check_gpu_graphs(FAMILY)
