"""The fused MoE experts patch (hybrid_compile/models/fused_experts.py, ``EngineConfig.fused_moe``) end to end.

Oracle: transformers' own greedy ``generate`` on the same weights (computed on the wrapped model, where
outside an engine step the experts run transformers' forward: the fused path must not be taken there).
The softmax top-k routers (hybrid_compile/models/fused_router.py, the same option) of Qwen3-Next, Qwen3.5-MoE,
Granite-4, Jamba and MiniMax run ``moe_topk_softmax`` in engine steps; NemotronH's, LFM2-MoE's and Kimi-Linear's
(sigmoid / biased / grouped routers) stay transformers'. Oracle for a router: its own transformers forward.
Families: every one with transformers' 3-D experts: Qwen3-Next MoE and Qwen3.5-MoE (gated silu experts +
shared expert), NemotronH (relu2 experts without a gate, beside Mamba2 and attention layers), Granite-4
(GraniteMoeHybrid), LFM2-MoE, Jamba, MiniMax and Kimi-Linear (skipped where transformers lacks them). Also the option's resolution
(False, the default, = transformers' path) and its errors, and ``close()`` restoring transformers' forward.
"""

from __future__ import annotations

import pytest
import torch

import engine_models as em
import kimi_models
import mamba1_models as m1
import mamba2_models as mm
import minimax_models
import test_lfm2 as lfm2
from hybrid_compile.models import PatchHandle, fused_experts, fused_router, shared_expert_fold

NEW_TOKENS = 8



def _kimi_linear():
    kimi_models.require_kimi_linear()
    return kimi_models.build_kimi_linear()


def _minimax():
    minimax_models.require_minimax()
    return minimax_models.build_minimax()


MODELS = {
    "qwen3_next_moe": lambda: em.build_model("qwen3_next_moe"),
    "qwen3_5_moe": lambda: em.build_model("qwen3_5_moe"),
    "nemotron_h": mm.build_nemotron_h,
    "granitemoehybrid": mm.build_granitemoehybrid,
    "lfm2_moe": lambda: lfm2._build("lfm2_moe", 0),
    "jamba": m1.build_jamba,
    "minimax": _minimax,
    "kimi_linear": _kimi_linear,
}


# families whose router is a softmax top-k (patched); the others keep transformers' router
SOFTMAX_ROUTER_FAMILIES = {"qwen3_next_moe", "qwen3_5_moe", "granitemoehybrid", "jamba", "minimax"}


GROUPED_ROUTER_FAMILIES = {"nemotron_h", "kimi_linear"}  # sigmoid group-limited routers


def _expected_routers(name, model):
    """Routers the fused path patches: every softmax and sigmoid group-limited router; 0 for the other
    families (LFM2-MoE), and for Jamba in transformers 5.17 (its router is a plain nn.Linear there, no
    router module)."""
    n = len(fused_router.fused_routers(model))
    if name in SOFTMAX_ROUTER_FAMILIES | GROUPED_ROUTER_FAMILIES and name != "jamba":
        assert n > 0, name
    if name not in SOFTMAX_ROUTER_FAMILIES | GROUPED_ROUTER_FAMILIES:
        assert n == 0 and any(type(m).__name__ in fused_router.OTHER_ROUTERS for m in model.modules()), name
    return n


def _count_calls(monkeypatch, modules, names) -> list[int]:
    """Replace ``module.name`` of each of ``modules`` and ``names`` by a wrapper counting its calls; the
    count (all of them together) is ``[n]``."""
    calls = [0]
    for module in modules if isinstance(modules, tuple) else (modules,):
        for name in names if isinstance(names, tuple) else (names,):
            real = getattr(module, name)

            def counting(*args, real=real, **kwargs):
                calls[0] += 1
                return real(*args, **kwargs)

            monkeypatch.setattr(module, name, counting)
    return calls


@pytest.fixture
def router_calls(monkeypatch):
    """Counts calls of the router ops from the patched routers (engine steps only)."""
    return _count_calls(monkeypatch, fused_router, ("moe_topk_softmax", "moe_topk_sigmoid_grouped"))


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from em.single_threaded()


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts calls of the fused experts forward (engine steps only): the experts modules' and, where
    a block's shared expert folds into its routed experts, the block's."""
    return _count_calls(monkeypatch, (fused_experts, shared_expert_fold), "fused_moe_experts")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fused_experts_greedy_tokens_equal_hf(name, fused_calls, router_calls):
    model = MODELS[name]()
    prompts = em.random_prompts([13, 3, 40], em.vocab_size(model), seed=5)
    n_routers = _expected_routers(name, model)
    engine = em.make_engine(model, fused_moe=True)
    try:
        n_experts = sum(1 for _, m in fused_experts.experts_modules(model))
        assert engine.stats()["fused_moe_modules"] == n_experts > 0
        assert engine.stats()["fused_moe_routers"] == n_routers
        assert all("forward" in m.__dict__ for _, m in fused_router.fused_routers(model))
        got = engine.generate_batch(prompts, max_new_tokens=NEW_TOKENS)
        assert fused_calls[0] > 0
        assert (router_calls[0] > 0) == (n_routers > 0)
        before = fused_calls[0], router_calls[0]
        # outside an engine step the patched experts and routers run transformers' forward
        expected = [em.hf_greedy(model, p, NEW_TOKENS) for p in prompts]
        assert (fused_calls[0], router_calls[0]) == before
    finally:
        engine.close()
    for p, g, e in zip(prompts, got, expected):
        em.assert_greedy_equal(model, p, g, e, what=f"{name} fused_moe")
    assert all("forward" not in m.__dict__ for _, m in fused_experts.experts_modules(model))  # close() undid it
    assert all("forward" not in m.__dict__ for _, m in fused_router.fused_routers(model))


@pytest.mark.parametrize("name", sorted(SOFTMAX_ROUTER_FAMILIES))
def test_patched_router_returns_transformers_outputs(name, monkeypatch):
    """Inside an engine step a patched router returns transformers' tuple: same order, shapes and dtypes
    (also for bf16 weights), the same experts, the same logits, weights to rounding."""
    import copy

    model = copy.deepcopy(MODELS[name]())  # (its router is cast to bf16 below: builders may share their models)
    routers = fused_router.softmax_routers(model)
    if not routers:
        pytest.skip(f"{name}: this transformers has no softmax router module (Jamba in 5.17)")
    handle = PatchHandle()
    monkeypatch.setattr(fused_router, "get_forward_context", lambda: object())  # as in an engine step
    for dtype in (torch.float32, torch.bfloat16):
        _, router = routers[0]
        router.to(dtype)
        assert fused_router.install_fused_routers(model, handle, True) == len(routers)
        x = torch.randn(7, router.weight.shape[1], generator=torch.Generator().manual_seed(3)).to(dtype)
        got, expected = router(x), type(router).forward(router, x)
        handle.undo()
        assert "forward" not in router.__dict__
        assert len(got) == len(expected) == 3
        for g, e in zip(got, expected):
            assert (g.shape, g.dtype) == (e.shape, e.dtype)
            if e.dtype == torch.int64:
                assert torch.equal(g, e)
            else:
                tol = 1e-6 if g.dtype == torch.float32 else 1e-2
                torch.testing.assert_close(g, e, atol=tol, rtol=tol)
    assert fused_router.install_fused_routers(model, handle, False) == 0


@pytest.mark.parametrize("name", sorted(GROUPED_ROUTER_FAMILIES))
def test_patched_grouped_router_returns_transformers_outputs(name, monkeypatch):
    """Inside an engine step a patched sigmoid group-limited router returns transformers' tuple (same
    order, shapes and dtypes, also for bf16 weights): the same logits, the same experts (transformers'
    ``topk(sorted=False)`` promises no order: compared as sets) with their weights to rounding."""
    import copy

    model = copy.deepcopy(MODELS[name]())
    routers = fused_router.fused_routers(model)
    assert routers and all(type(m).__name__ in fused_router.GROUPED_ROUTERS for _, m in routers)
    handle = PatchHandle()
    monkeypatch.setattr(fused_router, "get_forward_context", lambda: object())  # as in an engine step
    for dtype in (torch.float32, torch.bfloat16):
        _, router = routers[0]
        router.to(dtype)
        with torch.no_grad():  # a bias that changes the choice (the builders leave it at zero)
            router.e_score_correction_bias.copy_(torch.randn(router.e_score_correction_bias.shape,
                                                             generator=torch.Generator().manual_seed(4)) * 0.3)
        assert fused_router.install_fused_routers(model, handle, True) == len(routers)
        x = torch.randn(7, router.weight.shape[1], generator=torch.Generator().manual_seed(3)).to(dtype)
        got, expected = router(x), type(router).forward(router, x)
        handle.undo()
        assert "forward" not in router.__dict__
        assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in expected]
        torch.testing.assert_close(got[0], expected[0], atol=1e-6, rtol=1e-6)
        order, hf_order = got[2].argsort(-1), expected[2].argsort(-1)
        assert torch.equal(got[2].gather(1, order), expected[2].gather(1, hf_order))
        torch.testing.assert_close(got[1].gather(1, order), expected[1].gather(1, hf_order), atol=1e-6, rtol=1e-5)


def test_router_tuple_order_of_transformers_5_17_granite(monkeypatch):
    """transformers 5.17's Granite-4 router returns ``(index, weights, logits)`` (5.24: the reverse):
    the install-time probe finds the order and the patched forward returns it."""
    import copy

    model = copy.deepcopy(MODELS["granitemoehybrid"]())  # (its router's class is replaced below)
    router = fused_router.softmax_routers(model)[0][1]
    base = type(router)

    class GraniteMoeHybridTopKRouter(base):  # 5.17's forward, the class name the patch looks up
        def forward(self, hidden_states):
            router_logits = torch.nn.functional.linear(hidden_states, self.weight).float()
            top_k_logits, top_k_index = router_logits.topk(self.top_k, dim=-1)
            top_k_weights = torch.softmax(top_k_logits, dim=-1).type_as(hidden_states)
            return top_k_index, top_k_weights, router_logits

    router.__class__ = GraniteMoeHybridTopKRouter
    monkeypatch.setattr(fused_router, "get_forward_context", lambda: object())
    handle = PatchHandle()
    assert fused_router.install_fused_routers(router, handle, True) == 1
    x = torch.randn(5, router.weight.shape[1])
    (gi, gw, gl), (ei, ew, el) = router(x), GraniteMoeHybridTopKRouter.forward(router, x)
    handle.undo()
    assert gi.dtype == torch.int64 and torch.equal(gi, ei) and torch.equal(gl, el)
    torch.testing.assert_close(gw, ew, atol=1e-6, rtol=1e-6)
    # a router whose outputs are not the (logits, weights, index) the patch reproduces: a clear error
    monkeypatch.setattr(GraniteMoeHybridTopKRouter, "forward", lambda self, h: (h, h))
    with pytest.raises(ValueError, match=r"EngineConfig.fused_moe: GraniteMoeHybridTopKRouter returned .* use fused_moe=False"):
        fused_router.install_fused_routers(router, handle, True)
    assert "forward" not in router.__dict__


def test_option_resolution_and_errors(fused_calls):
    model = MODELS["qwen3_next_moe"]()
    for options in ({}, dict(fused_moe=False)):  # the default on the CPU: transformers' experts forward
        engine = em.make_engine(model, **options)
        try:
            assert engine.stats()["fused_moe_modules"] == engine.stats()["fused_moe_routers"] == 0
            engine.generate_batch([[1, 2, 3]], max_new_tokens=2)
            assert fused_calls[0] == 0
        finally:
            engine.close()
    for bad in ("yes", "decode", 1):
        with pytest.raises(ValueError, match="EngineConfig.fused_moe must be True, False or None"):
            em.make_engine(model, fused_moe=bad)
    dense = em.build_model("qwen3_next_dense")
    with pytest.raises(ValueError, match="fused_moe=True but Qwen3NextForCausalLM has no float MoE experts module"):
        em.make_engine(dense, fused_moe=True)
    # an experts layout the kernel does not serve (transformers' transposed [E, in, out] weights)
    layer = next(m for _, m in fused_experts.experts_modules(model))
    layer.is_transposed = True
    with pytest.raises(ValueError, match=r"fused_moe=True: .*'model.layers.\d.mlp.experts' \(Qwen3NextExperts\) is not "
                                         r"supported: its expert weights are transposed"):
        em.make_engine(model, fused_moe=True)
    assert all("forward" not in m.__dict__ for _, m in fused_experts.experts_modules(model))  # left untouched


def test_default_resolution():
    """``fused_moe=None`` (the default): on for a CUDA model whose experts all fit the fused path
    (tensor parallelism included), off on the CPU, for a dense model and for an experts layout it
    does not serve (no error: the default only picks); True / False as given."""
    model = MODELS["qwen3_next_moe"]()
    resolve = fused_experts.resolve_fused_moe
    assert resolve(model, None, "cuda") is True and resolve(model, None, torch.device("cuda", 1)) is True
    assert resolve(model, None, "cpu") is False
    assert resolve(model, True, "cpu") is True and resolve(model, False, "cuda") is False
    assert resolve(em.build_model("qwen3_next_dense"), None, "cuda") is False
    layer = next(m for _, m in fused_experts.experts_modules(model))
    layer.is_transposed = True
    assert resolve(model, None, "cuda") is False
    layer.is_transposed = False
    engine = em.make_engine(model, fused_moe=True)
    try:  # the patched modules are no longer "unfused"; after close they are again
        assert fused_experts.unfused_experts(model) == []
    finally:
        engine.close()
    assert len(fused_experts.unfused_experts(model)) == len(fused_experts.experts_modules(model)) > 0


def test_unsupported_reasons():
    model = MODELS["nemotron_h"]()
    (_, experts), = fused_experts.experts_modules(model)
    assert fused_experts.unsupported_reason(experts) is None
    experts.has_bias = True
    assert fused_experts.unsupported_reason(experts) == "its experts have biases"
    experts.has_bias = False
    experts.down_proj.data = experts.down_proj.data.double()
    assert "not one float dtype" in fused_experts.unsupported_reason(experts)
    experts.down_proj.data = experts.down_proj.data[:, :, :-1].float()
    assert "do not pair up" in fused_experts.unsupported_reason(experts)
    per_expert = torch.nn.Module()
    per_expert.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
    (name, m), = fused_experts.experts_modules(per_expert)
    assert name == "experts" and "not 3-D stacked weights" in fused_experts.unsupported_reason(m)


@pytest.mark.parametrize("name", ["nemotron_h", "qwen3_5_moe"])
def test_compiled_engine_no_graph_breaks(name):
    """The engine's torch.compile (our backend, Dynamo fullgraph between layer ops) traces the fused
    experts and (Qwen3.5-MoE) the fused routers: no graph break, no recompile across batch sizes, HF's
    tokens. (No call counter here: a counter's value would be guarded by Dynamo and recompile every step.)"""
    model = MODELS[name]()
    engine = em.make_engine(model, fused_moe=True, compile=True)
    try:
        assert engine.stats()["fused_moe_modules"] == len(fused_experts.experts_modules(model))
        assert engine.stats()["fused_moe_routers"] == _expected_routers(name, model)
        for b in (1, 3):
            prompts = em.random_prompts([5 + 7 * i for i in range(b)], em.vocab_size(model), seed=b)
            got = engine.generate_batch(prompts, max_new_tokens=4)
            for p, g in zip(prompts, got):
                em.assert_greedy_equal(model, p, g, em.hf_greedy(model, p, 4), what="compiled fused_moe")
        stats = engine.stats()["compile"]
    finally:
        engine.close()
    assert stats["graph_breaks"] == 0 and stats["recompiles"] == 0, stats


def test_draft_model_and_mtp_head_experts_are_fused(tmp_path, fused_calls):
    """Speculative decoding: a MoE draft model's experts and the MTP head's MoE layer take the fused
    path too (a dense draft model is no error); greedy tokens stay HF's."""
    import hybrid_compile as hc
    from mtp_models import write_mtp_checkpoint

    model = MODELS["qwen3_next_moe"]()
    draft = em.build_model("qwen3_next_moe", seed=1)
    prompts = em.random_prompts([9, 30], em.vocab_size(model), seed=2)
    expected = [em.hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    for spec in (dict(method="draft_model", draft_model=draft, num_draft_tokens=2),
                 dict(method="draft_model", draft_model=em.build_model("qwen3_next_dense"), num_draft_tokens=2)):
        engine = em.make_engine(model, fused_moe=True, speculative=spec)
        try:
            draft_experts = fused_experts.experts_modules(spec["draft_model"])
            assert all("forward" in m.__dict__ for _, m in draft_experts)  # the MoE draft's experts: patched
            got = engine.generate_batch(prompts, max_new_tokens=NEW_TOKENS)
            drafted = engine.stats()["speculative"]["drafted"]
        finally:
            engine.close()
        assert got == expected and drafted > 0
    assert "forward" not in next(m for _, m in fused_experts.experts_modules(draft)).__dict__  # close() undid it
    write_mtp_checkpoint("qwen3_next_moe", 0, str(tmp_path))
    engine = hc.from_pretrained(str(tmp_path), dtype=torch.float32, device="cpu", tokenizer=False, fused_moe=True,
                                speculative=dict(method="mtp", num_draft_tokens=2), **em.ENGINE_DEFAULTS)
    try:
        target_experts = len(fused_experts.experts_modules(engine.model))
        assert engine.stats()["fused_moe_modules"] == target_experts + 1  # + the MTP layer's experts
        assert engine.stats()["fused_moe_routers"] == len(fused_router.softmax_routers(engine.model)) + 1
        calls = fused_calls[0]
        got = engine.generate_batch(prompts, max_new_tokens=NEW_TOKENS)
        assert fused_calls[0] > calls
        assert got == [em.hf_greedy(engine.model, p, NEW_TOKENS) for p in prompts]
    finally:
        engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("name,option", [("qwen3_5_moe", True), ("granitemoehybrid", True), ("qwen3_5_moe", None)])
def test_gpu_fused_routers_in_cuda_graphs_match_hf(name, option):
    """On the GPU the routers run the Triton ``moe_topk_softmax`` kernel inside compiled CUDA graphs
    (Granite-4: the router whose tuple order changed between transformers 5.17 and 5.24); greedy tokens
    against HF on the CPU (a CPU/GPU near-tie allowed, see tests/test_cuda_graphs.py). ``None``: the
    default puts a CUDA MoE model on the fused path."""
    import copy

    from test_cuda_graphs import _assert_greedy_close

    cpu_model = MODELS[name]()
    model = copy.deepcopy(cpu_model).to("cuda")
    prompts = em.random_prompts([13, 1, 40, 5], em.vocab_size(model), seed=7)
    expected = [em.hf_greedy(cpu_model, p, NEW_TOKENS) for p in prompts]
    graphs = dict(compile=True, cuda_graphs=True, cuda_graph_batch_sizes=(1, 4))
    with em.make_engine(model, fused_moe=option, **graphs) as engine:
        got = engine.generate_batch(prompts, max_new_tokens=NEW_TOKENS)
        stats = engine.stats()
    assert stats["fused_moe_routers"] == _expected_routers(name, model) > 0
    assert stats["compile"]["cuda_graph_replays"] > 0, stats["compile"]
    for p, g, e in zip(prompts, got, expected):
        _assert_greedy_close(cpu_model, p, g, e, f"{name} fused_moe routers GPU")


@pytest.mark.gpu
def test_transformers_experts_piecewise_capture_error_names_the_fix():
    """fp32 experts on transformers' forward (``fused_moe=False``) under piecewise CUDA graphs: its
    eager experts loop copies the routing to the host, so the capture fails at start-up with one error
    naming the option that serves them without host syncs."""
    model = MODELS["qwen3_5_moe"]().to("cuda")
    with pytest.raises(RuntimeError, match="experts forward: fused_moe=True serves them without host syncs"):
        em.make_engine(model, fused_moe=False, compile=True, cuda_graphs=True, cuda_graph_batch_sizes=(1,))
