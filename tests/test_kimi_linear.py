"""Kimi-Linear (``kimi_linear``) through the engine: Kimi Delta Attention via the ``kda_layer`` op and
multi-head latent attention over a compressed KV cache (hybrid_compile/models/kimi_linear.py).

Greedy tokens equal transformers' own ``generate`` (tests/engine_models.py's oracle) for single
prompts, a continuous batch with chunked prefill, prefix-cache hits (SSM checkpoints every 64
tokens), speculative decoding (the target as its own draft, n-gram drafts) and ``compile=True``
(tests/test_compile_families.py: one graph, zero graph breaks). The MLA layer op, absorbed or expanded, equals HF's own
layer (keys and values expanded per head) on a packed chunked prefill + decode; the KV pool holds one compressed
row per token. Tiny random fp32 model: hidden 64, 4 layers (KDA, MLA, KDA, MLA), MoE, vocab 128.
GPU (``@pytest.mark.gpu``): the eager GPU engine and full + piecewise CUDA graphs equal HF's
tokens on the CPU up to CPU/GPU near-ties.
"""

from __future__ import annotations

import copy
import importlib.util
import pytest
import torch
import transformers

import hybrid_compile as hc
from hybrid_compile.layers.context import ForwardContext, ForwardMetadata, ForwardMode, forward_context

from engine_models import (
    assert_greedy_equal,
    assert_pools_restored,
    hf_greedy_cached,
    make_engine,
    random_prompts,
    single_threaded,
)
from family_parity import check_prefix_cache_hits, check_speculative, make_family
from kimi_models import KV_RANK, ROPE, VOCAB, build_kimi_linear

if not hasattr(transformers, "KimiLinearForCausalLM"):
    pytest.skip(f"transformers {transformers.__version__} has no KimiLinearForCausalLM (added in 5.17)",
                allow_module_level=True)

MAX_NEW = 8
ENGINE_ARGS = dict(max_running_requests=3, chunked_prefill_size=32, max_context_len=320, mamba_cache_size=8)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from single_threaded()


def _model(seed: int = 0, q_lora_rank=None):
    return build_kimi_linear(seed, q_lora_rank)


def _expected(prompts, max_new: int = MAX_NEW, seed: int = 0, q_lora_rank=None):
    model = _model(seed, q_lora_rank)
    return [hf_greedy_cached(model, ("kimi_linear", seed, q_lora_rank), p, max_new) for p in prompts]


KIMI = make_family("kimi_linear", build_kimi_linear,
                   lambda model, p, n: hf_greedy_cached(model, ("kimi_linear", 0, None), p, n), VOCAB)


def _assert_all_equal(prompts, got, expected, what, model=None):
    for i, (p, g, e) in enumerate(zip(prompts, got, expected)):
        assert_greedy_equal(model or _model(), p, g, e, f"kimi_linear {what}: prompt {i} (length {len(p)})")


def test_registered_and_compressed_kv_layout():
    assert "kimi_linear" in hc.supported_model_types()
    with make_engine(_model(), **ENGINE_ARGS) as engine:
        layout = engine.layout
        assert [s.layer_ids for s in layout.mamba] == [(0,), (2,)]
        assert layout.mamba[0].state_shape == (2, 16, 16) and layout.mamba[0].conv_dim == 3 * 2 * 16
        assert [s.layer_ids for s in layout.attention] == [(1,), (3,)]
        spec = layout.attention[0]
        assert spec.k_shape == (1, KV_RANK + ROPE) and spec.v_from_k
        # one compressed row per token and layer: latent + rope key, not K and V per head
        assert engine.pools.kv.bytes_per_token == 2 * (KV_RANK + ROPE) * 4
        k, v = engine.pools.kv.kv_cache(1)
        assert v.shape[1:] == (1, KV_RANK) and v.data_ptr() == k.data_ptr() and v.stride() == k.stride()
        assert len(engine.pools.kv.v_buffers) == 0


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_generate_single_prompts_and_batch_with_chunked_prefill(q_lora_rank):
    """One prompt at a time (150 tokens: five prefill chunks; then a 1-token prompt), then a
    continuous batch of six with chunked prefill (mixed prefill + decode steps). ``q_lora_rank``:
    both of HF's query paths (``q_proj``; ``q_a_proj`` + norm + ``q_b_proj``)."""
    model = _model(0, q_lora_rank)
    prompts = random_prompts((1, 150, 17, 64, 5, 100), VOCAB, seed=11)
    expected = _expected(prompts, q_lora_rank=q_lora_rank)
    with make_engine(model, **ENGINE_ARGS) as engine:
        initial_free = engine.pools.free_counts()
        for i in (1, 0):
            out = engine.generate(torch.tensor([prompts[i]]), max_new_tokens=MAX_NEW)
            _assert_all_equal([prompts[i]], [out[0, len(prompts[i]):].tolist()], [expected[i]], "single", model)
        engine.clear_prefix_cache()  # the batch below starts cold
        got = engine.generate_batch(prompts, max_new_tokens=MAX_NEW)
        stats = engine.stats()
        _assert_all_equal(prompts, got, expected, "batch", model)
        assert stats["decode_steps"] > 0 and stats["extend_steps"] > 0
        assert_pools_restored(engine, initial_free)


def test_prefix_cache_hits_at_checkpoints():
    """Prompts sharing a 140-token prefix: the first one's whole-prompt extend checkpoints its KDA
    states every 64 tokens (the op's chunk states), the later ones continue from the checkpoint at
    128 tokens (and the compressed KV of those tokens); a follow-up of a finished request hits at its
    full length. Greedy tokens equal HF's."""
    stats = check_prefix_cache_hits(KIMI, chunked_prefill_size=256)
    assert stats["checkpoints_tracked"] > 0 and stats["mamba_hits"] >= 3


@pytest.mark.parametrize("method", ["draft_self", "ngram"])
def test_speculative_greedy_equals_hf(method):
    check_speculative(KIMI, method)


def test_page_size_4_matches_hf():
    """Pages of 4 token slots in the KV pool (the compressed rows are paged like any K/V)."""
    model = _model()
    prompts = random_prompts((3, 70, 21), VOCAB, seed=19)
    with make_engine(model, page_size=4, **ENGINE_ARGS) as engine:
        got = engine.generate_batch(prompts, max_new_tokens=MAX_NEW)
    _assert_all_equal(prompts, got, _expected(prompts), "page size 4")


def test_forked_sequences_copy_the_compressed_cache():
    """``SamplingParams(n=2)``: a second sequence starts from copies of the first one's compressed
    KV rows and KDA state (a fork) instead of a prefill; both equal HF's greedy tokens."""
    model = _model()
    prompts = random_prompts((30, 75), VOCAB, seed=18)
    expected = _expected(prompts)
    with make_engine(model, **ENGINE_ARGS) as engine:
        got = engine.generate_batch(prompts, params=hc.SamplingParams(max_new_tokens=MAX_NEW, n=2))
        stats = engine.stats()
    assert stats["forked_requests"] >= 1 and stats["prefill_tokens"] < 2 * 105, stats
    for p, pair, want in zip(prompts, got, expected):
        _assert_all_equal([p, p], pair, [want, want], "n=2")


# -- the MLA layer against HF's own (expanded) layer ----------------------------------------------


def _metadata(mode, lens, prefix, slots):
    """Packed metadata of requests with ``prefix`` cached tokens each and ``lens`` new ones; token
    slot of request b, position p = 1 + 64 * b + p (slot 0 is the pool's dummy)."""
    i32 = dict(dtype=torch.int32)
    qsl = torch.zeros(len(lens) + 1, **i32)
    qsl[1:] = torch.cumsum(torch.tensor(lens), 0)
    seq = [p + n for p, n in zip(prefix, lens)]
    kv_indices = torch.cat([1 + 64 * b + torch.arange(s) for b, s in enumerate(seq)])
    kv_indptr = torch.zeros(len(lens) + 1, **i32)
    kv_indptr[1:] = torch.cumsum(torch.tensor(seq), 0)
    out_loc = torch.cat([1 + 64 * b + torch.arange(p, p + n) for b, (p, n) in enumerate(zip(prefix, lens))])
    return ForwardMetadata(
        mode=mode, positions=torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, lens)]), query_start_loc=qsl,
        seq_lens=torch.tensor(seq, **i32), prefix_lens=torch.tensor(prefix, **i32),
        mamba_cache_indices=torch.tensor(slots, **i32), has_initial_state=torch.tensor([p > 0 for p in prefix]),
        out_cache_loc=out_loc.long(), kv_indptr=kv_indptr, kv_indices=kv_indices.long(),
        logits_indices=qsl[1:].long() - 1, extend_lens_cpu=list(lens), seq_lens_cpu=seq,
    )


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
@torch.inference_mode()
def test_mla_layer_equals_hf_layer_over_chunked_prefill_and_decode(form, monkeypatch):
    """Two requests (37 and 20 tokens) prefilled in two chunks, then one decode step each, through
    the patched layer with a compressed KV pool; every output row equals HF's layer run on that
    request's whole prefix (eager attention, keys/values expanded per head, causal mask). The
    ``mla_layer`` op's extends in either form (the decode step is always absorbed; at these tiny
    dims the cost rule never expands: ``test_real_mla_head_dims_match_hf`` runs it)."""
    from hybrid_compile.layers import attention
    from hybrid_compile.models import kimi_linear

    picked = []
    rule = attention.mla_expands

    def choose(md, *dims):
        assert not rule(md, *dims)  # (2 * rank + rope) - (nope + rope + v) = 0: nothing to save
        picked.append(form == "expanded" and md.mode is ForwardMode.EXTEND)
        return picked[-1]

    monkeypatch.setattr(attention, "mla_expands", choose)

    model = _model(0, 24)
    layer = model.model.layers[1].self_attn
    lens = [38, 21]  # tokens per request (the last one decoded)
    g = torch.Generator().manual_seed(21)
    hidden = [torch.randn(1, n, 64, generator=g) for n in lens]
    want = []
    for h in hidden:
        mask = torch.full((h.shape[1], h.shape[1]), float("-inf")).triu(1)[None, None]
        want.append(type(layer).forward(layer, h, mask)[0])  # HF's own layer, outside an engine step
    k_cache = torch.zeros(2 * 64 + 1, 1, KV_RANK + ROPE)
    caches = {1: (k_cache, k_cache[..., :KV_RANK])}
    got = [[], []]
    steps = ((ForwardMode.EXTEND, [(0, 20), (0, 10)]), (ForwardMode.EXTEND, [(20, 37), (10, 20)]),
             (ForwardMode.DECODE, [(37, 38), (20, 21)]))
    for mode, spans in steps:
        prefix, new = [s for s, _ in spans], [e - s for s, e in spans]
        x = torch.cat([h[0, s:e] for h, (s, e) in zip(hidden, spans)])[None]
        with forward_context(ForwardContext(_metadata(mode, new, prefix, [0, 1]), caches, {})):
            out, _ = kimi_linear.mla_forward(layer, x)
        for r, rows in enumerate(out[0].split(new)):
            got[r].append(rows)
    for b in range(2):
        torch.testing.assert_close(torch.cat(got[b]), want[b][0], atol=2e-5, rtol=2e-5)
    assert picked == {"absorbed": [False] * 3, "expanded": [True, True, False]}[form]
    # opcheck (schema, fake impl, dispatch) of the op in this form, on a fresh prefill of the pool
    k0 = torch.zeros_like(k_cache)
    n = 12
    q = torch.randn(n, 4, 16 + ROPE, generator=g)
    args = (q[..., :16], q[..., 16:], torch.randn(n, KV_RANK, generator=g), torch.randn(n, ROPE, generator=g),
            *kimi_linear._absorbed_weights(layer), 1, 0.25)
    with forward_context(ForwardContext(_metadata(ForwardMode.EXTEND, [n], [0], [0]), {1: (k0, k0[..., :KV_RANK])}, {})):
        torch.library.opcheck(torch.ops.hybrid_compile.mla_layer, args)
    # the pool holds the compressed rows: latent after kv_a_layernorm, then the rope key
    compressed = layer.kv_a_proj_with_mqa(hidden[0][0])
    latent = layer.kv_a_layernorm(compressed[:, :KV_RANK])
    torch.testing.assert_close(k_cache[1:39, 0], torch.cat([latent, compressed[:, KV_RANK:]], -1))


def test_mla_form_rule_at_kimi_48b_dims():
    """The per-step choice at Kimi-Linear-48B's MLA dims (32 heads, nope 128, rope 64, rank 512,
    V 128, bf16): a long prompt chunk expands; decode, a one-token extend over a long context and a
    mixed step whose decode rows bring too much context to rebuild stay absorbed."""
    from hybrid_compile.layers.attention import MLA_EXPAND_MAX_BYTES, mla_expands

    dims = (32, 128, 64, 512, 128, 2)

    def md(mode, lens, prefix):
        return _metadata(mode, lens, prefix, list(range(len(lens))))

    assert mla_expands(md(ForwardMode.EXTEND, [4096], [0]), *dims)
    assert mla_expands(md(ForwardMode.EXTEND, [512], [2048]), *dims)  # 512 queries a context token
    assert not mla_expands(md(ForwardMode.EXTEND, [100], [4000]), *dims)  # ~2.4: rebuilding costs more
    assert not mla_expands(md(ForwardMode.DECODE, [1, 1], [4000, 9]), *dims)
    assert not mla_expands(md(ForwardMode.TARGET_VERIFY, [4, 4], [4000, 4000]), *dims)
    # 8 decode rows of 4k context + a 4k chunk: cheaper expanded, and its 36k rows fit the byte budget
    mixed = md(ForwardMode.EXTEND, [1] * 8 + [4096], [4096] * 8 + [0])
    assert mla_expands(mixed, *dims)
    # 64 such rows: 266k context tokens, 5.4 GB of rebuilt keys and values, over the budget
    crowded = md(ForwardMode.EXTEND, [1] * 64 + [8192], [4096] * 64 + [0])
    assert sum(crowded.seq_lens_cpu) * 32 * 320 * 2 > MLA_EXPAND_MAX_BYTES
    assert not mla_expands(crowded, *dims)


def test_kda_layer_op_extend_decode_against_reference_and_opcheck():
    """``kda_layer`` over a packed extend (slot 2 continues its state, slot 0 starts fresh, a padding
    request) and a decode step: the output and the pools equal the conv op followed by the
    per-token reference of the delta rule with the per-channel gate."""
    from hybrid_compile.ops.reference import gdn as ref

    op = torch.ops.hybrid_compile.kda_layer
    H, D, W, S = 2, 8, 4, 4
    gen = torch.Generator().manual_seed(22)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    weight = r(3 * H * D, W) * 0.5
    conv0, ssm0 = r(S, W - 1, 3 * H * D), r(S, H, D, D) * 0.3
    lens, slots, init = [9, 5, 3], [2, 0, -1], [True, False, False]
    x = r(sum(lens), 3 * H * D)
    g = -torch.rand(sum(lens), H, D, generator=gen)
    beta = torch.rand(sum(lens), H, generator=gen)
    md = _metadata(ForwardMode.EXTEND, lens, [4, 0, 0], slots)
    md.has_initial_state = torch.tensor(init)
    conv, ssm = conv0.clone(), ssm0.clone()
    with forward_context(ForwardContext(md, {}, {0: (conv, ssm)})):
        out = op(x, g, beta, weight, None, 0, H, D, "silu")
    md_fresh = _metadata(ForwardMode.EXTEND, lens, [4, 0, 0], slots)
    md_fresh.has_initial_state = torch.zeros(3, dtype=torch.bool)  # repeated calls give the same output
    with forward_context(ForwardContext(md_fresh, {}, {0: (conv0.clone(), ssm0.clone())})):
        torch.library.opcheck(op, (x, g, beta, weight, None, 0, H, D, "silu"))
    ref_conv, ref_ssm = conv0.clone(), ssm0.clone()
    xc = torch.ops.hybrid_compile.causal_conv1d_fn(x, weight, None, ref_conv, md.query_start_loc,
                                                   md.mamba_cache_indices, md.has_initial_state, "silu")
    q, k, v = xc.view(-1, 3, H, D).unbind(1)
    start = 0
    for n, slot, has in zip(lens, slots, init):
        sl = slice(start, start + n)
        start += n
        if slot < 0:
            assert torch.all(out[sl] == 0)
            continue
        o_ref, states = ref.delta_rule_ref(q[sl], k[sl], v[sl], g[sl], beta[sl], ssm0[slot] if has else None, True, 0.0)
        torch.testing.assert_close(out[sl], o_ref, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(ssm[slot], states[-1], atol=2e-5, rtol=2e-5)
        ref_ssm[slot] = states[-1]
    torch.testing.assert_close(conv, ref_conv)

    # DECODE: one token each for slots 2 and 0
    xd, gd, bd = r(2, 3 * H * D), -torch.rand(2, H, D, generator=gen), torch.rand(2, H, generator=gen)
    md = _metadata(ForwardMode.DECODE, [1, 1], [13, 5], [2, 0])
    with forward_context(ForwardContext(md, {}, {0: (conv, ssm)})):
        out = op(xd, gd, bd, weight, None, 0, H, D, "silu")
    xcd = torch.ops.hybrid_compile.causal_conv1d_update(xd[:, None], ref_conv, weight, None, "silu",
                                                        md.mamba_cache_indices, False, None)[:, 0]
    q, k, v = xcd.view(-1, 3, H, D).unbind(1)
    for row, slot in enumerate((2, 0)):
        o_ref, states = ref.delta_rule_ref(q[row:row + 1], k[row:row + 1], v[row:row + 1], gd[row:row + 1],
                                           bd[row:row + 1], ref_ssm[slot], True, 0.0)
        torch.testing.assert_close(out[row], o_ref[0], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(ssm[slot], states[-1], atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="kda_layer: g must be"):
        op(xd, gd[..., :3], bd, weight, None, 0, H, D, "silu")


def test_kv_cache_fp8_refused_for_compressed_cache():
    with pytest.raises(ValueError, match="fp8"):
        hc.wrap(_model(), kv_cache_dtype="fp8", **ENGINE_ARGS)


def test_fp8_kv_b_proj_refused_by_name():
    from hybrid_compile.models import kimi_linear

    layer = copy.deepcopy(_model().model.layers[1].self_attn)
    layer.kv_b_proj.weight = torch.nn.Parameter(layer.kv_b_proj.weight.to(torch.float8_e4m3fn), requires_grad=False)
    with pytest.raises(NotImplementedError, match="kv_b_proj"):
        kimi_linear._absorbed_weights(layer)


def test_other_kimi_linear_implementation_is_refused_clearly():
    """A ``kimi_linear`` model that is not transformers' own classes (a checkpoint's
    trust_remote_code model) fails at wrap with one clear error."""

    class RemoteKimi(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = transformers.PretrainedConfig()
            self.config.model_type = "kimi_linear"
            self.layer = torch.nn.Linear(4, 4)

    with pytest.raises(ValueError, match="trust_remote_code"):
        hc.wrap(RemoteKimi(), **ENGINE_ARGS)


# -- GPU -------------------------------------------------------------------------------------------


def test_real_mla_head_dims_match_hf(monkeypatch):
    """Kimi-Linear-48B's MLA dims (kv_lora_rank 512, rope 64: attention head dim 576 over the
    compressed cache) with the rest tiny: the prompts' extends run the expanded form (at these dims
    it pays from ~17 new tokens per context token), the decode steps and a short extend the
    absorbed one, and the tokens are HF's."""
    from hybrid_compile.layers import attention

    forms = []
    rule = attention.mla_expands

    def spy(md, *dims):
        forms.append((md.mode, rule(md, *dims)))
        return forms[-1][1]

    monkeypatch.setattr(attention, "mla_expands", spy)
    model = build_kimi_linear(0, None, ("linear_attention", "full_attention"), (512, 64))
    prompts = random_prompts((1, 70, 9), VOCAB, seed=17)
    expected = [hf_greedy_cached(model, ("kimi_linear", "mla512"), p, 4) for p in prompts]
    with make_engine(model, **ENGINE_ARGS) as engine:
        got = engine.generate_batch(prompts, max_new_tokens=4)
        assert engine.layout.attention[0].k_shape == (1, 576)
    _assert_all_equal(prompts, got, expected, "mla 512+64", model)
    assert {(ForwardMode.EXTEND, True), (ForwardMode.EXTEND, False), (ForwardMode.DECODE, False)} <= set(forms), forms


@pytest.mark.gpu
@pytest.mark.parametrize("mla_dims", [(KV_RANK, ROPE), (512, 64)], ids=["tiny-mla", "kimi48b-mla"])
def test_gpu_eager_and_graphs_match_hf(mla_dims):
    """Eager, compiled + CUDA graphs, and graphs + speculative on the GPU; (512, 64) runs the MLA
    attention with the split head dim (576 = 512 + 64) in the Triton kernels. Dense MLPs:
    transformers' fp32 MoE experts may sync with the host, which graph capture refuses (see
    tests/test_cuda_graphs.py)."""
    from test_cuda_graphs import _assert_greedy_close  # HF-on-CPU oracle with a CPU/GPU near-tie allowance

    if importlib.util.find_spec("fla") is not None:
        # transformers binds Kimi-Linear's chunk_kda / fused_recurrent_kda to fla's Triton kernels when fla
        # imports, and those cannot run the oracle's CPU tensors (the GPU suite runs without fla)
        pytest.skip("flash-linear-attention is importable: transformers' Kimi-Linear would run fla's Triton kernels "
                    "on the CPU oracle's tensors")
    cpu_model = build_kimi_linear(0, None, ("linear_attention", "full_attention"), mla_dims, False)
    model = copy.deepcopy(cpu_model).to("cuda")
    prompts = random_prompts((37, 1, 90, 5, 64, 3), VOCAB, seed=16) + [[5, 9, 14, 3] * 5]
    expected = [hf_greedy_cached(cpu_model, ("kimi_linear", "gpu", mla_dims), p, MAX_NEW) for p in prompts]
    graphs = dict(compile=True, cuda_graphs=True, cuda_graph_batch_sizes=(1, 4), piecewise_cuda_graph_tokens=(4, 16, 64))
    runs = {"eager": dict(compile=False), "graphs": graphs,
            "graphs+speculative": dict(graphs, speculative=dict(method="ngram", num_draft_tokens=3))}
    outs = {}
    for name, kw in runs.items():
        with make_engine(model, max_running_requests=8, **kw) as engine:
            outs[name] = engine.generate_batch(prompts, max_new_tokens=MAX_NEW)
    for name in runs:
        for p, got, want in zip(prompts, outs[name], expected):
            _assert_greedy_close(cpu_model, p, got, want, f"kimi_linear {name} GPU")
