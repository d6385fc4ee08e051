"""MiniMax (``minimax``) through the engine: lightning attention via the ``lightning_layer`` op and
softmax attention over the KV pool (hybrid_compile/models/minimax.py).

Greedy tokens equal transformers' own ``generate`` (tests/engine_models.py's oracle) for single
prompts, a continuous batch with chunked prefill, prefix-cache hits (state checkpoints every 64
tokens), speculative decoding (the target as its own draft, n-gram drafts); each rank's
tensor-parallel shard (tokens at 2 ranks: tests/test_tensor_parallel.py); ``compile=True`` is in
tests/test_compile_families.py (one graph, zero graph breaks). Tiny random fp32 model: hidden 64,
4 layers (lightning, attention, lightning, attention), MoE, vocab 128, HF block size 32.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import hybrid_compile as hc

from engine_models import (
    assert_greedy_equal,
    assert_pools_restored,
    hf_greedy_cached,
    make_engine,
    random_prompts,
    single_threaded,
)
from family_parity import check_prefix_cache_hits, check_speculative, check_speculative_tree, make_family
from minimax_models import HEAD_DIM, HEADS, VOCAB, build_minimax

if not hasattr(transformers, "MiniMaxForCausalLM"):
    pytest.skip(f"transformers {transformers.__version__} has no MiniMaxForCausalLM", allow_module_level=True)

MAX_NEW = 8
ENGINE_ARGS = dict(max_running_requests=3, chunked_prefill_size=32, max_context_len=320, mamba_cache_size=8)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from single_threaded()


def _expected(prompts, max_new: int = MAX_NEW):
    model = build_minimax()
    return [hf_greedy_cached(model, ("minimax", 0), p, max_new) for p in prompts]


MINIMAX = make_family("minimax", build_minimax, lambda model, p, n: hf_greedy_cached(model, ("minimax", 0), p, n), VOCAB)


def _assert_all_equal(prompts, got, expected, what):
    for i, (p, g, e) in enumerate(zip(prompts, got, expected)):
        assert_greedy_equal(build_minimax(), p, g, e, f"minimax {what}: prompt {i} (length {len(p)})")


def test_registered_and_layout():
    assert "minimax" in hc.supported_model_types()
    with make_engine(build_minimax(), **ENGINE_ARGS) as engine:
        layout = engine.layout
        assert [s.layer_ids for s in layout.mamba] == [(0,), (2,)]
        assert layout.mamba[0].state_shape == (HEADS, HEAD_DIM, HEAD_DIM)
        assert [s.layer_ids for s in layout.attention] == [(1,), (3,)]
        assert layout.ssm_chunk_size == 64


def test_generate_single_prompts_and_batch_with_chunked_prefill():
    """One prompt at a time (150 tokens: five prefill chunks; then a 1-token prompt), then a
    continuous batch of six with chunked prefill (mixed prefill + decode steps)."""
    model = build_minimax()
    prompts = random_prompts((1, 150, 17, 64, 5, 100), VOCAB, seed=11)
    expected = _expected(prompts)
    with make_engine(model, **ENGINE_ARGS) as engine:
        initial_free = engine.pools.free_counts()
        for i in (1, 0):
            out = engine.generate(torch.tensor([prompts[i]]), max_new_tokens=MAX_NEW)
            _assert_all_equal([prompts[i]], [out[0, len(prompts[i]):].tolist()], [expected[i]], "single")
        engine.clear_prefix_cache()
        got = engine.generate_batch(prompts, max_new_tokens=MAX_NEW)
        stats = engine.stats()
        _assert_all_equal(prompts, got, expected, "batch")
        assert stats["decode_steps"] > 0 and stats["extend_steps"] > 0
        assert_pools_restored(engine, initial_free)


def test_prefix_cache_hits_at_checkpoints():
    """Prompts sharing a 140-token prefix: the first one's extend checkpoints its lightning states
    every 64 tokens (the op's chunk states); the later ones continue from the checkpoint at 128
    tokens; a follow-up of a finished request hits at its full length."""
    stats = check_prefix_cache_hits(MINIMAX, chunked_prefill_size=256)
    assert stats["checkpoints_tracked"] > 0 and stats["mamba_hits"] >= 3


@pytest.mark.parametrize("method", ["draft_self", "ngram"])
def test_speculative_greedy_equals_hf(method):
    check_speculative(MINIMAX, method)


@pytest.mark.parametrize("topk", [2, 4])
def test_draft_trees_greedy_equal_hf(topk):
    """Draft trees (topk > 1) verified on the lightning op (each node from its parent's state): a
    replay tree whose accepted paths leave the first-child chain, and the model as its own tree draft."""
    check_speculative_tree(MINIMAX, topk)


def test_tensor_parallel_shards_hold_the_rank_heads(tmp_path):
    """Each rank's shard of a 2-rank plan (tokens at TP 2: tests/test_tensor_parallel.py
    ``[minimax]``): the fused ``qkv_proj`` takes its heads' ``[q | k | v]`` rows, the output gate and
    the norm their channels, ``out_proj`` their columns, and the decay buffers the rank's heads'
    slopes, both where the checkpoint holds them (sliced) and where it does not (recomputed from the
    whole model's head count: rank 1 must not get heads 0-1's slopes). 4 heads over 3 ranks: one
    ShardingError naming the count, from a directory with no weights at all (nothing is read)."""
    from safetensors.torch import load_file, save_file

    from hybrid_compile.distributed.loading import load_shard
    from hybrid_compile.distributed.plans import ShardingError, plan_for

    model = build_minimax()
    full, no_buffers, config_only = tmp_path / "full", tmp_path / "no_buffers", tmp_path / "config_only"
    model.save_pretrained(full)
    model.save_pretrained(no_buffers)
    weights = load_file(no_buffers / "model.safetensors")
    decays = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")
    save_file({k: v for k, v in weights.items() if not k.endswith(decays)}, no_buffers / "model.safetensors",
              metadata={"format": "pt"})
    local, d = HEADS // 2, HEAD_DIM
    for rank in (0, 1):
        heads = slice(rank * local, (rank + 1) * local)
        channels = slice(rank * local * d, (rank + 1) * local * d)
        for path in (full, no_buffers):
            shard, _ = load_shard(str(path), model.config, plan_for(model.config, 2, rank), torch.float32,
                                  torch.device("cpu"))
            assert shard.config.num_attention_heads == local
            for i in (0, 2):  # the lightning layers
                got, want = shard.model.layers[i].self_attn, model.model.layers[i].self_attn
                assert torch.equal(got.qkv_proj.weight, want.qkv_proj.weight.view(HEADS, 3 * d, -1)[heads].flatten(0, 1))
                assert torch.equal(got.output_gate.weight, want.output_gate.weight[channels])
                assert torch.equal(got.norm.weight, want.norm.weight[channels])
                assert torch.equal(got.out_proj.weight, want.out_proj.weight[:, channels])
                for name in decays[:3]:
                    assert torch.equal(getattr(got, name), getattr(want, name)[heads]), (path.name, rank, name)
                assert torch.equal(got.diagonal_decay, want.diagonal_decay[:, heads]), (path.name, rank)
    model.config.save_pretrained(config_only)
    with pytest.raises(ShardingError, match="minimax has num_attention_heads=4, which does not divide by 3"):
        hc.from_pretrained(str(config_only), tensor_parallel_size=3, device="cpu")


def test_not_a_transformers_minimax_model_is_refused():
    from hybrid_compile.models import minimax

    with pytest.raises(ValueError, match="no MiniMaxLightningAttention layer.*trust_remote_code"):
        minimax.layout(torch.nn.Linear(2, 2), kv_dtype=torch.float32, conv_dtype=torch.float32,
                       ssm_dtype=torch.float32)


def test_fp8_state_tracks_hf_logits_within_e4m3_rounding():
    """``ssm_state_dtype="fp8"``: the lightning states really are e4m3 with scales, the fp32-state
    engine is exact to fp32 noise against transformers' fp32 logits on the same tokens (the oracle of
    tests/test_fp8_pools_engine.py), and the FP8 state's per-step logit error exceeds the bf16 state's
    by no more than e4m3's coarser rounding (3 mantissa bits against 8: 32x). The model routes every
    token to all its experts: with top-2 routing a state rounding can flip an expert, a jump of the
    logits that no rounding bound describes."""
    from minimax_models import make_config
    from test_fp8_pools_engine import FP8, _step_errors

    config = make_config()
    config.num_experts_per_tok = config.num_local_experts
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.MiniMaxForCausalLM(config).float().eval()
    (prompt,) = random_prompts([40], VOCAB, seed=11)
    errors = {}
    for name, dtype in (("fp32", "float32"), ("bf16", "bfloat16"), ("fp8", "fp8")):
        # (one prefill step: the tap takes every forward's logits as the next token's)
        errors[name], (ssm_dtypes, _), (ssm_scales, _) = _step_errors(model, prompt, 8, ssm_state_dtype=dtype)
        if name == "fp8":
            assert ssm_dtypes == {FP8} and ssm_scales > 0
    assert errors["fp32"] < 1e-5, errors
    assert errors["bf16"] < errors["fp8"] < 32 * errors["bf16"], errors


def test_fp8_state_with_speculative_decoding_chunked_prefill_and_prefix_cache():
    """The FP8 lightning state through verify steps (rounded between steps as decode steps store it,
    committed with its scales), chunked prefills and prefix-cache hits on FP8 checkpoints: greedy
    tokens equal the plain FP8 engine's."""
    model = build_minimax()
    prompts = random_prompts([70, 11, 25], VOCAB, seed=7) + [[5, 9, 14, 3] * 5]
    kw = dict(ENGINE_ARGS, ssm_state_dtype="fp8", mamba_cache_size=16, enable_prefix_cache=True)
    outputs = []
    for speculative in (None, dict(method="draft_model", draft_model=model, num_draft_tokens=3)):
        with make_engine(model, speculative=speculative, **kw) as engine:
            got = engine.generate_batch(prompts, max_new_tokens=10)
            more = engine.generate_batch([p + g for p, g in zip(prompts, got)], max_new_tokens=5)
            stats = engine.stats()
            assert stats["prefix_cache"]["hit_tokens"] > 0
            if speculative:
                assert stats["speculative"]["verify_steps"] > 0
            engine.clear_prefix_cache()
            engine.pools.check_all_free()
        outputs.append((got, more))
    assert outputs[0] == outputs[1]


# -- GPU -------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_eager_and_graphs_match_hf():
    """Eager, compiled + CUDA graphs (full decode graphs and piecewise), and graphs + speculative
    (chains; draft trees) on the GPU (the Triton lightning kernels), against HF on the CPU. The GPU copy runs its MoE
    experts with transformers' ``batched_mm`` (no host sync, which graph capture refuses; the
    default fp32 path syncs, see tests/test_cuda_graphs.py): the same math."""
    import copy

    from test_cuda_graphs import _assert_greedy_close  # HF-on-CPU oracle with a CPU/GPU near-tie allowance

    cpu_model = build_minimax()
    model = copy.deepcopy(cpu_model).to("cuda")
    model.set_experts_implementation("batched_mm")
    prompts = random_prompts((37, 1, 150, 5, 64, 3), VOCAB, seed=16) + [[5, 9, 14, 3] * 5]
    expected = [hf_greedy_cached(cpu_model, ("minimax", 0), p, MAX_NEW) for p in prompts]
    graphs = dict(compile=True, cuda_graphs=True, cuda_graph_batch_sizes=(1, 4), piecewise_cuda_graph_tokens=(4, 16, 64))
    runs = {"eager": dict(compile=False), "graphs": graphs,
            "graphs+speculative": dict(graphs, speculative=dict(method="ngram", num_draft_tokens=3)),
            # draft trees: full tree verify graphs, the lightning kernel's tree path
            "graphs+tree": dict(graphs, speculative=dict(method="draft_model", draft_model=model, num_draft_tokens=3,
                                                         topk=2))}
    for name, kw in runs.items():
        with make_engine(model, max_running_requests=8, **kw) as engine:
            got = engine.generate_batch(prompts, max_new_tokens=MAX_NEW)
            if name == "graphs+tree":
                assert engine.stats()["speculative"]["verify_steps"] > 0
        for p, g, want in zip(prompts, got, expected):
            _assert_greedy_close(cpu_model, p, g, want, f"minimax {name} GPU")
