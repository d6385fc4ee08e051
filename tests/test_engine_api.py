"""The HybridEngine API around the forward pass: sampling and seeds, stop conditions, stats,
streaming, bad input, requests that can never fit, EngineConfig / model-type errors, and
per-instance patching (wrapping one model changes no other model, ``close`` undoes it all).

Outputs are checked against transformers' own greedy ``generate`` on the same weights; after
every run every pool slot is free again.
"""

from __future__ import annotations

import pytest
import torch

import hybrid_compile as hc
from engine_models import (
    RecordingStreamer,
    assert_greedy_equal,
    assert_pools_restored,
    build_model,
    cached_model,
    hf_greedy_cached,
    hf_next_logits,
    make_config,
    make_engine,
    random_prompts,
    single_threaded,
    vocab_size,
)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from single_threaded()


KIND = "qwen3_next_moe"
SEED = 0


@pytest.fixture(scope="module")
def model():
    return cached_model(KIND, SEED)


@pytest.fixture(scope="module")
def prompts(model):
    return random_prompts([23, 41, 9, 70, 3], vocab_size(model), seed=21)


def hf(model, prompt, new, eos=None):
    return hf_greedy_cached(model, (KIND, SEED), prompt, new, eos_token_id=eos)


def new_tokens(out: torch.Tensor, prompt_len: int) -> list[list[int]]:
    return out[:, prompt_len:].tolist()


# ---------------------------------------------------------------------------------------------
# sampling
# ---------------------------------------------------------------------------------------------


def test_sampling_is_reproducible_per_seed_and_differs_across_seeds(model, prompts):
    ids = torch.tensor([prompts[1]])
    kw = dict(max_new_tokens=12, do_sample=True, temperature=1.5, top_k=0, top_p=1.0)
    with make_engine(model) as engine:
        initial = engine.pools.free_counts()
        a = engine.generate(ids, seed=1234, **kw)
        b = engine.generate(ids, seed=1234, **kw)
        c = engine.generate(ids, seed=4321, **kw)
        greedy = engine.generate(ids, max_new_tokens=12)
        assert_pools_restored(engine, initial)
    with make_engine(model, max_running_requests=2) as other:  # a fresh engine: same draws
        d = other.generate(ids, seed=1234, **kw)
    assert torch.equal(a, b), "same seed, different tokens"
    assert torch.equal(a, d), "same seed on a fresh engine, different tokens"
    assert not torch.equal(a, c), "different seeds gave identical samples (is the seed used?)"
    assert not torch.equal(a, greedy), "do_sample=True at temperature 1.5 returned the greedy tokens"


def test_sampled_tokens_do_not_depend_on_batch_composition(model, prompts):
    kw = dict(max_new_tokens=10, do_sample=True, temperature=1.3, top_p=0.95, seed=77)
    with make_engine(model, chunked_prefill_size=32, max_running_requests=4) as engine:
        initial = engine.pools.free_counts()
        three = engine.generate_batch(prompts[:3], **kw)
        five = engine.generate_batch(prompts, **kw)
        # request i of a batch draws with seed + i: alone, with seed + i, it gives the same tokens
        alone = engine.generate_batch([prompts[1]], **{**kw, "seed": 78})
        assert_pools_restored(engine, initial)
    with make_engine(model, max_running_requests=1, chunked_prefill_size=16) as serial:
        serial_five = serial.generate_batch(prompts, **kw)
    assert five[:3] == three
    assert alone[0] == three[1]
    assert serial_five == five
    assert len({tuple(o) for o in five}) == len(five)


def test_do_sample_with_top_k_1_equals_greedy(model, prompts):
    with make_engine(model) as engine:
        initial = engine.pools.free_counts()
        for p in prompts[:3]:
            ids = torch.tensor([p])
            out = engine.generate(ids, max_new_tokens=10, do_sample=True, top_k=1, temperature=0.7, seed=3)
            assert_greedy_equal(model, p, new_tokens(out, len(p))[0], hf(model, p, 10), "top_k=1")
        assert_pools_restored(engine, initial)


def test_logit_transforms_match_transformers_warpers():
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from hybrid_compile.engine.sampling import transform_logits

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 97, generator=g) * 3
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 20, 0.6), (2.0, 1, 0.5)]:
        procs = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
        if top_k > 0:
            procs.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            procs.append(TopPLogitsWarper(top_p))
        expected = procs(torch.zeros(3, 1, dtype=torch.long), logits.clone())
        for row in range(3):
            got = transform_logits(logits[row], temperature, top_k, top_p)
            assert torch.equal(torch.isinf(got), torch.isinf(expected[row])), (temperature, top_k, top_p)
            keep = ~torch.isinf(got)
            torch.testing.assert_close(got[keep], expected[row][keep])


# ---------------------------------------------------------------------------------------------
# stop conditions, stats, streaming
# ---------------------------------------------------------------------------------------------


def _early_token(free_run: list[int]) -> tuple[int, int]:
    """A token of ``free_run`` and the index of its first occurrence, at least 2 in."""
    for i in range(2, len(free_run) - 2):
        if free_run.index(free_run[i]) == i:
            return free_run[i], i
    raise AssertionError(f"no early stop token in {free_run}")


def test_eos_and_stop_tokens_stop_like_hf(model, prompts):
    p = prompts[0]
    new = 12
    free_run = hf(model, p, new)
    tok, k = _early_token(free_run)
    with_eos = hf(model, p, new, eos=tok)
    assert with_eos == free_run[: k + 1] and with_eos[-1] == tok
    never = next(t for t in range(1, vocab_size(model)) if t not in free_run)
    ids = torch.tensor([p])
    with make_engine(model) as engine:
        initial = engine.pools.free_counts()
        out = engine.generate(ids, max_new_tokens=new, eos_token_id=tok)
        assert out.shape == (1, len(p) + k + 1)
        assert new_tokens(out, len(p))[0] == with_eos
        out = engine.generate(ids, max_new_tokens=new, eos_token_id=[never, tok])
        assert new_tokens(out, len(p))[0] == with_eos
        # stop_token_ids, alone and through generate_batch
        assert engine.generate_batch([p], max_new_tokens=new, stop_token_ids=[tok]) == [with_eos]
        # ignore_eos runs to max_new_tokens
        out = engine.generate(ids, max_new_tokens=new, eos_token_id=tok, ignore_eos=True)
        assert new_tokens(out, len(p))[0] == free_run
        # the model's generation_config supplies eos_token_id, as in HF
        saved = model.generation_config.eos_token_id
        model.generation_config.eos_token_id = tok
        try:
            out = engine.generate(ids, max_new_tokens=new)
        finally:
            model.generation_config.eos_token_id = saved
        assert new_tokens(out, len(p))[0] == with_eos
        # max_new_tokens is respected exactly
        for n in (1, 2, 5):
            out = engine.generate(ids, max_new_tokens=n)
            assert new_tokens(out, len(p))[0] == free_run[:n]
        assert [len(o) for o in engine.generate_batch(prompts, max_new_tokens=3)] == [3] * len(prompts)
        assert_pools_restored(engine, initial)


def test_stats_counters_match_the_work_done(model, prompts):
    with make_engine(model, chunked_prefill_size=32, max_running_requests=3) as engine:
        initial = engine.pools.free_counts()
        s0 = engine.stats()
        assert {s0[k] for k in ("requests_added", "requests_finished", "prefill_tokens", "decode_tokens",
                                "generated_tokens", "steps", "retractions")} == {0}
        p = prompts[3]  # 70 tokens: 3 prefill chunks of <= 32
        engine.generate(torch.tensor([p]), max_new_tokens=6)
        s1 = engine.stats()
        assert s1["requests_added"] == s1["requests_finished"] == 1
        assert s1["prefill_tokens"] == len(p)
        assert s1["decode_tokens"] == 5
        assert s1["generated_tokens"] == 6
        assert s1["extend_steps"] == 3 and s1["decode_steps"] == 5 and s1["steps"] == 8
        assert s1["waiting"] == s1["running"] == 0
        assert s1["prefix_cache"]["cached_tokens"] > 0  # on by default: it keeps the finished request
        engine.clear_prefix_cache()
        assert engine.stats()["memory"]["free"] == initial

        batch = prompts[:3]
        outs = engine.generate_batch(batch, max_new_tokens=7)
        s2 = engine.stats()
        assert s2["requests_added"] - s1["requests_added"] == 3
        assert s2["requests_finished"] - s1["requests_finished"] == 3
        assert s2["generated_tokens"] - s1["generated_tokens"] == sum(len(o) for o in outs) == 21
        assert s2["retractions"] == 0
        # every prompt token and every fed-back output token went through the model once
        fed = (s2["prefill_tokens"] + s2["decode_tokens"]) - (s1["prefill_tokens"] + s1["decode_tokens"])
        assert fed == sum(len(b) for b in batch) + sum(len(o) - 1 for o in outs)
        assert_pools_restored(engine, initial)


def test_a_lone_last_prompt_token_is_prefilled_not_decoded(model, prompts):
    """DECODE steps hold generated tokens only (the Mamba2 layer op clamps no ``dt`` in them): a
    prompt whose chunk boundary leaves its last token alone takes one more EXTEND step, and its
    greedy tokens are still HF's."""
    from hybrid_compile.layers.context import ForwardMode

    prompt = (prompts[3] + prompts[0])[:33]  # chunks of 32 + 1
    with make_engine(model, chunked_prefill_size=32) as engine:
        engine.overlap = False
        steps = []
        forward = engine.runner.forward

        def recording_forward(batch):
            steps.append((batch.mode, list(batch.extend_lens)))
            return forward(batch)

        engine.runner.forward = recording_forward
        out = engine.generate(torch.tensor([prompt]), max_new_tokens=3)
    extend, decode = ForwardMode.EXTEND, ForwardMode.DECODE
    assert steps == [(extend, [32]), (extend, [1]), (decode, [1]), (decode, [1])]
    assert new_tokens(out, len(prompt)) == [hf(model, prompt, 3)]


@pytest.mark.parametrize("speculative", [None, dict(method="ngram", num_draft_tokens=2)], ids=["plain", "ngram"])
def test_kernel_warm_up_leaves_no_trace(model, prompts, speculative):
    """``warmup_kernels`` (on by default on CUDA) serves two requests at wrap time through every
    step kind (extend, prefix-cache checkpoint and hit, mixed, decode; verify with speculative)
    and forgets them: counters at zero, request ids from 0, prefix cache empty, pools as an
    engine without warm-up has them, outputs equal HF's greedy."""
    kw = dict(chunked_prefill_size=32, max_running_requests=3, speculative=speculative)
    with make_engine(model, warmup_kernels=False, **kw) as cold:
        cold_free = cold.pools.free_counts()
        assert cold.stats()["warmup_kernels_seconds"] == 0.0
    with make_engine(model, warmup_kernels=True, **kw) as engine:
        s = engine.stats()
        assert s["warmup_kernels_seconds"] > 0
        assert {s[k] for k in ("requests_added", "requests_finished", "prefill_tokens", "decode_tokens",
                               "generated_tokens", "steps", "retractions", "waiting", "running")} == {0}
        assert s["prefix_cache"]["cached_tokens"] == 0 and s["prefix_cache"]["admitted_requests"] == 0
        if speculative is not None:
            assert s["speculative"]["verify_steps"] == 0 and s["speculative"]["acceptance_histogram"] == {}
        assert engine.pools.free_counts() == cold_free
        assert engine.add_request(prompts[0], hc.SamplingParams(max_new_tokens=4)) == 0
        while engine.has_unfinished():
            engine.step()
        assert_greedy_equal(model, prompts[0], engine.pop_finished(0).output, hf(model, prompts[0], 4))
        assert_pools_restored(engine, cold_free)


def test_warm_up_runs_every_step_kind(model):
    """The warm-up really goes through a checkpointed extend, a prefix hit and a mixed step (the
    kernel variants it exists to compile): counted before the counters are restored."""
    seen = []

    class Spy(hc.HybridEngine):
        def _warm_up_kernels(self):
            launch = self._launch

            def spy(batch):
                seen.append((batch.mode.value, sum(batch.prefix_lens) > 0 and batch.mode.value == "extend",
                             any(s >= 0 for s in (batch.track_slots or [])), len(batch.requests)))
                return launch(batch)

            self._launch = spy
            super()._warm_up_kernels()
            del self._launch

    engine = Spy(model, hc.EngineConfig(max_running_requests=3, mamba_cache_size=3, max_total_tokens=2048,
                                        warmup_kernels=True))
    try:
        modes = {m for m, _, _, _ in seen}
        assert modes == {"extend", "decode"}, seen
        assert any(hit for _, hit, _, _ in seen), "no extend over a cached prefix"
        assert any(tracked for _, _, tracked, _ in seen), "no prefix-cache checkpoint"
        assert any(m == "extend" and n == 2 for m, _, _, n in seen), "no mixed extend + decode step"
    finally:
        engine.close()


def test_prefill_and_decode_token_counters_split_by_token_kind(model, prompts):
    """prefill_tokens counts prompt tokens, decode_tokens counts fed-back output tokens, also
    when a step mixes decodes with another request's prefill chunk."""
    batch = [prompts[2], prompts[3]]  # 9 tokens (decodes soon) and 70 (prefilled in chunks)
    with make_engine(model, chunked_prefill_size=16, max_running_requests=2) as engine:
        outs = engine.generate_batch(batch, max_new_tokens=8)
        s = engine.stats()
    assert s["prefill_tokens"] == sum(len(b) for b in batch)
    assert s["decode_tokens"] == sum(len(o) - 1 for o in outs)


def test_streamer_gets_prompt_then_each_token_then_end(model, prompts):
    p = prompts[3]  # longer than a prefill chunk: chunk steps must not stream anything
    with make_engine(model, chunked_prefill_size=32) as engine:
        initial = engine.pools.free_counts()
        streamer = RecordingStreamer()
        out = engine.generate(torch.tensor([p]), max_new_tokens=6, streamer=streamer)
        with pytest.raises(ValueError, match="batch size 1"):
            engine.generate(torch.tensor([p[:5], p[5:10]]), max_new_tokens=2, streamer=RecordingStreamer())
        assert_pools_restored(engine, initial)
    new = new_tokens(out, len(p))[0]
    assert new == hf(model, p, 6)
    assert streamer.calls[0] == ("put", [p])
    assert streamer.calls[1:-1] == [("put", [t]) for t in new]
    assert streamer.calls[-1] == ("end", None)


def test_streamer_gets_only_its_own_requests_tokens(model, prompts):
    """A request queued with add_request before a streamed generate() keeps running during it;
    its tokens must not reach generate()'s streamer."""
    other, p = prompts[0], prompts[2]
    with make_engine(model) as engine:
        initial = engine.pools.free_counts()
        rid = engine.add_request(other, hc.SamplingParams(max_new_tokens=8))
        engine.step()
        streamer = RecordingStreamer()
        out = engine.generate(torch.tensor([p]), max_new_tokens=5, streamer=streamer)
        assert _drain(engine, rid) == hf(model, other, 8)
        assert_pools_restored(engine, initial)
    new = new_tokens(out, len(p))[0]
    assert new == hf(model, p, 5)
    assert streamer.calls == [("put", [p])] + [("put", [t]) for t in new] + [("end", None)]


def test_generation_config_max_new_tokens_is_used_like_hf(model, prompts):
    from transformers import GenerationConfig

    p = prompts[2]
    ids = torch.tensor([p])
    with make_engine(model) as engine:
        initial = engine.pools.free_counts()
        # an explicit generation_config
        out = engine.generate(ids, generation_config=GenerationConfig(max_new_tokens=4, do_sample=False))
        assert new_tokens(out, len(p))[0] == hf(model, p, 4)
        # the model's own generation_config, as model.generate() reads it
        saved = model.generation_config.max_new_tokens
        model.generation_config.max_new_tokens = 3
        try:
            hf_out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False)
            out = engine.generate(ids)
        finally:
            model.generation_config.max_new_tokens = saved
        assert hf_out.shape == (1, len(p) + 3)
        assert torch.equal(out, hf_out)
        assert_pools_restored(engine, initial)


# ---------------------------------------------------------------------------------------------
# bad input and requests that can never fit: clear errors, nothing in flight lost
# ---------------------------------------------------------------------------------------------


def _drain(engine, rid: int) -> list[int]:
    for _ in range(1_000):
        if not engine.has_unfinished():
            break
        engine.step()
    return engine.pop_finished(rid).output


def test_bad_input_raises_clear_errors_and_loses_nothing_in_flight(model, prompts):
    vocab = vocab_size(model)
    p = prompts[1]
    with make_engine(model) as engine:
        initial = engine.pools.free_counts()
        rid = engine.add_request(p, hc.SamplingParams(max_new_tokens=8))
        engine.step()
        engine.step()  # the request is running, with state in the pools
        assert engine.pools.used_counts()["mamba_slots"] == 1
        steps = engine.stats()["steps"]

        with pytest.raises(ValueError, match="empty"):
            engine.generate_batch([prompts[0], []], max_new_tokens=4)
        with pytest.raises(ValueError, match="empty"):
            engine.generate(torch.zeros((1, 0), dtype=torch.long), max_new_tokens=4)
        with pytest.raises(ValueError, match=rf"prompt 1 .*vocabulary.*{vocab}"):
            engine.generate_batch([prompts[0], [1, vocab, 2]], max_new_tokens=4)
        with pytest.raises(ValueError, match=r"prompt 0 .*vocabulary"):
            engine.generate_batch([[3, -1, 4]], max_new_tokens=4)
        with pytest.raises(ValueError, match=r"vocabulary"):
            engine.add_request([vocab + 5])
        with pytest.raises(ValueError, match="guidance_scale"):
            engine.generate(torch.tensor([p]), max_new_tokens=4, guidance_scale=1.3)
        with pytest.raises(ValueError, match="not_an_option"):
            engine.generate(torch.tensor([p]), max_new_tokens=4, not_an_option=1)
        with pytest.raises(ValueError, match="num_beams|beam"):
            engine.generate(torch.tensor([p]), max_new_tokens=4, num_beams=2)
        for bad in (0, -2):
            with pytest.raises(ValueError, match="max_new_tokens"):
                engine.generate(torch.tensor([p]), max_new_tokens=bad)
            with pytest.raises(ValueError, match="max_new_tokens"):
                engine.generate_batch([p], max_new_tokens=bad)
            with pytest.raises(ValueError, match="max_new_tokens"):
                engine.add_request(p, hc.SamplingParams(max_new_tokens=bad))

        # none of that queued or ran anything
        s = engine.stats()
        assert s["requests_added"] == 1 and s["steps"] == steps and s["waiting"] + s["running"] == 1
        assert _drain(engine, rid) == hf(model, p, 8)
        assert_pools_restored(engine, initial)


def test_request_that_can_never_fit_raises_before_any_work(model, prompts):
    capacity = 128
    ok, other = prompts[1], prompts[0]
    too_long = random_prompts([capacity], vocab_size(model), seed=5)[0]
    with make_engine(model, max_total_tokens=capacity, max_running_requests=4) as engine:
        initial = engine.pools.free_counts()
        rid = engine.add_request(ok, hc.SamplingParams(max_new_tokens=8))
        engine.step()  # in flight
        before = engine.stats()
        used = engine.pools.used_counts()
        with pytest.raises(ValueError, match=r"prompt 1 \(128 tokens\)"):
            engine.generate_batch([other, too_long], max_new_tokens=4)
        with pytest.raises(ValueError, match=r"prompt 0 "):
            engine.generate(torch.tensor([too_long[:125]]), max_new_tokens=4)  # 125 + 4 > 128
        after = engine.stats()
        for key in ("requests_added", "steps", "prefill_tokens", "decode_tokens", "waiting", "running"):
            assert after[key] == before[key], key
        assert engine.pools.used_counts() == used
        # a request that fits exactly is accepted and served, and so is the one in flight
        fits = too_long[:120]
        assert engine.generate_batch([fits], max_new_tokens=8) == [hf(model, fits, 8)]
        assert _drain(engine, rid) == hf(model, ok, 8)
        assert_pools_restored(engine, initial)


def test_prompt_longer_than_max_context_len_raises(model, prompts):
    with make_engine(model, max_context_len=48, max_total_tokens=1024) as engine:
        initial = engine.pools.free_counts()
        long_prompt = random_prompts([41], vocab_size(model), seed=6)[0]
        with pytest.raises(ValueError, match=r"prompt 2 .*context length 48"):
            engine.generate_batch([prompts[0], prompts[2], long_prompt], max_new_tokens=8)  # 41 + 8 > 48
        assert engine.stats()["requests_added"] == 0
        assert engine.generate_batch([long_prompt[:40]], max_new_tokens=8) == [hf(model, long_prompt[:40], 8)]
        assert_pools_restored(engine, initial)


def test_unknown_engine_config_field_raises_type_error_listing_fields(model):
    with pytest.raises(TypeError, match=r"not_a_field.*valid fields:.*max_total_tokens"):
        hc.wrap(model, not_a_field=1)
    with pytest.raises(TypeError, match=r"also_bad.*valid fields:.*chunked_prefill_size"):
        hc.wrap(model, config={"also_bad": 2})
    assert not any("forward" in m.__dict__ for m in model.modules()), "a failed wrap left a patch behind"


def test_unsupported_model_type_raises_listing_supported_types():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    llama = LlamaForCausalLM(cfg).eval()
    with pytest.raises(ValueError, match=r"'llama'.*supported model types:.*qwen3_5_moe_text.*qwen3_5_text.*qwen3_next"):
        hc.wrap(llama)
    assert not any("forward" in m.__dict__ for m in llama.modules())
    assert all(getattr(m, "config", cfg) is cfg for m in llama.modules())
    assert set(hc.supported_model_types()) >= {"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"}


# ---------------------------------------------------------------------------------------------
# per-instance patching
# ---------------------------------------------------------------------------------------------


def _module_configs(model) -> dict[str, int]:
    """id of the config object each module sees, by module name."""
    return {name: id(m.config) for name, m in model.named_modules() if hasattr(m, "config")}


def test_wrap_patches_only_its_own_instance_and_close_undoes_it():
    kind = "qwen3_5"
    config = make_config(kind)
    a = build_model(kind, 3, config=config)
    b = build_model(kind, 4, config=config)  # same config object
    assert a.config is b.config is config
    attn_impl = config._attn_implementation
    prompt = random_prompts([19], vocab_size(a), seed=9)[0]
    ids = torch.tensor([prompt])
    gen_kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))

    a_gen = a.generate(ids, **gen_kw)
    # a left-padded batch exercises HF's padding-mask path (mask functions) as well
    padded = torch.zeros((2, 19), dtype=torch.long)
    padded[0] = ids[0]
    padded[1, 7:] = ids[0, :12]
    padded_mask = (torch.arange(19) >= torch.tensor([[0], [7]])).long()
    padded_kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, attention_mask=padded_mask)
    a_padded_gen = a.generate(padded, **padded_kw)
    a_logits = hf_next_logits(a, prompt)
    b_logits = hf_next_logits(b, prompt)
    a_configs = _module_configs(a)
    b_configs = _module_configs(b)
    class_forwards = {type(m): type(m).forward for m in a.modules()}

    engine = hc.wrap(a, max_total_tokens=256, max_running_requests=2, mamba_cache_size=2)
    try:
        assert any("forward" in m.__dict__ for m in a.modules()), "wrap patched nothing on its model"
        assert _module_configs(a) != a_configs, "wrap left A's attention config untouched"
        # B and the shared config are untouched
        assert not any("forward" in m.__dict__ for m in b.modules())
        assert _module_configs(b) == b_configs
        assert config._attn_implementation == attn_impl
        assert torch.equal(hf_next_logits(b, prompt), b_logits)
        # the classes are untouched
        assert all(type(m).forward is f for m, f in ((m, class_forwards[type(m)]) for m in a.modules()))
        # outside an engine step A is HF's model: its own generate gives what it gave before
        assert torch.equal(a.generate(ids, **gen_kw), a_gen)
        assert torch.equal(a.generate(padded, **padded_kw), a_padded_gen)
        torch.testing.assert_close(hf_next_logits(a, prompt), a_logits, rtol=0, atol=1e-6)
        # and the engine on A gives HF's tokens too
        out = engine.generate(ids, max_new_tokens=8)
        assert_greedy_equal(a, prompt, out[0, len(prompt):].tolist(), a_gen[0, len(prompt):].tolist(), "wrapped A")
        assert torch.equal(hf_next_logits(b, prompt), b_logits)
    finally:
        engine.close()

    assert not any("forward" in m.__dict__ for m in a.modules()), "close() left instance forwards on A"
    assert _module_configs(a) == a_configs, "close() did not restore A's modules' config objects"
    assert all(m.config is config for m in a.modules() if hasattr(m, "config"))
    assert config._attn_implementation == attn_impl
    assert torch.equal(a.generate(ids, **gen_kw), a_gen)
    assert torch.equal(a.generate(padded, **padded_kw), a_padded_gen)
    assert torch.equal(hf_next_logits(a, prompt), a_logits)

    # wrapping again after close works and still matches HF
    with hc.wrap(a, max_total_tokens=256, max_running_requests=2, mamba_cache_size=2) as again:
        out = again.generate(ids, max_new_tokens=8)
    assert out[0, len(prompt):].tolist() == a_gen[0, len(prompt):].tolist()
    assert not any("forward" in m.__dict__ for m in a.modules())


def _bf16_state_model(kind: str):
    if kind == "mamba2":
        # plain Mamba2 (the tiny NemotronH's MoE layer makes transformers' own cached decode
        # differ from its uncached forward by ~1e-3, which would hide the effect measured here)
        from mamba2_models import build_mamba2

        return build_mamba2(seed=3)
    return cached_model(kind, SEED)


@pytest.mark.parametrize("kind", ["qwen3_next_dense", "mamba2"])
def test_bf16_recurrent_state_tracks_hf_logits_within_its_rounding(kind):
    """``ssm_state_dtype="bfloat16"`` (vLLM's default for these layers: half the state bytes per
    decode step) really keeps the recurrent state in bf16, and every step's logits stay within
    bf16 rounding of transformers' fp32 logits on the same tokens, while the fp32-state engine
    is exact to fp32 noise. The oracle is HF's plain forward over prompt + the engine's tokens."""
    model = _bf16_state_model(kind)
    (prompt,) = random_prompts([40], vocab_size(model), seed=11)
    errors = {}
    for dtype in (torch.float32, torch.bfloat16):
        with make_engine(model, ssm_state_dtype=str(dtype).replace("torch.", "")) as engine:
            assert {b.dtype for b in engine.pools.mamba.ssm_buffers} == {dtype}
            captured = []
            forward = engine.runner.forward

            def tapped(batch, forward=forward):
                out = forward(batch)
                captured.append(out[0].detach().float().clone())
                return out

            engine.runner.forward = tapped
            (out,) = engine.generate_batch([prompt], max_new_tokens=8, ignore_eos=True)
        assert len(captured) == len(out)
        worst = 0.0
        for i, got in enumerate(captured):
            ref = hf_next_logits(model, prompt + out[:i])
            worst = max(worst, ((got - ref).abs().max() / ref.abs().max()).item())
        errors[dtype] = worst
    assert errors[torch.float32] < 1e-5, errors
    # bf16 keeps 8 mantissa bits (relative rounding up to 2^-9 per element): the logits move by
    # well under a percent, and by far more than fp32 noise (the state really was rounded)
    assert 10 * errors[torch.float32] < errors[torch.bfloat16] < 2e-2, errors
