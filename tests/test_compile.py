"""torch.compile backend (CPU half of the compile issue): split pass, Inductor pieces, engine wiring.

- The split pass isolates every layer op in its own piece (FX unit test on a small function
  that calls the three layer ops with a hand-built forward context; both the aten-level
  ``make_fx`` graph, which calls op overloads, and Dynamo's graph, which calls op packets).
- ``EngineConfig.compile=True``: greedy tokens equal the eager engine's and HF ``generate``'s
  on the tiny dense Qwen3-Next (single prompts of 1 and 130 tokens, continuous batching with
  chunked prefill), the MoE Qwen3-Next and Qwen3.5; zero graph breaks and one Dynamo graph
  (zero recompiles) across batch sizes 1..5 and varying token counts.
- A graph break fails at wrap time with a clear error.

Inductor's CPU compiles are slow, so each model is compiled once (module-scoped engines).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo

import hybrid_compile as hc
from hybrid_compile.layers.context import ForwardContext, ForwardMetadata, ForwardMode, forward_context
from hybrid_compile.compilation.backend import HybridCompileBackend, piece_key
from hybrid_compile.compilation.split import DEFAULT_SPLITTING_OPS, resolve_op, resolve_ops, split_graph

from engine_models import (
    assert_greedy_equal,
    assert_pools_restored,
    build_model,
    cached_model,
    make_config,
    hf_greedy_cached,
    make_engine,
    random_prompts,
    single_threaded,
    vocab_size,
)

OPS = torch.ops.hybrid_compile


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from single_threaded()


def _graph_breaks() -> dict:
    return dict(torch._dynamo.utils.counters["graph_break"])


# ---------------------------------------------------------------------------------------------
# split pass on a small graph
# ---------------------------------------------------------------------------------------------

N, HQ, HKV, D = 3, 2, 1, 4  # attention
HK, KD, HV, VD, W = 1, 4, 2, 4, 4  # GDN
GDN_CONV = 2 * HK * KD + HV * VD
MH, MP, MG, MS = 2, 4, 1, 4  # Mamba2
M_CONV = MH * MP + 2 * MG * MS


def _small_inputs():
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    return dict(
        x=r(N, 8), wq=r(8, HQ * D), wk=r(8, HKV * D), wv=r(8, HKV * D), wg=r(HQ * D, GDN_CONV), wab=r(HQ * D, 2 * HV),
        gconv=r(GDN_CONV, W), a_log=r(HV), dt_bias=r(HV), wm=r(HV * VD, M_CONV + MH), mconv=r(M_CONV, W),
        m_a_log=r(MH), m_d=r(MH), m_dt_bias=r(MH),
    )


def small_model(x, wq, wk, wv, wg, wab, gconv, a_log, dt_bias, wm, mconv, m_a_log, m_d, m_dt_bias):
    """Glue (matmuls, activations) around one call of each layer op."""
    q, k, v = (x @ wq).view(N, HQ, D), (x @ wk).view(N, HKV, D), (x @ wv).view(N, HKV, D)
    h = OPS.attention_layer(q, k, v, 0, D ** -0.5, -1, 0.0).reshape(N, HQ * D)
    h = torch.nn.functional.silu(h)
    ab = h @ wab
    core = OPS.gdn_layer(h @ wg, ab[:, :HV], ab[:, HV:], gconv, None, a_log, dt_bias, 1, HK, KD, HV, VD, "silu")
    m = core.reshape(N, HV * VD) @ wm
    y = OPS.mamba2_layer(m[:, :M_CONV], m[:, M_CONV:], mconv, None, m_a_log, m_d, m_dt_bias, 2, MH, MP, MG, MS,
                         "silu", 8, 0.0, math.inf, False)
    return y.reshape(N, -1).sum(-1) * 2.0


def _small_context() -> ForwardContext:
    i32 = dict(dtype=torch.int32)
    md = ForwardMetadata(
        mode=ForwardMode.EXTEND,
        positions=torch.arange(N),
        query_start_loc=torch.tensor([0, N], **i32),
        seq_lens=torch.tensor([N], **i32),
        prefix_lens=torch.zeros(1, **i32),
        mamba_cache_indices=torch.zeros(1, **i32),
        has_initial_state=torch.zeros(1, dtype=torch.bool),
        out_cache_loc=torch.arange(1, N + 1),
        kv_indptr=torch.tensor([0, N], **i32),
        kv_indices=torch.arange(1, N + 1, dtype=torch.int32),
        logits_indices=torch.tensor([N - 1]),
        extend_lens_cpu=[N],
        seq_lens_cpu=[N],
        prompt_lens=torch.tensor([N], **i32),
    )
    kv = {0: (torch.zeros(8, HKV, D), torch.zeros(8, HKV, D))}
    mamba = {
        1: (torch.zeros(2, W - 1, GDN_CONV), torch.zeros(2, HV, KD, VD)),
        2: (torch.zeros(2, W - 1, M_CONV), torch.zeros(2, MH, MP, MS)),
    }
    return ForwardContext(md, kv, mamba)


def _run_small(fn, inputs):
    with forward_context(_small_context()):
        return fn(**inputs)


def _check_pieces(items, expected_ops):
    ops = [item.op for item in items if item.is_splitting_op]
    assert ops == expected_ops
    for item in items:
        calls = [n for n in item.graph.graph.nodes if n.op == "call_function"]
        if item.is_splitting_op:
            assert len(calls) == 1, [str(n.target) for n in calls]  # the op alone in its piece
        else:
            assert not any("hybrid_compile" in str(n.target) for n in calls)
    # pieces alternate: compute, op, compute, op, ... compute
    assert [item.is_splitting_op for item in items] == [False, True, False, True, False, True, False]


def test_split_pass_isolates_each_layer_op_in_an_aten_graph():
    from torch.fx.experimental.proxy_tensor import make_fx

    inputs = _small_inputs()
    expected = _run_small(small_model, inputs)
    gm = make_fx(lambda *a: small_model(*a), tracing_mode="fake")(*inputs.values())
    split_gm, items = split_graph(gm)
    _check_pieces(items, [OPS.attention_layer.default, OPS.gdn_layer.default, OPS.mamba2_layer.default])
    with forward_context(_small_context()):
        got = split_gm(*inputs.values())
    torch.testing.assert_close(got, expected)

    # configurable splitting ops: only attention -> op + the compute before and after it
    _, items = split_graph(gm, ["hybrid_compile::attention_layer"])
    assert [item.is_splitting_op for item in items] == [False, True, False]


def test_backend_splits_dynamo_graph_and_runs_op_eagerly():
    inputs = _small_inputs()
    expected = _run_small(small_model, inputs)
    backend = HybridCompileBackend(inductor=False)
    compiled = torch.compile(small_model, backend=backend, fullgraph=True)
    got = _run_small(compiled, inputs)
    torch.testing.assert_close(got, expected)
    _check_pieces(backend.items, [OPS.attention_layer.default, OPS.gdn_layer.default, OPS.mamba2_layer.default])
    assert backend.stats.graphs == 1 and backend.stats.pieces == 4 and backend.stats.splitting_op_calls == 3
    assert backend.stats.split_ops_seen == {
        "hybrid_compile::attention_layer": 1, "hybrid_compile::gdn_layer": 1, "hybrid_compile::mamba2_layer": 1,
    }


def _fx(fn, names):
    """A GraphModule of ``fn`` whose placeholders are called ``names`` (symbolic trace)."""
    gm = torch.fx.symbolic_trace(fn)
    for node, name in zip([n for n in gm.graph.nodes if n.op == "placeholder"], names):
        node.name = node.target = name
    gm.recompile()
    return gm


def test_piece_key_shares_repeated_pieces_only():
    """Two pieces share a compiled callable when their nodes match by position (placeholder names
    aside) and their inputs match in sizes, strides, offset, dtype and storage sharing; a piece with
    a constant (get_attr) shares with none."""
    def f(x, w):
        return torch.relu(x @ w.t()) * 2

    a, b = _fx(f, ["layer1_x", "layer1_w"]), _fx(f, ["layer7_x", "layer7_w"])
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    assert piece_key(a, [x, w]) == piece_key(b, [torch.randn(3, 4), torch.randn(5, 4)])
    assert piece_key(a, [x, w]) != piece_key(b, [torch.randn(3, 4), torch.randn(6, 4)])  # a size
    assert piece_key(a, [x, w]) != piece_key(b, [x, w.double()])  # a dtype
    assert piece_key(a, [x, w]) != piece_key(b, [x, torch.randn(4, 5).t()])  # strides
    packed = torch.randn(10, 4)  # two weights in one storage (the rewrite pass fuses by storage)
    assert piece_key(a, [packed[:3], packed[5:]]) != piece_key(a, [torch.randn(3, 4), torch.randn(5, 4)])
    assert piece_key(a, [x, w]) != piece_key(_fx(lambda x, w: torch.relu(x @ w.t()) * 3, ["x", "w"]), [x, w])

    class WithConstant(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("c", torch.randn(5))

        def forward(self, x, w):
            return x @ w.t() + self.c

    c1, c2 = torch.fx.symbolic_trace(WithConstant()), torch.fx.symbolic_trace(WithConstant())
    assert piece_key(c1, [x, w]) == piece_key(c1, [x, w]) and piece_key(c1, [x, w]) != piece_key(c2, [x, w])

    class Nested(torch.nn.Module):  # a constant of a submodule: a dotted get_attr target
        def __init__(self):
            super().__init__()
            self.inner = WithConstant()

        def forward(self, x, w):
            return x @ w.t() - self.inner.c

    n1, n2 = torch.fx.symbolic_trace(Nested()), torch.fx.symbolic_trace(Nested())
    assert piece_key(n1, [x, w]) == piece_key(n1, [x, w]) and piece_key(n1, [x, w]) != piece_key(n2, [x, w])


def test_repeated_layers_compile_once_and_generate_as_eager(monkeypatch):
    """A 9-layer tiny Qwen3-Next ((GDN, GDN, attention) x 3): 10 pieces, of which the repeated
    layers' share compiled code (``stats()["compile"]["distinct_pieces"]``) and get their fake
    outputs laid out from the first piece of their key instead of a second fake run
    (``laid_out_pieces``; here each also runs and must match: ``verify_reuse``), greedy tokens as
    the eager engine's."""
    from hybrid_compile.compilation.backend import PiecewiseCompiler

    monkeypatch.setattr(PiecewiseCompiler, "verify_reuse", True)
    config = make_config("qwen3_next_dense")
    config.num_hidden_layers = 9
    config.layer_types = ["linear_attention", "linear_attention", "full_attention"] * 3
    config.mlp_only_layers = list(range(9))
    model = build_model("qwen3_next_dense", 0, config)
    prompts = random_prompts((1, 37), vocab_size(model), seed=5)
    with make_engine(model) as eager:
        want = eager.generate_batch(prompts, max_new_tokens=6)
    with make_engine(model, compile=True) as engine:
        assert engine.generate_batch(prompts, max_new_tokens=6) == want
        stats = engine.stats()["compile"]
    assert stats["pieces"] == 10 and 3 <= stats["distinct_pieces"] <= 6, stats
    assert 0 < stats["laid_out_pieces"] <= stats["pieces"] - stats["distinct_pieces"], stats


def test_resolve_splitting_ops():
    assert resolve_ops(None) == tuple(resolve_op(n) for n in DEFAULT_SPLITTING_OPS)
    for name in ("hybrid_compile::gdn_layer", "hybrid_compile.gdn_layer", "hybrid_compile::gdn_layer.default",
                 OPS.gdn_layer, OPS.gdn_layer.default):
        assert resolve_op(name) is OPS.gdn_layer.default
    with pytest.raises(ValueError, match="not a registered operator"):
        resolve_op("hybrid_compile::no_such_layer")
    with pytest.raises(ValueError, match="expected"):
        resolve_op("gdn_layer")


# ---------------------------------------------------------------------------------------------
# engine with compile=True
# ---------------------------------------------------------------------------------------------


def test_config_compile_values():
    cfg = hc.EngineConfig()
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert cfg.compile is None and cfg.resolved_compile(cpu) is False and cfg.resolved_compile(cuda) is True
    assert hc.EngineConfig(compile=True).resolved_compile(cpu) is True
    assert hc.EngineConfig(compile=False).resolved_compile(cuda) is False
    with pytest.raises(ValueError, match="compile"):
        hc.EngineConfig.from_args(compile="yes")


@pytest.fixture(scope="module")
def dense():
    """The tiny dense Qwen3-Next, compiled once for the module."""
    breaks = _graph_breaks()
    model = cached_model("qwen3_next_dense", 0)
    engine = make_engine(model, compile=True)
    yield model, engine, breaks
    engine.close()


def test_eager_engine_reports_compile_off():
    model = cached_model("qwen3_next_dense", 0)
    with make_engine(model) as engine:
        assert engine.stats()["compile"] == {"enabled": False}


def test_compiled_greedy_matches_eager_and_hf(dense):
    model, engine, _ = dense
    key = ("qwen3_next_dense", 0)
    stats = engine.stats()["compile"]
    assert stats["enabled"] and stats["graphs"] == 1 and stats["pieces"] == 4
    assert stats["split_ops_seen"] == {"hybrid_compile::gdn_layer": 2, "hybrid_compile::attention_layer": 1}
    initial = engine.pools.free_counts()
    new = 8
    # single prompts: one token (every step is one request: padded) and one prefilled in 3 chunks
    for seed, length in ((1, 1), (2, 130)):
        (prompt,) = random_prompts([length], vocab_size(model), seed=100 + seed)
        out = engine.generate(torch.tensor([prompt]), max_new_tokens=new)
        assert_greedy_equal(model, prompt, out[0, length:].tolist(), hf_greedy_cached(model, key, prompt, new),
                            f"compiled, len {length}")
    # continuous batching, mixed prefill + decode, chunked prefill
    prompts = random_prompts([37, 1, 90, 5, 64], vocab_size(model), seed=7)
    got = engine.generate_batch(prompts, max_new_tokens=new)
    with make_engine(model) as eager:
        assert eager.generate_batch(prompts, max_new_tokens=new) == got
    for prompt, tokens in zip(prompts, got):
        assert_greedy_equal(model, prompt, tokens, hf_greedy_cached(model, key, prompt, new), "compiled batch")
    assert_pools_restored(engine, initial)
    stats = engine.stats()["compile"]
    assert stats["padded_steps"] > 0 and stats["compiled_steps"] > stats["padded_steps"]


def test_zero_graph_breaks_and_recompiles_across_batch_sizes(dense):
    model, engine, breaks_before = dense
    steps = []
    original = engine.scheduler.schedule

    def schedule(*args, **kwargs):
        batch = original(*args, **kwargs)
        if batch is not None:
            steps.append((len(batch.requests), sum(batch.extend_lens)))
        return batch

    engine.scheduler.schedule = schedule
    try:
        for b in range(1, 6):
            prompts = random_prompts([3 + 11 * i for i in range(b)], vocab_size(model), seed=200 + b)
            engine.generate_batch(prompts, max_new_tokens=3)
    finally:
        engine.scheduler.schedule = original
    assert {bs for bs, _ in steps} == {1, 2, 3, 4, 5}
    assert len({n for _, n in steps}) > 5  # many token counts
    stats = engine.stats()["compile"]
    assert stats["graphs"] == 1 and stats["recompiles"] == 0 and stats["recompile_reasons"] == [], stats
    assert stats["graph_breaks"] == 0
    assert _graph_breaks() == breaks_before
    assert stats["compile_seconds"] > 0 and stats["warmup_seconds"] >= stats["compile_seconds"]


def test_recompile_reasons_name_the_failed_guard_of_one_forward():
    """``stats()["compile"]["recompile_reasons"]``: Dynamo's first failed guard per recompile of the code
    named by the runner (its own code copy), none of another code's."""
    from hybrid_compile.engine.graph_setup import _own_code_copy, _recompile_reasons

    def double(x):
        return x * 2

    fns = [torch.compile(_own_code_copy(double, f"recompile_reasons_test_{i}"), backend="eager", dynamic=False)
           for i in range(2)]
    fns[0](torch.ones(3))
    fns[0](torch.ones(4))  # a static size: a recompile
    fns[1](torch.ones(3))
    (reason,) = _recompile_reasons("recompile_reasons_test_0")
    assert "size mismatch" in reason and "expected 3, actual 4" in reason, reason
    assert _recompile_reasons("recompile_reasons_test_1") == []


@pytest.mark.parametrize("kind", ["qwen3_next_moe", "qwen3_5"])
def test_compiled_other_kinds_match_hf(kind):
    """The MoE Qwen3-Next traces in one graph too (transformers' MoE block has no graph break
    here), and Qwen3.5 (interleaved-MRoPE rotary)."""
    model = cached_model(kind, 0)
    prompts = random_prompts([1, 20, 70], vocab_size(model), seed=11)
    new = 5
    with make_engine(model, compile=True) as engine:
        got = engine.generate_batch(prompts, max_new_tokens=new)
        out = engine.generate(torch.tensor([prompts[1]]), max_new_tokens=new)
        stats = engine.stats()["compile"]
    assert out[0, len(prompts[1]):].tolist() == got[1]
    for prompt, tokens in zip(prompts, got):
        assert_greedy_equal(model, prompt, tokens, hf_greedy_cached(model, (kind, 0), prompt, new), kind)
    assert stats["graphs"] == 1 and stats["recompiles"] == 0 and stats["graph_breaks"] == 0, stats


def test_graph_break_fails_at_wrap_with_clear_error():
    model = build_model("qwen3_next_dense", 0)  # a private instance: it is modified
    norm = model.model.norm
    original = norm.forward

    def breaking_forward(hidden_states):
        torch._dynamo.graph_break()
        return original(hidden_states)

    norm.forward = breaking_forward
    # the message keeps Dynamo's explanation and where the break is (the function it would not trace)
    with pytest.raises(RuntimeError, match=r"graph break: .*; Explanation: .*; at File .*test_compile\.py\", "
                       r"line \d+, in breaking_forward.*compile=False"):
        make_engine(model, compile=True)


def test_split_keeps_each_functional_collective_with_its_wait():
    """Tensor parallelism's functional all-reduce stays inside a compute piece with its wait (each
    piece's CUDA graph captures its NCCL collectives); a wait cut off by a splitting op is refused."""
    c10d = torch.ops._c10d_functional

    def waited(x):
        y = c10d.wait_tensor.default(c10d.all_reduce.default(x * 2, "sum", "0"))
        return torch.ops.aten.relu.default(y) + 1

    def cut(x):
        pending = c10d.all_reduce.default(x * 2, "sum", "0")
        y = torch.ops.aten.relu.default(x)
        return c10d.wait_tensor.default(pending) + y

    split_gm, items = split_graph(torch.fx.symbolic_trace(waited), ["aten::relu"])
    assert [item.is_splitting_op for item in items] == [False, True, False]
    first = [str(n.target) for n in items[0].graph.graph.nodes if n.op == "call_function"]
    assert any("all_reduce" in t for t in first) and any("wait_tensor" in t for t in first), first
    with pytest.raises(AssertionError, match="all_reduce unwaited"):
        split_graph(torch.fx.symbolic_trace(cut), ["aten::relu"])
