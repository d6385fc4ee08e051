"""Post-grad rewrite pass (hybrid_compile.compilation.rewrite): projections sharing an input become one
matmul over weights packed once.

- On a small module (gate/up MLP + q/k/v projections, a biased projection that must stay alone):
  the backend packs the weights once (parameters become adjacent views of one buffer, values
  unchanged), the pass fuses each group (its counters, and Inductor's own count of extern matmul
  calls in the generated code: ``off - on == matmuls removed``), outputs equal eager; with
  ``rewrites=False`` nothing is packed or fused.
- Engine on the tiny dense Qwen3-Next with the pass on (the default): ``engine.stats()["compile"]
  ["rewrites"]`` shows every group fused (MLP gate/up per layer, GDN ``in_proj_qkvz``/``in_proj_ba``,
  attention q/k/v) and greedy tokens equal HF ``generate``; ``extra={"rewrite_passes": False}``
  reaches the backend. On the tiny Qwen3-Next MoE the fused router's linear joins the shared
  expert's group (it reads a reshape of the same rows).
- Undoing the packing: a backend's ``release_packed_weights`` leaves the packing to another live
  backend compiled against it, the last one gives every parameter its own storage back (same
  ``Parameter`` objects, same values); ``engine.close()`` does it for the engine's backend: no two
  parameters share storage, the packed buffers are freed, values are bitwise those before the wrap,
  ``save_pretrained`` (safetensors) reloads them, HF ``generate`` is unchanged, and a second
  wrap + close of the same model packs and unpacks again.

Inductor's FX graph / AOT caches are off here: a piece served from the cache skips the pass, so
its counters would not show the rewrite.
"""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters
from torch.multiprocessing.reductions import StorageWeakRef

from hybrid_compile.compilation.backend import HybridCompileBackend

from engine_models import (
    assert_greedy_equal,
    cached_model,
    hf_greedy,
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


def _compile_block(block, x, rewrites, skinny_matmuls=None):
    torch._dynamo.reset()
    counters.clear()
    backend = HybridCompileBackend(rewrites=rewrites, skinny_matmuls=skinny_matmuls)
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
    params, values = _snapshot(block)

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
    assert r["skinny_matmuls"] == 0  # on CPU by default matmuls stay aten.mm
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

    # undoing: the packing stays while another live backend uses it; the last one unpacks
    assert backend.release_packed_weights() == 0
    assert block.up_proj.weight.untyped_storage().data_ptr() == storage
    assert backend2.release_packed_weights() == 5
    assert backend.release_packed_weights() == backend2.release_packed_weights() == 0  # idempotent
    _assert_own_storage(block, params, values)


class OddProjections(nn.Module):
    """Three projections of one input, 5 + 1 + 7 = 13 rows: not whole 16-byte output rows in fp32."""

    def __init__(self, hidden=16):
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(hidden, n, bias=False) for n in (5, 1, 7))

    def forward(self, x):
        return torch.cat([self.a(x), torch.sigmoid(self.b(x)) * self.c(x)], dim=-1)


def test_fused_matmul_over_spare_rows_has_aligned_output_rows(monkeypatch):
    """A group of 13 fp32 rows is packed into 16 (zero spare rows) and fused as one matmul over all 16,
    whose extra columns are never read: output equal to eager; a buffer with no spare rows (a packing
    of the weights lying back to back in a storage of exactly 13 rows) fuses over its 13."""
    from hybrid_compile.compilation import rewrite

    torch.manual_seed(0)
    block = OddProjections().eval()
    x = torch.randn(7, 16)
    with torch.no_grad():
        expected = block(x)
    widths = []
    real_call = rewrite._call

    def recording_call(graph, fake_mode, target, args, kwargs=None):
        if target is torch.ops.aten.as_strided.default:
            widths.append(args[1][0])
        return real_call(graph, fake_mode, target, args, kwargs)

    monkeypatch.setattr(rewrite, "_call", recording_call)
    backend, out, _, _ = _compile_block(block, x, rewrites=True)
    torch.testing.assert_close(out, expected)
    assert backend.stats.rewrites["fused_groups"] == 1 and widths == [16], (backend.stats.rewrites, widths)
    storage = block.a.weight.untyped_storage()
    assert storage.nbytes() == 16 * 16 * 4  # 16 rows of 16 fp32
    spare = torch.empty(0).set_(storage, 13 * 16, (3, 16), (16, 1))
    assert torch.equal(spare, torch.zeros(3, 16))
    backend.release_packed_weights()

    # weights already back to back in a storage of exactly their rows: reused as they lie, fused over 13
    with torch.no_grad():
        exact = torch.cat([block.a.weight, block.b.weight, block.c.weight])
        for p, start, n in ((block.a.weight, 0, 5), (block.b.weight, 5, 1), (block.c.weight, 6, 7)):
            p.data = exact[start:start + n]
    widths.clear()
    backend, out, _, _ = _compile_block(block, x, rewrites=True)
    torch.testing.assert_close(out, expected)
    assert widths == [13]
    backend.release_packed_weights()


def test_pass_routes_matmuls_to_skinny_mm():
    """With ``skinny_matmuls=True`` (the default on CUDA) every bias-free projection left after the
    fusion (fused gate/up, down, fused q/k/v) becomes ``hybrid_compile::skinny_mm`` (the profiler
    sees it run); the biased one (``addmm``) stays; outputs equal eager at two token counts."""
    torch.manual_seed(0)
    block = Block().eval()
    x = torch.randn(7, 16)
    with torch.no_grad():
        expected, expected2 = block(x), block(x[:5])
    torch._dynamo.reset()
    backend = HybridCompileBackend(skinny_matmuls=True)
    compiled = torch.compile(block, backend=backend, fullgraph=True, dynamic=True)
    with _no_compile_caches(), torch.no_grad():
        out = compiled(x)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out2 = compiled(x[:5])  # another token count: same graph
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(out2, expected2)
    r = backend.stats.rewrites
    assert backend.stats.graphs == 1 and r["fused_groups"] == 2 and r["skinny_matmuls"] == 3, r
    calls = sum(e.count for e in prof.key_averages() if e.key == "hybrid_compile::skinny_mm")
    assert calls == 3, calls
    backend.release_packed_weights()


def _snapshot(model):
    """The parameters of ``model`` by name and copies of their values."""
    params = dict(model.named_parameters())
    return params, {name: p.detach().clone() for name, p in params.items()}


def _assert_own_storage(model, params, values):
    """Every parameter of ``model`` is the same object as in ``params``, has ``values`` bitwise and
    its own storage."""
    now = dict(model.named_parameters())
    assert now.keys() == params.keys()
    for name, p in now.items():
        assert p is params[name], name
        assert p.dtype == values[name].dtype and p.device == values[name].device
        assert p.requires_grad, name  # (every parameter of these models requires grad)
        assert p.is_contiguous() and p.storage_offset() == 0, name
        assert torch.equal(p.detach(), values[name]), name
    ptrs = [p.untyped_storage().data_ptr() for p in now.values()]
    assert len(set(ptrs)) == len(ptrs), "parameters share storage"


class Fp8Block(nn.Module):
    """Block-FP8 projections of one input: two that fill whole 128-row scale blocks, two that do not
    (only one of those can go last in the packing), one with a bias (never packed)."""

    def __init__(self):
        super().__init__()
        from hybrid_compile.quantization import Fp8Linear

        def fp8(n, bias=False):
            return Fp8Linear.from_linear(nn.Linear(256, n, bias=bias))

        self.q_proj, self.k_proj, self.v_proj, self.o_proj = fp8(384), fp8(64), fp8(128), fp8(96)
        self.biased = fp8(128, bias=True)

    def forward(self, x):
        return (self.q_proj(x) + 1, self.k_proj(x) * 2, self.v_proj(x), self.o_proj(x).relu(), self.biased(x))


def test_pass_fuses_block_fp8_projections_with_their_scales():
    """Bias-free ``fp8_block_linear`` calls on one input: the weights are packed in one buffer and their
    block scales in another, in the same order (whole 128-row blocks first, the one partial-block
    weight last, a second partial one and the biased one left alone); the pass makes the run one
    ``fp8_block_linear`` call; outputs bitwise those of eager (one activation quantization, the same
    per-column products); releasing the backend gives every parameter its own storage back."""
    torch.manual_seed(0)
    block = Fp8Block().eval()
    x = torch.randn(2, 5, 256)
    with torch.no_grad():
        expected = block(x)
    values = {name: p.detach().clone() for name, p in block.named_parameters()}
    torch._dynamo.reset()
    backend = HybridCompileBackend()
    with _no_compile_caches(), torch.no_grad():
        got = torch.compile(block, backend=backend, fullgraph=True, dynamic=True)(x)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    r = backend.stats.rewrites
    assert r["packed_groups"] == 2 and r["packed_weights"] == 6, r  # 3 weights + their 3 scales
    assert r["fused_groups"] == r["fp8_fused_groups"] == 1 and r["group_sizes"] == {3: 1}, r
    q, v, k, o = block.q_proj, block.v_proj, block.k_proj, block.o_proj
    for attr in ("weight", "weight_scale_inv"):
        t = [getattr(m, attr) for m in (q, v, k)]  # k (64 rows) last: its partial scale block ends the buffer
        assert len({x.untyped_storage().data_ptr() for x in t}) == 1
        assert [x.storage_offset() for x in t] == [0, t[0].numel(), t[0].numel() + t[1].numel()]
        assert getattr(o, attr).untyped_storage().data_ptr() != t[0].untyped_storage().data_ptr()
    for name, p in block.named_parameters():
        assert torch.equal(p, values[name]), name
    assert backend.release_packed_weights() == 6
    ptrs = [p.untyped_storage().data_ptr() for p in block.parameters()]
    assert len(set(ptrs)) == len(ptrs)


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


class FourProjections(nn.Module):
    """Four projections of one input; ``forward(x, all_four=False)`` reads two of them (a graph
    specialised otherwise, as the folded MoE block's one-token step reads the router and the shared
    expert's gate only)."""

    def __init__(self, hidden=16):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(hidden, n, bias=False) for n in (12, 8, 8, 4))

    def forward(self, x, all_four=True):
        if all_four:
            return self.a(x).sum(-1) + (self.b(x) * self.c(x)).sum(-1) + self.d(x).sum(-1)
        return self.a(x).sum(-1) * self.d(x).sum(-1)


def _compile_fn(fn, x):
    """``fn`` compiled by a backend of its own (a live user of what it packs): (backend, compiled fn)."""
    backend = HybridCompileBackend()
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=True)
    with _no_compile_caches(), torch.no_grad():
        compiled(x)
    return backend, compiled


@pytest.mark.parametrize("laid_out", [False, True])
def test_a_second_graph_never_moves_weights_a_live_graph_reads_packed(laid_out):
    """Two live graphs over the same parameters group them differently (all four, then ``a`` and ``d``).
    Re-packing ``a`` / ``d`` for the second would move weights under the first (its packed-weight guard
    then refuses to run): the second leaves them apart. Laid out beforehand with ``pack_parameters`` in
    an order where ``a`` / ``d`` lead (``a, d, b, c``), both graphs find their groups packed -- in any
    order -- and fuse them. Outputs equal eager either way; the weights keep their values."""
    from hybrid_compile.compilation.rewrite import pack_parameters

    torch.manual_seed(3)
    block = FourProjections().eval()
    x = torch.randn(5, 16)
    with torch.no_grad():
        want_all, want_two = block(x), block(x, all_four=False)
    params, values = _snapshot(block)
    if laid_out:
        pack_parameters([block.a.weight, block.d.weight, block.b.weight, block.c.weight])
    torch._dynamo.reset()
    first, all_four = _compile_fn(block, x)
    layout = {n: (p.untyped_storage().data_ptr(), p.storage_offset()) for n, p in block.named_parameters()}
    second, two = _compile_fn(lambda t: block(t, all_four=False), x)
    assert {n: (p.untyped_storage().data_ptr(), p.storage_offset()) for n, p in block.named_parameters()} == layout
    assert first.stats.rewrites["fused_groups"] == 1 and first.stats.rewrites["group_sizes"] == {4: 1}
    assert second.stats.rewrites.get("fused_groups", 0) == (1 if laid_out else 0), second.stats.rewrites
    with torch.no_grad():
        torch.testing.assert_close(all_four(x), want_all)  # the first graph still runs: nothing moved
        torch.testing.assert_close(two(x), want_two)
        torch.testing.assert_close(all_four(x[:3]), want_all[:3])
    for name, p in block.named_parameters():
        assert torch.equal(p, values[name]), name
    first.release_packed_weights()
    second.release_packed_weights()


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


def test_engine_routes_projections_to_skinny_mm_and_matches_hf():
    """``extra={"skinny_matmuls": True}`` forces the routing on CPU (the default is CUDA only): every
    projection matmul of the tiny dense Qwen3-Next (per GDN layer: in_proj, out_proj, gate/up, down;
    attention: q/k/v, o_proj, gate/up, down; the LM head) runs as ``skinny_mm``; greedy tokens equal HF."""
    model = cached_model("qwen3_next_dense", 0)
    with _no_compile_caches(), make_engine(model, compile=True, extra={"skinny_matmuls": True}) as engine:
        r = engine.stats()["compile"]["rewrites"]
        assert r["skinny_matmuls"] == 2 * 4 + 4 + 1, r
        prompts = random_prompts([1, 23], vocab_size(model), seed=33)
        got = engine.generate_batch(prompts, max_new_tokens=5)
    for prompt, tokens in zip(prompts, got):
        assert_greedy_equal(model, prompt, tokens, hf_greedy_cached(model, ("qwen3_next_dense", 0), prompt, 5),
                            "skinny_mm")


def test_engine_packs_the_fused_router_with_the_shared_expert():
    """Tiny Qwen3-Next MoE with the fused router (``fused_moe=True``): the router's linear reads a
    reshape of the rows the shared expert reads, and joins its group (router, shared gate / up,
    shared-expert gate: 4 per MoE layer), so each MoE layer issues one projection matmul for the
    four (skinny matmuls per GDN / attention layer: in_proj or q/k/v, out_proj, router + shared
    expert, shared down; plus the LM head), and the router op reads its logits as a strided slice of
    the packed output (no dense copy kernel); greedy tokens equal HF."""
    model = cached_model("qwen3_next_moe", 0)
    # (the shared expert kept apart from the routed experts: extra["fold_shared_experts"]=False)
    with _no_compile_caches(), make_engine(model, compile=True, fused_moe=True,
                                           extra={"skinny_matmuls": True, "fold_shared_experts": False}) as engine:
        r = engine.stats()["compile"]["rewrites"]
        assert r["group_sizes"] == {2: 2, 3: 2, 4: 4} and r["skinny_matmuls"] == 4 * 4 + 1, r
        # the router's logits reach moe_topk_softmax as a column slice of the packed output, no copy
        assert r["strided_slices"] == 4, r
        prompts = random_prompts([1, 23], vocab_size(model), seed=34)
        got = engine.generate_batch(prompts, max_new_tokens=5)
    for prompt, tokens in zip(prompts, got):
        assert_greedy_equal(model, prompt, tokens, hf_greedy_cached(model, ("qwen3_next_moe", 0), prompt, 5),
                            "router packed with the shared expert")


def test_engine_config_turns_the_pass_off():
    model = cached_model("qwen3_next_dense", 0)
    with make_engine(model, compile=True, extra={"rewrite_passes": False}) as engine:
        assert engine.runner.graphs.backend.rewrites is False
        assert engine.stats()["compile"]["rewrites"] == {}
        (prompt,) = random_prompts([12], vocab_size(model), seed=32)
        tokens = engine.generate_batch([prompt], max_new_tokens=4)[0]
    assert_greedy_equal(model, prompt, tokens, hf_greedy_cached(model, ("qwen3_next_dense", 0), prompt, 4), "pass off")


def test_engine_close_unpacks_the_weights(tmp_path):
    """close() undoes the packing: the model is as before the wrap (storage, values, save/load,
    HF generate), and a second wrap of it packs and unpacks again."""
    model = cached_model("qwen3_next_dense", 0)
    params, values = _snapshot(model)
    _assert_own_storage(model, params, values)
    (prompt,) = random_prompts([11], vocab_size(model), seed=33)
    new = 5
    expected = hf_greedy(model, prompt, new)
    for _ in range(2):
        with _no_compile_caches():
            engine = make_engine(model, compile=True)
        try:
            groups = engine.runner.graphs.backend.packed_groups
            assert len(groups) == 6
            buffers = [StorageWeakRef(g.packed.untyped_storage()) for g in groups]
            mixer = model.model.layers[0].linear_attn
            assert mixer.in_proj_ba.weight.storage_offset() == mixer.in_proj_qkvz.weight.numel()  # packed
            tokens = engine.generate_batch([prompt], max_new_tokens=new)[0]
            assert_greedy_equal(model, prompt, tokens, expected, "wrap before close")
            code = engine.runner.graphs._code  # (the runner's own code object: Dynamo's entries hang on it)
            assert _dynamo_entries(code) > 0
        finally:
            engine.close()
        _assert_own_storage(model, params, values)
        gc.collect()
        assert all(b.expired() for b in buffers), "a packed buffer outlives close()"
        assert _dynamo_entries(code) == 0, "Dynamo's compiled entries (outside Python's gc) outlive close()"
        engine.close()  # idempotent
        _assert_own_storage(model, params, values)
        with pytest.raises(RuntimeError, match="engine was closed"):  # (a recompile would pack again)
            engine.generate_batch([prompt], max_new_tokens=1)
        _assert_own_storage(model, params, values)
        assert hf_greedy(model, prompt, new) == expected

    model.save_pretrained(tmp_path, safe_serialization=True)
    reloaded = type(model).from_pretrained(tmp_path)
    state = reloaded.state_dict()
    for name, v in values.items():
        assert torch.equal(state[name], v), name


def _dynamo_entries(code) -> int:
    return len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code))


def test_close_without_a_compile_is_a_no_op():
    model = cached_model("qwen3_next_dense", 0)
    params, values = _snapshot(model)
    with make_engine(model, compile=False) as engine:
        assert engine.runner.release_packed_weights() == 0
    _assert_own_storage(model, params, values)


class _ZeroDrafts:
    """A draft source proposing token 0 k times (rejected drafts: the output stays the target's)."""

    def propose(self, requests, k):
        return [[0] * k for _ in requests]


def test_self_drafting_target_keeps_its_packing_until_the_engine_closes():
    """The target drafting for itself is compiled twice (the target's runner packs, the draft's
    reuses the packing): closing the draft (switching the source) leaves the target's compiled
    graphs their packed weights; the engine's close unpacks."""
    model = cached_model("qwen3_next_dense", 0)
    params, values = _snapshot(model)
    prompts = random_prompts([7, 20], vocab_size(model), seed=34)
    new = 5
    expected = [hf_greedy_cached(model, ("qwen3_next_dense", 0), p, new) for p in prompts]
    spec = dict(method="draft_model", draft_model=model, num_draft_tokens=2)
    with _no_compile_caches():
        engine = make_engine(model, compile=True, speculative=spec)
    try:
        target_groups = engine.runner.graphs.backend.packed_groups
        draft_groups = engine.speculative.source.runner.graphs.backend.packed_groups
        assert [g.packed.data_ptr() for g in draft_groups] == [g.packed.data_ptr() for g in target_groups]
        for phase in ("self-drafting", "after the draft closed"):
            got = engine.generate_batch(prompts, max_new_tokens=new)
            for p, g, e in zip(prompts, got, expected):
                assert_greedy_equal(model, p, g, e, phase)
            engine.speculative.use_source(_ZeroDrafts())  # closes the self-draft
            mixer = model.model.layers[0].linear_attn
            assert mixer.in_proj_ba.weight.storage_offset() == mixer.in_proj_qkvz.weight.numel()  # still packed
    finally:
        engine.close()
    _assert_own_storage(model, params, values)


def test_failed_wrap_after_the_compile_unpacks(monkeypatch):
    """A wrap that fails after the compile packed the weights (e.g. a CUDA graph capture, simulated
    here) leaves the model's weights as they were."""
    from hybrid_compile.engine.graph_setup import CompiledGraphs

    model = cached_model("qwen3_next_dense", 0)
    params, values = _snapshot(model)

    compile_then_capture = CompiledGraphs.setup

    def failing_capture(self, *args):  # the compile runs; the capture that would follow fails
        compile_then_capture(self, *args)
        assert self.backend.packed_groups, "the compile packed nothing"
        raise RuntimeError("simulated capture failure")

    monkeypatch.setattr(CompiledGraphs, "setup", failing_capture)
    with _no_compile_caches(), pytest.raises(RuntimeError, match="simulated capture failure"):
        make_engine(model, compile=True)
    _assert_own_storage(model, params, values)


@pytest.mark.gpu
def test_close_unpacks_under_cuda_graphs():
    """With full and piecewise CUDA graphs (which captured the packed weights' addresses) close()
    unpacks, frees the packed buffers and the engine refuses to replay; a second wrap packs again
    and gives the eager engine's tokens."""
    import copy

    model = copy.deepcopy(cached_model("qwen3_next_dense", 0)).to("cuda")
    params, values = _snapshot(model)
    prompts = random_prompts([20, 3], vocab_size(model), seed=35)
    new = 6
    with make_engine(model, compile=False) as engine:
        reference = engine.generate_batch(prompts, max_new_tokens=new)
    del engine
    _free_cached_device_memory()
    before = torch.cuda.memory_allocated()
    for _ in range(2):
        with make_engine(model, compile=True, cuda_graphs=True, cuda_graph_batch_sizes=(1, 4),
                         piecewise_cuda_graph_tokens=(4, 16, 64)) as engine:
            # (the one-token compile of the batch-1 decode graph reuses the packing: same buffers)
            buffers = list({g.packed.untyped_storage().data_ptr(): StorageWeakRef(g.packed.untyped_storage())
                            for g in engine.runner.graphs.backend.packed_groups}.values())
            assert len(buffers) == 6
            got = engine.generate_batch(prompts, max_new_tokens=new)
            stats = engine.stats()["compile"]
            assert stats["cuda_graph_replays"] > 0 and stats["piecewise_replays"] > 0, stats
        assert got == reference
        _assert_own_storage(model, params, values)
        gc.collect()
        assert all(b.expired() for b in buffers), "a packed buffer outlives close()"
        with pytest.raises(RuntimeError, match="engine was closed"):
            engine.generate_batch(prompts, max_new_tokens=1)
    # a closed engine's device memory goes with it (its pools, CUDA graphs and compiled pieces:
    # Dynamo's entries held them outside Python's gc before close() reset them)
    del engine
    _free_cached_device_memory()
    assert torch.cuda.memory_allocated() <= before + (8 << 20), (before, torch.cuda.memory_allocated())


def _free_cached_device_memory() -> None:
    """Collect garbage and drop what torch caches per stream: cuBLAS keeps a 32 MiB workspace for
    every stream that ran a matmul (each engine's graph-capture stream one), counted as allocated."""
    gc.collect()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
