"""RecurrentGemma (``recurrent_gemma``: RG-LRU recurrent blocks + local attention) through the engine.

The RG-LRU runs on the Mamba1 scan ops (one state per channel, see models/recurrent_gemma.py): the
mapping is checked against HF's own ``RecurrentGemmaRglru`` module (prefill from zeros, then decode
steps from HF's carried state; a channel whose recurrent gate underflows the floor included).
Greedy tokens equal transformers' ``generate`` on a tiny random model (tests/recurrent_gemma_models.py)
for single prompts, a continuous batch with chunked prefill, prefix-cache hits, speculative
decoding (the target as its own draft, n-gram): the scenarios of tests/family_parity.py; the compiled engine is in
tests/test_compile_families.py, the Triton kernels at the RG-LRU shape in tests/test_triton_mamba1.py,
tensor parallelism in tests/test_tensor_parallel.py.
GPU (``@pytest.mark.gpu``): compile + CUDA graphs (and speculative decoding under them) against the
eager GPU engine and HF.
"""

from __future__ import annotations

import copy

import pytest
import torch

import hybrid_compile as hc
from hybrid_compile.models import recurrent_gemma as rg

import family_parity as fp
from engine_models import make_engine, random_prompts, single_threaded
from recurrent_gemma_models import VOCAB, build_recurrent_gemma, hf_greedy_fresh


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from single_threaded()


FAMILY = fp.make_family("recurrent_gemma", build_recurrent_gemma, hf_greedy_fresh, VOCAB)


def test_rg_lru_on_the_mamba1_ops_equals_hf_module():
    """Prefill of 11 tokens from zeros through ``mamba1_selective_scan``, then 3 decode tokens
    through ``mamba1_state_update``, against HF's ``RecurrentGemmaRglru`` (which carries its own
    state). Channel 0's recurrent gate is pushed below the floor (``a_t`` = 1 in fp32)."""
    lru = copy.deepcopy(FAMILY.model().model.layers[0].temporal_block.rg_lru)
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
    model = FAMILY.model()
    with make_engine(model, **fp.ENGINE_ARGS) as engine:
        assert [s.layer_ids for s in engine.layout.attention] == [(1,)]
        assert [s.layer_ids for s in engine.layout.mamba] == [(0,), (2,)]
        spec = engine.layout.mamba[0]
        assert spec.conv_window_shape == (2, 32) and spec.state_shape == (32, 1)
        assert engine.layout.ssm_chunk_size == rg.RG_LRU_CHECKPOINT_ALIGN
    prompt = random_prompts((90,), VOCAB, seed=21)[0]
    unwindowed = build_recurrent_gemma(0, window=4096)  # same weights, the window beyond every prompt
    assert hf_greedy_fresh(unwindowed, prompt, fp.MAX_NEW) != FAMILY.hf(tuple(prompt), fp.MAX_NEW), "the window should matter here"


def test_generate_single_prompts_and_batch_with_chunked_prefill():
    fp.check_batch_with_chunked_prefill(FAMILY)


def test_prefix_cache_hits_at_checkpoints():
    """RG-LRU state + conv window checkpoints every 16 tokens."""
    assert fp.check_prefix_cache_hits(FAMILY)["checkpoints_tracked"] > 0


@pytest.mark.parametrize("method", ["draft_self", "ngram"])
def test_speculative_greedy_equals_hf(method):
    fp.check_speculative(FAMILY, method)


@pytest.mark.parametrize("topk", [2, 4])
def test_draft_trees_greedy_equal_hf(topk):
    """Draft trees (topk > 1): the RG-LRU layers verify them on the Mamba1 op (each node from its
    parent's state), the local attention with the tree mask under its sliding window (each node's
    window counted from its depth's position)."""
    fp.check_speculative_tree(FAMILY, topk)


@pytest.mark.gpu
def test_gpu_graphs_match_eager_and_hf():
    fp.check_gpu_graphs(FAMILY)
