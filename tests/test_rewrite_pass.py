"""Post-grad rewrite pass (hybrid_compile.passes.rewrite): projections sharing an input become one
matmul over weights packed once.

- On a small module (gate/up MLP + q/k/v projections, a biased projection that must stay alone):
  the backend packs the weights once (parameters become adjacent views of one buffer, values
  unchanged), the pass fuses each group (its counters, and Inductor's own count of extern matmul
  calls in the generated code: ``off - on == matmuls removed``), outputs equal eager; with
  ``rewrites=False`` nothing is packed or fused.
- Engine on the tiny dense Qwen3-Next with the pass on (the default): ``engine.stats()["compile"]
  ["rewrites"]`` shows every group fused (MLP gate/up per layer, GDN ``in_proj_qkvz``/``in_proj_ba``,
  attention q/k/v) and greedy tokens equal HF ``generate``; ``extra={"rewrite_passes": False}``
  reaches the backend.

Inductor's FX graph / AOT caches are off here: a piece served from the cache skips the pass, so
its counters would not show the rewrite.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

from hybrid_compile.passes.backend import HybridCompileBackend

from engine_models import (
    assert_greedy_equal,
    cached_model,
    hf_greedy_cached,
    make_engine,
    random_prompts,
    single_threaded,
    vocab_size,
)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from single_threaded()


@contextlib.contextmanager
def _no_compile_caches():
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield


class Block(nn.Module):
    """gate/up MLP and q/k/v projections of one normalised input, plus a biased projection."""

    def __init__(self, hidden=16, inter=24):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.q_proj = nn.Linear(hidden, 32, bias=False)
        self.k_proj = nn.Linear(hidden, 8, bias=False)
        self.v_proj = nn.Linear(hidden, 8, bias=False)
        self.biased = nn.Linear(hidden, 8, bias=True)  # shares the input, has a bias: not packed

    def forward(self, x):
        h = torch.nn.functional.rms_norm(x, (x.shape[-1],))
        y = self.down_proj(torch.nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))
        q, k, v = self.q_proj(y).view(-1, 4, 8), self.k_proj(y).view(-1, 1, 8), self.v_proj(y).view(-1, 1, 8)
        att = (q * k).sum(-1, keepdim=True) * v  # [N, 4, 8]
        return att.flatten(1) + self.biased(y).repeat(1, 4)


def _compile_block(block, x, rewrites):
    torch._dynamo.reset()
    counters.clear()
    backend = HybridCompileBackend(rewrites=rewrites)
    compiled = torch.compile(block, backend=backend, fullgraph=True, dynamic=True)
    with _no_compile_caches(), torch.no_grad():
        out = compiled(x)
        out2 = compiled(x[:5])  # another token count: same graph
    return backend, out, out2, counters["inductor"]["extern_calls"]


def test_pass_packs_weights_once_and_fuses_shared_input_matmuls():
    torch.manual_seed(0)
    block = Block().eval()
    x = torch.randn(7, 16)
    with torch.no_grad():
        expected, expected2 = block(x), block(x[:5])
    values = {name: p.detach().clone() for name, p in block.named_parameters()}

    backend_off, out_off, _, extern_off = _compile_block(block, x, rewrites=False)
    assert backend_off.stats.rewrites == {}
    assert block.up_proj.weight.untyped_storage().data_ptr() != block.gate_proj.weight.untyped_storage().data_ptr()

    backend, out, out2, extern_on = _compile_block(block, x, rewrites=True)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(out2, expected2)
    torch.testing.assert_close(out_off, expected)
    assert backend.stats.graphs == 1
    r = backend.stats.rewrites
    assert r["packed_groups"] == 2 and r["packed_weights"] == 5
    assert r["pass_runs"] == 1 and r["fused_groups"] == 2 and r["matmuls_removed"] == 3
    assert r["group_sizes"] == {2: 1, 3: 1}
    # Inductor's generated code calls three fewer extern matmuls
    assert extern_off - extern_on == 3, (extern_off, extern_on)

    # packed: adjacent views of one buffer, values unchanged, eager still right
    gate, up = block.gate_proj.weight, block.up_proj.weight
    assert gate.untyped_storage().data_ptr() == up.untyped_storage().data_ptr()
    assert (gate.storage_offset(), up.storage_offset()) == (0, gate.numel())
    q, k, v = block.q_proj.weight, block.k_proj.weight, block.v_proj.weight
    assert [t.storage_offset() for t in (q, k, v)] == [0, q.numel(), q.numel() + k.numel()]
    assert block.biased.weight.untyped_storage().data_ptr() not in {gate.untyped_storage().data_ptr(),
                                                                   q.untyped_storage().data_ptr()}
    for name, p in block.named_parameters():
        assert torch.equal(p, values[name]), name
    with torch.no_grad():
        torch.testing.assert_close(block(x), expected)

    # a second compile of the packed module reuses the packing (no copy) and fuses again
    storage = gate.untyped_storage().data_ptr()
    backend2, out3, _, _ = _compile_block(block, x, rewrites=True)
    assert block.gate_proj.weight.untyped_storage().data_ptr() == storage
    assert backend2.stats.rewrites["fused_groups"] == 2
    torch.testing.assert_close(out3, expected)


def test_replaced_packed_weight_fails_clearly():
    """The fused matmul reads the group through its first weight: replacing a packed parameter
    after the compile must fail with a clear error, not read out of bounds."""
    torch.manual_seed(1)
    block = Block().eval()
    x = torch.randn(6, 16)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=HybridCompileBackend(), fullgraph=True, dynamic=True)
    with torch.no_grad():
        compiled(x)
        block.load_state_dict({k: v * 2 for k, v in block.state_dict().items()})  # in place: packing kept
        torch.testing.assert_close(compiled(x), block(x))
        block.up_proj.weight = nn.Parameter(block.up_proj.weight.detach().clone())
        with pytest.raises(RuntimeError, match="packed at compile time was replaced"):
            compiled(x)


def test_backend_refuses_a_foreign_post_grad_pre_pass():
    with pytest.raises(ValueError, match="rewrites=False"):
        HybridCompileBackend(inductor_config={"post_grad_custom_pre_pass": lambda g: None})
    HybridCompileBackend(inductor_config={"post_grad_custom_pre_pass": lambda g: None}, rewrites=False)


def test_engine_fuses_projections_and_matches_hf():
    """Tiny dense Qwen3-Next (GDN, GDN, attention; dense MLP in each): 3 gate/up pairs, 2 GDN
    in_proj_qkvz/in_proj_ba pairs, 1 attention q/k/v triple."""
    model = cached_model("qwen3_next_dense", 0)
    with _no_compile_caches():
        engine = make_engine(model, compile=True)
    try:
        r = engine.stats()["compile"]["rewrites"]
        assert r["packed_groups"] == 6 and r["packed_weights"] == 13
        assert r["fused_groups"] == 6 and r["matmuls_removed"] == 7 and r["group_sizes"] == {2: 5, 3: 1}
        mixer = model.model.layers[0].linear_attn
        assert mixer.in_proj_ba.weight.storage_offset() == mixer.in_proj_qkvz.weight.numel()
        prompts = random_prompts([1, 40, 9], vocab_size(model), seed=31)
        new = 6
        got = engine.generate_batch(prompts, max_new_tokens=new)
        for prompt, tokens in zip(prompts, got):
            assert_greedy_equal(model, prompt, tokens, hf_greedy_cached(model, ("qwen3_next_dense", 0), prompt, new),
                                "rewrite pass")
    finally:
        engine.close()


def test_engine_config_turns_the_pass_off():
    model = cached_model("qwen3_next_dense", 0)
    with make_engine(model, compile=True, extra={"rewrite_passes": False}) as engine:
        assert engine.runner._backend.rewrites is False
        assert engine.stats()["compile"]["rewrites"] == {}
        (prompt,) = random_prompts([12], vocab_size(model), seed=32)
        tokens = engine.generate_batch([prompt], max_new_tokens=4)[0]
    assert_greedy_equal(model, prompt, tokens, hf_greedy_cached(model, ("qwen3_next_dense", 0), prompt, 4), "pass off")
