"""A failed step loses nothing and corrupts nothing (engine/engine.py's module docstring).

Faults are raised from inside a step's model forward — in a layer op, after the layers before it
have already updated their KV and recurrent state in place, as a Ctrl-C, a CUDA error or an
out-of-memory would — at chosen steps (a first prefill chunk, a later chunk, a mixed prefill +
decode step, a decode step, a decode step launched ahead with overlap, a speculative verify step,
a draft model's forward), with the prefix cache on and off, eager and compiled, and for every
family. After each:

- the exception reached the caller unchanged;
- the radix tree passes its invariant check and every pool returns to its free count once idle;
- the interrupted requests, continued, and every other request produce exactly transformers'
  greedy tokens, and so does a later request extending the interrupted sequence (served from the
  prefix cache where it is on: it must not have cached a half-updated state).

``generate`` / ``generate_batch`` that raise (a failed step, a streamer, a user's logits processor
or stopping criterion) end their own requests and leave requests added by others running; no
output of those is lost. A stopping criterion that raises in a step's commit commits the rows
before it and rolls back the others (no request is left with KV or state past its tokens).
"""

from __future__ import annotations

import functools

import pytest
import torch

import hybrid_compile as hc
import hybrid_compile.layers.attention as attention_layer
import hybrid_compile.layers.gdn as gdn_layer
import hybrid_compile.layers.mamba2 as mamba2_layer
import hybrid_compile.layers.short_conv as short_conv_layer
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from hybrid_compile.engine import SamplingParams
from hybrid_compile.layers.context import ForwardMode

import mamba2_models as mm
from engine_models import (
    assert_greedy_equal, build_model, hf_greedy_cached, make_engine, random_prompts, single_threaded, vocab_size,
)

MAX_NEW = 6
PROMPT_LENS = (100, 7, 40)  # chunked_prefill_size 32: chunked prompts beside a decoding one (mixed steps)
ENGINE_ARGS = dict(max_running_requests=3, chunked_prefill_size=32, max_total_tokens=2048, mamba_cache_size=16,
                   max_context_len=256)
_LAYER_MODULES = (attention_layer, gdn_layer, mamba2_layer, short_conv_layer)

_one_thread = pytest.fixture(scope="module", autouse=True)(single_threaded)


class Interrupt(KeyboardInterrupt):
    """The injected fault (a BaseException, like Ctrl-C: nothing may rely on ``except Exception``)."""


# which step a fault hits: a predicate over the step's ScheduledBatch
STEPS = {
    "first_chunk": lambda b: b.mode is ForwardMode.EXTEND
    and any(p == 0 and n < len(r.prompt) for r, p, n in zip(b.requests, b.prefix_lens, b.extend_lens)),
    "later_chunk": lambda b: b.mode is ForwardMode.EXTEND
    and any(0 < p < len(r.prompt) for r, p in zip(b.requests, b.prefix_lens)),
    "mixed": lambda b: b.mode is ForwardMode.EXTEND
    and any(r.decoding for r in b.requests) and any(not r.decoding for r in b.requests),
    "decode": lambda b: b.mode is ForwardMode.DECODE and b.input_ids is None,
    "decode_ahead": lambda b: b.mode is ForwardMode.DECODE and b.input_ids is not None,  # overlap
}


class Fault:
    """Raises :class:`Interrupt` once, inside the ``layer``-th layer op (counted over all layer
    ops of one forward) of the first forward of ``runner`` whose step matches ``step`` (a key of
    :data:`STEPS`, or ``"verify"`` for a TARGET_VERIFY forward, or ``"any"``)."""

    def __init__(self, monkeypatch, runner, step: str, layer: int) -> None:
        self.step, self.layer, self.fired, self._armed, self._calls = step, layer, 0, False, 0
        for module in _LAYER_MODULES:
            original = module.require_forward_context
            monkeypatch.setattr(module, "require_forward_context", functools.partial(self._layer_op, original))
        forward, verify = runner.forward, runner.forward_verify

        def forward_hook(batch, *args, **kw):
            self._arm(step in ("any",) or (step in STEPS and STEPS[step](batch)))
            return forward(batch, *args, **kw)

        def verify_hook(*args, **kw):
            self._arm(step in ("any", "verify"))
            return verify(*args, **kw)

        monkeypatch.setattr(runner, "forward", forward_hook)
        monkeypatch.setattr(runner, "forward_verify", verify_hook)

    def _arm(self, match: bool) -> None:
        self._armed, self._calls = match and not self.fired, 0

    def _layer_op(self, original, what):
        ctx = original(what)
        if self._armed:
            if self._calls == self.layer:
                self._armed, self.fired = False, self.fired + 1
                raise Interrupt(f"injected into {what} (layer op {self.layer}) of a {self.step} step")
            self._calls += 1
        return ctx


class _RaisesAt:
    """Counts its calls; raises ValueError at the ``k``-th (None: never)."""

    def __init__(self, k: int | None) -> None:
        self.k, self.calls = k, 0

    def _count(self) -> None:
        self.calls += 1
        if self.calls == self.k:
            raise ValueError(f"raised at call {self.k}")


class RaisingProcessor(_RaisesAt, LogitsProcessor):
    """A user's logits processor: the identity, but it raises at its ``k``-th call."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._count()
        return scores


class RaisingCriterion(_RaisesAt, StoppingCriteria):
    """A user's stopping criterion: never stops, but it raises at its ``k``-th call."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self._count()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@functools.lru_cache(maxsize=None)
def _model(family: str):
    if family in ("qwen3_next_moe", "qwen3_next_dense", "qwen3_5", "qwen3_5_moe", "olmo_hybrid"):
        return build_model(family, seed=0)
    if family in ("lfm2", "lfm2_moe"):
        from test_lfm2 import _model as lfm2_model

        return lfm2_model(family)
    builder = {"mamba2": mm.build_mamba2, "nemotron_h": mm.build_nemotron_h, "falcon_h1": mm.build_falcon_h1,
               "bamba": mm.build_bamba, "granitemoehybrid": mm.build_granitemoehybrid, "zamba2": mm.build_zamba2}
    return builder[family](1)


def _layer_ops(engine) -> int:
    """Layer ops one forward of the engine runs (counted on a one-token probe request)."""
    calls = []
    with pytest.MonkeyPatch.context() as m:
        for module in _LAYER_MODULES:
            original = module.require_forward_context
            m.setattr(module, "require_forward_context", lambda what, original=original: calls.append(what) or original(what))
        engine.generate_batch([[1]], max_new_tokens=1)
    engine.clear_prefix_cache()
    assert calls
    return len(calls)


def _prompts(family: str) -> list[list[int]]:
    return random_prompts(PROMPT_LENS, vocab_size(_model(family)), seed=11)


def _expected(family: str, prompt: list[int], max_new: int = MAX_NEW) -> list[int]:
    return hf_greedy_cached(_model(family), (family, "fault"), prompt, max_new)


def _assert_consistent_and_idle(engine, initial_free: dict) -> None:
    """Tree invariants hold; nothing runs; once the cache is emptied every pool is as after wrap."""
    assert not engine.has_unfinished()
    if engine.prefix_cache is not None:
        engine.prefix_cache.check_invariants()
        engine.clear_prefix_cache()
    engine.pools.check_all_free()
    assert engine.pools.free_counts() == initial_free


def _interrupted_run(family: str, engine, monkeypatch, step: str, layer: int) -> None:
    """Serve the prompts by driving ``step()``; a fault hits one step; every request still ends
    with HF's greedy tokens, and so does a request that extends the longest interrupted one."""
    model = _model(family)
    prompts = _prompts(family)
    with monkeypatch.context() as m:
        fault = Fault(m, engine.runner, step, layer)
        rids = [engine.add_request(p, SamplingParams(max_new_tokens=MAX_NEW)) for p in prompts]
        raised = []
        while engine.has_unfinished():
            try:
                engine.step()
            except Interrupt as e:
                raised.append(e)
        assert fault.fired == 1 and len(raised) == 1, f"{family} {step}: the fault did not fire exactly once"
        assert "injected" in str(raised[0])  # the caller got the very exception raised inside the forward
    outputs = [engine.pop_finished(rid).output for rid in rids]
    for i, (p, out) in enumerate(zip(prompts, outputs)):
        assert_greedy_equal(model, p, out, _expected(family, p), f"{family} {step}@{layer}: request {i}")
    # a request that continues the interrupted sequence: served from the prefix cache (when on),
    # which must hold no half-updated state
    longer = prompts[0] + outputs[0] + [3, 1, 4]
    got = engine.generate_batch([longer], max_new_tokens=MAX_NEW)[0]
    assert_greedy_equal(model, longer, got, _expected(family, longer), f"{family} {step}@{layer}: continuation")


FAMILIES = ("qwen3_next_moe", "qwen3_next_dense", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "mamba2", "nemotron_h",
            "falcon_h1", "bamba", "granitemoehybrid", "zamba2", "lfm2", "lfm2_moe")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_recovers_from_a_fault_mid_prefill_and_mid_decode(family, monkeypatch):
    """Every family: a fault half-way through a later prefill chunk's layers, then one in a decode
    step launched ahead (overlap), on one engine with the prefix cache on."""
    model = _model(family)
    engine = make_engine(model, **ENGINE_ARGS)
    initial = engine.pools.free_counts()
    half = _layer_ops(engine) // 2
    _interrupted_run(family, engine, monkeypatch, "later_chunk", half)
    _interrupted_run(family, engine, monkeypatch, "decode_ahead", max(1, half))
    stats = engine.stats()
    assert stats["failed_steps"] >= 2 and stats["requests_recomputed"] >= 2
    _assert_consistent_and_idle(engine, initial)
    engine.close()


@pytest.mark.parametrize("family", ["qwen3_next_moe", "nemotron_h"])
@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no_cache"])
def test_faults_at_every_kind_of_step(family, cache, monkeypatch):
    """Faults at the first chunk (before layer 0 and mid-forward), a later chunk, a mixed step, a
    decode step and a decode step launched ahead, one after another on one engine."""
    model = _model(family)
    engine = make_engine(model, enable_prefix_cache=cache, **ENGINE_ARGS)
    initial = engine.pools.free_counts()
    n = _layer_ops(engine)
    for step, layer in [("first_chunk", 0), ("first_chunk", n - 1), ("later_chunk", 1), ("mixed", n // 2),
                        ("decode", n - 1), ("decode_ahead", 0)]:
        _interrupted_run(family, engine, monkeypatch, step, layer)
        _assert_consistent_and_idle(engine, initial)
    engine.close()


@pytest.mark.parametrize("family", ["qwen3_next_moe", "nemotron_h"])
def test_compiled_engine_recovers(family, monkeypatch):
    """The same through the compiled forward (the fault raised inside a layer op of the split graph):
    a later chunk, a mixed prefill + decode step, a decode step."""
    model = _model(family)
    engine = make_engine(model, compile=True, **ENGINE_ARGS)
    initial = engine.pools.free_counts()
    _interrupted_run(family, engine, monkeypatch, "later_chunk", 1)
    n = _layer_ops(engine)  # (counted once compiled: a first call also counts the traced ops)
    _interrupted_run(family, engine, monkeypatch, "mixed", n // 2)
    _interrupted_run(family, engine, monkeypatch, "decode", n - 1)
    assert engine.stats()["compile"]["graph_breaks"] == 0
    _assert_consistent_and_idle(engine, initial)
    engine.close()


@pytest.mark.parametrize("family", ["qwen3_next_moe", "nemotron_h"])
@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no_cache"])
def test_speculative_verify_and_draft_faults(family, cache, monkeypatch):
    """Speculative decoding with a draft model (of the same family, other weights): a fault in the
    verify forward (the main states are untouched: only the drafts' KV slots are undone), then one
    inside the draft model's own forward (it forgets those requests and recomputes them)."""
    model = _model(family)
    draft = build_model(family, seed=1) if family == "qwen3_next_moe" else mm.build_nemotron_h(2)
    engine = make_engine(model, enable_prefix_cache=cache,
                         speculative=dict(method="draft_model", draft_model=draft, num_draft_tokens=3), **ENGINE_ARGS)
    initial = engine.pools.free_counts()
    _interrupted_run(family, engine, monkeypatch, "verify", 2)
    assert engine.stats()["speculative"]["verify_steps"] > 0
    source = engine.speculative.source
    draft_initial = source.pools.free_counts()
    with monkeypatch.context() as m:
        fault = Fault(m, source.runner, "any", 1)
        prompts = _prompts(family)
        got = []
        for _ in range(3):  # the first attempts may fail; the engine serves on
            try:
                got = engine.generate_batch(prompts, max_new_tokens=MAX_NEW)
                break
            except Interrupt:
                assert not engine.has_unfinished()
        assert fault.fired == 1
    for i, (p, out) in enumerate(zip(prompts, got)):
        assert_greedy_equal(model, p, out, _expected(family, p), f"draft fault: request {i}")
    assert source.pools.free_counts() == draft_initial  # the draft side holds nothing once idle
    _assert_consistent_and_idle(engine, initial)
    engine.close()


def test_max_time_reached_in_a_verify_step():
    """``max_time`` runs out while a speculative verify step emits several tokens of a request: the
    check runs before the commit, once after the request's last kept token; the request ends with
    every verified token (HF's greedy ones), reason ``"time"``, and its slots go back (to the tree)."""
    family = "qwen3_next_moe"
    model = _model(family)
    prompt = _prompts(family)[1]
    engine = make_engine(model, speculative=dict(method="draft_model", draft_model=model, num_draft_tokens=3),
                         **ENGINE_ARGS)
    initial = engine.pools.free_counts()
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=20, max_time=3600.0))
    while not engine.request(rid).output:
        engine.step()
    engine.request(rid).arrival_time -= 7200.0  # the time is up
    verified = engine.stats()["speculative"]["verify_steps"]
    outputs = engine.step()
    assert engine.stats()["speculative"]["verify_steps"] == verified + 1
    assert len(outputs) == 4 and [o.finished for o in outputs] == [False, False, False, True]  # (the drafts: the model's own)
    r = engine.pop_finished(rid)
    assert r.finish_reason == "time" and len(r.output) == 5
    assert_greedy_equal(model, prompt, r.output, _expected(family, prompt, 5), "max_time in a verify step")
    _assert_consistent_and_idle(engine, initial)
    engine.close()


def test_generate_that_raises_ends_only_its_own_requests(monkeypatch):
    """A failed step inside ``generate_batch``, a streamer that raises inside ``generate``, and a
    sampling callback that raises: each call's requests end with it (slots freed, locks released,
    nothing left queued); a request added by another caller keeps running and ends with HF's
    tokens; later calls serve normally."""
    family = "qwen3_next_dense"
    model = _model(family)
    prompts = _prompts(family)
    engine = make_engine(model, **ENGINE_ARGS)
    initial = engine.pools.free_counts()
    other = engine.add_request(prompts[2], SamplingParams(max_new_tokens=MAX_NEW))  # another caller's

    # 1. a step fails inside generate_batch
    with monkeypatch.context() as m:
        Fault(m, engine.runner, "later_chunk", 1)
        with pytest.raises(Interrupt):
            engine.generate_batch(prompts[:2], max_new_tokens=MAX_NEW)
    assert list(engine._requests) == [other]

    # 2. a streamer raises after a few tokens
    class Broken:
        def __init__(self):
            self.puts = 0

        def put(self, value):
            self.puts += 1
            if self.puts == 3:
                raise RuntimeError("client went away")

        def end(self):
            raise AssertionError("end() of a failed stream")

    with pytest.raises(RuntimeError, match="client went away"):
        engine.generate(torch.tensor([prompts[1]]), streamer=Broken(), max_new_tokens=MAX_NEW)
    assert list(engine._requests) == [other]

    # 3. a user's logits processor raises (at its second call: the step's sampling): rolled back
    processor = RaisingProcessor(2)
    with pytest.raises(ValueError, match="raised at call 2"):
        engine.generate_batch(prompts[:2], max_new_tokens=MAX_NEW, logits_processor=LogitsProcessorList([processor]))
    assert processor.calls == 2
    assert list(engine._requests) == [other]

    while engine.has_unfinished():
        engine.step()
    assert_greedy_equal(model, prompts[2], engine.pop_finished(other).output, _expected(family, prompts[2]), "other")
    got = engine.generate_batch(prompts, max_new_tokens=MAX_NEW)
    for i, (p, out) in enumerate(zip(prompts, got)):
        assert_greedy_equal(model, p, out, _expected(family, p), f"after the failed calls: request {i}")
    _assert_consistent_and_idle(engine, initial)
    engine.close()


def _drain(engine) -> list:
    """Step until idle; every output the steps returned."""
    events = []
    while engine.has_unfinished():
        events += engine.step()
    return events


def _assert_events_complete(events: list, rid: int, output: list[int]) -> None:
    """Each token of the request came as exactly one output of step(), in order; it finished once."""
    assert [o.token for o in events if o.rid == rid and o.token is not None] == output, rid
    assert sum(o.finished for o in events if o.rid == rid) == 1, rid


def _assert_between_steps(engine) -> None:
    """No request holds KV or recurrent state past its tokens (each running one has tokens to
    feed, and KV for exactly its computed ones); the radix tree is consistent."""
    assert engine._ahead is None
    for r in engine.scheduler.running:
        assert r.pending >= 1 and r.kv_slots.numel() == r.num_computed, (r.rid, r.pending, r.num_computed)
    for r in engine.scheduler.waiting:
        assert r.num_computed == 0 and r.kv_slots.numel() == 0 and r.mamba_slot is None, r.rid
    if engine.prefix_cache is not None:
        engine.prefix_cache.check_invariants()


@pytest.mark.parametrize("family", ["qwen3_next_dense", "nemotron_h"])
@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no_cache"])
def test_a_raising_logits_processor_ends_only_its_generate_call(family, cache):
    """A user's logits processor (a transformers LogitsProcessorList) passed to ``generate`` raises
    at its 3rd call, in a step beside two requests of another caller (add_request): the step is
    rolled back and the exception reaches the caller unchanged; the call's request ends; the other
    requests end with HF's greedy tokens, each token coming once from step(); the interrupted
    prompt, resubmitted with a processor that does not raise, too."""
    model = _model(family)
    prompts = _prompts(family)
    engine = make_engine(model, enable_prefix_cache=cache, **ENGINE_ARGS)
    initial = engine.pools.free_counts()
    others = [engine.add_request(p, SamplingParams(max_new_tokens=MAX_NEW)) for p in (prompts[0], prompts[2])]
    processor = RaisingProcessor(3)
    with pytest.raises(ValueError, match="raised at call 3"):
        engine.generate(torch.tensor([prompts[1]]), logits_processor=LogitsProcessorList([processor]),
                        max_new_tokens=MAX_NEW)
    assert processor.calls == 3 and sorted(engine._requests) == others
    stats = engine.stats()
    assert stats["failed_steps"] == 1 and stats["requests_recomputed"] == 3  # the others were in the failed step
    _assert_between_steps(engine)
    events = _drain(engine)
    for rid, p in zip(others, (prompts[0], prompts[2])):
        out = engine.pop_finished(rid).output
        _assert_events_complete(events, rid, out)
        assert_greedy_equal(model, p, out, _expected(family, p), f"{family}: the other caller's request {rid}")
    again = RaisingProcessor(None)
    got = engine.generate(torch.tensor([prompts[1]]), logits_processor=LogitsProcessorList([again]),
                          max_new_tokens=MAX_NEW)[0, len(prompts[1]):].tolist()
    assert again.calls == len(got)
    assert_greedy_equal(model, prompts[1], got, _expected(family, prompts[1]), f"{family}: resubmitted")
    _assert_consistent_and_idle(engine, initial)
    engine.close()


@pytest.mark.parametrize("family", ["qwen3_next_dense", "nemotron_h"])
@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no_cache"])
def test_a_raising_stopping_criterion_commits_the_rows_before_it_only(family, cache):
    """A user's stopping criterion raises at a later step of three decoding requests (driven by
    step()): the row before it commits (its output comes with the next step), its row and the row
    after it are rolled back (none keeps KV or state past its tokens); continued, every request
    ends with HF's greedy tokens, each token coming once from step(). Then inside
    ``generate_batch`` beside another caller's request: the call's requests end with it, the other
    one and the resubmitted prompts end with HF's tokens."""
    model = _model(family)
    prompts = _prompts(family)
    engine = make_engine(model, enable_prefix_cache=cache, **ENGINE_ARGS)
    initial = engine.pools.free_counts()

    # 1. step(): the middle request's criterion raises at its 4th call (every request has one: no step runs ahead)
    criteria = [RaisingCriterion(None), RaisingCriterion(4), RaisingCriterion(None)]
    rids = [engine.add_request(p, SamplingParams(max_new_tokens=MAX_NEW, stopping_criteria=(c,)))
            for p, c in zip(prompts, criteria)]
    events, raised = [], 0
    while engine.has_unfinished():
        before = {rid: len(engine.request(rid).output) for rid in rids}
        try:
            events += engine.step()
        except ValueError as e:
            assert str(e) == "raised at call 4"
            raised += 1
            _assert_between_steps(engine)
            # every request sampled in that step (rows in admission order): the first one committed
            assert [len(engine.request(rid).output) - before[rid] for rid in rids] == [1, 0, 0]
            assert [engine.request(rid).num_computed for rid in rids[1:]] == [0, 0]  # rolled back
            assert criteria[2].calls == before[rids[2]]  # the check of the row after it never ran
    assert raised == 1 and engine.stats()["failed_steps"] == 1
    for rid, p in zip(rids, prompts):
        out = engine.pop_finished(rid).output
        _assert_events_complete(events, rid, out)
        assert_greedy_equal(model, p, out, _expected(family, p), f"{family}: request {rid}")

    # 2. generate_batch, beside another caller's request
    other = engine.add_request(prompts[2], SamplingParams(max_new_tokens=MAX_NEW))
    criterion = RaisingCriterion(5)
    with pytest.raises(ValueError, match="raised at call 5"):
        engine.generate_batch(prompts[:2], max_new_tokens=MAX_NEW, stopping_criteria=StoppingCriteriaList([criterion]))
    assert list(engine._requests) == [other]
    _assert_between_steps(engine)
    events = _drain(engine)
    out = engine.pop_finished(other).output
    _assert_events_complete(events, other, out)
    assert_greedy_equal(model, prompts[2], out, _expected(family, prompts[2]), f"{family}: the other caller's request")
    got = engine.generate_batch(prompts[:2], max_new_tokens=MAX_NEW,
                                stopping_criteria=StoppingCriteriaList([RaisingCriterion(None)]))
    for i, (p, out) in enumerate(zip(prompts[:2], got)):
        assert_greedy_equal(model, p, out, _expected(family, p), f"{family}: resubmitted request {i}")
    _assert_consistent_and_idle(engine, initial)
    engine.close()


def test_other_callers_outputs_are_never_lost():
    """The steps of a ``generate`` call also produce outputs of requests added by others: those come
    with the next step(), whether the call returns or raises — also the outputs after the one
    whose streamer ``put`` raised, in the same step."""
    family = "qwen3_next_dense"
    model = _model(family)
    prompts = _prompts(family)
    engine = make_engine(model, **ENGINE_ARGS)
    initial = engine.pools.free_counts()
    first = engine.add_request(prompts[2], SamplingParams(max_new_tokens=MAX_NEW))  # its rows come before the call's
    short = random_prompts((6,), vocab_size(model), seed=13)[0]
    added = []

    class Streamer:
        puts = 0

        def put(self, value):
            self.puts += 1
            if self.puts == 1:  # (the prompt) another caller adds a request: its rows come after the call's
                added.append(engine.add_request(short, SamplingParams(max_new_tokens=MAX_NEW)))
            elif self.puts == 2:  # the call's first token; the added request's first one follows it in the step
                raise RuntimeError("client went away")

        def end(self):
            raise AssertionError("end() of a failed stream")

    with pytest.raises(RuntimeError, match="client went away"):
        engine.generate(torch.tensor([prompts[1]]), streamer=Streamer(), max_new_tokens=MAX_NEW)
    later = added[0]
    assert sorted(engine._requests) == [first, later]
    assert len(engine.request(later).output) == 1  # its first token came in the step whose put raised
    # a call that returns: the others' outputs of its steps wait for step() too
    got = engine.generate(torch.tensor([prompts[1]]), max_new_tokens=MAX_NEW)[0, len(prompts[1]):].tolist()
    assert_greedy_equal(model, prompts[1], got, _expected(family, prompts[1]), "the generate call")
    events = _drain(engine)
    for rid, p in ((first, prompts[2]), (later, short)):
        out = engine.pop_finished(rid).output
        _assert_events_complete(events, rid, out)
        assert_greedy_equal(model, p, out, _expected(family, p), f"the other caller's request {rid}")
    _assert_consistent_and_idle(engine, initial)
    engine.close()


def test_seeded_sampling_is_unchanged_by_a_rolled_back_step(monkeypatch):
    """A seeded sampled request with penalties draws the same tokens as without the fault: the
    generators are restored and the token counts forgotten with the step (the oracle: the same
    engine's run without a fault)."""
    family = "qwen3_next_dense"
    prompts = _prompts(family)
    # penalties too: their per-request token counts (on the device) must forget a rolled-back step's tokens
    params = dict(max_new_tokens=MAX_NEW, do_sample=True, temperature=0.9, top_k=20, seed=5, presence_penalty=0.7,
                  repetition_penalty=1.3)
    engine = make_engine(_model(family), **ENGINE_ARGS)
    clean = engine.generate_batch(prompts, **params)
    engine.clear_prefix_cache()
    for step in ("decode", "decode_ahead", "mixed"):
        with monkeypatch.context() as m:
            fault = Fault(m, engine.runner, step, 1)
            rids = [engine.add_request(p, SamplingParams(**{**params, "seed": 5 + i})) for i, p in enumerate(prompts)]
            while engine.has_unfinished():
                try:
                    engine.step()
                except Interrupt:
                    pass
            assert fault.fired == 1, step
        assert [engine.pop_finished(r).output for r in rids] == clean, step
        engine.clear_prefix_cache()
    engine.close()


def test_abort_frees_a_request_and_leaves_the_others_unchanged():
    """``abort`` of a waiting and of a running request (mid-prefill and mid-decode, with a decode
    step in flight): slots freed, locks released, a final ``"abort"`` output; the other requests'
    tokens equal the run without the abort (HF's greedy)."""
    family = "qwen3_next_moe"
    model = _model(family)
    prompts = _prompts(family) + random_prompts((12,), vocab_size(model), seed=12)
    engine = make_engine(model, **dict(ENGINE_ARGS, max_running_requests=2))
    initial = engine.pools.free_counts()
    rids = [engine.add_request(p, SamplingParams(max_new_tokens=MAX_NEW)) for p in prompts]
    assert engine.abort(rids[3])  # waiting (two run at a time)
    outputs = []
    aborted_running = None
    while engine.has_unfinished():
        outputs += engine.step()
        running = engine.scheduler.running
        if aborted_running is None and engine._ahead is not None:
            aborted_running = running[0].rid  # decoding, with a step launched ahead on it
            assert engine.abort(aborted_running)
    assert aborted_running is not None
    finals = {o.rid: o.finish_reason for o in outputs if o.finished}
    assert finals[rids[3]] == finals[aborted_running] == "abort"
    assert not engine.abort(aborted_running)  # already ended
    for rid, p in zip(rids, prompts):
        r = engine.pop_finished(rid)
        if rid in (rids[3], aborted_running):
            assert r.finish_reason == "abort"
            assert r.output == _expected(family, p)[: len(r.output)]
        else:
            assert_greedy_equal(model, p, r.output, _expected(family, p), f"request {rid}")
    with pytest.raises(KeyError):
        engine.abort(rids[0])
    assert engine.stats()["requests_aborted"] == 2
    _assert_consistent_and_idle(engine, initial)
    engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["sample_ahead", "read_tokens"])
def test_gpu_cuda_graphs_roll_back_a_host_side_fault_with_overlap(where, monkeypatch):
    """On the GPU with full and piecewise CUDA graphs and overlap on: a fault between a replayed
    step's launch and its commit (the sampling of a decode step launched ahead, or the wait for a
    step's tokens) rolls the step back; every request still ends with the fault-free run's tokens
    (the eager engine on the same weights) and the pools return to their free counts."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    family = "qwen3_next_dense"  # (fp32 MoE blocks run transformers' expert loop: no CUDA graphs)
    with torch.device("cuda"):
        model = build_model(family, seed=0).cuda()
    prompts = _prompts(family)
    args = dict(ENGINE_ARGS, cuda_graph_batch_sizes=[1, 2, 4])
    reference = hc.wrap(model, compile=False, cuda_graphs=False, **args)
    expected = reference.generate_batch(prompts, max_new_tokens=MAX_NEW)
    reference.close()
    engine = hc.wrap(model, compile=True, cuda_graphs=True, **args)
    initial = engine.pools.free_counts()
    calls = []
    if where == "sample_ahead":
        sample = engine.sampler.sample_rows

        def faulty(*a, **kw):
            if kw.get("in_flight") == 1 and not calls:  # the sampling of a decode step launched ahead
                calls.append(1)
                raise Interrupt("injected into the sampling of a step launched ahead")
            return sample(*a, **kw)

        monkeypatch.setattr(engine.sampler, "sample_rows", faulty)
    else:
        launch = engine._forward_and_sample

        class FailingEvent:  # the wait for a launched step's tokens raises (as an async CUDA error would)
            def __init__(self, event):
                self.event = event

            def synchronize(self):
                calls.append(1)
                raise Interrupt("injected while waiting for a step's tokens")

        def faulty(batch, undo):
            launched = launch(batch, undo)
            if batch.input_ids is not None and not calls:  # a decode step launched ahead
                launched.tokens_ready = FailingEvent(launched.tokens_ready)
            return launched

        monkeypatch.setattr(engine, "_forward_and_sample", faulty)
    rids = [engine.add_request(p, SamplingParams(max_new_tokens=MAX_NEW)) for p in prompts]
    while engine.has_unfinished():
        try:
            engine.step()
        except Interrupt:
            pass
    assert calls == [1]
    assert [engine.pop_finished(r).output for r in rids] == expected
    stats = engine.stats()
    assert stats["failed_steps"] >= 1 and stats["overlapped_steps"] > 0
    _assert_consistent_and_idle(engine, initial)
    engine.close()
