"""Mamba1 families (Mamba, FalconMamba, Jamba, Zamba) through the engine: greedy tokens equal transformers'
own ``generate`` per prompt (one prompt with chunked prefill, a continuous batch, prefix-cache hits at
the 64-token checkpoint grid, speculative decoding), pools all free afterwards; the patched model still
gives HF's result outside the engine; the patched mixer (``short_conv_layer`` + ``mamba1_ssm_layer``)
matches HF's mixer over a packed, chunked extend; layout and FP8-state error; tensor-parallel plans;
bf16 weights compile one graph, as fp32.

GPU (``gpu`` marker): fp32 and bf16, the Triton path eager and compiled with full + piecewise CUDA
graphs, with and without speculative decoding.

Tiny random fp32 models from :mod:`mamba1_models`; HF references computed once per model.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import hybrid_compile as hc
from hybrid_compile.layers.context import ForwardContext, ForwardMetadata, ForwardMode, forward_context
from hybrid_compile.models import FAMILIES

import family_parity as fp
import mamba1_models as mm
from engine_models import assert_pools_restored, make_engine, random_prompts, record_prefix_hits, single_threaded
from test_mamba2_families import _check_all_free, _hf_generate, _record_logits, packed_extend_outputs

MAX_NEW = 8
PROMPT_LENS = (1, 150, 17, 64, 5, 33)  # chunked_prefill_size 32
ENGINE_ARGS = dict(max_running_requests=3, chunked_prefill_size=32, max_context_len=256, max_total_tokens=2048,
                   mamba_cache_size=8)
CASES = {"mamba": 0, "falcon_mamba": 1, "jamba": 2, "zamba": 3}


@functools.lru_cache(maxsize=None)
def _case(name: str):
    """(model, prompts, HF greedy tokens per prompt, HF logits per prompt), built once per family."""
    seed = CASES[name]
    model = mm.BUILDERS[name](seed)
    g = torch.Generator().manual_seed(100 + seed)
    prompts = [torch.randint(0, mm.VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    refs, ref_logits = zip(*(_hf_generate(model, p, logits=True) for p in prompts))
    return model, prompts, list(refs), list(ref_logits)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from single_threaded()


@pytest.fixture(params=list(CASES))
def case(request):
    return request.param, *_case(request.param)


def test_families_registered():
    for model_type in ("mamba", "falcon_mamba", "jamba", "zamba"):
        assert model_type in hc.supported_model_types()
        assert FAMILIES[model_type].__name__.endswith("models.zamba" if model_type == "zamba" else "models.mamba1")


def test_generate_single_prompt_and_batch(case):
    """One 150-token prompt (five prefill chunks) and a 1-token prompt, then a continuous batch with
    chunked prefill (mixed prefill + decode steps): HF's greedy tokens, and the logits of every sampled
    position close to HF's."""
    name, model, prompts, refs, ref_logits = case
    with hc.wrap(model, **ENGINE_ARGS) as engine:
        records = _record_logits(engine)
        for rid, i in enumerate((1, 0)):
            out = engine.generate(torch.tensor([prompts[i]]), max_new_tokens=MAX_NEW)
            assert out[0, len(prompts[i]):].tolist() == refs[i], f"{name}: prompt {i}"
            torch.testing.assert_close(torch.stack(records[rid]), ref_logits[i], rtol=1e-4, atol=1e-4)
        outs = engine.generate_batch(prompts, max_new_tokens=MAX_NEW)
        stats = engine.stats()
        _check_all_free(engine)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out == ref, f"{name}: prompt {i} (length {len(prompts[i])})"
        torch.testing.assert_close(torch.stack(records[2 + i]), ref_logits[i], rtol=1e-4, atol=1e-4)
    assert stats["decode_steps"] > 0 and stats["extend_steps"] > 0


@pytest.mark.parametrize("policy,name", [("lru", "jamba"), ("marconi", "mamba"), ("lru", "zamba")])
def test_prefix_cache_hits_at_checkpoint_grid(policy, name):
    """Prompts sharing a 140-token prefix, in flight together and again after it is cached: hits at
    multiples of the 64-token checkpoint alignment, greedy outputs equal HF's. (Prefill chunks of 64:
    a chunk budget below the alignment would not end chunks on the checkpoint grid.)"""
    model, prompts = _case(name)[:2]
    base = prompts[1][:140]
    shared = [base + t for t in (prompts[2][:9], prompts[5][:20], prompts[3][:3])]
    order = [0, 1, 0, 2, 1, 2, 0]
    batch = [shared[i] for i in order]
    refs = [_hf_generate(model, p) for p in shared]
    with hc.wrap(model, **dict(ENGINE_ARGS, chunked_prefill_size=64), prefix_cache_policy=policy) as engine:
        hits = record_prefix_hits(engine)
        outs = []
        for start, end in ((0, 2), (2, 5), (5, 7)):
            outs += engine.generate_batch(batch[start:end], max_new_tokens=MAX_NEW)
        stats = engine.stats()["prefix_cache"]
        _check_all_free(engine)
    assert outs == [refs[i] for i in order], f"{name} ({policy})"
    finished = {len(p) + MAX_NEW - 1 for p in batch}
    assert all(h % 64 == 0 or h in finished for h in hits if h), f"{name} ({policy}): hits {hits}"
    assert max(hits) >= 128 and stats["mamba_hits"] > 0, f"{name} ({policy}): hits {hits}"


@pytest.mark.parametrize("name", list(CASES))
def test_speculative_greedy_equals_hf(name):
    """The target drafting for itself (every draft accepted), then n-gram drafts on repetitive prompts
    (some rejected: the state of an intermediate verify step is committed): HF's greedy tokens."""
    model, prompts, refs = _case(name)[:3]
    picked = [0, 2, 4]
    with hc.wrap(model, speculative=dict(method="draft_model", draft_model=model, num_draft_tokens=3),
                 **ENGINE_ARGS) as engine:
        outs = engine.generate_batch([prompts[i] for i in picked], max_new_tokens=MAX_NEW)
        spec = engine.stats()["speculative"]
        _check_all_free(engine)
    assert outs == [refs[i] for i in picked], name
    assert spec["verify_steps"] > 0 and spec["acceptance_rate"] == 1.0, spec

    repetitive = [[5, 9, 14, 3] * 5, prompts[2][:6] * 4, prompts[5][:10] * 3]
    expected = [_hf_generate(model, p, 12) for p in repetitive]
    with hc.wrap(model, speculative=dict(method="ngram", num_draft_tokens=3, ngram_max=3, ngram_min=1),
                 **ENGINE_ARGS) as engine:
        outs = engine.generate_batch(repetitive, max_new_tokens=12)
        spec = engine.stats()["speculative"]
        _check_all_free(engine)
    assert outs == expected, name
    assert spec["verify_steps"] > 0 and 0 < spec["accepted"] < spec["drafted"], spec


@functools.lru_cache(maxsize=None)
def _large_dt_model(name: str):
    """The family's model with ``dt`` ~ 1 and 3x larger B / C: with HF's dt init (0.001-0.1) a token
    barely moves the state, so a node started from its elder sibling's state instead of its
    parent's would not show in these tiny models' greedy tokens. Checked by running the verify as a
    chain (``parent_indices`` dropped): Mamba, FalconMamba and Jamba then fail; Zamba's tokens stay
    right for that error (they fail for every node started from the cached state), its layers run
    the same ``mamba1_ssm_layer`` code."""
    model = copy.deepcopy(_case(name)[0])
    with torch.no_grad():
        for mod in model.modules():
            bias = getattr(mod, "dt_proj_bias", None)  # Zamba's per-head dt bias
            if bias is None and isinstance(getattr(mod, "dt_proj", None), torch.nn.Linear):
                bias = mod.dt_proj.bias
            if isinstance(bias, torch.Tensor):  # dt = softplus(bias + ...) ~ 0.5 .. 1.7
                bias.copy_(torch.linspace(-0.5, 1.5, bias.numel()).reshape(bias.shape))
            for attr in ("x_proj", "x_proj_weight"):  # larger B and C: the state's share of y grows
                proj = getattr(mod, attr, None)
                weight = proj.weight if isinstance(proj, torch.nn.Linear) else proj
                if isinstance(weight, torch.Tensor):
                    weight *= 3.0
    return model


@pytest.mark.parametrize("name,topk", [("mamba", 2), ("falcon_mamba", 4), ("jamba", 2), ("zamba", 4)])
def test_draft_trees_greedy_equal_hf(name, topk):
    """Draft trees (topk > 1) verified on the Mamba1 op (each node from its parent's state): a replay
    tree whose accepted paths leave the first-child chain, and the model as its own tree draft."""
    family = fp.make_family(name, lambda: _large_dt_model(name), _hf_generate, mm.VOCAB)
    fp.check_speculative_tree(family, topk)


def test_patched_model_generate_outside_engine():
    model, prompts, refs = _case("jamba")[:3]
    engine = hc.wrap(model, **ENGINE_ARGS)
    try:
        engine.generate_batch(prompts[:2], max_new_tokens=2)
        assert _hf_generate(model, prompts[2]) == refs[2], "patched model, HF generate"
    finally:
        engine.close()
    assert _hf_generate(model, prompts[3]) == refs[3], "after close"


def test_layout_and_errors():
    model = _case("jamba")[0]
    cfg = model.config
    d_inner = cfg.mamba_expand * cfg.hidden_size
    with hc.wrap(model, **ENGINE_ARGS) as engine:
        assert engine.pools.kv.layer_ids == [1]
        assert engine.pools.mamba.layer_ids == [0, 2, 3]
        spec = engine.layout.mamba[0]
        assert spec.conv_window_shape == (3, d_inner) and spec.state_shape == (d_inner, 8)
        assert engine.layout.ssm_chunk_size == 64
        assert engine.pools.mamba.ssm(0).shape[1:] == (d_inner, 8)

    # Zamba: a mixer in every layer; each use of the shared attention block gets its own KV id
    model = _case("zamba")[0]
    n = model.config.num_hidden_layers
    with hc.wrap(model, **ENGINE_ARGS) as engine:
        assert engine.pools.mamba.layer_ids == list(range(n))
        assert engine.pools.kv.layer_ids == [n + 2, n + 4]
        assert engine.layout.mamba[0].state_shape == (64, 8)
    assert all(layer.shared_transf.self_attn.layer_idx is None for layer in model.model.layers
               if hasattr(layer, "shared_transf")), "close() restores HF's attention layer_idx"


@pytest.mark.parametrize("name", ["mamba", "zamba"])
def test_fp8_state_speculative_equals_plain(name):
    """An FP8 recurrent state (one scale per channel over N): the pool holds e4m3 values and fp32
    scales, and speculative decoding (self-draft, n-gram with rejections) gives the plain FP8 engine's
    greedy tokens (verify rounds the state between steps as decode stores it)."""
    model, prompts = _case(name)[:2]
    batch = [prompts[2], prompts[5], [5, 9, 14, 3] * 5]
    args = dict(ENGINE_ARGS, ssm_state_dtype="float8_e4m3fn")
    outs = {}
    for run, spec in (("plain", None), ("draft", dict(method="draft_model", draft_model=model, num_draft_tokens=3)),
                      ("ngram", dict(method="ngram", num_draft_tokens=3, ngram_max=3, ngram_min=1))):
        with hc.wrap(model, speculative=spec, **args) as engine:
            if run == "plain":
                layer = engine.layout.mamba[0].layer_ids[0]
                assert engine.pools.mamba.ssm(layer).dtype == torch.float8_e4m3fn
                assert engine.pools.mamba.ssm_scale(layer).shape[1:] == (64,)
            outs[run] = engine.generate_batch(batch, max_new_tokens=10)
            if spec is not None:
                assert engine.stats()["speculative"]["verify_steps"] > 0
            _check_all_free(engine)
    assert outs["draft"] == outs["plain"] and outs["ngram"] == outs["plain"], outs


def test_tensor_parallel_plans():
    """The plans split the D_inner channels (x_proj by input columns, all-reduced; Zamba by heads); a
    count that does not divide fails before any weight is read (tests/test_tensor_parallel.py serves
    them on 2 ranks)."""
    from hybrid_compile.distributed.plans import ShardingError, plan_for

    zamba = plan_for(_case("zamba")[0].config, 2, 1)  # per-head x_proj: split by heads, not reduced
    prefix = "model.layers.2.mamba_decoder.mamba"
    assert zamba.slice_of(f"{prefix}.x_proj_weight").dim == 0 and not zamba.is_reduced(f"{prefix}.x_proj", None)
    assert zamba.is_reduced(f"{prefix}.out_proj", None)
    with pytest.raises(ShardingError, match="n_mamba_heads"):
        plan_for(_case("zamba")[0].config, 4)  # 2 heads
    for name in ("mamba", "falcon_mamba", "jamba"):
        cfg = _case(name)[0].config
        plan = plan_for(cfg, 2, 1)
        prefix = "model.layers.0.mamba" if name == "jamba" else "backbone.layers.0.mixer"
        assert plan.slice_of(f"{prefix}.x_proj.weight").dim == 1
        assert plan.is_reduced(f"{prefix}.x_proj", None) and plan.is_reduced(f"{prefix}.out_proj", None)
        assert plan.slice_of(f"{prefix}.A_log").dim == 0
        local = plan.local_config(cfg)
        d_inner = 64
        assert (local.mamba_expand * local.hidden_size if name == "jamba" else local.intermediate_size) == d_inner // 2
        with pytest.raises(ShardingError, match="Mamba1 intermediate size"):
            plan_for(cfg, 3)


@pytest.mark.parametrize("name", ["falcon_mamba", "jamba", "zamba"])
def test_mixer_layer_ops_match_hf_chunked_extend(name):
    """Two requests packed in one EXTEND step, continued from their pools in a second; the patched
    mixer's output equals HF's mixer over each whole sequence (no cache)."""
    model = _case(name)[0]
    with hc.wrap(model, **ENGINE_ARGS) as engine:
        mixer, layer_id = FAMILIES[name].mamba_layers(model)[0]
        conv, ssm = engine.pools.mamba.conv(layer_id), engine.pools.mamba.ssm(layer_id)
        seqs, outs = packed_extend_outputs(mixer, layer_id, conv, ssm, model.config.hidden_size)
        for seq, out in zip(seqs, outs):
            with torch.no_grad():
                ref = type(mixer).forward(mixer, seq[None])[0]
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_ssm_layer_op_fake_shape_and_verify_needs_buffers():
    from torch._subclasses.fake_tensor import FakeTensorMode

    D_inner, N = 16, 4
    args = lambda n: (torch.randn(n, D_inner), torch.randn(n, D_inner), torch.randn(n, 1, N), torch.randn(n, 1, N),
                      torch.randn(n, D_inner), torch.zeros(D_inner, N), torch.ones(D_inner), torch.zeros(D_inner))
    with FakeTensorMode():
        out = torch.ops.hybrid_compile.mamba1_ssm_layer(*args(5), 0, 64)
    assert out.shape == (5, D_inner)
    with pytest.raises(ValueError, match="B and C must be"):
        torch.ops.hybrid_compile.mamba1_ssm_layer(*args(5)[:2], torch.randn(5, 1, N), torch.randn(5, 1, N + 1),
                                                  *args(5)[4:], 0, 64)
    md = ForwardMetadata(
        mode=ForwardMode.TARGET_VERIFY, positions=torch.arange(4), query_start_loc=torch.tensor([0, 2, 4]),
        seq_lens=torch.tensor([5, 5]), prefix_lens=torch.tensor([3, 3]), mamba_cache_indices=torch.tensor([0, 1]),
        has_initial_state=torch.tensor([True, True]), out_cache_loc=torch.zeros(0, dtype=torch.int64),
        kv_indptr=torch.zeros(3, dtype=torch.int32), kv_indices=torch.zeros(0, dtype=torch.int64),
        logits_indices=torch.arange(4), draft_len=2,
    )
    pools = {0: (torch.zeros(2, 3, D_inner), torch.zeros(2, D_inner, N))}
    with forward_context(ForwardContext(md, {}, pools)), pytest.raises(RuntimeError, match="speculative buffers"):
        torch.ops.hybrid_compile.mamba1_ssm_layer(*args(4), 0, 64)


# --------------------------------------------------------------------------------------------
# bf16 compiled: one graph for every token count (CPU); GPU: fp32 and bf16, eager / CUDA graphs /
# CUDA graphs + speculative
# --------------------------------------------------------------------------------------------


def _graphs_case(name: str, moe: bool = False):
    """(fp32 CPU model, prompts) of the compile-count tests: token counts 1 to 90 per step (the
    warm-up compiles at 3 tokens). Jamba dense unless ``moe`` (on the CPU transformers' experts run,
    whose fp32 loop syncs with the host: the GPU test serves them on our fused MoE op)."""
    cpu_model = mm.build_jamba(2, moe=moe) if name == "jamba" else mm.BUILDERS[name](CASES[name])
    return cpu_model, random_prompts((37, 1, 90, 5, 64, 3), mm.VOCAB, seed=16) + [[5, 9, 14, 3] * 5]


def _assert_one_graph(c: dict, run: str) -> None:
    """One Dynamo graph (and the one-token decode graph where captured), no recompile, no graph break;
    the counts and Dynamo's recompile reasons spelled out (pytest shortens a dict in the message)."""
    assert c["graphs"] == 1 + c["one_token_graph"] and c["recompiles"] == 0 and c["graph_breaks"] == 0, (
        f"{run}: {c['graphs']} graphs (one-token graph: {c['one_token_graph']}), {c['graph_breaks']} graph "
        f"breaks, recompiled because {c['recompile_reasons']}")


@pytest.mark.parametrize("name", list(CASES))
def test_bf16_compile_one_graph(name):
    """bf16 weights compile the forward once, as fp32 (``tests/test_compile_families.py``), over the
    GPU test's token counts. On the GPU, bf16 compiled one graph more until Inductor's ``shape_padding``
    was turned off (its pad-mm pass, CUDA-only, guarded the graph on ``2 <= tokens <= 3`` for the tiny
    models' unaligned matmuls, ``engine/graph_setup.py``); this catches a dtype-dependent guard of our
    own (a bf16-only branch, a dtype read from a parameter) on CPU. Tokens are not compared: eager and
    compiled bf16 round differently on CPU (fp32 parity: ``test_compile_families.py``)."""
    cpu_model, prompts = _graphs_case(name)
    model = copy.deepcopy(cpu_model).to(torch.bfloat16)
    with make_engine(model, max_running_requests=8, compile=True) as engine:
        initial_free = engine.pools.free_counts()
        outs = engine.generate_batch(prompts, max_new_tokens=MAX_NEW)
        c = engine.stats()["compile"]
        assert_pools_restored(engine, initial_free)
    assert all(len(o) == MAX_NEW and all(0 <= t < mm.VOCAB for t in o) for o in outs), outs
    _assert_one_graph(c, f"{name} bf16 compiled")
    assert c["inductor_config"]["shape_padding"] is False, c["inductor_config"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", [pytest.param("mamba", marks=pytest.mark.smoke), "falcon_mamba", "jamba", "zamba"])
def test_gpu_graphs_and_speculative(name, dtype):
    """The Triton path on the GPU: eager, compiled, compiled + full and piecewise CUDA graphs, and that
    + speculative decoding (the target as its own draft). CUDA graphs replay the compiled engine's
    tokens exactly (same kernels); fp32: eager and graphs + speculative give HF's greedy tokens on the
    CPU up to CPU/GPU near-ties; bf16: the self-draft is mostly accepted (verify runs the projections
    over 4 tokens per request, so bf16 rounding may differ from decode's). Jamba with its MoE layers,
    on our fused MoE op (the default on CUDA; transformers' fp32 experts loop syncs with the host,
    which graph capture refuses)."""
    from test_cuda_graphs import _assert_greedy_close

    cpu_model, prompts = _graphs_case(name, moe=True)
    model = copy.deepcopy(cpu_model).to("cuda", dtype)
    graphs = dict(compile=True, cuda_graphs=True, cuda_graph_batch_sizes=(1, 4),
                  piecewise_cuda_graph_tokens=(4, 16, 64))
    spec = dict(method="draft_model", draft_model=model, num_draft_tokens=3)
    runs = {"eager": dict(compile=False), "compiled": dict(compile=True, cuda_graphs=False), "graphs": graphs,
            "graphs+speculative": dict(graphs, speculative=spec)}
    outs, stats = {}, {}
    for run, kw in runs.items():
        with make_engine(model, max_running_requests=8, **kw) as engine:
            initial_free = engine.pools.free_counts()
            outs[run] = engine.generate_batch(prompts, max_new_tokens=MAX_NEW)
            stats[run] = engine.stats()
            assert_pools_restored(engine, initial_free)
    assert outs["graphs"] == outs["compiled"], outs
    if dtype == torch.float32:
        expected = [_hf_generate(cpu_model, p) for p in prompts]
        for run in ("eager", "graphs+speculative"):
            for p, got, want in zip(prompts, outs[run], expected):
                _assert_greedy_close(cpu_model, p, got, want, f"{name} {run} GPU")
    for run in ("compiled", "graphs"):  # bf16 as fp32: see test_bf16_compile_one_graph
        c = stats[run]["compile"]
        _assert_one_graph(c, run)
    assert c["cuda_graph_replays"] > 0 and c["piecewise_replays"] > 0, c
    s = stats["graphs+speculative"]["speculative"]
    assert s["verify_steps"] > 0 and s["acceptance_rate"] > (0.9 if dtype == torch.float32 else 0.5), s
    assert (stats["graphs"]["fused_moe_modules"] > 0) == (name == "jamba"), stats["graphs"]["fused_moe_modules"]
