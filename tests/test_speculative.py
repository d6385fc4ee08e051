"""Speculative decoding (engine/speculative): greedy outputs equal HF's own ``generate`` and the
non-speculative engine token for token with every draft source (the target as its own draft,
which accepts everything; another random model, which accepts little; n-gram lookup; a plain
HF draft model), with the prefix cache on and pools all free afterwards; speculative sampling
matches the target's distribution (chi-square against the exact distribution computed from HF
forwards; chains and a draft tree); the acceptance rules against brute force; the verify layer ops against step-by-step
decode; the Mamba2 families; compile; the verify metadata fast path against the general path;
the benchmarks' smoke runs (replay continuation a fixed point of the speculative engine, the
verify host-overhead phases). GPU: the commit as CUDA graphs equals the op, in the engine too.
"""

from __future__ import annotations

import time

import pytest
import torch

import hybrid_compile as hc
from hybrid_compile.engine.speculative import (
    NgramDraft,
    ReplayDraft,
    SpeculativeConfig,
    accept_greedy,
    accept_sampled,
    truncate_at_stop,
)
from hybrid_compile.engine.request import Request
from hybrid_compile.engine.sampling import SamplingParams, transform_logits
from hybrid_compile.layers.context import ForwardContext, ForwardMetadata, ForwardMode, forward_context

import mamba2_models as mm
from engine_models import (
    assert_greedy_equal,
    assert_metadata_equal,
    build_model,
    cached_model,
    hf_greedy_cached,
    make_config,
    make_engine,
    random_prompts,
    single_threaded,
    vocab_size,
)

KIND, SEED = "qwen3_next_moe", 0
MAX_NEW = 12
# mixed lengths: one prompt longer than chunked_prefill_size (chunked), more prompts than
# max_running_requests (so verify steps alternate with prefills of admitted requests)
PROMPT_LENS = (3, 70, 11, 25, 6)
ENGINE_ARGS = dict(max_running_requests=3, mamba_cache_size=16, chunked_prefill_size=64, enable_prefix_cache=True)

_one_thread = pytest.fixture(scope="module", autouse=True)(single_threaded)


def _prompts(model):
    prompts = random_prompts(PROMPT_LENS, vocab_size(model), seed=7)
    # a prompt with a repeated pattern: n-gram lookup finds drafts in it (a random-weight model
    # does not continue it, so they are rejected: acceptance is exercised by the other sources)
    return prompts + [[5, 9, 14, 3] * 5]


def _expected(model, prompts, eos=None):
    return [hf_greedy_cached(model, (KIND, SEED), p, MAX_NEW, eos) for p in prompts]


def _finish(engine) -> None:
    """The prefix cache is consistent and, once emptied, every pool slot is free."""
    if engine.prefix_cache is not None:
        engine.prefix_cache.check_invariants()
        engine.clear_prefix_cache()
    engine.pools.check_all_free()
    assert not engine.has_unfinished()
    engine.close()


class _TinyLlama:
    """A plain (non-hybrid) HF causal LM with the target's vocabulary: drafts through HFDraftModel."""

    @staticmethod
    def build(vocab: int):
        import transformers

        cfg = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=None, eos_token_id=None,
        )
        torch.manual_seed(3)
        return transformers.LlamaForCausalLM(cfg).float().eval()


def _spec(method: str, model, k: int = 3) -> dict:
    if method == "draft_self":
        return dict(method="draft_model", draft_model=model, num_draft_tokens=k)
    if method == "draft_other":
        return dict(method="draft_model", draft_model=cached_model(KIND, SEED + 1), num_draft_tokens=k)
    if method == "draft_hf":
        return dict(method="draft_model", draft_model=_TinyLlama.build(vocab_size(model)), num_draft_tokens=k)
    if method == "ngram":
        return dict(method="ngram", num_draft_tokens=k, ngram_max=3, ngram_min=1)
    raise KeyError(method)


@pytest.mark.parametrize("method", ["draft_self", "draft_other", "ngram", "draft_hf"])
def test_greedy_equals_hf_and_plain_engine(method):
    model = cached_model(KIND, SEED)
    prompts = _prompts(model)
    expected = _expected(model, prompts)
    engine = make_engine(model, speculative=_spec(method, model), **ENGINE_ARGS)
    got = engine.generate_batch(prompts, max_new_tokens=MAX_NEW)
    for p, g, e in zip(prompts, got, expected):
        assert_greedy_equal(model, p, g, e, method)
    # continuations hit the prefix cache at the finished requests' full length: the state the
    # speculative commits left there is exact
    follow = [p + g for p, g in zip(prompts, got)]
    got = engine.generate_batch(follow, max_new_tokens=MAX_NEW // 2)
    for p, g in zip(follow, got):
        assert_greedy_equal(model, p, g, hf_greedy_cached(model, (KIND, SEED), p, MAX_NEW // 2), f"{method} cached")
    stats = engine.stats()
    spec = stats["speculative"]
    assert spec["verify_steps"] > 0 and spec["drafted"] == spec["verified_requests"] * 3
    assert stats["prefix_cache"]["hit_tokens"] > 0
    hist = spec["acceptance_histogram"]
    if method == "draft_self":
        # the target drafting for itself is always right: k + 1 tokens per verify step, less
        # only at the last step of a request (cut by max_new_tokens)
        assert sum(n for length, n in hist.items() if length != 4) <= 2 * len(prompts)
        assert spec["acceptance_rate"] == 1.0
    elif method == "draft_other":
        assert spec["acceptance_rate"] < 0.5
    _finish(engine)


def test_plain_engine_agrees():
    """The non-speculative engine gives the same tokens (same oracle as above)."""
    model = cached_model(KIND, SEED)
    prompts = _prompts(model)
    engine = make_engine(model, **ENGINE_ARGS)
    assert engine.generate_batch(prompts, max_new_tokens=MAX_NEW) == [
        hf_greedy_cached(model, (KIND, SEED), p, MAX_NEW) for p in prompts
    ]
    _finish(engine)


@pytest.mark.parametrize("draft", ["chain", "tree"])
@pytest.mark.parametrize("case", ["eos", "retraction"])
def test_stop_token_inside_accepted_run_and_retraction(case, draft):
    """An EOS inside an accepted run ends the request there (the rest of the run is dropped, its
    state not committed); a KV pool too small for every request's verify tokens retracts and
    recomputes without changing any output. ``tree``: the same over draft trees (topk 2, 8
    nodes: a replay tree of the greedy output, the accepted path cut at the EOS's node)."""
    model = cached_model(KIND, SEED)
    prompts = _prompts(model)
    eos = _expected(model, prompts)[1][5] if case == "eos" else None  # proposed mid-run by the draft
    expected = _expected(model, prompts, eos)
    args = dict(ENGINE_ARGS, max_total_tokens=100) if case == "retraction" else ENGINE_ARGS
    spec = _spec("draft_self", model)
    if draft == "tree":
        continuations = {tuple(p): e for p, e in zip(prompts, _expected(model, prompts))}
        spec = dict(method="custom", num_draft_tokens=3, topk=2, num_tree_nodes=8,
                    draft_source=ReplayDraft(continuations, q=0.3, vocab_size=vocab_size(model), seed=5))
    engine = make_engine(model, speculative=spec, **args)
    if case == "retraction":  # admit without a reserve for future tokens: the verify steps overrun the pool
        engine.scheduler.new_token_ratio = engine.scheduler.MIN_NEW_TOKEN_RATIO = 0.0
    got = engine.generate_batch(prompts, max_new_tokens=MAX_NEW, eos_token_id=eos)
    for p, g, e in zip(prompts, got, expected):
        assert_greedy_equal(model, p, g, e, case)
    if case == "eos":
        assert any(len(e) < MAX_NEW for e in expected)
    else:
        assert engine.stats()["retractions"] > 0
    _finish(engine)


class _DeviceRows:
    """A draft source whose chains come back as one int64 tensor (``propose_on_device``, the way the
    MTP head's proposal graphs leave theirs on the GPU): the decoder's device-draft path."""

    def __init__(self, inner, vocab: int) -> None:
        self.inner, self.vocab, self.calls = inner, vocab, 0

    def propose(self, requests, k):
        return self.inner.propose(requests, k)

    def propose_on_device(self, requests, k):
        from hybrid_compile.engine.speculative.drafts import fill_drafts

        self.calls += 1
        return torch.tensor(fill_drafts(self.inner.propose(requests, k), requests, k, self.vocab), dtype=torch.int64)


@pytest.mark.parametrize("case", ["retraction", "sampled"])
def test_device_drafts_equal_host_drafts(case):
    """Drafts handed to the verify step as a device tensor (copied into its input ids, brought to the
    host with the targets) give what the same drafts as host lists give: greedy equal to HF's
    with a KV pool small enough to retract requests between the proposal and the verify step
    (the rows of the requests still scheduled are picked on the device), and seeded sampling
    (rejection sampling reads the drafts on the host) token for token equal."""
    model = cached_model(KIND, SEED)
    prompts = _prompts(model)
    expected = _expected(model, prompts)
    continuations = {tuple(p): e for p, e in zip(prompts, expected)}
    args = dict(ENGINE_ARGS, max_total_tokens=100) if case == "retraction" else ENGINE_ARGS
    sampling = dict(do_sample=True, temperature=0.8, seed=3) if case == "sampled" else {}
    outs = []
    for on_device in (True, False):
        source = ReplayDraft(continuations, q=0.3, vocab_size=vocab_size(model), seed=5)
        if on_device:
            source = _DeviceRows(source, vocab_size(model))
        engine = make_engine(model, speculative=dict(method="custom", num_draft_tokens=3, draft_source=source), **args)
        if case == "retraction":  # admit without a reserve for future tokens: the verify steps overrun the pool
            engine.scheduler.new_token_ratio = engine.scheduler.MIN_NEW_TOKEN_RATIO = 0.0
        outs.append(engine.generate_batch(prompts, max_new_tokens=MAX_NEW, **sampling))
        stats = engine.stats()
        assert stats["speculative"]["device_draft_steps"] == (stats["speculative"]["verify_steps"] if on_device else 0)
        if case == "retraction":
            assert stats["retractions"] > 0
        _finish(engine)
    assert outs[0] == outs[1]
    if case == "retraction":
        for p, g, e in zip(prompts, outs[0], expected):
            assert_greedy_equal(model, p, g, e, case)


def test_compile_and_speculative():
    """The verify step runs through the compiled graph (the layer ops read TARGET_VERIFY from the
    context), one request padded to two."""
    model = cached_model(KIND, SEED)
    prompts = _prompts(model)[:2]
    engine = make_engine(model, speculative=_spec("ngram", model), compile=True, **ENGINE_ARGS)
    got = engine.generate_batch(prompts, max_new_tokens=MAX_NEW) + engine.generate_batch(prompts[:1], max_new_tokens=MAX_NEW)
    for p, g, e in zip(prompts + prompts[:1], got, _expected(model, prompts + prompts[:1])):
        assert_greedy_equal(model, p, g, e, "compile")
    stats = engine.stats()
    assert stats["compile"]["graph_breaks"] == 0 and stats["speculative"]["verify_steps"] > 0
    _finish(engine)


def test_compile_and_tree_verify():
    """A draft-tree verify (topk 2, engine/speculative/tree.py) runs through the compiled graph too (the
    layer ops read the tree mask and parents from the context; the graph is the chain's, so this
    reuses its compiled code): no graph break, one request padded to two (the padding rows get
    tree metadata), K/V of accepted paths moved."""
    model = cached_model(KIND, SEED)
    prompts = _prompts(model)[:2]
    expected = _expected(model, prompts)
    source = ReplayDraft({tuple(p): e for p, e in zip(prompts, expected)}, q=0.5, vocab_size=vocab_size(model))
    spec = dict(method="custom", draft_source=source, num_draft_tokens=3, topk=2, num_tree_nodes=6)
    engine = make_engine(model, speculative=spec, compile=True, **ENGINE_ARGS)
    got = engine.generate_batch(prompts, max_new_tokens=MAX_NEW) + engine.generate_batch(prompts[:1], max_new_tokens=MAX_NEW)
    for p, g, e in zip(prompts + prompts[:1], got, expected + expected[:1]):
        assert_greedy_equal(model, p, g, e, "compiled tree")
    stats = engine.stats()
    assert stats["compile"]["graph_breaks"] == 0 and stats["speculative"]["tree_kv_moves"] > 0
    _finish(engine)


@pytest.mark.parametrize("kind", ["qwen3_next_dense", "qwen3_5", "qwen3_5_moe", "olmo_hybrid"])
def test_other_qwen_kinds_greedy(kind):
    model = cached_model(kind, 0)
    prompts = random_prompts((5, 30), vocab_size(model), seed=3)
    expected = [hf_greedy_cached(model, (kind, 0), p, 8) for p in prompts]
    engine = make_engine(model, speculative=dict(method="draft_model", draft_model=model, num_draft_tokens=2),
                         **ENGINE_ARGS)
    got = engine.generate_batch(prompts, max_new_tokens=8)
    for p, g, e in zip(prompts, got, expected):
        assert_greedy_equal(model, p, g, e, kind)
    _finish(engine)


@pytest.mark.parametrize("family", sorted(mm.BUILDERS))
def test_mamba2_families_greedy(family):
    """Issue 8: speculative decoding for the Mamba2 families (mamba2 has no attention layer)."""
    model = mm.BUILDERS[family](1)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, mm.VOCAB, (n,), generator=g).tolist() for n in (1, 40, 9)]
    expected = []
    for p in prompts:
        x = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False)
        expected.append(out[0, len(p):].tolist())
    engine = hc.wrap(
        model, speculative=dict(method="draft_model", draft_model=model, num_draft_tokens=3), max_running_requests=2,
        chunked_prefill_size=32, max_context_len=256, max_total_tokens=2048, mamba_cache_size=8,
    )
    t0 = time.perf_counter()
    assert engine.generate_batch(prompts, max_new_tokens=10) == expected
    wall = time.perf_counter() - t0
    spec = engine.stats()["speculative"]
    assert spec["acceptance_rate"] == 1.0
    # every part of the verify steps timed on the host, within the run's wall time
    phases = spec["phase_seconds"]
    assert set(phases) == {"draft", "schedule", "metadata", "forward", "accept", "commit", "observe", "emit"}
    assert all(v > 0 for v in phases.values()) and sum(phases.values()) < wall, phases
    assert phases["draft"] == pytest.approx(spec["draft_seconds"])
    _finish(engine)


# -- sampling: the output distribution is the target's ------------------------------------------


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of ``counts`` against ``probs``; cells expected below 5 are
    pooled into one."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat.double() / 2))


@torch.inference_mode()
def _exact_joint(model, prompt: list[int], vocab: int, params: SamplingParams) -> torch.Tensor:
    """P(t1, t2, t3) of ancestral sampling from HF's logits after temperature / top-k / top-p,
    ``[V, V, V]`` (V + V*V + 1 forwards)."""

    def probs(tokens):
        ids = torch.tensor([tokens])
        logits = model(input_ids=ids, use_cache=False).logits[0, -1].float()
        return transform_logits(logits, params.temperature, params.top_k, params.top_p).double().softmax(-1)

    joint = torch.zeros(vocab, vocab, vocab, dtype=torch.float64)
    p1 = probs(prompt)
    for a in range(vocab):
        p2 = probs(prompt + [a])
        for b in range(vocab):
            joint[a, b] = p1[a] * p2[b] * probs(prompt + [a, b])
    return joint


@pytest.mark.parametrize("params, source", [
    (SamplingParams(do_sample=True, temperature=1.5), "replay"),
    (SamplingParams(do_sample=True, temperature=0.9, top_k=5, top_p=0.9), "replay"),
    (SamplingParams(do_sample=True, temperature=1.5), "mtp"),
    (SamplingParams(do_sample=True, temperature=0.9, top_k=5, top_p=0.9), "replay_tree"),
], ids=["temperature", "top_k_top_p", "mtp_temperature", "tree_top_k_top_p"])
def test_speculative_sampling_matches_target_distribution(params, source, tmp_path):
    """Tokens 2 and 3 come out of a verify step (token 1 from the prefill), drafted by a replay
    of the most likely continuation or by an MTP head of the checkpoint (random weights;
    deterministic drafts: accepted with probability p(draft), else resampled); the joint
    distribution of the three tokens over 1600 seeded requests matches the exact one."""
    vocab, samples = 8, 1600
    config = make_config("qwen3_next_dense")
    config.vocab_size = vocab
    model = build_model("qwen3_next_dense", seed=2, config=config)
    prompt = [1, 5, 2, 7]
    joint = _exact_joint(model, prompt, vocab, params)
    a = int(joint.sum((1, 2)).argmax())
    b = int(joint[a].sum(1).argmax())
    likely = [a, b, int(joint[a, b].argmax())]
    exact = joint.flatten()
    if source == "mtp":
        from mtp_models import write_mtp_checkpoint

        write_mtp_checkpoint("qwen3_next_dense", 2, str(tmp_path), model=model)
        spec = dict(method="mtp", num_draft_tokens=2, mtp_checkpoint=str(tmp_path))
    elif source == "replay_tree":  # a draft tree (topk 2): tree rejection sampling (engine/speculative/tree.py)
        spec = dict(method="custom", num_draft_tokens=2, topk=2, num_tree_nodes=4,
                    draft_source=ReplayDraft({tuple(prompt): likely + [0, 0]}, q=0.5, vocab_size=vocab))
    else:
        spec = dict(method="custom", num_draft_tokens=2,
                    draft_source=ReplayDraft({tuple(prompt): likely + [0, 0]}, q=0.0, vocab_size=vocab))
    engine = make_engine(
        model, speculative=spec,
        max_running_requests=64, chunked_prefill_size=256, max_total_tokens=4096, enable_prefix_cache=False,
    )
    sampling = dict(max_new_tokens=3, do_sample=True, temperature=params.temperature, top_k=params.top_k,
                    top_p=params.top_p, seed=11)
    outs = engine.generate_batch([prompt] * samples, **sampling)
    spec = engine.stats()["speculative"]
    assert 0.05 < spec["acceptance_rate"] < 0.95  # both accepted and resampled drafts
    codes = torch.tensor([(a * vocab + b) * vocab + c for a, b, c in outs])
    counts = torch.bincount(codes, minlength=vocab**3).double()
    assert _chi2_pvalue(counts, exact) > 1e-3
    # seeded requests are reproducible
    again = engine.generate_batch([prompt] * 4, **sampling)
    assert again == outs[:4]
    _finish(engine)


# -- acceptance rules against brute force ---------------------------------------------------------


def test_accept_greedy_brute_force():
    g = torch.Generator().manual_seed(0)
    target = torch.randint(0, 3, (200, 5), generator=g)
    drafts = torch.randint(0, 3, (200, 4), generator=g)
    got = accept_greedy(target, drafts)
    for t, d, out in zip(target.tolist(), drafts.tolist(), got):
        n = 0
        while n < 4 and d[n] == t[n]:
            n += 1
        assert out == d[:n] + [t[n]]


@pytest.mark.parametrize("draft_kind", ["one_hot", "distribution"])
def test_accept_sampled_is_exact(draft_kind):
    """Monte Carlo against the definition: the first emitted token ~ p_0; given that the first j
    emitted tokens are (accepted) drafts, the next ~ p_j. Drafts: fixed (one-hot q), or drawn
    from q (the p_j here do not depend on the prefix, so the conditionals are the p_j)."""
    vocab, k, n = 5, 2, 12000
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, -1)
    drafts = [int(probs[0].argmax()), int(probs[1].argmax())]
    q = None
    if draft_kind == "distribution":
        q = torch.softmax(torch.randn(k, vocab, generator=g), -1)
    gen = torch.Generator().manual_seed(2)
    runs = []
    for _ in range(n):
        if q is not None:
            drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(k)]
        runs.append(accept_sampled(probs, drafts, gen, q))
    for j in range(k + 1):
        reached = [r for r in runs if len(r) > j]  # the first j emitted tokens were accepted drafts
        counts = torch.bincount(torch.tensor([r[j] for r in reached]), minlength=vocab).double()
        assert _chi2_pvalue(counts, probs[j].double()) > 1e-3, j
    assert all(1 <= len(r) <= k + 1 for r in runs)


def test_truncate_ngram_and_replay():
    r = Request(rid=0, prompt=[1, 2], params=SamplingParams(max_new_tokens=5, eos_token_ids=(9,)))
    r.output = [4, 4]
    assert truncate_at_stop(r, [3, 9, 5]) == [3, 9]
    assert truncate_at_stop(r, [3, 5, 6, 7]) == [3, 5, 6]  # 3 of max_new_tokens left

    ngram = NgramDraft(ngram_max=3, ngram_min=1)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        tokens = torch.randint(0, 4, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        expected = []
        for size in range(min(3, len(tokens) - 1), 0, -1):
            starts = [s for s in range(len(tokens) - size) if tokens[s:s + size] == tokens[-size:]]
            if starts:
                expected = tokens[starts[-1] + size:starts[-1] + size + 3]
                break
        assert ngram.lookup(tokens, 3) == expected

    cont = {(1, 2): [7, 8, 9, 10]}
    exact = ReplayDraft(cont, q=0.0, vocab_size=16)
    assert exact.propose([r], 3) == [[9, 10]]
    wrong = ReplayDraft(cont, q=1.0, vocab_size=16, seed=3)
    assert all(a != b for a, b in zip(wrong.propose([r], 3)[0], [9, 10]))


def test_config_validation():
    cfg = SpeculativeConfig.coerce({"method": "ngram", "num_draft_tokens": 2})
    assert cfg.num_draft_tokens == 2 and hc.EngineConfig.from_args(speculative=cfg).speculative == cfg
    for bad, match in (
        ({"method": "eagle"}, "method"),
        ({"method": "ngram", "num_draft_tokens": 0}, "num_draft_tokens"),
        ({"method": "draft_model"}, "needs draft_model"),
        ({"method": "custom"}, "draft_source"),
        ({"method": "ngram", "ngram_min": 3, "ngram_max": 2}, "ngram_min"),
    ):
        with pytest.raises(ValueError, match=match):
            hc.EngineConfig.from_args(speculative=bad)
    with pytest.raises(TypeError, match="unknown SpeculativeConfig"):
        hc.EngineConfig.from_args(speculative={"draft_tokens": 3})
    with pytest.raises(TypeError, match="SpeculativeConfig"):
        hc.EngineConfig.from_args(speculative=3)


def test_bad_draft_model_leaves_target_unpatched():
    model = cached_model(KIND, SEED)
    with pytest.raises(TypeError, match="draft_model must be an HF causal LM"):
        make_engine(model, speculative=dict(method="draft_model", draft_model="tiny-llama"))
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_custom_draft_source():
    """A custom DraftSource (a replay of the target's own greedy continuation) accepts every
    draft when uncorrupted; proposals shorter than k are filled; KV pages of 4 tokens (rejected
    slots freed inside a page); a token outside the vocabulary is a clear error that ends the call's request."""
    model = cached_model(KIND, SEED)
    prompts = _prompts(model)[:3]
    expected = _expected(model, prompts)
    source = ReplayDraft({tuple(p): e[:6] for p, e in zip(prompts, expected)}, q=0.0, vocab_size=vocab_size(model))
    engine = make_engine(model, speculative=dict(method="custom", draft_source=source, num_draft_tokens=3),
                         page_size=4, **ENGINE_ARGS)
    assert engine.generate_batch(prompts, max_new_tokens=MAX_NEW) == expected
    hist = engine.stats()["speculative"]["acceptance_histogram"]
    assert hist.get(4, 0) >= len(prompts)
    engine.speculative.use_source(ReplayDraft({tuple(prompts[0]): [vocab_size(model)] * 8}, 0.0, 10**6))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate_batch(prompts[:1], max_new_tokens=4)
    # the failed call's request ended with it (nothing left running); the engine serves on
    assert not engine.has_unfinished() and not engine._requests
    engine.speculative.use_source(source)
    assert engine.generate_batch(prompts[:1], max_new_tokens=4) == [expected[0][:4]]
    _finish(engine)


def test_verify_metadata_fast_path_equals_general_path():
    """``ModelRunner.build_verify_metadata`` (one host->device copy, KV indices gathered on the
    device) gives exactly the tensors of the general path (``ForwardBatchBuilder.build_extend`` with every
    token's logits and the drafts as input ids) on real verify steps of a continuous batch (KV
    pages of 4, chunked prefills beside), and writes the same ``req_to_token`` entries."""
    import dataclasses

    model = cached_model(KIND, SEED)
    prompts = _prompts(model)
    engine = make_engine(model, speculative=_spec("ngram", model), page_size=4, **ENGINE_ARGS)
    runner = engine.runner
    original = runner.build_verify_metadata
    checked = []

    def build_verify_metadata(batch, drafts):
        ids, md = original(batch, drafts)
        r2t = engine.pools.req_to_token
        fast_map, fast_host = r2t.req_to_token.clone(), r2t._req_to_token_host.clone()
        want_ids = []
        for r, row in zip(batch.requests, drafts):
            want_ids += [r.token_ids(r.num_computed, r.num_computed + 1)[0], *row]
        _, want = runner.batch_builder.build_extend(batch)  # (writes the same req_to_token entries again)
        want = dataclasses.replace(want, logits_indices=torch.arange(md.num_tokens), draft_len=runner.draft_len)
        assert ids.tolist() == want_ids and ids.dtype == torch.int64
        assert_metadata_equal(md, want)
        assert torch.equal(r2t.req_to_token, fast_map) and torch.equal(r2t._req_to_token_host, fast_host)
        checked.append(md.batch_size)
        return ids, md

    runner.build_verify_metadata = build_verify_metadata
    assert engine.generate_batch(prompts, max_new_tokens=MAX_NEW) == _expected(model, prompts)
    assert len(checked) >= 5 and max(checked) == ENGINE_ARGS["max_running_requests"]
    del runner.build_verify_metadata
    _finish(engine)


# -- the verify layer ops against step-by-step decode ---------------------------------------------


def _metadata(mode, slots, prefix, steps, prompt_len):
    b = len(slots)
    lens = torch.full((b,), steps, dtype=torch.int32)
    return ForwardMetadata(
        mode=mode,
        positions=(torch.tensor(prefix).repeat_interleave(steps) + torch.arange(steps).repeat(b)).long(),
        query_start_loc=torch.arange(b + 1, dtype=torch.int32) * steps,
        seq_lens=torch.tensor(prefix, dtype=torch.int32) + lens,
        prefix_lens=torch.tensor(prefix, dtype=torch.int32),
        mamba_cache_indices=torch.tensor(slots, dtype=torch.int32),
        has_initial_state=torch.ones(b, dtype=torch.bool),
        out_cache_loc=torch.zeros(0, dtype=torch.int64),
        kv_indptr=torch.zeros(b + 1, dtype=torch.int32),
        kv_indices=torch.zeros(0, dtype=torch.int64),
        logits_indices=torch.arange(b * steps),
        draft_len=steps if mode is ForwardMode.TARGET_VERIFY else 0,
        prompt_lens=torch.full((b,), prompt_len, dtype=torch.int32),
    )


def _layer_cases():
    g = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=g)
    hk, kd, hv, vd, w = 2, 8, 4, 8, 4
    conv_dim = 2 * hk * kd + hv * vd
    gdn = dict(
        op=torch.ops.hybrid_compile.gdn_layer, width=w, conv_dim=conv_dim, state=(hv, kd, vd),
        inputs=lambda n: (r(n, conv_dim), r(n, hv), r(n, hv)),
        params=(r(conv_dim, w), r(conv_dim), r(hv), r(hv), 0, hk, kd, hv, vd, "silu"),
    )
    h, p, gr, ns = 4, 8, 2, 16
    conv_dim2 = h * p + 2 * gr * ns
    mamba = dict(
        op=torch.ops.hybrid_compile.mamba2_layer, width=w, conv_dim=conv_dim2, state=(h, p, ns),
        inputs=lambda n: (r(n, conv_dim2), r(n, h)),
        # a dt clamp that only prompt tokens get (as HF's mixers): verify tokens must not get it
        params=(r(conv_dim2, w), r(conv_dim2), r(h), r(h), r(h), 0, h, p, gr, ns, "silu", 16, 0.5, 2.0, False),
    )
    # MiniMax's lightning layer: no conv (a 1-wide spec keeps an empty window), state [H, D, D]; small
    # qkv and slopes so the decayed state stays O(1) over the steps
    hl, dl = 2, 8
    lightning = dict(
        op=torch.ops.hybrid_compile.lightning_layer, width=1, conv_dim=1, state=(hl, dl, dl),
        inputs=lambda n: (0.5 * r(n, 3 * hl * dl),), params=(torch.tensor([0.1, 0.7]), 0, hl, dl),
    )
    return {"gdn": gdn, "mamba2": mamba, "lightning": lightning}


@pytest.mark.parametrize("name", ["gdn", "mamba2", "lightning"])
def test_verify_then_commit_equals_decode_steps(name):
    case = _layer_cases()[name]
    steps, slots, prefix = 4, [2, 0], [6, 9]
    g = torch.Generator().manual_seed(6)
    conv0 = torch.randn(3, case["width"] - 1, case["conv_dim"], generator=g)
    ssm0 = torch.randn(3, *case["state"], generator=g)
    inputs = case["inputs"](len(slots) * steps)

    # verify: all steps at once, main state untouched, every step's state in the buffers
    conv, ssm = conv0.clone(), ssm0.clone()
    inter = (torch.zeros(len(slots) + 1, steps, *conv.shape[1:]), torch.zeros(len(slots) + 1, steps, *ssm.shape[1:]))
    md = _metadata(ForwardMode.TARGET_VERIFY, slots, prefix, steps, prompt_len=5)
    with forward_context(ForwardContext(md, {}, {0: (conv, ssm)}, {0: inter})):
        verify_out = case["op"](*inputs, *case["params"])
        torch.library.opcheck(case["op"], (*inputs, *case["params"]))  # (the main state stays untouched)
    assert torch.equal(conv, conv0) and torch.equal(ssm, ssm0)

    # the same verify batch with a trailing 3-token padding request (a token-count bucket's
    # filler): same outputs, zeros for the filler, the same intermediate states
    from hybrid_compile.engine.forward_batch import pad_requests

    md = _metadata(ForwardMode.TARGET_VERIFY, slots, prefix, steps, prompt_len=5)
    md.extend_lens_cpu, md.seq_lens_cpu = [steps] * len(slots), md.seq_lens.tolist()
    _, padded = pad_requests(torch.zeros(md.num_tokens, dtype=torch.int64), md, [3], padding_slot=0)
    pad_inter = tuple(torch.zeros_like(t) for t in inter)
    with forward_context(ForwardContext(padded, {}, {0: (conv, ssm)}, {0: pad_inter})):
        pad_out = case["op"](*(torch.cat([x, x[:3]]) for x in inputs), *case["params"])
    torch.testing.assert_close(pad_out[: len(slots) * steps], verify_out)
    assert not pad_out[len(slots) * steps:].any() and torch.equal(conv, conv0) and torch.equal(ssm, ssm0)
    assert all(torch.equal(a[: len(slots)], b[: len(slots)]) for a, b in zip(pad_inter, inter))

    # decode: one token per step, states updated in place
    dconv, dssm = conv0.clone(), ssm0.clone()
    decode_out, states = [], []
    for t in range(steps):
        rows = torch.arange(len(slots)) * steps + t
        md = _metadata(ForwardMode.DECODE, slots, [p + t for p in prefix], 1, prompt_len=5)
        with forward_context(ForwardContext(md, {}, {0: (dconv, dssm)})):
            decode_out.append(case["op"](*(x[rows] for x in inputs), *case["params"]))
        states.append((dconv.clone(), dssm.clone()))
    decode_out = torch.stack(decode_out, dim=1).flatten(0, 1)  # request-major like the verify batch
    torch.testing.assert_close(verify_out, decode_out, rtol=1e-5, atol=1e-5)

    # commit of accepted steps (3 for request 0, 1 for request 1) = the decode states after them
    accepted = [3, 1]
    torch.ops.hybrid_compile.commit_speculative_state(
        [conv, ssm], list(inter), torch.tensor(slots), torch.tensor(accepted)
    )
    for slot, a in zip(slots, accepted):
        torch.testing.assert_close(conv[slot], states[a - 1][0][slot], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ssm[slot], states[a - 1][1][slot], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv[1], conv0[1])  # another request's slot


def test_benchmark_tiny_smoke(tmp_path):
    """benchmarks/speculative.py runs end to end on CPU with --tiny (numbers are not asserted)."""
    import json
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    out = tmp_path / "spec.json"
    cmd = [sys.executable, str(root / "benchmarks" / "speculative.py"), "--tiny", "--device", "cpu",
           "--batches", "1,2", "--draft-tokens", "2", "--qs", "0,0.5", "--new-tokens", "8", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=root,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())["modes"]["eager"]
    assert set(run["baseline"]) == {"1", "2"}
    rows = {(r["source"], r["batch"]): r for r in run["speculative"]}
    assert set(rows) == {(s, b) for s in ("replay_q0.0", "replay_q0.5", "ngram", "draft_model") for b in (1, 2)}
    # an uncorrupted replay of the target's own greedy output is accepted in full
    assert rows["replay_q0.0", 1]["acceptance_rate"] == 1.0 and rows["replay_q0.0", 1]["match_tokens"] == 8
    # the replay continuation is the speculative engine's own output (a fixed point; fp32: the baseline's)
    for b in (1, 2):
        r = rows["replay_q0.0", b]
        assert r["replay_converged"] and r["replay_rounds"] >= 1 and r["replay_match_tokens"] == 8


def test_replay_continuation_fixed_point(monkeypatch):
    """``benchmarks/speculative.py``'s ``self_consistent_continuations`` from a wrong start: the
    first round (every draft rejected) yields the engine's greedy output, the second replays it
    unchanged: converged in 2 rounds at HF's greedy tokens; 1 round caps it unconverged."""
    import runpy
    import sys
    from pathlib import Path

    monkeypatch.setattr(sys, "path", list(sys.path))
    bench = runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" / "speculative.py"))
    model = cached_model(KIND, SEED)
    prompts = _prompts(model)[:2]
    new = 6
    with make_engine(model, speculative=_spec("ngram", model, k=2), **ENGINE_ARGS) as engine:
        wrong = [[0] * new for _ in prompts]
        conts, info = bench["self_consistent_continuations"](engine, prompts, wrong, vocab_size(model), new, 8)
        assert info == {"rounds": 2, "converged": True}
        assert [conts[tuple(p)] for p in prompts] == [hf_greedy_cached(model, (KIND, SEED), p, new) for p in prompts]
        _, info = bench["self_consistent_continuations"](engine, prompts, wrong, vocab_size(model), new, 1)
        assert info == {"rounds": 1, "converged": False}


def test_host_overhead_verify_benchmark_smoke(tmp_path, monkeypatch):
    """``benchmarks/host_overhead.py --speculative K`` times every phase of the verify steps on CPU
    (acceptance length 1: one token per request per step; no speed asserted)."""
    import json
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "host_overhead.py"
    out = tmp_path / "host.json"
    monkeypatch.setattr(sys, "argv", [str(script), "--device", "cpu", "--tiny", "--batches", "1,2", "--prompt-len", "8",
                                      "--new-tokens", "10", "--speculative", "2", "--out", str(out)])
    monkeypatch.setattr(sys, "path", list(sys.path))
    runpy.run_path(str(script), run_name="__main__")
    result = json.loads(out.read_text())
    for b in ("1", "2"):
        row = result["modes"]["eager"]["verify_k2"][b]
        assert row["steps"] >= 9 - 4 and row["model"] > 0 and row["host"] > 0  # (10 tokens: 9 verify steps, 4 dropped)
        assert all(row[k] > 0 for k in ("draft", "schedule", "build_metadata", "accept", "commit", "kv_free")), row


# -- the commit as CUDA graphs (GPU) --------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.smoke
def test_commit_graphs_equal_the_op():
    """``CommitGraphs`` (one graph replay per commit, buckets 2 and 4) writes exactly what the
    ``commit_speculative_state`` op writes, for 1 to 4 requests (padding rows skipped, a request
    with 0 kept steps untouched), in fp32 and bf16 pool tensors."""
    from hybrid_compile.engine.speculative.decoder import CommitGraphs

    cuda = torch.device("cuda")
    g = torch.Generator(device=cuda).manual_seed(0)
    states = [torch.randn(7, 3, 5, device=cuda, generator=g), torch.randn(7, 4, 2, 2, device=cuda, generator=g).bfloat16()]
    inters = [torch.randn(5, 4, 3, 5, device=cuda, generator=g), torch.randn(5, 4, 4, 2, 2, device=cuda, generator=g).bfloat16()]
    graphs = CommitGraphs(states, inters, (2, 4))
    assert sorted(graphs.graphs) == [2, 4] and graphs.fits(4) and not graphs.fits(5)
    cases = [([3], [2]), ([6, 0, 2], [4, 1, 0]), ([1, 5, 4, 2], [1, 2, 3, 4]), ([0, 6], [3, 4])]
    for slots, steps in cases:
        for t in inters:  # new intermediate states every step (what a verify forward writes)
            t.copy_(torch.randn(t.shape, device=cuda, generator=g).to(t.dtype))
        expected = [s.clone() for s in states]
        torch.ops.hybrid_compile.commit_speculative_state(
            expected, inters, torch.tensor(slots, dtype=torch.int32, device=cuda),
            torch.tensor(steps, dtype=torch.int32, device=cuda))
        graphs.commit(slots, steps)
        torch.cuda.synchronize()
        for got, want in zip(states, expected):
            assert torch.equal(got, want), (slots, steps)
    assert graphs.replays == len(cases)


@pytest.mark.gpu
def test_speculative_full_graphs_with_one_running_request():
    """max_running_requests=1: the decode bucket is 1 but a verify graph takes 2 rows (one of
    padding), so the stable buffers hold 2; outputs equal the engine without speculation."""
    import copy

    model = copy.deepcopy(cached_model("qwen3_next_dense", 0)).to("cuda")
    prompts = random_prompts([37, 5], vocab_size(model), seed=3)
    kw = dict(compile=True, cuda_graphs=True, enable_prefix_cache=False, max_running_requests=1)
    with make_engine(model, **kw) as engine:
        plain = engine.generate_batch(prompts, max_new_tokens=12)
    spec = dict(method="draft_model", draft_model=model, num_draft_tokens=3)
    with make_engine(model, speculative=spec, **kw) as engine:
        assert engine.stats()["compile"]["verify_batch_sizes"] == [2]
        assert engine.generate_batch(prompts, max_new_tokens=12) == plain
        assert engine.stats()["compile"]["verify_graph_replays"] > 0


@pytest.mark.gpu
@pytest.mark.smoke
def test_speculative_engine_commits_through_graphs():
    """With full CUDA graphs the verify steps' commits replay ``CommitGraphs`` (verify batches within
    the buckets), and the outputs are exactly those of the same engine committing through the
    op; the target drafting for itself is accepted (a wrong commit would break its state); pools
    all free afterwards."""
    import copy

    from engine_models import assert_pools_restored

    model = copy.deepcopy(cached_model("qwen3_next_dense", 0)).to("cuda")
    prompts = random_prompts([37, 1, 90, 5, 64, 3], vocab_size(model), seed=7) + [[5, 9, 14, 3] * 5]
    spec = dict(method="draft_model", draft_model=model, num_draft_tokens=3)
    with make_engine(model, compile=True, cuda_graphs=True, cuda_graph_batch_sizes=(1, 4), enable_prefix_cache=False,
                     piecewise_cuda_graph_tokens=(4, 16, 64), max_running_requests=4, speculative=spec) as engine:
        initial = engine.pools.free_counts()
        graphs = engine.speculative.commit_graphs
        assert graphs is not None and sorted(graphs.graphs) == sorted(engine.stats()["compile"]["verify_batch_sizes"]) == [2, 4]
        with_graphs = engine.generate_batch(prompts, max_new_tokens=10)
        stats = engine.stats()["speculative"]
        assert stats["commit_graph_replays"] > 0 and stats["acceptance_rate"] > 0.9, stats
        engine.speculative.commit_graphs = None  # the op, launched per state tensor
        assert engine.generate_batch(prompts, max_new_tokens=10) == with_graphs
        engine.speculative.commit_graphs = graphs
        assert_pools_restored(engine, initial)
