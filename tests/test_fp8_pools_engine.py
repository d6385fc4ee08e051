"""FP8 pools in the engine: ``kv_cache_dtype="fp8"`` and ``ssm_state_dtype="fp8"``.

The pools really hold e4m3 (with fp32 scales beside them), every step's logits stay within a stated
tolerance of the fp32 logits of transformers' own forward on the same tokens (the oracle of the bf16
state test), further from them than the bf16 state; and the memory budget sized with the smaller
elements holds more tokens and Mamba slots (``stats()["memory"]``).
"""

from __future__ import annotations

import pytest
import torch

from engine_models import cached_model, hf_next_logits, make_engine, random_prompts, vocab_size
from hybrid_compile.memory import plan_memory
from test_engine_api import SEED, _bf16_state_model

FP8 = torch.float8_e4m3fn


def _step_errors(model, prompt, steps, **overrides):
    """(engine, worst over steps of max|logits - HF| / max|HF|) of one greedy request."""
    with make_engine(model, **overrides) as engine:
        captured = []
        forward = engine.runner.forward

        def tapped(batch, forward=forward):
            out = forward(batch)
            captured.append(out[0].detach().float().clone())
            return out

        engine.runner.forward = tapped
        (out,) = engine.generate_batch([prompt], max_new_tokens=steps, ignore_eos=True)
        pools = engine.pools
        dtypes = ({b.dtype for b in pools.mamba.ssm_buffers}, {b.dtype for b in pools.kv.k_buffers})
        scales = (len(pools.mamba.ssm_scale_buffers), len(pools.kv.scale_buffers))
    worst = 0.0
    for i, got in enumerate(captured):
        ref = hf_next_logits(model, prompt + out[:i])
        worst = max(worst, ((got - ref).abs().max() / ref.abs().max()).item())
    return worst, dtypes, scales


@pytest.mark.parametrize("kind", ["qwen3_next_dense", "mamba2"])
def test_fp8_state_and_kv_cache_track_hf_logits_within_e4m3_rounding(kind):
    model = _bf16_state_model(kind)
    (prompt,) = random_prompts([40], vocab_size(model), seed=11)
    errors = {}
    for name, kw in (("fp32", dict(ssm_state_dtype="float32")), ("bf16", dict(ssm_state_dtype="bfloat16")),
                     ("fp8", dict(ssm_state_dtype="fp8")), ("fp8_kv", dict(kv_cache_dtype="fp8"))):
        errors[name], (ssm_dtypes, kv_dtypes), (ssm_scales, kv_scales) = _step_errors(model, prompt, 8, **kw)
        if name == "fp8":
            assert ssm_dtypes == {FP8} and ssm_scales > 0  # e4m3 values + fp32 scales
        if name == "fp8_kv":
            if kv_dtypes:  # (plain Mamba2 has no attention layer)
                assert kv_dtypes == {FP8} and kv_scales > 0
            assert ssm_dtypes == {torch.float32}
    print(kind, errors)
    assert errors["fp32"] < 1e-5, errors
    # e4m3 keeps 3 mantissa bits (relative rounding up to 2^-4 of each vector's largest element), re-
    # applied at every step: the logits move by a few percent at most, and clearly more than with a
    # bf16 state (8 mantissa bits)
    assert errors["bf16"] < errors["fp8"] < 0.1, errors
    if kind != "mamba2":
        assert 10 * errors["fp32"] < errors["fp8_kv"] < 0.1, errors


def test_fp8_pools_give_more_capacity_from_one_budget():
    """The same budget holds more KV tokens and Mamba slots in proportion to the smaller bytes per
    token / slot: e4m3 values plus one fp32 scale per vector (a vector is 16 elements in the tiny
    model, 128 or 256 in the real ones: there the gain is ~1.9x over bf16 K/V and ~3.9x over an
    fp32 state)."""
    model = cached_model("qwen3_next_dense", SEED)
    from hybrid_compile.models import family_of

    family = family_of(model)
    dt = next(model.parameters()).dtype  # (the tiny model's: fp32)
    base = family.layout(model, kv_dtype=dt, conv_dtype=dt, ssm_dtype=torch.float32)
    fp8 = family.layout(model, kv_dtype=FP8, conv_dtype=dt, ssm_dtype=FP8)
    kw = dict(device="cpu", max_running_requests=4, max_context_len=256, memory_budget_bytes=64 << 20)
    p0 = plan_memory(base.attention, base.mamba, **kw)
    p1 = plan_memory(fp8.attention, fp8.mamba, **kw)
    kv0, kv1 = sum(s.bytes_per_token for s in base.attention), sum(s.bytes_per_token for s in fp8.attention)
    heads = sum(s.num_kv_heads * s.num_layers for s in fp8.attention)
    # one byte per K/V element, plus an fp32 scale per token, head and K/V
    assert kv1 == kv0 // dt.itemsize + 2 * 4 * heads
    # the budget's KV part holds as many more tokens as a token got smaller (whole pages: +-1%)
    assert p1.max_total_tokens / p0.max_total_tokens == pytest.approx(kv0 / kv1, rel=0.02)
    ssm0 = sum(s.ssm_bytes_per_slot_per_layer * s.num_layers for s in base.mamba)
    ssm1 = sum(s.ssm_bytes_per_slot_per_layer * s.num_layers for s in fp8.mamba)
    vec = fp8.mamba[0].state_shape[fp8.mamba[0].ssm_scale_dim]  # elements per scale
    assert ssm1 * vec == ssm0 // 4 * (vec + 4)  # 1 byte per element + 4 per vector, against 4 per element
    ratio = p1.mamba_cache_size / p0.mamba_cache_size
    assert ratio == pytest.approx(p0.bytes_per_mamba_slot / p1.bytes_per_mamba_slot, rel=0.01) and ratio > 1.5  # (the conv window stays in the model dtype)

    # the engine reports the dtypes, the smaller bytes per token / slot and the capacity it got
    with make_engine(model, kv_cache_dtype="fp8", ssm_state_dtype="fp8", max_total_tokens=None,
                     mamba_cache_size=None, memory_fraction=0.001) as engine:
        mem = engine.stats()["memory"]
        assert mem["dtypes"] == {"kv": ["float8_e4m3fn"], "ssm": ["float8_e4m3fn"]}
        assert mem["bytes"]["per_token"] == kv1
        assert mem["bytes"]["per_mamba_slot"] == p1.bytes_per_mamba_slot
        assert mem["capacity"]["kv_tokens"] > 0 and mem["capacity"]["mamba_slots"] > 0


def test_unknown_pool_dtypes_are_rejected():
    model = cached_model("qwen3_next_dense", SEED)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make_engine(model, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="ssm_state_dtype"):
        make_engine(model, ssm_state_dtype="fp4")


@pytest.mark.parametrize("kind", ["qwen3_next_dense", "mamba2"])
def test_fp8_pools_with_speculative_decoding_and_prefix_cache(kind):
    """Speculative verify rounds the FP8 state between its steps exactly as decode steps store it,
    and commits values with their scales: greedy tokens equal the plain FP8 engine's, through
    prefix-cache hits on FP8 checkpoints (tracked inside prefills and committed by verify steps)."""
    model = _bf16_state_model(kind)
    prompts = random_prompts([70, 11, 25], vocab_size(model), seed=7) + [[5, 9, 14, 3] * 5]
    kw = dict(ssm_state_dtype="fp8", kv_cache_dtype="fp8", max_running_requests=3, mamba_cache_size=16,
              chunked_prefill_size=64, enable_prefix_cache=True)
    outputs = []
    for speculative in (None, dict(method="draft_model", draft_model=model, num_draft_tokens=3)):
        with make_engine(model, speculative=speculative, **kw) as engine:
            got = engine.generate_batch(prompts, max_new_tokens=10)
            follow = [p + g for p, g in zip(prompts, got)]  # hit the cache at the finished requests' length
            more = engine.generate_batch(follow, max_new_tokens=5)
            stats = engine.stats()
            assert stats["prefix_cache"]["hit_tokens"] > 0
            if speculative:
                # (not all accepted: the self-draft catches up on accepted tokens in extend steps, which
                # round its own FP8 state once per extend, not once per token)
                assert stats["speculative"]["verify_steps"] > 0 and stats["speculative"]["acceptance_rate"] > 0.5
            engine.clear_prefix_cache()
            engine.pools.check_all_free()
        outputs.append((got, more))
    assert outputs[0] == outputs[1]


def test_fp8_pools_compiled_engine_matches_eager_without_graph_breaks():
    """torch.compile(fullgraph) of the model with FP8 pools: the layer ops stay opaque split points,
    no graph break, and the greedy tokens equal the eager FP8 engine's."""
    model = cached_model("qwen3_next_dense", SEED)
    prompts = random_prompts([5, 70], vocab_size(model), seed=3)
    kw = dict(ssm_state_dtype="fp8", kv_cache_dtype="fp8")
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    with make_engine(model, compile=True, **kw) as engine:
        compiled = engine.generate_batch(prompts, max_new_tokens=6)
        assert engine.stats()["compile"]["graph_breaks"] == 0
    assert dict(torch._dynamo.utils.counters["graph_break"]) == breaks
    with make_engine(model, **kw) as engine:
        assert engine.generate_batch(prompts, max_new_tokens=6) == compiled


@pytest.mark.parametrize("name", ["gdn", "mamba2", "lightning"])
def test_fp8_verify_then_commit_equals_decode_steps(name):
    """Layer ops on FP8 pools: a TARGET_VERIFY batch + the commit of the accepted steps leaves the
    same e4m3 state (values and scales), and gives the same outputs, as one DECODE step per token
    (verify rounds the state between its steps as decode stores it)."""
    from hybrid_compile.layers.context import ForwardContext, ForwardMode, forward_context
    from hybrid_compile.ops.fp8_cache import (
        GDN_STATE_SCALE_DIM, MAMBA2_STATE_SCALE_DIM, dequantize_vectors, quantize_vectors,
    )
    from test_speculative import _layer_cases, _metadata

    dim = MAMBA2_STATE_SCALE_DIM if name == "mamba2" else GDN_STATE_SCALE_DIM  # (lightning: K, as GDN)
    case = _layer_cases()[name]
    steps, slots, prefix = 4, [2, 0], [6, 9]
    g = torch.Generator().manual_seed(6)
    conv0 = torch.randn(3, case["width"] - 1, case["conv_dim"], generator=g)
    q0, s0 = quantize_vectors(torch.randn(3, *case["state"], generator=g), dim)
    inputs = case["inputs"](len(slots) * steps)

    conv, q, s = conv0.clone(), q0.clone(), s0.clone()
    inter = (torch.zeros(len(slots) + 1, steps, *conv.shape[1:]), torch.zeros(len(slots) + 1, steps, *q.shape[1:],
             dtype=FP8), torch.zeros(len(slots) + 1, steps, *s.shape[1:]))
    md = _metadata(ForwardMode.TARGET_VERIFY, slots, prefix, steps, prompt_len=5)
    with forward_context(ForwardContext(md, {}, {0: (conv, q, s)}, {0: inter})):
        verify_out = case["op"](*inputs, *case["params"])
    assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0)  # untouched

    dconv, dq, ds = conv0.clone(), q0.clone(), s0.clone()
    decode_out, states = [], []
    for t in range(steps):
        rows = torch.arange(len(slots)) * steps + t
        md = _metadata(ForwardMode.DECODE, slots, [p + t for p in prefix], 1, prompt_len=5)
        with forward_context(ForwardContext(md, {}, {0: (dconv, dq, ds)})):
            decode_out.append(case["op"](*(x[rows] for x in inputs), *case["params"]))
        states.append((dconv.clone(), dq.clone(), ds.clone()))
    decode_out = torch.stack(decode_out, dim=1).flatten(0, 1)
    torch.testing.assert_close(verify_out, decode_out, rtol=1e-6, atol=1e-6)

    accepted = [3, 1]
    torch.ops.hybrid_compile.commit_speculative_state([conv, q, s], list(inter), torch.tensor(slots),
                                                      torch.tensor(accepted))
    for slot, a in zip(slots, accepted):
        # (decode gates inside its fused GDN kernel, verify outside it: fp32 noise apart, the same
        # state; a value may sit on an e4m3 rounding boundary, so allow one step of its vector)
        torch.testing.assert_close(s[slot], states[a - 1][2][slot], rtol=1e-5, atol=0)
        got = dequantize_vectors(q[slot], s[slot], dim)
        want = dequantize_vectors(states[a - 1][1][slot], states[a - 1][2][slot], dim)
        assert ((got - want).abs() <= 32 * s[slot].unsqueeze(dim) + 1e-7).all()
        assert (q[slot].view(torch.uint8) == states[a - 1][1][slot].view(torch.uint8)).float().mean() > 0.99
