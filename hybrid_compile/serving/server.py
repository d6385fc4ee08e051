"""The OpenAI-compatible HTTP server: a FastAPI app over an :class:`AsyncEngine`, run by uvicorn.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or server-sent events
with ``"stream": true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus).
``hybrid-compile serve`` (:func:`run`) starts uvicorn first and loads the model on a thread:
until the engine is ready ``/health`` and the generation endpoints answer 503.

Each prompt of a request (a completion request may hold several) is one engine request of ``n``
sequences (``SamplingParams.n``: the prompt is prefilled once), one per choice; a choice's tokens
become text through :class:`IncrementalText`, which cuts the text at a stop string (the engine
ends the sequence there too). A client that
goes away cancels the handler (streaming: starlette cancels the response; non-streaming: a
watcher of the connection does), which aborts the engine requests at the next step. Errors are
OpenAI's bodies (:class:`OpenAIError`): 400 naming the field for bad input, 503 while loading,
500 when an engine step failed under the request (its other requests keep going).

Host cost per token (the event loop shares the GIL with the engine's driver thread, unless the
engine runs in its own process: ``serve --engine-process``, :mod:`.engine_process`): a request's
handler wakes once per hand-off of the driver (not per token), takes every update that came
meanwhile (:meth:`AsyncEngine.generate_batches`: when it fell behind, one update carries several
tokens), detokenizes each choice's new tokens with one window decode, and writes all the
resulting SSE events in one send; a chunk is a prebuilt JSON prefix and suffix around its choice
object (only the choice is encoded per event). ``stream_interval`` N > 1 (``serve
--stream-interval``, as SGLang's and vLLM's) sends a choice's text every N tokens (and at its
end), detokenizing only then; a non-streaming response detokenizes each choice once, at its end.

Host cost per request: text prompts and chat conversations are tokenized on a few threads of the
server (the fast tokenizers release the GIL while they encode), not on the event loop; a request
is queued to the engine in its handler, before its response starts (``open_stream``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import gc
import json
import logging
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import HybridEngine, SamplingParams
from ..engine.request_front import out_of_vocabulary
from .async_engine import AsyncEngine, AsyncEngineBase, EngineClosedError, EngineStepError, freeze_long_lived_objects
from .detokenize import IncrementalText
from .metrics import ServerMetrics
from .request_timing import REQUEST_ID_HEADER, RequestTimes, RequestTimingLog
from .protocol import (
    ChatCompletionRequest, CompletionRequest, OpenAIError, chat_logprobs, check_n, completion_logprobs, engine_error,
    generate_kwargs, parse_request, stop_strings, usage,
)

logger = logging.getLogger("hybrid_compile.serving")


class ServerState:
    """What the handlers share: the engine once loaded, the served name, the metrics."""

    def __init__(self, model_name: str, engine: AsyncEngineBase | None = None,
                 timing_log: RequestTimingLog | None = None) -> None:
        self.model_name = model_name
        self.engine = engine
        self.timing_log = timing_log
        self.load_error: BaseException | None = None
        self.created = int(time.time())
        self.metrics = ServerMetrics(model_name)
        if engine is not None:
            engine.observer = self.metrics
        # text prompts and chat conversations are tokenized here, off the event loop (see _tokenize)
        self.tokenizer_threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="hybrid-compile-tokenize")

    def ready(self) -> AsyncEngineBase:
        if self.engine is not None and self.engine.failure is not None:  # an engine process that died
            raise OpenAIError(f"the engine is down: {self.engine.failure}", status=500)
        if self.engine is None:
            if self.load_error is not None:
                raise OpenAIError(f"the model failed to load: {self.load_error}", status=500)
            raise OpenAIError("the server is starting: the model is still loading", status=503)
        return self.engine


def build_app(model_name: str, engine: HybridEngine | AsyncEngineBase | None = None,
              load: Callable[[], HybridEngine | AsyncEngineBase] | None = None,
              on_load_error: Callable[[BaseException], None] | None = None, stream_interval: int = 1,
              request_timing_log: str | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (a HybridEngine, or an AsyncEngine / ProcessAsyncEngine)
    under ``model_name``; or, with ``load``, the app that calls ``load()`` (either kind, e.g. a
    ProcessAsyncEngine whose child loads the model) on a thread at startup and answers 503 until
    it returns. The engine's driver thread stops at the app's shutdown (a loaded engine is also
    closed). ``stream_interval``: a streamed choice's text goes out every that many tokens (and
    at its end). ``request_timing_log``: a file that gets one JSON line of times per request
    (:mod:`.request_timing`)."""
    if (engine is None) == (load is None):
        raise ValueError("build_app takes either engine= or load=")
    if not isinstance(stream_interval, int) or stream_interval < 1:
        raise ValueError(f"stream_interval must be an integer >= 1, got {stream_interval!r}")
    if isinstance(engine, HybridEngine):
        engine = AsyncEngine(engine)
    state = ServerState(model_name, engine, RequestTimingLog(request_timing_log) if request_timing_log else None)

    def load_in_background() -> None:
        try:
            loaded = load()
            if isinstance(loaded, AsyncEngineBase):
                loaded.observer = state.metrics
            else:
                loaded = AsyncEngine(loaded, observer=state.metrics)
        except BaseException as e:  # noqa: BLE001 -- reported, and the server stops (on_load_error)
            state.load_error = e
            if on_load_error is not None:
                on_load_error(e)
            return
        freeze_long_lived_objects()  # (before the first request: no full collection pass mid-burst)
        state.engine = loaded
        logger.info("model %s loaded: serving", model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = None
        if load is not None:
            loader = threading.Thread(target=load_in_background, name="hybrid-compile-load", daemon=True)
            loader.start()
        yield
        if loader is not None:
            loader.join()
        if state.engine is not None:
            state.engine.shutdown(close_engine=load is not None)
        if load is not None:
            gc.unfreeze()  # (frozen once loaded: the exit collects everything as usual)
        if state.timing_log is not None:
            state.timing_log.close()
        state.tokenizer_threads.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="hybrid_compile", lifespan=lifespan)
    app.state.serving = state

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, e: OpenAIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(OpenAIError(str(e.detail), status=e.status_code).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        logger.exception("request failed")
        return JSONResponse(OpenAIError(f"{type(e).__name__}: {e}", status=500).body(), status_code=500)

    @app.get("/health")
    async def health():
        state.ready()
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": state.created, "owned_by": "hybrid_compile"}
        if state.engine is not None:
            card["max_model_len"] = state.engine.max_context_len
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        return Response(await state.metrics.render(state.engine), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        times = _times(state, request)
        req = parse_request(CompletionRequest, await _json_body(request))
        engine = _check_model(state, req.model)
        if req.echo:
            raise OpenAIError("echo is not supported by this server", param="echo")
        if req.suffix:
            raise OpenAIError("suffix is not supported by this server", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise OpenAIError("best_of other than n is not supported by this server", param="best_of")
        if req.logprobs is not None and not 0 <= req.logprobs <= 5:
            raise OpenAIError(f"logprobs must be between 0 and 5, got {req.logprobs}", param="logprobs")
        prompts = await _completion_prompts(state, engine, req.prompt)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        gen = _Generation.plan(engine, req, prompts, max_tokens, "max_tokens", "prompt", req.logprobs, stream_interval)
        return await gen.respond(request, _CompletionFormat(gen, model_name), times, state.timing_log)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        times = _times(state, request)
        req = parse_request(ChatCompletionRequest, await _json_body(request))
        engine = _check_model(state, req.model)
        if not req.messages:
            raise OpenAIError("messages must not be empty", param="messages")
        if engine.tokenizer is None or getattr(engine.tokenizer, "chat_template", None) is None:
            raise OpenAIError("this model's tokenizer has no chat template", param="messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise OpenAIError(f"top_logprobs must be between 0 and 20, got {req.top_logprobs}", param="top_logprobs")
        try:
            (prompt,) = await _tokenize(state, engine, [[m.as_template_message() for m in req.messages]])
        except Exception as e:  # noqa: BLE001 -- the template rejected the conversation
            raise OpenAIError(f"the chat template failed on these messages: {e}", param="messages") from None
        limit_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:  # as much as the context leaves
            max_tokens = engine.max_context_len - len(prompt)
            if max_tokens <= 0:
                raise OpenAIError(
                    f"This model's maximum context length is {engine.max_context_len} tokens; the messages take "
                    f"{len(prompt)} tokens", param="messages", code="context_length_exceeded")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        gen = _Generation.plan(engine, req, [prompt], max_tokens, limit_name, "messages", logprobs, stream_interval)
        return await gen.respond(request, _ChatFormat(gen, model_name), times, state.timing_log)

    return app


# -- request handling ---------------------------------------------------------------------------------


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise OpenAIError(
            "We could not parse the JSON body of your request. (HINT: This likely means you aren't using your "
            "HTTP library correctly. The OpenAI API expects a JSON payload, but what was sent was not valid JSON.)",
            param=None,
        ) from None


def _times(state: ServerState, request: Request) -> RequestTimes | None:
    """The request's timing record when the server keeps a timing log (its handler starts now)."""
    if state.timing_log is None:
        return None
    return RequestTimes(request.headers.get(REQUEST_ID_HEADER), time.perf_counter())


def _check_model(state: ServerState, name: str) -> AsyncEngineBase:
    engine = state.ready()
    if name != state.model_name:
        raise OpenAIError(f"The model `{name}` does not exist (this server serves `{state.model_name}`)",
                          param="model", code="model_not_found")
    return engine


async def _tokenize(state: ServerState, engine: AsyncEngineBase, prompts: list) -> list[list[int]]:
    """Texts and chat conversations -> token ids (``RequestFront.encode``) on the server's tokenizer
    threads: a fast tokenizer releases the GIL while it encodes, so the event loop goes on parsing
    the next requests and streaming the running ones meanwhile (a prompt of thousands of tokens
    takes milliseconds). An error of the tokenizer or chat template is raised here."""
    return await asyncio.get_running_loop().run_in_executor(
        state.tokenizer_threads, functools.partial(_encode_all, engine.front, prompts))


def _encode_all(front, prompts: list) -> list[list[int]]:
    return [front.encode(p) for p in prompts]


async def _completion_prompts(state: ServerState, engine: AsyncEngineBase, prompt: Any) -> list[list[int]]:
    """OpenAI's four prompt forms (text, texts, token ids, lists of token ids) -> token ids."""
    # (the request model validated it: a list holds only token ids, only texts or only lists of ids)
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise OpenAIError("prompt must not be empty", param="prompt")
    texts = [p for p in prompt if isinstance(p, str)]
    if texts and engine.tokenizer is None:
        raise OpenAIError("text prompts need a tokenizer and this model has none", param="prompt")
    encoded = iter(await _tokenize(state, engine, texts) if texts else [])
    out = []
    for p in prompt:
        p = next(encoded) if isinstance(p, str) else list(p)
        if not p:
            raise OpenAIError("prompt must not be empty", param="prompt")
        out.append(p)
    return out


@dataclass
class _Choice:
    index: int
    text: IncrementalText
    done: bool = False
    # tokens (and their logprobs) received and not detokenized / sent yet (stream_interval)
    held_ids: list[int] = dataclasses.field(default_factory=list)
    held_logprobs: list | None = None


@dataclass
class _Group:
    """One prompt's choices: one engine request of ``n`` sequences (the prompt prefilled once)."""

    prompt: list[int]
    params: SamplingParams
    choices: list[_Choice]
    cached_tokens: int = 0
    batches: Any = None  # its engine request's updates (AsyncEngineBase.open_stream), once queued


@dataclass
class _Event:
    """One step of one choice: new text (and tokens), and at the end its finish reason."""

    choice: _Choice
    text: str
    token_ids: list[int]
    logprobs: list | None
    finish_reason: str | None = None


class _Generation:
    """The engine requests of one API request (one per prompt, of ``n`` sequences each) and their
    responses."""

    def __init__(self, engine: AsyncEngineBase, groups: list[_Group], stream: bool, include_usage: bool,
                 stream_interval: int = 1) -> None:
        self.engine, self.groups, self.stream, self.include_usage = engine, groups, stream, include_usage
        # tokens a choice gathers before its text is decoded and sent (a whole response: only at the end)
        self.interval = stream_interval if stream else sys.maxsize
        self.choices = [c for g in groups for c in g.choices]
        self.id_suffix = uuid.uuid4().hex
        self.created = int(time.time())
        self.times: RequestTimes | None = None  # (the timing log's record, set by respond)

    @classmethod
    def plan(cls, engine: AsyncEngineBase, req, prompts: list[list[int]], max_tokens: int, limit_name: str,
             prompt_name: str, logprobs: int | None, stream_interval: int = 1) -> "_Generation":
        """Check everything before anything is queued: a bad request leaves the engine untouched."""
        n = check_n(req)
        stop = stop_strings(req)
        if max_tokens <= 0:
            raise OpenAIError(f"{limit_name} must be at least 1, got {max_tokens}", param=limit_name)
        vocab = engine.front.vocab_size
        for p in prompts:
            bad = out_of_vocabulary(p, vocab)
            if bad:
                raise OpenAIError(f"{prompt_name} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}",
                                  param=prompt_name)
            if len(p) + max_tokens > engine.max_context_len:
                raise OpenAIError(
                    f"This model's maximum context length is {engine.max_context_len} tokens. However, you requested "
                    f"{len(p) + max_tokens} tokens ({len(p)} in the {prompt_name}, {max_tokens} in the completion). "
                    f"Please reduce the length of the {prompt_name} or {limit_name}.",
                    param=limit_name, code="context_length_exceeded",
                )
        names = {"max_tokens": limit_name, "logprobs": "top_logprobs" if getattr(req, "top_logprobs", None)
                 else "logprobs"}
        if engine.tokenizer is None:
            raise OpenAIError("this model has no tokenizer to turn tokens into text", param=None)
        groups = []
        try:
            # the in-process generate()'s own mapping (defaults and EOS from the generation config)
            settings = engine.front.settings(**generate_kwargs(req, max_tokens, logprobs, stop))
            for p in prompts:
                # choice j of a prompt is its engine request's sequence j (sampling with seed + j)
                params = dataclasses.replace(engine.front.sampling_params(settings, len(p)), n=n)
                engine.validate(p, params)
                choices = [_Choice(len(groups) * n + j, IncrementalText(engine.tokenizer, req.skip_special_tokens,
                                                                        stop)) for j in range(n)]
                groups.append(_Group(p, params, choices))
        except ValueError as e:
            raise engine_error(e, names) from None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream_options is not None and not req.stream:
            raise OpenAIError("stream_options needs stream=true", param="stream_options")
        return cls(engine, groups, bool(req.stream), include_usage, stream_interval)

    def start(self) -> None:
        """Queue every prompt's engine request now (before the response starts: the engine sees
        them without waiting for the event loop to get to the response's first step). The
        requests must then be ended: read to their end, or :meth:`abort`."""
        try:
            for group in self.groups:
                group.batches = self.engine.open_stream(group.prompt, group.params, validated=True)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Abort every engine request of this response that has not ended (no-op for the others)."""
        for group in self.groups:
            if group.batches is not None:
                group.batches.close()

    async def _events(self, group: _Group) -> AsyncIterator[list[_Event]]:
        """The events of one prompt's choices, by wake-up (at most one per choice each); closing
        this iterator early aborts its request."""
        batches = group.batches
        open_choices = len(group.choices)
        async with contextlib.aclosing(batches):
            async for batch in batches:
                events = []
                for out in batch:
                    if self.times is not None:
                        self.times.observe(out.arrival_time, out.admission_time, out.first_token_time)
                    choice = group.choices[out.index]
                    if choice.done:  # ended at a stop string before its engine sequence did
                        continue
                    group.cached_tokens = out.cached_tokens
                    choice.held_ids += out.new_token_ids
                    if out.logprobs:
                        choice.held_logprobs = (choice.held_logprobs or []) + out.logprobs
                    if not out.finished and len(choice.held_ids) < self.interval:
                        continue
                    token_ids, logprobs = choice.held_ids, choice.held_logprobs
                    choice.held_ids, choice.held_logprobs = [], None
                    text = choice.text
                    text.add(token_ids)
                    done = out.finished or text.stopped
                    if done:
                        text.finish()
                        choice.done = True
                        open_choices -= 1
                    reason = ("stop" if text.stopped else out.finish_reason) if done else None
                    piece = text.take(finished=done)
                    if piece or done or logprobs:
                        events.append(_Event(choice, piece, token_ids, logprobs, reason))
                if events:
                    yield events
                if open_choices == 0:
                    return  # (a sequence still running after its stop string: aclosing aborts it)

    async def respond(self, request: Request, fmt: "_Format", times: RequestTimes | None = None,
                      timing_log: RequestTimingLog | None = None) -> Response:
        if times is not None:
            self.times, times.prompts = times, len(self.groups)
        try:
            self.start()
        except (EngineClosedError, EngineStepError) as e:  # (an engine that stopped meanwhile)
            raise _error_of(e) from None
        if self.stream:
            return _AbortingStreamingResponse(self, self._sse(fmt, timing_log), media_type="text/event-stream")
        status = 499
        try:
            collected = await _cancel_on_disconnect(request, _all(self._collect(g) for g in self.groups))
            if collected is None:  # the client went away: its requests were aborted
                return Response(status_code=499)
            events = [e for group_events in collected for e in group_events]
            response = JSONResponse(fmt.response([[e for e in events if e.choice is c] for c in self.choices]))
            status = 200
            return response
        except OpenAIError as e:
            status = e.status
            raise
        finally:
            self.abort()  # (a client that went away, an error: what still runs)
            self._log_times(timing_log, fmt, status)

    def _log_times(self, timing_log: RequestTimingLog | None, fmt: "_Format", status: int) -> None:
        if timing_log is not None and self.times is not None:
            timing_log.write(self.times.record(f"{fmt.id_prefix}-{self.id_suffix}", time.perf_counter(), status))

    async def _collect(self, group: _Group) -> list[_Event]:
        return [e async for events in self._events(group) for e in events]

    async def _sse(self, fmt: "_Format", timing_log: RequestTimingLog | None = None) -> AsyncIterator[str]:
        """The response's SSE text: one piece (one send) per wake-up, holding its events."""
        status = 499  # (until it ends: a client that went away closes this generator)
        try:
            start = "".join(_sse_data(chunk) for chunk in fmt.start_chunks())
            if start:
                yield start
            try:
                async for events in self._merged_events():
                    if self.times is not None and self.times.first_sent is None and any(e.text for e in events):
                        self.times.first_sent = time.perf_counter()
                    yield "".join(fmt.chunk_sse(e) for e in events)
            except Exception as e:  # noqa: BLE001 -- ends the whole response with an error event
                error = _error_of(e)
                status = error.status
                yield _sse_data(error.body()) + "data: [DONE]\n\n"
                return
            tail = _sse_data(fmt.usage_chunk(self.usage())) if self.include_usage else ""
            status = 200
            yield tail + "data: [DONE]\n\n"
        finally:
            self._log_times(timing_log, fmt, status)

    async def _merged_events(self) -> AsyncIterator[list[_Event]]:
        """The events of every prompt's choices by wake-up: one prompt's directly, several through
        one task each; the first error is raised (closing this aborts every engine request)."""
        if len(self.groups) == 1:
            async with contextlib.aclosing(self._events(self.groups[0])) as events:
                async for batch in events:
                    yield batch
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(group: _Group) -> None:
            try:
                async for batch in self._events(group):
                    queue.put_nowait(batch)
            except Exception as e:  # noqa: BLE001 -- raised to the response
                queue.put_nowait(e)
            queue.put_nowait(done)

        tasks = [asyncio.ensure_future(pump(g)) for g in self.groups]
        try:
            remaining = len(tasks)
            while remaining:
                items = [await queue.get()]
                while not queue.empty():  # everything ready now goes out in one send
                    items.append(queue.get_nowait())
                batch, error = [], None
                for item in items:
                    if item is done:
                        remaining -= 1
                    elif isinstance(item, Exception):
                        error = error or item
                    else:
                        batch += item
                if batch:
                    yield batch
                if error is not None:
                    raise error
        finally:
            for t in tasks:  # a client that went away: every engine request is aborted
                t.cancel()

    def usage(self) -> dict:
        return usage(sum(len(g.prompt) for g in self.groups), sum(c.text.num_tokens for c in self.choices),
                     sum(g.cached_tokens for g in self.groups))


class _AbortingStreamingResponse(StreamingResponse):
    """A streamed response whose engine requests were queued before it started: however it ends
    (finished, the client gone, cancelled before its body began), what still runs is aborted."""

    def __init__(self, gen: _Generation, content: AsyncIterator[str], media_type: str) -> None:
        super().__init__(content, media_type=media_type)
        self._gen = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._gen.abort()


_json_str = json.encoder.encode_basestring  # a str as a JSON string, non-ASCII kept (ensure_ascii=False)


def _json_reason(reason: str | None) -> str:
    return "null" if reason is None else _json_str(reason)


def _sse_data(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _error_of(e: Exception) -> OpenAIError:
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, (EngineStepError, EngineClosedError)):
        return OpenAIError(str(e), status=500)
    return OpenAIError(f"{type(e).__name__}: {e}", status=500)


async def _all(coros) -> list:
    """Run coroutines together; the first exception cancels the others and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if t.exception() is not None:
                raise _error_of(t.exception())
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()


async def _cancel_on_disconnect(request: Request, coro) -> Any:
    """Await ``coro``; if the client disconnects first, cancel it and return None."""
    work = asyncio.ensure_future(coro)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()  # (it ends at its next await: not done yet)
    if not work.done() or work.cancelled():
        return None
    return work.result()


# -- response formats ---------------------------------------------------------------------------------


class _Format:
    """OpenAI's response and chunk bodies of one endpoint (subclasses: the choice objects)."""

    id_prefix = response_object = chunk_object = ""

    def __init__(self, gen: _Generation, model_name: str) -> None:
        self.gen, self.model_name = gen, model_name
        self._logprob_chars: dict[int, int] = {}  # per choice: text offset of its next token (logprobs)
        # a chunk's SSE text around its one choice object, encoded once per response
        marker = "\x00choice\x00"
        whole = _sse_data(self._chunk(marker))
        self._sse_prefix, self._sse_suffix = whole.split(json.dumps(marker), 1)

    def _head(self, obj: str) -> dict:
        return {"id": f"{self.id_prefix}-{self.gen.id_suffix}", "object": obj, "created": self.gen.created,
                "model": self.model_name}

    def response(self, collected: list[list[_Event]]) -> dict:
        choices = []
        for events in collected:
            last = events[-1]
            text = "".join(e.text for e in events)
            logprobs = None
            if any(e.logprobs for e in events):
                logprobs, _ = self.logprobs([t for e in events for t in e.token_ids],
                                            [x for e in events for x in e.logprobs or []], 0)
            choices.append(self.final_choice(last.choice.index, text, logprobs, last.finish_reason))
        return {**self._head(self.response_object), "choices": choices, "usage": self.gen.usage()}

    def chunk_sse(self, e: _Event) -> str:
        """The SSE event of one event: ``data: {chunk with this one choice}``."""
        if not e.logprobs:  # the common case: only the text is encoded
            return f"{self._sse_prefix}[{self.plain_choice_json(e)}]{self._sse_suffix}"
        i = e.choice.index
        logprobs, self._logprob_chars[i] = self.logprobs(e.token_ids, e.logprobs, self._logprob_chars.get(i, 0))
        return f"{self._sse_prefix}[{json.dumps(self.chunk_choice(e, logprobs), ensure_ascii=False)}]{self._sse_suffix}"

    def _chunk(self, choices) -> dict:
        out = {**self._head(self.chunk_object), "choices": choices}
        if self.gen.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, u: dict) -> dict:
        return {**self._head(self.chunk_object), "choices": [], "usage": u}

    def start_chunks(self) -> list[dict]:
        return []


class _CompletionFormat(_Format):
    id_prefix, response_object, chunk_object = "cmpl", "text_completion", "text_completion"

    def logprobs(self, token_ids: list[int], entries: list, text_offset: int) -> tuple[dict, int]:
        return completion_logprobs(self.gen.engine.tokenizer, token_ids, entries, text_offset)

    def final_choice(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def chunk_choice(self, e: _Event, logprobs: dict | None) -> dict:
        return self.final_choice(e.choice.index, e.text, logprobs, e.finish_reason)

    def plain_choice_json(self, e: _Event) -> str:
        """``json.dumps(self.chunk_choice(e, None))``, by string formatting."""
        return (f'{{"index": {e.choice.index}, "text": {_json_str(e.text)}, "logprobs": null, '
                f'"finish_reason": {_json_reason(e.finish_reason)}}}')


class _ChatFormat(_Format):
    id_prefix, response_object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def logprobs(self, token_ids: list[int], entries: list, text_offset: int) -> tuple[dict, int]:
        return chat_logprobs(self.gen.engine.tokenizer, token_ids, entries), text_offset

    def final_choice(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def chunk_choice(self, e: _Event, logprobs: dict | None) -> dict:
        return {"index": e.choice.index, "delta": {"content": e.text} if e.text else {}, "logprobs": logprobs,
                "finish_reason": e.finish_reason}

    def plain_choice_json(self, e: _Event) -> str:
        """``json.dumps(self.chunk_choice(e, None))``, by string formatting."""
        delta = f'{{"content": {_json_str(e.text)}}}' if e.text else "{}"
        return (f'{{"index": {e.choice.index}, "delta": {delta}, "logprobs": null, '
                f'"finish_reason": {_json_reason(e.finish_reason)}}}')

    def start_chunks(self) -> list[dict]:
        return [self._chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for c in self.gen.choices]


# -- hybrid-compile serve ---------------------------------------------------------------------------


def run(model_name: str, load: Callable[[], HybridEngine | AsyncEngineBase], host: str, port: int, log_level: str = "info",
        access_log: bool = True, stream_interval: int = 1, request_timing_log: str | None = None) -> int:
    """Serve until interrupted (uvicorn); the model loads on a thread meanwhile. Returns the exit
    status: 2 if the model failed to load (its error printed as one ``error:`` line)."""
    import uvicorn

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s:     %(message)s")
    server: uvicorn.Server | None = None

    def stop(e: BaseException) -> None:
        print(f"error: {' '.join(str(e).split()) or type(e).__name__}", file=sys.stderr, flush=True)
        server.should_exit = True

    app = build_app(model_name, load=load, on_load_error=stop, stream_interval=stream_interval,
                    request_timing_log=request_timing_log)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    server.run()
    return 2 if app.state.serving.load_error is not None else 0
