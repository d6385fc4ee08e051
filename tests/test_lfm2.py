"""LFM2 families (``lfm2``, ``lfm2_moe``) through the engine and the ``short_conv_layer`` op.

Greedy tokens equal transformers' own ``generate`` (tests/engine_models.py's oracle) for single
prompts, a continuous batch with chunked prefill, prefix-cache hits (conv-window checkpoints),
speculative decoding (the target as its own draft, n-gram drafts) and ``compile=True``; the layer
op matches a brute-force depthwise conv over each whole sequence in every forward mode and passes
``torch.library.opcheck``. Tiny random fp32 models: hidden 32, 4 layers mixing short conv and
full attention, vocab 128. GPU (``@pytest.mark.gpu``): the Triton path compiled with full +
piecewise CUDA graphs gives the eager GPU engine's tokens; those, and speculative decoding's under
graphs, equal HF's on the CPU up to CPU/GPU near-ties.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
import transformers

import hybrid_compile as hc
from hybrid_compile.layers.context import ForwardContext, ForwardMetadata, ForwardMode, forward_context
from hybrid_compile.memory import MambaLayerSpec
from hybrid_compile.models import FAMILIES

from engine_models import (
    INIT_STD,
    PAD_TOKEN_ID,
    assert_greedy_equal,
    assert_pools_restored,
    hf_greedy_cached,
    make_engine,
    random_prompts,
    record_prefix_hits,
    single_threaded,
)

VOCAB = 128
MAX_NEW = 8
LAYER_TYPES = ["conv", "full_attention", "conv", "conv"]
ENGINE_ARGS = dict(max_running_requests=3, chunked_prefill_size=32, max_context_len=320, mamba_cache_size=8)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from single_threaded()


def _common(conv_bias: bool) -> dict:
    return dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=len(LAYER_TYPES),
        layer_types=list(LAYER_TYPES), num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        conv_L_cache=3, conv_bias=conv_bias, initializer_range=INIT_STD, tie_word_embeddings=False,
        pad_token_id=PAD_TOKEN_ID, bos_token_id=None, eos_token_id=None,
    )


def _build(kind: str, seed: int):
    if kind == "lfm2":  # conv_bias on: the op's bias path (LFM2 checkpoints ship without it)
        config = transformers.Lfm2Config(**_common(True), block_auto_adjust_ff_dim=False)
        cls = transformers.Lfm2ForCausalLM
    else:
        if not hasattr(transformers, "Lfm2MoeForCausalLM"):
            pytest.skip(f"transformers {transformers.__version__} has no Lfm2MoeForCausalLM")
        config = transformers.Lfm2MoeConfig(
            **_common(False), moe_intermediate_size=32, num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
        )
        cls = transformers.Lfm2MoeForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config).float().eval()
    model.generation_config.do_sample = False
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    return model


@functools.lru_cache(maxsize=None)
def _model(kind: str, seed: int = 0):
    return _build(kind, seed)


def _expected(kind: str, prompts, max_new: int = MAX_NEW, seed: int = 0):
    model = _model(kind, seed)
    return [hf_greedy_cached(model, (kind, seed), p, max_new) for p in prompts]


def _assert_all_equal(kind, prompts, got, expected, what):
    for i, (p, g, e) in enumerate(zip(prompts, got, expected)):
        assert_greedy_equal(_model(kind), p, g, e, f"{kind} {what}: prompt {i} (length {len(p)})")


def test_registered_and_layout():
    assert {"lfm2", "lfm2_moe"} <= set(hc.supported_model_types())
    model = _model("lfm2")
    with make_engine(model, **ENGINE_ARGS) as engine:
        assert [s.layer_ids for s in engine.layout.attention] == [(1,)]
        assert [s.layer_ids for s in engine.layout.mamba] == [(0,), (2,), (3,)]
        spec = engine.layout.mamba[0]
        assert spec.state_shape == () and not spec.has_ssm_state and spec.conv_window_shape == (2, 32)
        assert engine.layout.ssm_chunk_size == FAMILIES["lfm2"].SHORT_CONV_CHECKPOINT_ALIGN
        assert engine.pools.mamba.ssm(0).numel() == 0  # conv-only: no SSM state


@pytest.mark.parametrize("kind", ["lfm2", "lfm2_moe"])
def test_generate_single_prompts_and_batch_with_chunked_prefill(kind):
    """One prompt at a time (150 tokens: five prefill chunks; then a 1-token prompt), then a
    continuous batch of seven with chunked prefill (mixed prefill + decode steps)."""
    model = _model(kind)
    prompts = random_prompts((1, 150, 17, 64, 5, 33, 100), VOCAB, seed=11)
    expected = _expected(kind, prompts)
    with make_engine(model, **ENGINE_ARGS) as engine:
        initial_free = engine.pools.free_counts()
        for i in (1, 0):
            out = engine.generate(torch.tensor([prompts[i]]), max_new_tokens=MAX_NEW)
            _assert_all_equal(kind, [prompts[i]], [out[0, len(prompts[i]):].tolist()], [expected[i]], "single")
        engine.clear_prefix_cache()  # the batch below starts cold
        got = engine.generate_batch(prompts, max_new_tokens=MAX_NEW)
        stats = engine.stats()
        _assert_all_equal(kind, prompts, got, expected, "batch")
        assert stats["decode_steps"] > 0 and stats["extend_steps"] > 0
        assert_pools_restored(engine, initial_free)


def test_prefix_cache_hits_at_checkpoints():
    """Prompts sharing a 140-token prefix: the first request's extend checkpoints its conv windows
    every 64 tokens (no SSM state to track), the later ones continue from the checkpoint at 128;
    a follow-up of a finished request hits at its full length. Greedy tokens equal HF's."""
    model = _model("lfm2")
    base, a, b, c = random_prompts((140, 9, 20, 3), VOCAB, seed=12)
    first = [base + a]
    second = [base + b, base + c]
    with make_engine(model, **ENGINE_ARGS) as engine:
        initial_free = engine.pools.free_counts()
        hits = record_prefix_hits(engine)
        got_first = engine.generate_batch(first, max_new_tokens=MAX_NEW)
        got_second = engine.generate_batch(second, max_new_tokens=MAX_NEW)
        follow = [first[0] + got_first[0]]
        got_follow = engine.generate_batch(follow, max_new_tokens=MAX_NEW // 2)
        stats = engine.stats()["prefix_cache"]
        assert_pools_restored(engine, initial_free)
    _assert_all_equal("lfm2", first + second, got_first + got_second, _expected("lfm2", first + second), "prefix")
    _assert_all_equal("lfm2", follow, got_follow, _expected("lfm2", follow, MAX_NEW // 2), "follow-up")
    assert hits[0] == 0 and hits[1:3] == [128, 128], hits
    assert hits[3] == len(follow[0]) - 1, hits  # the finished request: all its tokens but the last sampled one
    assert stats["checkpoints_tracked"] > 0 and stats["mamba_hits"] >= 3


def _speculative(method: str, model) -> dict:
    if method == "draft_self":
        return dict(method="draft_model", draft_model=model, num_draft_tokens=3)
    return dict(method="ngram", num_draft_tokens=3, ngram_max=3, ngram_min=1)


@pytest.mark.parametrize("kind, method", [("lfm2", "draft_self"), ("lfm2", "ngram"), ("lfm2_moe", "draft_self")])
def test_speculative_greedy_equals_hf(kind, method):
    model = _model(kind)
    prompts = random_prompts((1, 40, 9), VOCAB, seed=13)
    prompts.append((prompts[2] * 5)[:37])  # a repeated pattern: n-gram lookup finds drafts in it
    expected = _expected(kind, prompts)
    with make_engine(model, speculative=_speculative(method, model), **ENGINE_ARGS) as engine:
        initial_free = engine.pools.free_counts()
        got = engine.generate_batch(prompts, max_new_tokens=MAX_NEW)
        _assert_all_equal(kind, prompts, got, expected, method)
        # continuations hit the prefix cache at the finished requests' length: the windows the
        # speculative commits left there are exact
        follow = [p + g for p, g in zip(prompts, got)]
        got = engine.generate_batch(follow, max_new_tokens=MAX_NEW // 2)
        _assert_all_equal(kind, follow, got, _expected(kind, follow, MAX_NEW // 2), f"{method} cached")
        stats = engine.stats()
        assert_pools_restored(engine, initial_free)
    spec = stats["speculative"]
    assert spec["verify_steps"] > 0 and stats["prefix_cache"]["hit_tokens"] > 0
    if method == "draft_self":
        assert spec["acceptance_rate"] == 1.0


@pytest.mark.parametrize("kind", ["lfm2", "lfm2_moe"])
def test_compiled_engine_matches_hf_with_zero_graph_breaks(kind):
    """CPU Inductor is slow: one engine, three prompts with chunked prefill, few tokens."""
    model = _model(kind)
    prompts = random_prompts((1, 40, 70), VOCAB, seed=14)
    expected = _expected(kind, prompts, 4)
    with make_engine(model, compile=True, max_running_requests=3, chunked_prefill_size=32, max_context_len=256,
                     mamba_cache_size=12) as engine:
        got = engine.generate_batch(prompts, max_new_tokens=4)
        stats = engine.stats()["compile"]
    _assert_all_equal(kind, prompts, got, expected, "compiled")
    assert stats["graphs"] == 1 and stats["recompiles"] == 0 and stats["graph_breaks"] == 0, stats
    # the graph is split at every layer op: three short convs and one attention layer
    assert stats["split_ops_seen"] == {"hybrid_compile::short_conv_layer": 3, "hybrid_compile::attention_layer": 1}


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["lfm2", "lfm2_moe"])
def test_gpu_graphs_and_speculative_match_eager_and_hf(kind):
    """fp32 on the GPU, CUDA graphs (full and piecewise) and speculative decoding. ``lfm2_moe``'s fp32
    experts run our fused MoE op (the default on CUDA), which holds no host sync (transformers' fp32
    experts forward does, which graph capture refuses: tests/test_cuda_graphs.py)."""
    from test_cuda_graphs import _assert_greedy_close  # HF-on-CPU oracle with a CPU/GPU near-tie allowance

    cpu_model = _model(kind)
    model = copy.deepcopy(cpu_model).to("cuda")
    prompts = random_prompts((37, 1, 90, 5, 64, 3), VOCAB, seed=16) + [[5, 9, 14, 3] * 5]
    expected = _expected(kind, prompts)
    graphs = dict(compile=True, cuda_graphs=True, cuda_graph_batch_sizes=(1, 4), piecewise_cuda_graph_tokens=(4, 16, 64))
    runs = {
        "eager": dict(compile=False),
        "graphs": graphs,
        "graphs+speculative": dict(graphs, speculative=_speculative("draft_self", model)),
    }
    outs, stats = {}, {}
    for name, kw in runs.items():
        with make_engine(model, max_running_requests=8, **kw) as engine:
            initial_free = engine.pools.free_counts()
            outs[name] = engine.generate_batch(prompts, max_new_tokens=MAX_NEW)
            stats[name] = engine.stats()
            assert_pools_restored(engine, initial_free)
    for name in ("eager", "graphs+speculative"):  # verify runs other kernels than decode: near-ties may flip
        for p, got, want in zip(prompts, outs[name], expected):
            _assert_greedy_close(cpu_model, p, got, want, f"{kind} {name} GPU")
    assert outs["graphs"] == outs["eager"], outs  # the same kernels per step, replayed
    c = stats["graphs"]["compile"]
    assert c["graphs"] == 1 + c["one_token_graph"] and c["recompiles"] == 0 and c["graph_breaks"] == 0, c
    assert c["cuda_graph_replays"] > 0 and c["piecewise_replays"] > 0, c
    assert stats["graphs+speculative"]["speculative"]["verify_steps"] > 0
    assert (stats["graphs"]["fused_moe_modules"] > 0) == (kind == "lfm2_moe"), stats["graphs"]["fused_moe_modules"]


# -- the layer op against a brute-force conv ------------------------------------------------------

D, W = 16, 4


def _brute_force(window: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor):
    """Depthwise causal conv of ``x [L, D]`` after the window ``[W-1, D]`` -> (out ``[L, D]``,
    the window after the last token)."""
    seq = torch.cat([window, x])
    out = F.conv1d(seq.T[None], weight[:, None], bias, groups=D)[0].T
    return out, seq[-(W - 1):]


def _metadata(mode, lens, slots, has_state, draft_len=0):
    i32 = dict(dtype=torch.int32)
    lens_t = torch.tensor(lens, **i32)
    qsl = torch.zeros(len(lens) + 1, **i32)
    qsl[1:] = torch.cumsum(lens_t, 0)
    return ForwardMetadata(
        mode=mode, positions=torch.cat([torch.arange(n) for n in lens]), query_start_loc=qsl, seq_lens=lens_t,
        prefix_lens=torch.zeros(len(lens), **i32), mamba_cache_indices=torch.tensor(slots, **i32),
        has_initial_state=torch.tensor(has_state), out_cache_loc=torch.zeros(0, dtype=torch.int64),
        kv_indptr=torch.zeros(len(lens) + 1, **i32), kv_indices=torch.zeros(0, dtype=torch.int64),
        logits_indices=qsl[1:].long() - 1, extend_lens_cpu=list(lens), seq_lens_cpu=list(lens), draft_len=draft_len,
    )


def test_short_conv_layer_op_every_mode_and_opcheck():
    op = torch.ops.hybrid_compile.short_conv_layer
    g = torch.Generator().manual_seed(15)
    r = lambda *s: torch.randn(*s, generator=g)
    weight, bias = r(D, W), r(D)
    window0 = r(4, W - 1, D)  # slot 3 starts from this window, the others from zeros
    conv = window0.clone()
    empty_ssm = torch.zeros(4, 0)

    # EXTEND: slot 3 continues its window, slot 1 starts fresh, a padding request (-1) is skipped;
    # slot 0 receives slot 1's checkpoint after 5 tokens (prefix-cache tracking)
    lens, slots = [7, 12, 3], [3, 1, -1]
    x = r(sum(lens), D)
    md = _metadata(ForwardMode.EXTEND, lens, slots, [True, False, False])
    md.track_slots, md.track_lens, md.has_tracking = torch.tensor([-1, 0, -1]), torch.tensor([-1, 5, -1]), True
    with forward_context(ForwardContext(md, {}, {0: (conv, empty_ssm)})):
        out = op(x, weight, bias, 0)
    ref3, win3 = _brute_force(window0[3], x[:7], weight, bias)
    ref1, win1 = _brute_force(torch.zeros(W - 1, D), x[7:19], weight, bias)
    torch.testing.assert_close(out[:7], ref3)
    torch.testing.assert_close(out[7:19], ref1)
    assert torch.all(out[19:] == 0)
    torch.testing.assert_close(conv[3], win3)
    torch.testing.assert_close(conv[1], win1)
    torch.testing.assert_close(conv[0], _brute_force(torch.zeros(W - 1, D), x[7:12], weight, bias)[1])

    # DECODE: one token for slots 1 and 3
    xd = r(2, D)
    with forward_context(ForwardContext(_metadata(ForwardMode.DECODE, [1, 1], [1, 3], [True, True]), {},
                                        {0: (conv, empty_ssm)})):
        out = op(xd, weight, bias, 0)
    for row, (slot, window) in enumerate(((1, win1), (3, win3))):
        ref, new_window = _brute_force(window, xd[row:row + 1], weight, bias)
        torch.testing.assert_close(out[row:row + 1], ref)
        torch.testing.assert_close(conv[slot], new_window)

    # TARGET_VERIFY: 3 steps for slots 3 and 1, the main windows untouched, the window after every
    # step in the intermediate buffer (rows = batch rows); a trailing 2-token filler request stays zero
    steps, before = 3, conv.clone()
    xv = r(2 * steps + 2, D)
    md = _metadata(ForwardMode.TARGET_VERIFY, [steps, steps, 2], [3, 1, -1], [True, True, False], draft_len=steps)
    inter = torch.zeros(3, steps, W - 1, D)
    with forward_context(ForwardContext(md, {}, {0: (conv, empty_ssm)}, {0: (inter, torch.zeros(3, steps, 0))})):
        out = op(xv, weight, bias, 0)
        torch.library.opcheck(op, (xv, weight, bias, 0))  # (the main windows stay untouched)
    assert torch.equal(conv, before)
    for row, slot in enumerate((3, 1)):
        tokens = xv[row * steps:(row + 1) * steps]
        ref, _ = _brute_force(before[slot], tokens, weight, bias)
        torch.testing.assert_close(out[row * steps:(row + 1) * steps], ref)
        for s in range(steps):
            torch.testing.assert_close(inter[row, s], _brute_force(before[slot], tokens[: s + 1], weight, bias)[1])
    assert torch.all(out[2 * steps:] == 0)

    # opcheck in EXTEND without initial state (repeated calls give the same output)
    md = _metadata(ForwardMode.EXTEND, [5, 4], [0, 2], [False, False])
    with forward_context(ForwardContext(md, {}, {0: (conv, empty_ssm)})):
        torch.library.opcheck(op, (r(9, D), weight, None, 0))


def test_short_conv_layer_rejects_bad_shapes_and_verify_without_buffers():
    op = torch.ops.hybrid_compile.short_conv_layer
    with pytest.raises(ValueError, match="short_conv_layer"):
        op(torch.randn(3, D + 1), torch.randn(D, W), None, 0)
    md = _metadata(ForwardMode.TARGET_VERIFY, [2, 2], [0, 1], [True, True], draft_len=2)
    with forward_context(ForwardContext(md, {}, {0: (torch.zeros(2, W - 1, D), torch.zeros(2, 0))})):
        with pytest.raises(RuntimeError, match="speculative buffers"):
            op(torch.randn(4, D), torch.randn(D, W), None, 0)
    assert MambaLayerSpec(0, W, D, (), torch.float32).bytes_per_slot == (W - 1) * D * 4
