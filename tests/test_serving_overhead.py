"""The serving path's host-cost design (hybrid_compile/serving/): what keeps the HTTP layer cheap
per output token, checked so a regression shows up as a failure, not only as a slower benchmark.

- The driver thread wakes an event loop at most once per step for all its requests (counted by
  wrapping the loop's own ``call_soon_threadsafe``), not once per request or per token.
- A consumer that falls behind (an event loop kept busy) gets merged updates: fewer updates than
  tokens, the same tokens (transformers' greedy ``generate`` is the oracle).
- The SSE path over coalesced updates: one event per choice per wake-up, the text exactly the
  one-shot decode cut at the first stop string whatever the batching, each chunk (prebuilt JSON
  prefix / suffix) the same object as OpenAI's chunk built as a dict.
- The metrics' own histograms: Prometheus' bucket semantics (``value <= le``).
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install hybrid_compile[serve])")

import hybrid_compile as hc  # noqa: E402
from checkpoints import build_tokenizer, save_checkpoint  # noqa: E402
from engine_models import single_threaded  # noqa: E402
from hybrid_compile.serving.async_engine import StreamOutput  # noqa: E402
from hybrid_compile.serving.detokenize import IncrementalText  # noqa: E402

NEW = 12
SMALL = dict(device="cpu", max_running_requests=16, max_total_tokens=2048, chunked_prefill_size=256)
TEXT = "Hello world! How are you today? numbers 0123 ; é ü The quick brown fox"


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from single_threaded()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    ckpt = save_checkpoint(tmp_path_factory.mktemp("serving_overhead") / "qwen3_next", "qwen3_next", seed=0)
    eng = hc.from_pretrained(str(ckpt), **SMALL)
    eng.checkpoint = str(ckpt)
    yield eng
    eng.close()


def _hf_greedy(engine, ids: list[int]) -> list[int]:
    """transformers' greedy generate on the same checkpoint, EOS ignored (as the engine's requests)."""
    import torch

    from checkpoints import load_hf

    model, _ = load_hf(engine.checkpoint)
    with torch.inference_mode():
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=None)
    return out[0, len(ids):].tolist()


def test_one_event_loop_wakeup_per_step_and_a_busy_loop_gets_merged_updates(engine):
    tok = engine.tokenizer
    sentences = ["Hello world! How are", "The quick brown", "Hybrid models mix", "Gated delta networks keep",
                 "A small tokenizer for", "numbers 0123", "The lazy dog", "state space layers"]
    prompts = [tok(s)["input_ids"] for s in sentences * 2]  # 16 streams at once
    params = hc.SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    async_engine = hc.AsyncEngine(engine)
    wakeups = {"n": 0}

    async def collect(ids, busy: bool):
        tokens, updates = [], 0
        async for out in async_engine.generate_stream(ids, params):
            tokens.extend(out.new_token_ids)
            updates += 1
            assert out.num_generated == len(tokens)
            if busy:
                time.sleep(0.2)  # the event loop is busy meanwhile; the driver keeps stepping (several steps, loaded CPU too)
        return tokens, updates

    async def run(busy: bool):
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counting(*args, **kwargs):  # every wake-up of this loop from another thread
            wakeups["n"] += 1
            return real(*args, **kwargs)

        loop.call_soon_threadsafe = counting
        try:
            return await asyncio.gather(*(collect(p, busy) for p in (prompts[:2] if busy else prompts)))
        finally:
            loop.call_soon_threadsafe = real

    try:
        steps0 = engine.stats()["steps"]
        results = asyncio.run(run(busy=False))
        steps = engine.stats()["steps"] - steps0
        # O(1) per step: at most one wake-up per step (+1: the driver's last post after the final step)
        assert sum(len(t) for t, _ in results) == len(prompts) * NEW
        assert 0 < wakeups["n"] <= steps + 1, (wakeups["n"], steps, len(prompts))
        assert async_engine.num_handoffs <= async_engine.num_posts

        wakeups["n"] = 0
        busy = asyncio.run(run(busy=True))
    finally:
        async_engine.shutdown()
    for (tokens, updates), ids in zip(busy, prompts[:2]):
        assert tokens == results[prompts.index(ids)][0] == _hf_greedy(engine, ids)
        assert updates < NEW // 2, updates  # merged: several tokens per update
    assert not engine.has_unfinished()


def _in_engine(engine) -> list[tuple[int, str, list[int]]]:
    """(driver) The engine's requests (queued, running, finished not popped): rid, status, prompt."""
    return sorted((rid, r.status.name, list(r.prompt)) for rid, r in engine._requests.items())


def test_open_stream_queues_at_once_keeps_order_and_closing_aborts(engine):
    """AsyncEngineBase.open_stream: the request reaches the engine before anyone iterates it (a
    call queued after it already sees it, in submission order); its updates are transformers'
    tokens, stamped arrival <= admission <= first token; closing it unfinished aborts it (the
    engine frees it), closing it after its end queues nothing; ``validated=True`` takes only a
    checked list of ints."""
    tok = engine.tokenizer
    prompts = [tok(s)["input_ids"] for s in ("Hello world! How are", "The quick brown", "Hybrid models mix")]
    params = hc.SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    async_engine = hc.AsyncEngine(engine)

    async def run():
        first = async_engine.open_stream(prompts[0], params)
        second = async_engine.open_stream(prompts[1], params, validated=True)
        seen = await async_engine.call(_in_engine)  # applied after both adds, before any iteration
        # (waiting, or running already: the driver may have stepped between the commands)
        assert len(seen) == 2 and all(status in ("WAITING", "RUNNING") for _, status, _ in seen), seen
        assert [prompt for _, _, prompt in seen] == prompts[:2]  # in submission order
        await second.aclose()  # unfinished: aborted, freed by the driver before its next step
        tokens, stamps = [], None
        async for batch in first:
            for out in batch:
                tokens += out.new_token_ids
                if out.new_token_ids and stamps is None:
                    stamps = (out.arrival_time, out.admission_time, out.first_token_time)
        commands_before = len(async_engine._commands)
        first.close()  # ended: nothing to abort
        assert len(async_engine._commands) == commands_before
        with pytest.raises(StopAsyncIteration):
            await first.__anext__()
        with pytest.raises(TypeError, match="validated=True"):
            async_engine.open_stream(tuple(prompts[2]), params, validated=True)
        with pytest.raises(ValueError, match="vocabulary"):
            async_engine.open_stream([1, engine.front.vocab_size], params)
        return tokens, stamps, await async_engine.call(_in_engine)

    try:
        tokens, (arrival, admission, first_token), left = asyncio.run(run())
    finally:
        async_engine.shutdown()
    assert tokens == _hf_greedy(engine, prompts[0])
    assert arrival <= admission <= first_token
    assert left == [] and not engine.has_unfinished()  # the aborted one was freed and popped too


class _RecordingFront:
    """The engine's RequestFront, noting the thread of each encode."""

    def __init__(self, front) -> None:
        self.front, self.threads = front, set()

    def encode(self, prompt):
        self.threads.add(threading.current_thread().name)
        return self.front.encode(prompt)


def test_server_tokenizes_off_the_event_loop_with_the_same_ids_and_errors(engine):
    """The server's text and chat tokenization (server._completion_prompts / _tokenize) runs on its
    tokenizer threads, never the event loop's, and gives RequestFront.encode's token ids for many
    requests at once (in each request's prompt order) and its errors."""
    from types import SimpleNamespace

    from hybrid_compile.serving.protocol import OpenAIError
    from hybrid_compile.serving.server import ServerState, _completion_prompts, _tokenize

    front = engine.front
    texts = [f"{TEXT} {i} " * (1 + i % 7) for i in range(24)]
    chats = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": t}] for t in texts[:8]]
    recording = _RecordingFront(front)
    fake = SimpleNamespace(front=recording, tokenizer=front.tokenizer)
    state = ServerState("m")

    async def run():
        prompts = await asyncio.gather(*(_completion_prompts(state, fake, [t, [5, 6], texts[0]]) for t in texts))
        single = await _completion_prompts(state, fake, texts[3])
        conversations = await asyncio.gather(*(_tokenize(state, fake, [c]) for c in chats))
        with pytest.raises(TypeError, match="expected a string or a list of chat message dicts"):
            await _tokenize(state, fake, [42])
        with pytest.raises(OpenAIError, match="prompt must not be empty"):
            await _completion_prompts(state, fake, ["", "x"])
        with pytest.raises(OpenAIError, match="need a tokenizer"):
            await _completion_prompts(state, SimpleNamespace(front=recording, tokenizer=None), ["x"])
        return prompts, single, conversations, threading.current_thread().name

    try:
        prompts, single, conversations, loop_thread = asyncio.run(run())
    finally:
        state.tokenizer_threads.shutdown()
    assert prompts == [[front.encode(t), [5, 6], front.encode(texts[0])] for t in texts]
    assert single == [front.encode(texts[3])]
    assert conversations == [[front.encode(c)] for c in chats]
    assert recording.threads and loop_thread not in recording.threads
    assert all(name.startswith("hybrid-compile-tokenize") for name in recording.threads), recording.threads


def _stop_cut(text: str, stops: list[str]) -> str:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(found)] if found else text


@pytest.mark.parametrize("seed", range(6))
def test_incremental_text_over_any_batching_equals_one_decode_cut_at_the_first_stop(seed):
    tok = build_tokenizer()
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    full = tok.decode(ids, skip_special_tokens=True)
    rng = random.Random(seed)
    stops = [["How a"], ["é", "zzz"], ["fox"], [], ["0123 ;", "today"], ["Hello"]][seed]
    inc, streamed, i = IncrementalText(tok, stop=stops), "", 0
    while i < len(ids) and not inc.stopped:
        k = rng.randint(1, 6)  # coalesced updates of 1..6 tokens
        inc.add(ids[i : i + k])
        i += k
        streamed += inc.take(finished=False)
        assert "\ufffd" not in streamed
    inc.finish()
    streamed += inc.take(finished=True)
    assert streamed == inc.text == _stop_cut(full, stops)
    # the tokens counted end at the one that completes the stop string, whatever the grouping
    first = next((k for k in range(1, len(ids) + 1) if _stop_cut(tok.decode(ids[:k]), stops) != tok.decode(ids[:k])),
                 len(ids))
    assert inc.num_tokens == first, (inc.num_tokens, first)


class _ScriptedEngine:
    """Stands in for the AsyncEngine under the server's SSE path: a scripted sequence of coalesced
    updates (one prompt, n sequences)."""

    def __init__(self, tokenizer, script: list[list[StreamOutput]]) -> None:
        self.tokenizer, self.script = tokenizer, script
        self.closed = False

    def open_stream(self, prompt, params, validated=False):
        async def batches():
            try:
                for batch in self.script:
                    await asyncio.sleep(0)
                    yield batch
            finally:
                self.closed = True

        return batches()


def _script(ids: list[int], n: int, seed: int) -> list[list[StreamOutput]]:
    rng = random.Random(seed)
    done = [0] * n
    out = []
    while min(done) < len(ids):
        batch = []
        for j in range(n):
            if done[j] < len(ids) and rng.random() < 0.8:
                k = rng.randint(1, 5)
                new = ids[done[j] : done[j] + k]
                done[j] += len(new)
                batch.append(StreamOutput(request_id=j, index=j, new_token_ids=new, num_generated=done[j],
                                          finished=done[j] == len(ids), finish_reason="length" if done[j] == len(ids)
                                          else None, prompt_tokens=3, cached_tokens=0))
        if batch:
            out.append(batch)
    return out


@pytest.mark.parametrize("stop,interval", [([], 1), (["How a"], 1), (["0123 ;"], 1), ([], 4), (["brown"], 5)])
def test_sse_over_coalesced_updates_gives_exact_text_and_openai_chunks(stop, interval):
    from hybrid_compile.serving.server import _Choice, _CompletionFormat, _Generation, _Group

    tok = build_tokenizer()
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    n = 2
    engine = _ScriptedEngine(tok, _script(ids, n, seed=len(stop)))
    choices = [_Choice(j, IncrementalText(tok, True, stop)) for j in range(n)]
    gen = _Generation(engine, [_Group([1, 2, 3], hc.SamplingParams(n=n), choices)], stream=True, include_usage=True,
                      stream_interval=interval)
    fmt = _CompletionFormat(gen, "m")

    async def run():
        gen.start()
        return [piece async for piece in gen._sse(fmt)]

    pieces = asyncio.run(run())
    assert engine.closed  # the engine stream is closed (aborted, if a stop string ended it early)
    events = "".join(pieces).split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    usage_chunk = chunks.pop()
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["prompt_tokens"] == 3
    texts = {j: "" for j in range(n)}
    reasons = {}
    for c in chunks:
        assert c == {"id": f"cmpl-{gen.id_suffix}", "object": "text_completion", "created": gen.created, "model": "m",
                     "choices": c["choices"], "usage": None}
        (choice,) = c["choices"]
        assert set(choice) == {"index", "text", "logprobs", "finish_reason"} and choice["logprobs"] is None
        assert choice["index"] not in reasons  # nothing after a choice's last chunk
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"] is not None:
            reasons[choice["index"]] = choice["finish_reason"]
    want = _stop_cut(tok.decode(ids, skip_special_tokens=True), stop)
    assert texts == {j: want for j in range(n)}
    assert reasons == {j: "stop" if stop else "length" for j in range(n)}
    if interval > 1:  # a choice's chunk every `interval` tokens at most (and its last one)
        assert len(chunks) <= n * (len(ids) // interval + 1), (len(chunks), len(ids))
    # fewer SSE sends than chunks: the events of one wake-up go out together
    assert len(pieces) < len(chunks) + 3


def test_metrics_histograms_keep_prometheus_bucket_semantics():
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from hybrid_compile.serving.metrics import ServerMetrics

    m = ServerMetrics("m")
    itls = [0.001, 0.0010001, 0.02, 100.0, 0.0]
    m.observe_step([0.5], itls, [])
    exposition = generate_latest(m.registry).decode()
    samples = {(s.name, s.labels.get("le")): s.value for f in text_string_to_metric_families(exposition)
               for s in f.samples}
    p = "hybrid_compile_inter_token_latency_seconds"
    assert samples[(p + "_bucket", "0.001")] == 2  # 0.0 and 0.001 (<= le)
    assert samples[(p + "_bucket", "0.005")] == 3
    assert samples[(p + "_bucket", "0.02")] == 4
    assert samples[(p + "_bucket", "+Inf")] == samples[(p + "_count", None)] == 5
    assert samples[(p + "_sum", None)] == pytest.approx(sum(itls))
    assert samples[("hybrid_compile_time_to_first_token_seconds_count", None)] == 1
    assert samples[("hybrid_compile_generation_tokens_total", None)] == 6


def test_prebuilt_chunk_text_is_the_chunk_object_and_the_backend_decode_is_decode():
    from hybrid_compile.serving.detokenize import backend_decoder
    from hybrid_compile.serving.server import _ChatFormat, _Choice, _CompletionFormat, _Event, _Generation, _Group

    tok = build_tokenizer()
    assert backend_decoder(tok) is not None  # the fast path is the one the tests' tokenizer takes
    ids = tok(TEXT + " <|im_end|>", add_special_tokens=False)["input_ids"]
    for skip in (True, False):
        inc = IncrementalText(tok, skip_special_tokens=skip)
        for i in range(len(ids) + 1):
            assert inc._decode(ids[:i]) == tok.decode(ids[:i], skip_special_tokens=skip)
    choice = _Choice(3, IncrementalText(tok))
    gen = _Generation(_ScriptedEngine(tok, []), [_Group([1], hc.SamplingParams(), [choice])], stream=True,
                      include_usage=False)
    for fmt_cls in (_CompletionFormat, _ChatFormat):
        fmt = fmt_cls(gen, 'model "x" é')
        for text in ("", "plain", 'quo"te \\ back', "tab\tnew\nline \x00 \x1f", "é ü 漢字 🙂", "\u2028"):
            for reason in (None, "stop", "length", "abort"):
                e = _Event(choice, text, [], None, reason)
                assert json.loads(fmt.plain_choice_json(e)) == fmt.chunk_choice(e, None)
                assert json.loads(fmt.chunk_sse(e).removeprefix("data: ")) == fmt._chunk([fmt.chunk_choice(e, None)])


def test_stream_interval_is_checked():
    from hybrid_compile.serving.server import build_app

    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="stream_interval"):
            build_app("m", load=lambda: None, stream_interval=bad)
