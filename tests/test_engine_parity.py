"""Engine output equals transformers' own greedy ``generate`` on the same weights.

Every model kind (Qwen3-Next MoE and dense, Qwen3.5 dense and MoE text models: tiny, random
weights, fp32) through single prompts, continuous batching with chunked prefill and requests
joining while others decode, left-padded ``generate`` batches with early-stopping rows, and a
KV pool too small for all requests at once (retraction). The oracle runs per prompt.
After every run all pool slots are free again.
"""

from __future__ import annotations

import pytest
import torch

from engine_models import (
    KINDS,
    assert_greedy_equal,
    assert_pools_restored,
    build_model,
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

# (seed, prompt length): a one-token prompt, a short one, and one longer than a prefill chunk
# (64 tokens, also the GDN kernel's chunk) so that it is prefilled in pieces.
SINGLE_CASES = [(0, 37), (1, 1), (2, 130)]


class StepRecorder:
    """Records what the scheduler put in each step (rows' prefix and new-token counts)."""

    def __init__(self, engine) -> None:
        self.steps: list[list[tuple[int, int, int]]] = []  # per step: (rid, prefix_len, extend_len)
        scheduler = engine.scheduler
        original = scheduler.schedule

        def schedule():
            batch = original()
            if batch is not None:
                self.steps.append([(r.rid, p, n) for r, p, n in zip(batch.requests, batch.prefix_lens, batch.extend_lens)])
            return batch

        scheduler.schedule = schedule


@pytest.mark.parametrize("seed,length", SINGLE_CASES, ids=[f"seed{s}-len{n}" for s, n in SINGLE_CASES])
@pytest.mark.parametrize("kind", KINDS)
def test_single_prompt_greedy_matches_hf(kind, seed, length):
    model = cached_model(kind, seed)
    (prompt,) = random_prompts([length], vocab_size(model), seed=100 + seed)
    new = 12
    expected = hf_greedy_cached(model, (kind, seed), prompt, new)
    assert len(expected) == new
    with make_engine(model, chunked_prefill_size=64) as engine:
        initial = engine.pools.free_counts()
        ids = torch.tensor([prompt])
        out = engine.generate(ids, max_new_tokens=new, do_sample=False)
        assert out.shape == (1, length + new) and out.dtype == torch.long
        assert out[0, :length].tolist() == prompt
        assert_greedy_equal(model, prompt, out[0, length:].tolist(), expected, f"{kind} seed {seed}")
        assert_pools_restored(engine, initial)
        # the same engine again (slots reused): same answer
        again = engine.generate(ids, max_new_tokens=new)
        assert torch.equal(again, out)
        assert_pools_restored(engine, initial)


BATCH_LENGTHS = [1, 200, 7, 64, 33, 150, 65, 90]


@pytest.mark.parametrize("kind", KINDS)
def test_generate_batch_with_chunked_prefill_and_joining_requests_matches_hf(kind):
    seed = 0
    model = cached_model(kind, seed)
    prompts = random_prompts(BATCH_LENGTHS, vocab_size(model), seed=7)
    new = 10
    expected = [hf_greedy_cached(model, (kind, seed), p, new) for p in prompts]
    with make_engine(model, chunked_prefill_size=48, max_running_requests=3, max_total_tokens=1024) as engine:
        initial = engine.pools.free_counts()
        rec = StepRecorder(engine)
        outputs = engine.generate_batch(prompts, max_new_tokens=new, do_sample=False)
        assert len(outputs) == len(prompts)
        for i, (p, got, exp) in enumerate(zip(prompts, outputs, expected)):
            assert_greedy_equal(model, p, got, exp, f"{kind} prompt {i} (len {len(p)})")
        assert_pools_restored(engine, initial)
        stats = engine.stats()

    # the run exercised what this test is about
    assert max(len(step) for step in rec.steps) <= 3, "max_running_requests=3 was exceeded"
    assert all(sum(n for _, _, n in step) <= 48 + 3 for step in rec.steps)
    split = {rid for step in rec.steps for rid, p, n in step if p > 0 and n > 1}
    assert split, "no prompt was prefilled in more than one chunk"
    mixed = [step for step in rec.steps if any(n == 1 and p > 0 for _, p, n in step) and any(n > 1 for _, _, n in step)]
    assert mixed, "no step mixed a decode with a prefill chunk (no request joined while others decoded)"
    assert stats["requests_finished"] == stats["requests_added"] == len(prompts)
    assert stats["generated_tokens"] == len(prompts) * new
    # mixed steps ran their decode rows as a DECODE part of the step (ForwardMetadata.mixed_parts), packed
    # after its prefill chunks
    assert 0 < stats["mixed_steps"] <= stats["extend_steps"] and stats["mixed_decode_rows"] >= stats["mixed_steps"]
    for step in mixed:
        kinds = [n > 1 for _, _, n in step]
        assert kinds == sorted(kinds, reverse=True), f"decode rows before a prefill chunk: {step}"


@pytest.mark.parametrize("kind", KINDS)
def test_left_padded_generate_matches_hf_per_row(kind):
    seed = 1
    model = cached_model(kind, seed)
    vocab = vocab_size(model)
    lengths = [5, 30, 17, 12]
    prompts = random_prompts(lengths, vocab, seed=11)
    new = 10
    free_run = [hf_greedy_cached(model, (kind, seed), p, new) for p in prompts]
    # an EOS that stops some row early while another row runs to max_new_tokens
    eos = None
    for row in free_run:
        for tok in row[:new - 2]:
            if any(tok not in other for other in free_run):
                eos = tok
                break
        if eos is not None:
            break
    assert eos is not None, "could not find an early-stopping token in HF's outputs"
    expected = [hf_greedy_cached(model, (kind, seed), p, new, eos_token_id=eos) for p in prompts]
    assert min(len(e) for e in expected) < new == max(len(e) for e in expected)

    width = max(lengths)
    pad = vocab - 1  # distinct from the config's pad token, so the padding source is visible
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with make_engine(model) as engine:
        initial = engine.pools.free_counts()
        out = engine.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=eos, pad_token_id=pad)
        assert_pools_restored(engine, initial)
    assert out.shape == (len(prompts), width + new)
    assert torch.equal(out[:, :width], ids)
    for i, (p, exp) in enumerate(zip(prompts, expected)):
        row = out[i, width:].tolist()
        got = row[: len(exp)]
        assert_greedy_equal(model, p, got, exp, f"{kind} row {i}")
        assert row[len(exp):] == [pad] * (new - len(exp)), f"row {i} is not padded after its EOS: {row}"


@pytest.mark.parametrize("kind", KINDS)
def test_pool_exhaustion_retracts_and_loses_nothing(kind):
    seed = 2
    model = cached_model(kind, seed)
    lengths = [60, 58, 62, 55, 61, 59, 63, 57]
    prompts = random_prompts(lengths, vocab_size(model), seed=13)
    new = 20
    expected = [hf_greedy_cached(model, (kind, seed), p, new) for p in prompts]
    # 200 KV slots: each request (<= 83 tokens) fits alone, at most two fit at once
    with make_engine(model, max_total_tokens=200, max_running_requests=8, chunked_prefill_size=64) as engine:
        initial = engine.pools.free_counts()
        rec = StepRecorder(engine)
        outputs = engine.generate_batch(prompts, max_new_tokens=new)
        for i, (p, got, exp) in enumerate(zip(prompts, outputs, expected)):
            assert_greedy_equal(model, p, got, exp, f"{kind} prompt {i}")
        assert_pools_restored(engine, initial)
        stats = engine.stats()
    assert stats["requests_finished"] == len(prompts)
    # the scheduler admits by the current chunk and retracts under pressure: with 200 slots
    # this run has to retract (if admission gets more conservative, shrink max_total_tokens)
    assert stats["retractions"] > 0
    assert max(len(step) for step in rec.steps) >= 2, "requests never ran concurrently"
    # every step's KV demand stayed within the pool
    assert all(sum(p + n for _, p, n in step) <= 200 for step in rec.steps)


def test_seeded_sampling_survives_retraction():
    """A retracted request keeps its output and its random stream: seeded samples under KV
    pressure equal those of an engine with room for every request at once."""
    kind = "qwen3_next_dense"
    model = cached_model(kind, 0)
    prompts = random_prompts([40, 41, 42, 43, 40, 41], vocab_size(model), seed=17)
    kw = dict(max_new_tokens=16, do_sample=True, temperature=1.2, seed=5)
    with make_engine(model, max_total_tokens=1024) as roomy:
        expected = roomy.generate_batch(prompts, **kw)
        assert roomy.stats()["retractions"] == 0
    # 150 slots: two requests run together and one gets retracted mid-decode (output kept)
    with make_engine(model, max_total_tokens=150, chunked_prefill_size=64) as tight:
        initial = tight.pools.free_counts()
        got = tight.generate_batch(prompts, **kw)
        assert tight.stats()["retractions"] > 0, "the tight engine was meant to retract"
        assert_pools_restored(tight, initial)
    assert got == expected


def test_retraction_recomputation_stays_bounded():
    """Under KV pressure a retracted request must not be re-admitted straight away only to be
    retracted again (thrashing): the prompt and output tokens recomputed because of retractions
    stay within the tokens the requests hold."""
    kind, seed = "qwen3_5_moe", 0
    model = cached_model(kind, seed)
    prompts = random_prompts([60, 58, 62, 55, 61, 59], vocab_size(model), seed=3)
    new = 20
    expected = [hf_greedy_cached(model, (kind, seed), p, new) for p in prompts]
    # 100 KV slots: one request (<= 82 tokens) fits, two never fit together to the end
    with make_engine(model, max_total_tokens=100, chunked_prefill_size=16, max_running_requests=6) as engine:
        initial = engine.pools.free_counts()
        outputs = engine.generate_batch(prompts, max_new_tokens=new)
        for i, (p, got, exp) in enumerate(zip(prompts, outputs, expected)):
            assert_greedy_equal(model, p, got, exp, f"{kind} prompt {i}")
        assert_pools_restored(engine, initial)
        stats = engine.stats()
    useful = sum(len(p) for p in prompts) + sum(len(o) - 1 for o in outputs)
    fed = stats["prefill_tokens"] + stats["decode_tokens"]
    assert fed <= 2 * useful, (
        f"{stats['retractions']} retractions made the engine feed {fed} tokens for {useful} useful ones"
    )


def test_tie_helper_accepts_only_exact_ties():
    """The divergence rule of assert_greedy_equal: a divergence passes only where HF's top-2
    logits are exactly equal and the engine picked one of the tied tokens."""
    kind = "qwen3_next_dense"
    model = build_model(kind, 5)
    prompt = random_prompts([6], vocab_size(model), seed=5)[0]
    expected = hf_greedy(model, prompt, 4)
    assert_greedy_equal(model, prompt, list(expected), expected)
    wrong = [(expected[0] + 1) % vocab_size(model)] + expected[1:]
    with pytest.raises(AssertionError, match="not tied"):
        assert_greedy_equal(model, prompt, wrong, expected)
    with pytest.raises(AssertionError, match="lengths differ"):
        assert_greedy_equal(model, prompt, expected[:3], expected)
    # make token `twin` an exact copy of HF's first pick in the LM head: every step now ties
    first = expected[0]
    twin = next(t for t in range(vocab_size(model)) if t != first and t not in expected)
    with torch.no_grad():
        model.lm_head.weight[twin] = model.lm_head.weight[first]
    assert hf_greedy(model, prompt, 4)[0] in (first, twin)
    assert_greedy_equal(model, prompt, [twin, 1, 2, 3], [first] + expected[1:])
    with pytest.raises(AssertionError, match="not tied"):
        assert_greedy_equal(model, prompt, [wrong[0]] + expected[1:], expected)


def test_paged_kv_cache_with_chunks_and_retraction_matches_hf():
    """page_size > 1: requests fill their last page before taking a new one, across chunked
    prefill, decode and retraction."""
    kind, seed = "qwen3_5", 0
    model = cached_model(kind, seed)
    prompts = random_prompts([1, 30, 7, 64, 33, 50, 65, 90, 3, 17], vocab_size(model), seed=7)
    new = 24
    expected = [hf_greedy_cached(model, (kind, seed), p, new) for p in prompts]
    # 200 slots (50 pages of 4) for 10 requests of up to 114 tokens: pages run out and the
    # scheduler has to retract (if admission gets more conservative, shrink max_total_tokens)
    with make_engine(model, page_size=4, max_total_tokens=200, chunked_prefill_size=30, max_running_requests=8) as engine:
        initial = engine.pools.free_counts()
        outputs = engine.generate_batch(prompts, max_new_tokens=new)
        for i, (p, got, exp) in enumerate(zip(prompts, outputs, expected)):
            assert_greedy_equal(model, p, got, exp, f"{kind} page_size=4 prompt {i}")
        assert engine.stats()["retractions"] > 0
        assert_pools_restored(engine, initial)


def test_max_total_tokens_that_is_not_a_whole_number_of_pages():
    """max_total_tokens=130 with page_size=4 holds 128 tokens (32 pages): wrap must accept it
    (the engine derives max_context_len from max_total_tokens itself, the user set no
    max_context_len) and serve any request that fits in 128 tokens."""
    kind, seed = "qwen3_5", 0
    model = cached_model(kind, seed)
    prompt = random_prompts([120], vocab_size(model), seed=8)[0]
    with make_engine(model, max_total_tokens=130, page_size=4) as engine:
        initial = engine.pools.free_counts()
        assert engine.max_context_len <= 128
        assert engine.generate_batch([prompt], max_new_tokens=8) == [hf_greedy_cached(model, (kind, seed), prompt, 8)]
        with pytest.raises(ValueError, match="prompt 0"):
            engine.generate_batch([prompt + prompt[:5]], max_new_tokens=8)  # 125 + 8 > 128
        assert_pools_restored(engine, initial)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_image_text_model_text_path_matches_hf(kind):
    """``Qwen3_5(Moe)ForConditionalGeneration`` (model_type qwen3_5 / qwen3_5_moe) wraps too: token
    prompts run through its text model and equal HF's own generate."""
    import transformers

    from engine_models import make_config

    text = make_config(kind).to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=text["hidden_size"],
                  patch_size=4, temporal_patch_size=1, spatial_merge_size=1)
    if kind == "qwen3_5":
        config, cls = transformers.Qwen3_5Config(text_config=text, vision_config=vision), transformers.Qwen3_5ForConditionalGeneration
    else:
        config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision)
        cls = transformers.Qwen3_5MoeForConditionalGeneration
    torch.manual_seed(0)
    model = cls(config).float().eval()
    model.generation_config.eos_token_id = None
    prompts = random_prompts([5, 40, 1], vocab_size(model), seed=11)
    expected = [hf_greedy(model, p, 8) for p in prompts]
    with make_engine(model, chunked_prefill_size=16, max_running_requests=2) as engine:
        initial = engine.pools.free_counts()
        outputs = engine.generate_batch(prompts, max_new_tokens=8)
        for i, (p, got, exp) in enumerate(zip(prompts, outputs, expected)):
            assert_greedy_equal(model, p, got, exp, f"{kind} image-text prompt {i}")
        assert_pools_restored(engine, initial)


def test_qwen3_next_projection_split_equals_hf_reordering():
    """The patched mixer splits Qwen3-Next's per-key-head interleaved projections itself (views that
    keep the token dimension apart); the values must be those of HF's ``fix_query_key_value_ordering``."""
    from hybrid_compile.models.gated_deltanet import _split_interleaved

    model = cached_model("qwen3_next_dense", 0)
    mixer = next(m for m in model.modules() if hasattr(m, "in_proj_qkvz"))
    assert mixer.num_v_heads > mixer.num_k_heads  # several value heads per key head: the interleaving matters
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    qkvz, ba = mixer.in_proj_qkvz(hidden), mixer.in_proj_ba(hidden)
    q, k, v, z, b, a = mixer.fix_query_key_value_ordering(qkvz[None], ba[None])
    mixed_qkv, z_ours, b_ours, a_ours = _split_interleaved(mixer, qkvz, ba)
    assert torch.equal(mixed_qkv, torch.cat((q.reshape(5, -1), k.reshape(5, -1), v.reshape(5, -1)), dim=-1))
    assert torch.equal(z_ours, z[0]) and torch.equal(b_ours, b[0]) and torch.equal(a_ours, a[0])


@pytest.mark.parametrize("kind", KINDS)
def test_gdn_gated_norm_runs_as_our_op(kind):
    """Every Gated DeltaNet family hands its gated norm (HF: ``[tokens * heads, head_dim]`` rows, one
    ``[head_dim]`` weight) to the ``gated_rms_norm`` op on ``[tokens, heads * head_dim]``: the same values."""
    from hybrid_compile.models.gated_deltanet import _gated_norm

    model = cached_model(kind, 0)
    mixer = next(m for m in model.modules() if hasattr(m, "A_log") and hasattr(m, "dt_bias"))
    norm = mixer.norm if hasattr(mixer, "out_proj") else mixer.o_norm
    k = mixer.num_v_heads * mixer.head_v_dim
    core, gate = torch.randn(2, 3, k, generator=torch.Generator().manual_seed(0)).unbind()
    ours = _gated_norm(norm, core, gate)
    vd = mixer.head_v_dim
    with torch.no_grad():
        torch.testing.assert_close(ours, norm(core.reshape(-1, vd), gate.reshape(-1, vd)).reshape(3, k), rtol=0, atol=0)
