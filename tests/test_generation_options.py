"""Every transformers generation setting honoured (token for token as transformers' own
``generate``) or refused with one error naming it; vLLM-style SamplingParams fields (penalties,
min_tokens, logprobs, n, stop strings); n > 1 sharing one prefill; per-request timings.

Oracles: transformers' ``model.generate`` on the same weights (greedy, and seeded sampling: a
request seeded ``s`` draws as transformers does after ``torch.manual_seed(s)``), transformers'
own ``LogitsProcessor`` classes on random logits, and a literal per-step loop over HF's logits for
the vLLM penalties and log-probabilities.
"""

from __future__ import annotations

import pytest
import torch

import hybrid_compile as hc
from engine_models import (
    PAD_TOKEN_ID,
    RecordingStreamer,
    assert_pools_restored,
    cached_model,
    hf_next_logits,
    make_engine,
    random_prompts,
    single_threaded,
    vocab_size,
)
from hybrid_compile.engine import generation_config as gc_rules
from hybrid_compile.engine.logits_processing import LogitsProcessing, StepRows
from hybrid_compile.engine.request import Request

KIND, SEED = "qwen3_next_moe", 0
NEW = 8


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from single_threaded()


@pytest.fixture(scope="module")
def model():
    return cached_model(KIND, SEED)


@pytest.fixture(scope="module")
def prompts(model):
    return random_prompts([11, 17, 6], vocab_size(model), seed=3)


@pytest.fixture(scope="module")
def engine(model):
    with make_engine(model) as e:
        yield e


def _initial(engine) -> dict:
    engine.clear_prefix_cache()
    return engine.pools.free_counts()


@torch.inference_mode()
def hf_generate(model, prompt, seed=None, **kw):
    ids = torch.tensor([prompt])
    if seed is not None:
        torch.manual_seed(seed)
    kw.setdefault("pad_token_id", PAD_TOKEN_ID)
    return model.generate(ids, attention_mask=torch.ones_like(ids), **kw)


# ---------------------------------------------------------------------------------------------
# the classification of every GenerationConfig field
# ---------------------------------------------------------------------------------------------


def test_every_generation_config_field_is_classified_exactly_once():
    tables = [set(gc_rules.HONOURED), set(gc_rules.NO_EFFECT), set(gc_rules.REFUSED)]
    for field in gc_rules.config_fields():  # from transformers' class: a new field fails here
        assert sum(field in t for t in tables) == 1, f"GenerationConfig.{field} is not classified exactly once"
    assert not (gc_rules.HONOURED_ARGUMENTS & set(gc_rules.REFUSED_ARGUMENTS))


REFUSED_VALUES = {
    "guidance_scale": 1.5, "watermarking_config": {"greenlist_ratio": 0.25}, "token_healing": True, "top_h": 0.5,
    "use_mtp": True, "penalty_alpha": 0.6, "dola_layers": "low", "diversity_penalty": 0.5, "num_beam_groups": 2,
    "force_words_ids": [[3]], "constraints": ["c"], "output_attentions": True, "output_hidden_states": True,
    "prompt_lookup_num_tokens": 3, "assistant_early_exit": 1, "speculation_type": "x",
}


def test_refused_settings_raise_naming_the_field_from_every_source(model, engine, prompts):
    from transformers import GenerationConfig

    ids = torch.tensor([prompts[0]])
    fields = set(gc_rules.config_fields())
    before = engine.stats()["requests_added"]
    for field, value in [*REFUSED_VALUES.items(), ("num_beams", 2)]:
        if field not in fields:
            continue
        with pytest.raises(ValueError, match=field):
            engine.generate(ids, max_new_tokens=3, **{field: value})
        cfg = GenerationConfig()
        setattr(cfg, field, value)
        with pytest.raises(ValueError, match=rf"{field}.*generation_config"):
            engine.generate(ids, max_new_tokens=3, generation_config=cfg)
        saved = getattr(model.generation_config, field, None)
        setattr(model.generation_config, field, value)
        try:
            with pytest.raises(ValueError, match=rf"{field}.*the model's generation_config"):
                engine.generate(ids, max_new_tokens=3)
        finally:
            setattr(model.generation_config, field, saved)
    for arg in ("assistant_model", "prefix_allowed_tokens_fn", "negative_prompt_ids", "custom_generate"):
        with pytest.raises(ValueError, match=arg):
            engine.generate(ids, max_new_tokens=3, **{arg: object()})
    assert set(REFUSED_VALUES) == set(gc_rules.REFUSED)
    assert engine.stats()["requests_added"] == before  # refused before any work


# ---------------------------------------------------------------------------------------------
# the processors against transformers' own, on random logits
# ---------------------------------------------------------------------------------------------


def _processor_cases(V):
    from transformers.generation import logits_process as lp

    eos = [3, 9]
    return [
        (dict(repetition_penalty=1.7), [lp.RepetitionPenaltyLogitsProcessor(1.7)]),
        (dict(no_repeat_ngram_size=2), [lp.NoRepeatNGramLogitsProcessor(2)]),
        (dict(bad_words_ids=((5,), (7, 8)), eos_token_ids=tuple(eos)), [lp.NoBadWordsLogitsProcessor([[5], [7, 8]], eos)]),
        (dict(sequence_bias=(((4,), 2.5), ((7, 11), -3.0))), [lp.SequenceBiasLogitsProcessor([[[4], 2.5], [[7, 11], -3.0]])]),
        (dict(min_tokens=50, eos_token_ids=tuple(eos)), [lp.MinNewTokensLengthLogitsProcessor(0, 50, eos)]),
        (dict(suppress_tokens=(1, 2, 6)), [lp.SuppressTokensLogitsProcessor([1, 2, 6])]),
        (dict(remove_invalid_values=True), [lp.InfNanRemoveLogitsProcessor()]),
        (dict(exponential_decay_length_penalty=(2, 1.3), eos_token_ids=(3,)),
         lambda prompt: [lp.ExponentialDecayLengthPenalty((2, 1.3), 3, len(prompt))]),
        # the encoder processors, with the prompt as encoder input (as transformers for a decoder-only model)
        (dict(encoder_repetition_penalty=1.6, repetition_penalty=1.2),
         lambda prompt: [lp.EncoderRepetitionPenaltyLogitsProcessor(1.6, torch.tensor([prompt])),
                         lp.RepetitionPenaltyLogitsProcessor(1.2)]),
        (dict(encoder_no_repeat_ngram_size=2, no_repeat_ngram_size=3),
         lambda prompt: [lp.NoRepeatNGramLogitsProcessor(3),
                         lp.EncoderNoRepeatNGramLogitsProcessor(2, torch.tensor([prompt]))]),
        (dict(renormalize_logits=True, repetition_penalty=0.8), [lp.RepetitionPenaltyLogitsProcessor(0.8), lp.LogitNormalization()]),
        (dict(do_sample=True, temperature=0.7, top_k=9, top_p=0.8, min_p=0.05),
         [lp.TemperatureLogitsWarper(0.7), lp.TopKLogitsWarper(9), lp.TopPLogitsWarper(0.8), lp.MinPLogitsWarper(0.05)]),
        (dict(do_sample=True, typical_p=0.7), [lp.TypicalLogitsWarper(0.7)]),
        (dict(do_sample=True, epsilon_cutoff=3e-3), [lp.EpsilonLogitsWarper(3e-3)]),
        (dict(do_sample=True, eta_cutoff=3e-3), [lp.EtaLogitsWarper(3e-3)]),
        (dict(), []),
    ]


def test_batched_processing_equals_transformers_processors_row_by_row():
    from transformers.generation import logits_process as lp

    V = 64
    g = torch.Generator().manual_seed(0)
    cases = _processor_cases(V)
    requests, params, expected = [], [], []
    logits = torch.randn(len(cases), V, generator=g) * 4
    logits[6, 5] = float("nan")
    logits[6, 7] = float("inf")
    for i, (kw, procs) in enumerate(cases):
        p = hc.SamplingParams(max_new_tokens=100, **kw)
        prompt = torch.randint(0, V, (9,), generator=g).tolist()
        prompt[4:6] = [7, 30]  # a prompt bigram that the output's last token (7) starts
        out = [7, 11, 4, 7]
        r = Request(rid=i, prompt=prompt, params=p)
        r.output = list(out)
        if callable(procs):
            procs = procs(prompt)
        ids = torch.tensor([prompt + out])
        row = logits[i : i + 1].clone()
        for proc in procs:
            row = proc(ids, row)
        requests.append(r)
        params.append(p)
        expected.append(row[0])
    got = LogitsProcessing(V, torch.device("cpu"), 4)(logits.clone(), StepRows(requests, params))
    for i, (kw, _) in enumerate(cases):
        assert torch.equal(got[i].isnan(), expected[i].isnan()), kw
        keep = ~expected[i].isnan()
        assert torch.equal(got[i][keep], expected[i][keep]), kw


# ---------------------------------------------------------------------------------------------
# token for token against transformers' generate
# ---------------------------------------------------------------------------------------------


def _free_run(model, prompt):
    return hf_generate(model, prompt, max_new_tokens=NEW, do_sample=False)[0, len(prompt):].tolist()


GREEDY_OPTIONS = [
    dict(max_length=19),
    dict(repetition_penalty=1.5),
    dict(repetition_penalty=0.7, no_repeat_ngram_size=2),
    dict(no_repeat_ngram_size=1),
    dict(suppress_tokens=[]),  # filled per prompt: the free run's tokens
    dict(begin_suppress_tokens=[]),
    dict(bad_words_ids=[]),
    dict(eos_token_id=[]),
    dict(min_new_tokens=5, eos_token_id=[]),
    dict(min_length=15, eos_token_id=[]),
    dict(forced_eos_token_id=5),
    dict(sequence_bias={}),
    dict(exponential_decay_length_penalty=(2, 1.5), eos_token_id=[]),
    dict(renormalize_logits=True, remove_invalid_values=True),
    dict(encoder_repetition_penalty=1.5),  # transformers: on a decoder-only model, with the prompt as encoder input
    dict(encoder_no_repeat_ngram_size=1),
]


def _fill(option: dict, free: list[int]) -> dict:
    o = dict(option)
    if "suppress_tokens" in o:
        o["suppress_tokens"] = free[:3]
    if "begin_suppress_tokens" in o:
        o["begin_suppress_tokens"] = free[:1]
    if "bad_words_ids" in o:
        o["bad_words_ids"] = [[free[1]], free[3:5]]
    if "eos_token_id" in o:
        o["eos_token_id"] = [free[2], 1]
    if "sequence_bias" in o:
        o["sequence_bias"] = {(free[0],): -5.0, (free[1], free[2]): -10.0}
    return o


@pytest.mark.parametrize("option", GREEDY_OPTIONS, ids=lambda o: ",".join(o))
def test_greedy_option_equals_transformers(model, engine, prompts, option):
    initial = _initial(engine)
    for prompt in prompts[:2]:
        kw = _fill(option, _free_run(model, prompt))
        kw.setdefault("max_new_tokens", NEW) if "max_length" not in kw else None
        want = hf_generate(model, prompt, do_sample=False, **kw)
        got = engine.generate(torch.tensor([prompt]), do_sample=False, **kw)
        assert got.tolist() == want.tolist(), kw
        if prompt is prompts[0]:  # the same settings inside a GenerationConfig
            from transformers import GenerationConfig

            got = engine.generate(torch.tensor([prompt]), generation_config=GenerationConfig(do_sample=False, **kw))
            assert got.tolist() == want.tolist(), kw
    assert_pools_restored(engine, initial)


def test_user_logits_processor_applied_per_request(model, engine, prompts):
    from transformers import LogitsProcessor, LogitsProcessorList

    class BanPrevious(LogitsProcessor):  # reads the request's own tokens
        def __call__(self, input_ids, scores):
            return scores.scatter(1, input_ids[:, -1:], float("-inf"))

    procs = LogitsProcessorList([BanPrevious()])
    for prompt in prompts[:2]:
        want = hf_generate(model, prompt, max_new_tokens=NEW, do_sample=False, logits_processor=procs)
        assert engine.generate(torch.tensor([prompt]), max_new_tokens=NEW, logits_processor=procs).tolist() == \
            want.tolist()
    # in a batch with requests that have none: each row gets only its own processors
    rows = engine.generate_batch(prompts[:2], params=[
        hc.SamplingParams(max_new_tokens=NEW, logits_processors=tuple(procs)), hc.SamplingParams(max_new_tokens=NEW)])
    assert rows[0] == hf_generate(model, prompts[0], max_new_tokens=NEW, logits_processor=procs)[0, 11:].tolist()
    assert rows[1] == _free_run(model, prompts[1])


SAMPLING_OPTIONS = [
    dict(temperature=0.8, top_k=20, top_p=0.9),
    dict(min_p=0.1, temperature=1.3),
    dict(typical_p=0.8, top_k=0),
    dict(epsilon_cutoff=0.01, top_k=0),
    dict(eta_cutoff=0.01, top_k=0),
    dict(repetition_penalty=1.3, top_k=0, temperature=1.2),
]


@pytest.mark.parametrize("option", SAMPLING_OPTIONS, ids=lambda o: ",".join(o))
def test_seeded_sampling_equals_transformers(model, engine, prompts, option):
    prompt = prompts[1]
    for seed in (5, 6):
        want = hf_generate(model, prompt, seed=seed, max_new_tokens=NEW, do_sample=True, **option)
        got = engine.generate(torch.tensor([prompt]), seed=seed, max_new_tokens=NEW, do_sample=True, **option)
        assert got.tolist() == want.tolist(), (seed, option)


def test_num_return_sequences_shares_one_prefill_and_samples_like_transformers(model, prompts):
    prompt, n = prompts[1], 3
    kw = dict(max_new_tokens=NEW, do_sample=True, temperature=1.4, top_k=0)
    want = [hf_generate(model, prompt, seed=40 + j, **kw)[0].tolist() for j in range(n)]
    for prefix_cache in (False, True):
        with make_engine(model, enable_prefix_cache=prefix_cache) as engine:
            initial = _initial(engine)
            got = engine.generate(torch.tensor([prompt]), num_return_sequences=n, seed=40, **kw)
            s = engine.stats()
            assert got.tolist() == want, prefix_cache
            assert s["prefill_tokens"] == len(prompt), "the prompt was prefilled more than once"
            assert s["forked_requests"] == n - 1 and s["forked_prompt_tokens"] == (n - 1) * len(prompt)
            # SamplingParams(n=2), greedy: n copies of transformers' greedy output; prompt-major order
            got = engine.generate_batch(prompts[:2], params=hc.SamplingParams(max_new_tokens=NEW, n=2))
            assert got == [[_free_run(model, p)] * 2 for p in prompts[:2]]
            if engine.prefix_cache is not None:
                engine.clear_prefix_cache()
            assert_pools_restored(engine, initial)


def test_greedy_num_return_sequences_is_refused_as_transformers_does(model, engine, prompts):
    before = engine.stats()["requests_added"]
    with pytest.raises(ValueError, match="num_return_sequences"):  # the oracle: transformers refuses it too
        hf_generate(model, prompts[0], max_new_tokens=2, do_sample=False, num_return_sequences=2)
    with pytest.raises(ValueError, match=r"num_return_sequences=2 \(from argument\) with greedy"):
        engine.generate(torch.tensor([prompts[0]]), max_new_tokens=2, num_return_sequences=2)
    with pytest.raises(ValueError, match="num_return_sequences=3"):
        engine.generate_batch(prompts[:1], max_new_tokens=2, num_return_sequences=3)
    assert engine.stats()["requests_added"] == before


def test_call_arguments_are_honoured_or_refused(model, engine, prompts):
    initial = _initial(engine)
    # streamer: one prompt, one sequence, fed as generate() feeds it
    streamers = [RecordingStreamer(), RecordingStreamer()]
    (out,) = engine.generate_batch(prompts[:1], max_new_tokens=NEW, streamer=streamers[0])
    engine.generate(torch.tensor([prompts[0]]), max_new_tokens=NEW, streamer=streamers[1])
    assert out == _free_run(model, prompts[0])
    assert streamers[0].calls == streamers[1].calls == \
        [("put", [prompts[0]])] + [("put", [t]) for t in out] + [("end", None)]
    before = engine.stats()["requests_added"]
    for kw, name in [
        (dict(streamer=RecordingStreamer()), "streamer"),  # two prompts
        (dict(attention_mask=torch.ones(2, 17)), "attention_mask"),
        (dict(skip_special_tokens=False), "skip_special_tokens"),  # token ids in, token ids out
        (dict(logprobs=2), "logprobs"),  # outputs the call would not return
        (dict(return_dict_in_generate=True, output_scores=True), "return_dict_in_generate"),
    ]:
        with pytest.raises(ValueError, match=name):
            engine.generate_batch(prompts[:2], max_new_tokens=2, **kw)
    with pytest.raises(ValueError, match="streamer"):
        engine.generate_batch(prompts[:1], streamer=RecordingStreamer(),
                              params=hc.SamplingParams(max_new_tokens=2, n=2, do_sample=True))
    for kw, name in [(dict(skip_special_tokens=True), "skip_special_tokens"), (dict(logprobs=0), "logprobs")]:
        with pytest.raises(ValueError, match=name):
            engine.generate(torch.tensor([prompts[0]]), max_new_tokens=2, **kw)
    with pytest.raises(ValueError, match="encoder_repetition_penalty"):
        engine.generate_batch(prompts[:1], params=hc.SamplingParams(encoder_repetition_penalty=0.0))
    with pytest.raises(TypeError, match="extra"):  # no catch-all field that nothing reads
        hc.SamplingParams(extra={"top_a": 0.1})
    assert engine.stats()["requests_added"] == before
    assert_pools_restored(engine, initial)


def test_return_dict_in_generate_gives_transformers_output_with_scores_and_logits(model, engine, prompts):
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    prompt = prompts[0]
    kw = dict(max_new_tokens=5, return_dict_in_generate=True, output_scores=True, output_logits=True,
              repetition_penalty=1.4)
    want = hf_generate(model, prompt, **kw)
    got = engine.generate(torch.tensor([prompt]), **kw)
    assert isinstance(got, GenerateDecoderOnlyOutput)
    assert got.sequences.tolist() == want.sequences.tolist()
    assert len(got.scores) == len(want.scores) == len(got.logits) == 5
    for a, b in zip(got.scores + got.logits, want.scores + want.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert engine.generate(torch.tensor([prompt]), max_new_tokens=2, output_scores=True).dim() == 2  # no dict


def test_checkpoint_generation_config_is_honoured(tmp_path):
    from checkpoints import load_hf, save_checkpoint
    from transformers import GenerationConfig

    d = save_checkpoint(tmp_path / "ckpt", "qwen3_next", seed=1)
    hf_model, tok = load_hf(str(d))
    cfg = GenerationConfig.from_pretrained(d)
    cfg.update(repetition_penalty=1.6, no_repeat_ngram_size=2, max_length=30)
    cfg.save_pretrained(d)
    load_hf.cache_clear()
    hf_model, tok = load_hf(str(d))
    ids = tok("Hello world! The quick brown fox", return_tensors="pt")["input_ids"]
    want = hf_model.generate(ids, attention_mask=torch.ones_like(ids))
    with hc.from_pretrained(str(d), device="cpu", dtype="float32", max_total_tokens=512, max_running_requests=2,
                            mamba_cache_size=4, chunked_prefill_size=64) as engine:
        got = engine.generate(ids)
        assert got.shape[1] == 30
        assert got.tolist() == want.tolist()
        # stop strings, with the tokenizer: the token that completes the string is the last one
        text = tok.decode(want[0, ids.shape[1]:])
        stop = text[3:6]
        want = hf_model.generate(ids, attention_mask=torch.ones_like(ids), stop_strings=[stop, "zzz"], tokenizer=tok)
        got = engine.generate(ids, stop_strings=[stop, "zzz"], tokenizer=tok)
        assert got.tolist() == want.tolist() and got.shape[1] < 30
        rid = engine.add_request(ids[0].tolist(), hc.SamplingParams(max_new_tokens=20, stop=("zzz", stop)))
        while engine.has_unfinished():
            engine.step()
        r = engine.pop_finished(rid)
        assert r.output == got[0, ids.shape[1]:].tolist()[: len(r.output)] and r.stop_str == stop
        assert r.finish_reason == "stop"
        # tokenizer= is used for the call (stop strings, text, decoding), the engine's own after it
        engine.tokenizer = None
        try:
            got = engine.generate_batch([ids[0].tolist()], stop_strings=[stop, "zzz"], tokenizer=tok)
            assert got[0] == want[0, ids.shape[1]:].tolist()
            with pytest.raises(ValueError, match="stop"):
                engine.generate_batch([ids[0].tolist()], stop_strings=[stop])
            new = engine.generate_batch([ids[0].tolist()], max_new_tokens=4, forced_eos_token_id=tok.eos_token_id)[0]
            assert new[-1] == tok.eos_token_id
            texts = [engine.generate_batch(["Hello world! The quick brown fox"], tokenizer=tok, max_new_tokens=4,
                                           forced_eos_token_id=tok.eos_token_id, skip_special_tokens=skip)[0]
                     for skip in (False, True)]
            assert texts == [tok.decode(new, skip_special_tokens=skip) for skip in (False, True)]
            assert texts[0] != texts[1] and engine.tokenizer is None
        finally:
            engine.tokenizer = tok


# ---------------------------------------------------------------------------------------------
# vLLM-style SamplingParams fields, against a literal loop over HF's logits
# ---------------------------------------------------------------------------------------------


def _literal_penalised_greedy(model, prompt, new, presence=0.0, frequency=0.0, repetition=1.0, min_tokens=0,
                              stop=()):
    out = []
    for _ in range(new):
        x = hf_next_logits(model, prompt + out)
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=x.shape[0]).float() if out else \
            torch.zeros_like(x)
        seen = torch.zeros_like(x, dtype=torch.bool)
        seen[prompt + out] = True
        x = torch.where(seen, torch.where(x < 0, x * repetition, x / repetition), x)
        x = x - frequency * counts - presence * (counts > 0).float()
        if len(out) < min_tokens:
            x[list(stop)] = float("-inf")
        out.append(int(x.argmax()))
        if out[-1] in stop and len(out) >= min_tokens:
            break
    return out


def test_presence_frequency_penalties_min_tokens_and_per_prompt_params(model, engine, prompts):
    initial = _initial(engine)
    free = _free_run(model, prompts[0])
    cases = [
        dict(presence_penalty=1.5),
        dict(frequency_penalty=2.0, repetition_penalty=1.2),
        dict(min_tokens=5, eos_token_ids=(free[1],)),
    ]
    params = [hc.SamplingParams(max_new_tokens=NEW, **c) for c in cases]
    got = engine.generate_batch([prompts[0]] * 3, params=params)  # one SamplingParams per prompt
    for c, g in zip(cases, got):
        kw = dict(c)
        stop = kw.pop("eos_token_ids", ())
        want = _literal_penalised_greedy(model, prompts[0], NEW, **{k.replace("_penalty", ""): v for k, v in kw.items()
                                                                    if k != "min_tokens"},
                                         min_tokens=kw.get("min_tokens", 0), stop=stop)
        assert g == want, c
    assert got[0] != free and got[1] != free
    with pytest.raises(ValueError, match="presence_penalty"):
        engine.generate_batch(prompts[:1], params=hc.SamplingParams(presence_penalty=3.0))
    with pytest.raises(ValueError, match="params must be"):
        engine.generate_batch(prompts[:2], params=params)
    assert_pools_restored(engine, initial)


def test_penalties_keep_launching_decode_steps_ahead(model, prompts):
    # counts live on the device: a penalised request's decode steps are still launched ahead
    with make_engine(model) as engine:
        got = engine.generate_batch(prompts[:2], params=hc.SamplingParams(max_new_tokens=NEW, presence_penalty=1.0,
                                                                          repetition_penalty=1.3))
        assert engine.stats()["overlapped_steps"] > 0
    for p, g in zip(prompts[:2], got):
        assert g == _literal_penalised_greedy(model, p, NEW, presence=1.0, repetition=1.3)


def test_logprobs_are_the_models_log_probabilities(model, engine, prompts):
    prompt = prompts[2]
    rid = engine.add_request(prompt, hc.SamplingParams(max_new_tokens=4, logprobs=3))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.rid == rid]
    r = engine.pop_finished(rid)
    assert len(r.logprobs) == 4 and [o.logprobs for o in outs] == r.logprobs
    for i, (lp, top) in enumerate(r.logprobs):
        ref = hf_next_logits(model, prompt + r.output[:i]).log_softmax(-1)
        assert abs(lp - float(ref[r.output[i]])) < 1e-4
        assert [t for t, _ in top] == ref.topk(3).indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in top]), ref.topk(3).values, rtol=1e-4, atol=1e-4)


def test_finished_requests_carry_timings_and_stats_report_ttft_tpot(engine, prompts):
    rid = engine.add_request(prompts[0], hc.SamplingParams(max_new_tokens=4))
    while engine.has_unfinished():
        engine.step()
    r = engine.pop_finished(rid)
    t = r.timings()
    assert t["arrival"] <= t["first_token"] <= t["finish"] and t["ttft"] >= 0 and t["tpot"] >= 0
    assert r.finish_reason == "length"
    s = engine.stats()
    assert s["ttft"]["count"] >= 1 and s["ttft"]["p50"] >= 0 and s["tpot"]["p99"] >= s["tpot"]["p50"]


# ---------------------------------------------------------------------------------------------
# request control: abort, and a user's processor that raises
# ---------------------------------------------------------------------------------------------


def _drain(engine) -> dict[int, list[int]]:
    outputs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outputs[o.rid] = o
    return outputs


def test_abort_leaves_every_other_requests_output_unchanged(model, prompts):
    mixed = [
        hc.SamplingParams(max_new_tokens=NEW),
        hc.SamplingParams(max_new_tokens=NEW, presence_penalty=1.0, repetition_penalty=1.3),
        hc.SamplingParams(max_new_tokens=NEW, do_sample=True, temperature=1.3, seed=9, n=2),
        hc.SamplingParams(max_new_tokens=NEW, min_p=0.05, do_sample=True, seed=4, logprobs=2),
    ]
    lineup = [(prompts[0], mixed[0]), (prompts[1], mixed[1]), (prompts[2], mixed[2]), (prompts[0], mixed[3]),
              (prompts[1], mixed[0])]

    def run(abort_at: int | None):
        with make_engine(model, max_running_requests=3) as engine:
            initial = _initial(engine)
            rids = [engine.add_request(p, sp) for p, sp in lineup]
            groups = [engine.sequence_ids(r) for r in rids]
            victims = []
            for step in range(12):
                if step == abort_at:
                    # a running request (decoding) and one still waiting for admission
                    running = engine.scheduler.running[1].rid
                    waiting = engine.scheduler.waiting[-1].rid
                    victims = [running, waiting]
                    assert all(engine.abort(v) for v in victims)
                    assert not engine.abort(victims[0])  # already finished: nothing to do
                engine.step()
            _drain(engine)
            out = {}
            for g in groups:
                for rid in g:
                    r = engine.pop_finished(rid)
                    out[rid] = (r.output, r.finish_reason, r.logprobs)
            assert_pools_restored(engine, initial)
            return out, victims

    base, _ = run(None)
    aborted, victims = run(abort_at=3)
    assert len(victims) == 2
    for rid, (output, reason, lps) in aborted.items():
        if rid in victims:
            assert reason == "abort" and len(output) < NEW
        else:
            assert (output, reason) == base[rid][:2], rid
            if lps is not None:
                torch.testing.assert_close(torch.tensor([lp for lp, _ in lps]),
                                           torch.tensor([lp for lp, _ in base[rid][2]]))


class ProcessorFailure(RuntimeError):
    pass


def test_a_raising_logits_processor_propagates_unchanged_and_the_engine_stays_consistent(model, prompts):
    calls = []
    failure = ProcessorFailure("user processor failed")

    def flaky(input_ids, scores):
        calls.append(input_ids.shape[1])
        if len(calls) == 3:
            raise failure
        return scores

    with make_engine(model) as engine:
        initial = _initial(engine)
        other = engine.add_request(prompts[1], hc.SamplingParams(max_new_tokens=NEW, repetition_penalty=1.2))
        with pytest.raises(ProcessorFailure) as info:
            engine.generate(torch.tensor([prompts[0]]), max_new_tokens=NEW, logits_processor=[flaky])
        assert info.value is failure  # the user's own exception object, not a wrapper
        outputs = _drain(engine)
        r = engine.pop_finished(other)
        assert r.output == hf_generate(model, prompts[1], max_new_tokens=NEW, repetition_penalty=1.2)[0, 17:].tolist()
        assert other in outputs and not engine.has_unfinished()
        assert_pools_restored(engine, initial)
        # later requests: transformers' greedy tokens
        for p in prompts:
            assert engine.generate(torch.tensor([p]), max_new_tokens=NEW)[0, len(p):].tolist() == _free_run(model, p)
        assert_pools_restored(engine, initial)
