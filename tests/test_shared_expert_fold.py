"""The shared expert folded into the routed experts (hybrid_compile/models/shared_expert_fold.py).

Oracle: transformers' own ``generate`` (greedy) on tiny fp32 Qwen3-Next and Qwen3.5-MoE models, where
the fold's single rounding of the block sum changes nothing a greedy token sees.

- With ``fused_moe=True`` every MoE block folds (``stats()["folded_shared_experts"]``): steps of one
  token (one request decoding) run the fused experts op with ``E + 1`` experts and ``top_k + 1`` pairs,
  steps of several tokens transformers' block; greedy tokens equal HF's, eager and compiled (no graph
  break); the folded one-token forward under torch.compile(fullgraph=True) equals transformers' block.
- ``engine.close()`` leaves the model as it was: every parameter bitwise equal and in its own storage.
- ``extra={"fold_shared_experts": False}`` keeps the blocks apart (0 folded, same tokens).
- :func:`fold_reason` names why a block cannot fold (a shared expert of another width, FP8 shared
  expert projections, experts off the fused path).
"""

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import hybrid_compile  # noqa: F401
from hybrid_compile.models import shared_expert_fold as fold
from hybrid_compile.ops import moe as moe_ops

from engine_models import (
    assert_greedy_equal,
    cached_model,
    hf_greedy_cached,
    make_engine,
    random_prompts,
    record_graph_inputs,
    single_threaded,
    symbolic_model_inputs,
    vocab_size,
)

NEW = 6


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from single_threaded()


def _blocks(model):
    return [m for m in model.modules() if type(m).__name__ in fold.FOLDABLE_BLOCKS]


@pytest.mark.parametrize("kind", ["qwen3_next_moe", "qwen3_5_moe"])
def test_folded_blocks_match_hf_and_close_restores_the_model(kind, monkeypatch):
    model = cached_model(kind, 0)
    blocks = _blocks(model)
    assert blocks and all(fold.fold_reason(b) is None for b in blocks)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    calls = []
    real = fold.fused_moe_experts

    def recording(x, index, weights, up, down, *args, **kwargs):
        calls.append((index.shape[1], up.shape[0], weights.dtype))
        return real(x, index, weights, up, down, *args, **kwargs)

    monkeypatch.setattr(fold, "fused_moe_experts", recording)
    prompts = random_prompts([1, 9, 30], vocab_size(model), seed=5)
    with make_engine(model, fused_moe=True) as engine:
        assert engine.stats()["folded_shared_experts"] == len(blocks)
        # one request: its decode steps are one token each, which fold
        got = engine.generate_batch(prompts[2:], max_new_tokens=NEW)
        one_token_calls = len(calls)
        # several requests: steps of several tokens run transformers' block (nothing folded)
        got = engine.generate_batch(prompts[:2], max_new_tokens=NEW) + got
    experts = blocks[0].experts.gate_up_proj.shape[0]
    top_k = blocks[0].gate.top_k
    assert one_token_calls >= len(blocks) * (NEW - 1)
    assert set(calls) == {(top_k + 1, experts + 1, torch.float32)}
    for prompt, tokens in zip(prompts, got):
        assert_greedy_equal(model, prompt, tokens, hf_greedy_cached(model, (kind, 0), prompt, NEW), "folded")
    after = dict(model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)
    storages = [StorageWeakRef(p.untyped_storage()) for p in after.values()]
    assert len(set(storages)) == len(storages), "a parameter still shares storage after close()"
    assert all("forward" not in b.__dict__ for b in blocks)


def test_folded_block_compiles_and_matches_the_block(monkeypatch):
    """The folded forward of one token (what the batch-1 decode graph traces; on the CPU the engine pads
    compiled steps to two requests) under torch.compile(fullgraph=True) equals transformers' block."""
    model = cached_model("qwen3_next_moe", 0)
    block = _blocks(model)[0]
    x = torch.randn(1, 1, block.experts.gate_up_proj.shape[2], generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = type(block).forward(block, x)
    from hybrid_compile.models.base import PatchHandle

    handle = PatchHandle()
    try:
        forward = fold._folded_forward(*fold._pack(block, handle, None)).__get__(block)
        inside = object()
        monkeypatch.setattr(fold, "get_forward_context", lambda: inside)  # as inside an engine step
        torch._dynamo.reset()
        with torch.no_grad():
            eager, compiled = forward(x), torch.compile(forward, fullgraph=True)(x)
    finally:
        handle.undo()
    torch.testing.assert_close(eager, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled, want, atol=1e-5, rtol=1e-5)


def test_one_token_graph_and_other_graphs_fuse_the_input_projections(monkeypatch):
    """With the rewrite pass the fold lays the router's, ``shared_expert_gate``'s, then the shared
    ``gate_proj`` / ``up_proj`` weights back to back: a graph of several tokens (transformers' block:
    all four project the input) and the one-token folded graph (router and gate only) both fuse their
    projections over that buffer and neither moves a weight under the other (the first graph runs
    again after the second compiled; on the GPU a re-packing had failed its packed-weight guard).
    Outputs equal transformers' block; undo gives every parameter its own storage with its values."""
    from hybrid_compile.compilation.backend import HybridCompileBackend
    from hybrid_compile.compilation.rewrite import pack_parameters
    from hybrid_compile.models.base import PatchHandle

    model = cached_model("qwen3_next_moe", 0)
    block = _blocks(model)[0]
    hidden = block.experts.gate_up_proj.shape[2]
    g = torch.Generator().manual_seed(9)
    x1, x3 = torch.randn(1, 1, hidden, generator=g), torch.randn(1, 3, hidden, generator=g)
    params = dict(block.named_parameters())
    values = {n: p.detach().clone() for n, p in params.items()}
    with torch.no_grad():
        want1, want3 = type(block).forward(block, x1), type(block).forward(block, x3)
    handle = PatchHandle()
    backends = []
    try:
        folded = fold._folded_forward(*fold._pack(block, handle, pack_parameters)).__get__(block)
        router = block.gate.weight
        assert [p.storage_offset() for p in (router, block.shared_expert_gate.weight)] == [0, router.numel()]
        inside = object()
        monkeypatch.setattr(fold, "get_forward_context", lambda: inside)  # as inside an engine step
        torch._dynamo.reset()
        with torch._inductor.config.patch(fx_graph_cache=False), torch.no_grad():
            compiled = []
            for fn, x in ((lambda t: type(block).forward(block, t), x3), (folded, x1)):
                backends.append(HybridCompileBackend())
                compiled.append(torch.compile(fn, backend=backends[-1], fullgraph=True, dynamic=False))
                compiled[-1](x)
            got3, got1 = compiled[0](x3), compiled[1](x1)
        r = [b.stats.rewrites for b in backends]
        assert r[0]["group_sizes"] == {4: 1}, r
        # the one-token graph takes the router and the gate packed as they lie (on the CPU Inductor turns a
        # one-row matmul into a reduction before the fusion step, so it is fused on CUDA only)
        assert (r[1]["packed_groups"], r[1]["packed_weights"]) == (1, 2), r
        torch.testing.assert_close(got3, want3, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got1, want1, atol=1e-5, rtol=1e-5)
    finally:
        for b in backends:
            b.release_packed_weights()
        handle.undo()
    for name, p in block.named_parameters():
        assert p is params[name] and torch.equal(p, values[name]) and p.storage_offset() == 0, name
    storages = {StorageWeakRef(p.untyped_storage()) for p in params.values()}
    assert len(storages) == len(params)


def test_engine_with_folds_compiles_without_graph_breaks():
    model = cached_model("qwen3_next_moe", 0)
    prompts = random_prompts([1, 17], vocab_size(model), seed=6)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with make_engine(model, fused_moe=True, compile=True) as engine:
        block = _blocks(model)[0]
        # compiled with the rewrite pass: the block's input projections lie back to back
        laid = [block.gate.weight, block.shared_expert_gate.weight, block.shared_expert.gate_proj.weight,
                block.shared_expert.up_proj.weight]
        assert len({p.untyped_storage().data_ptr() for p in laid}) == 1
        got = engine.generate_batch(prompts, max_new_tokens=NEW)
        stats = engine.stats()
    after = dict(model.named_parameters())
    assert all(torch.equal(before[n], after[n]) and after[n].storage_offset() == 0 for n in before)
    assert len({StorageWeakRef(p.untyped_storage()) for p in after.values()}) == len(after)
    assert stats["folded_shared_experts"] == len(_blocks(model))
    c = stats["compile"]
    assert c["graph_breaks"] == 0 and c["recompiles"] == 0, c
    for prompt, tokens in zip(prompts, got):
        assert_greedy_equal(model, prompt, tokens, hf_greedy_cached(model, ("qwen3_next_moe", 0), prompt, NEW),
                            "folded, compiled")


@pytest.mark.parametrize("kind", ["qwen3_next_moe", "qwen3_5_moe"])
def test_one_token_graph_sees_the_folded_experts_with_static_shapes(kind, monkeypatch):
    """The compiled forward of one token (what the batch-1 decode CUDA graph captures; here called
    with a one-token decode step of graph buffers on the CPU) gets only its step inputs with symbolic
    sizes: the packed experts the folded blocks read are Parameters, whose shapes Dynamo keeps static.
    As plain tensors closed over by the forward they got fresh size symbols per layer under the engine's
    ``dynamic=True`` compile, so no two layers' pieces shared an Inductor FX-cache key (on a GPU the
    80B shape's capture phase compiled all 49 pieces, the compile phase 5)."""
    from hybrid_compile.compilation import cuda_graphs as cg
    from hybrid_compile.engine.forward_batch import ForwardMode
    from hybrid_compile.layers.context import ForwardContext, forward_context

    graphs = record_graph_inputs(monkeypatch)
    model = cached_model(kind, 0)
    with make_engine(model, fused_moe=True, compile=True) as engine:
        assert engine.stats()["folded_shared_experts"] == len(_blocks(model))
        runner, pools = engine.runner, engine.runner.pools
        r2t = pools.req_to_token.req_to_token
        buffers = cg.GraphBuffers(2, r2t.shape[1], r2t.device, r2t.dtype, pools.kv.PADDING_SLOT)
        key = cg.GraphKey(ForwardMode.DECODE, 1)
        buffers.reset(key)
        with torch.inference_mode(), forward_context(ForwardContext(buffers.metadata(key), runner.kv_caches,
                                                                    runner.mamba_caches)):
            runner._call_compiled(buffers.input_ids[:1], buffers.positions[:1], buffers.logits_indices[:1])
    assert len(graphs) == 2, "expected the step graph and the one-token graph"
    one_token = graphs[1]
    folded = [name for name, _ in one_token if "closure" in name or "packed" in name]
    assert folded, one_token  # the folded blocks' packed experts are inputs of this graph
    assert symbolic_model_inputs(one_token) == [], one_token


def test_extra_option_keeps_the_shared_expert_apart(monkeypatch):
    model = cached_model("qwen3_next_moe", 0)
    monkeypatch.setattr(fold, "fused_moe_experts", lambda *a, **k: pytest.fail("folded despite the option"))
    prompts = random_prompts([12], vocab_size(model), seed=7)
    with make_engine(model, fused_moe=True, extra={"fold_shared_experts": False}) as engine:
        assert engine.stats()["folded_shared_experts"] == 0
        got = engine.generate_batch(prompts, max_new_tokens=NEW)
    assert_greedy_equal(model, prompts[0], got[0], hf_greedy_cached(model, ("qwen3_next_moe", 0), prompts[0], NEW),
                        "not folded")


def test_fold_reason_names_what_does_not_fit():
    model = cached_model("qwen3_next_moe", 0)
    block = _blocks(model)[0]
    shared, experts = block.shared_expert, block.experts
    hidden = experts.gate_up_proj.shape[2]
    saved = shared.gate_proj
    shared.gate_proj = nn.Linear(hidden, 8, bias=False)  # another width
    try:
        assert "width" in fold.fold_reason(block)
    finally:
        shared.gate_proj = saved

    class FakeFp8(nn.Module):  # not an nn.Linear (as Fp8Linear)
        pass

    saved = shared.down_proj
    shared.down_proj = FakeFp8()
    try:
        assert "FP8" in fold.fold_reason(block)
    finally:
        shared.down_proj = saved
    saved = experts.down_proj
    experts.down_proj = nn.Parameter(saved.detach()[:, :, :-1].clone(), requires_grad=False)  # shapes do not pair
    try:
        assert "fused path" in fold.fold_reason(block)
    finally:
        experts.down_proj = saved
    assert fold.fold_reason(block) is None
    assert fold.fold_reason(nn.Linear(2, 2)) == "not an experts + gated shared expert block"
    assert moe_ops.fused_activation(experts.act_fn, True) == "silu_and_mul"
