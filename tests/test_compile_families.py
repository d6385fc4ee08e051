"""Every family under ``EngineConfig.compile=True`` on CPU (our backend, no CUDA graphs).

Per family of the Supported-families table that ``tests/test_compile.py`` does not cover
already: greedy tokens of a compiled engine equal transformers' own ``generate`` on the same
tiny random weights (continuous batching of three prompts with chunked prefill, then one more
request on the warm engine), with one Dynamo graph, zero graph breaks and zero recompiles, and no
input of that graph but the step's own with symbolic sizes (a weight traced with size symbols of its
own makes identical layers distinct Inductor compiles: the folded shared experts once did, on the GPU).
Inductor's CPU compiles are slow, so each family runs once with few tokens.
"""

from __future__ import annotations

import pytest
import torch

import hybrid_compile as hc

import kimi_models as km
import lfm3_models as lfm3
import mamba1_models as m1
import mamba2_models as mm
import minimax_models as mx
import recurrent_gemma_models as rgm
from engine_models import cached_model, hf_greedy, record_graph_inputs, single_threaded, symbolic_model_inputs

NEW = 4
BUILDERS = {
    "mamba2": lambda: mm.build_mamba2(0),
    "nemotron_h": lambda: mm.build_nemotron_h(1),
    "falcon_h1": lambda: mm.build_falcon_h1(6),
    "bamba": lambda: mm.build_bamba(4),
    "granitemoehybrid": lambda: mm.build_granitemoehybrid(5),
    "zamba2": lambda: mm.build_zamba2(6),
    "mamba": lambda: m1.build_mamba(0),
    "falcon_mamba": lambda: m1.build_falcon_mamba(1),
    "jamba": lambda: m1.build_jamba(2),
    "zamba": lambda: m1.build_zamba(3),
    "qwen3_5_moe": lambda: cached_model("qwen3_5_moe", 0),
    "olmo_hybrid": lambda: cached_model("olmo_hybrid", 0),
    # one KDA and one MLA layer (CPU Inductor's compile time grows with the layers)
    "kimi_linear": lambda: km.build_kimi_linear(0, None, ("linear_attention", "full_attention")),
    # one lightning and one softmax attention layer
    "minimax": lambda: mx.build_minimax(0, ("linear_attention", "full_attention")),
    "lfm3": lambda: lfm3.build_lfm3(0),  # skips on a transformers without LFM3
    "recurrent_gemma": lambda: rgm.build_recurrent_gemma(0),
}
SPLIT_OPS = {
    "kimi_linear": {"hybrid_compile::kda_layer": 1, "hybrid_compile::mla_layer": 1},
    "minimax": {"hybrid_compile::lightning_layer": 1, "hybrid_compile::attention_layer": 1},
    "lfm3": {"hybrid_compile::short_conv_layer": 3, "hybrid_compile::attention_layer": 2},
    "recurrent_gemma": {"hybrid_compile::short_conv_layer": 2, "hybrid_compile::mamba1_ssm_layer": 2,
                        "hybrid_compile::attention_layer": 1},
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from single_threaded()


@pytest.fixture(autouse=True)
def _verify_laid_out_pieces(monkeypatch):
    """Every family's repeated pieces also run under fake mode, their outputs checked against the
    layout taken from their key's first piece (``PiecewiseCompiler.verify_reuse``)."""
    from hybrid_compile.compilation.backend import PiecewiseCompiler

    monkeypatch.setattr(PiecewiseCompiler, "verify_reuse", True)


@pytest.mark.parametrize("family", list(BUILDERS))
def test_compiled_family_matches_hf(family, monkeypatch):
    model = BUILDERS[family]()
    graphs = record_graph_inputs(monkeypatch)
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (1, 40, 70)]
    expected = [hf_greedy(model, p, NEW) for p in prompts]
    with hc.wrap(model, compile=True, max_running_requests=3, chunked_prefill_size=32, max_total_tokens=1024,
                 max_context_len=256, mamba_cache_size=12) as engine:
        got = engine.generate_batch(prompts, max_new_tokens=NEW, do_sample=False)
        again = engine.generate(torch.tensor([prompts[2]]), max_new_tokens=NEW, do_sample=False)
        stats = engine.stats()["compile"]
    assert got == expected, family
    assert again[0, len(prompts[2]):].tolist() == expected[2], family
    assert stats["graphs"] == 1 and stats["recompiles"] == 0 and stats["graph_breaks"] == 0, stats
    # only the step's inputs have symbolic sizes: a weight or state traced with size symbols of its own
    # would make identical layers distinct Inductor compiles
    assert len(graphs) == 1 and symbolic_model_inputs(graphs[0]) == [], graphs
    if family in SPLIT_OPS:
        assert stats["split_ops_seen"] == SPLIT_OPS[family], stats
