"""AsyncEngine: many concurrent token streams over one HybridEngine, for asyncio code.

:class:`AsyncEngineBase` is the event-loop side (streams, hand-off, request checks through the
engine's :class:`~hybrid_compile.engine.request_front.RequestFront`); :class:`_Driver` is the
engine's side (commands, steps, per-sequence updates). :class:`AsyncEngine` runs the driver on a
thread of this process (below); :class:`~.engine_process.ProcessAsyncEngine` runs it in a child
process and carries the same commands and updates over ``multiprocessing`` pipes.

One driver thread owns the :class:`~hybrid_compile.HybridEngine`: it applies the commands the
event loop queued (add a request, abort one, run a function on the engine), runs ``step()`` while
requests are in flight and sleeps on an event while none are. The event loop never waits for a
step and never touches the engine (it is not thread-safe: every call into it happens on the
driver thread, between steps).

Hand-off (the host cost that an HTTP server at saturation pays per output token, on the GIL the
driver needs too): each step's updates of every request are appended, under one lock, to one
inbox per event loop, and the loop is woken by one ``call_soon_threadsafe`` — only if no wake-up
of it is pending already. The loop's callback drains the whole inbox into the streams, merging
the updates of a sequence that its consumer has not taken yet into one (tokens concatenated). So
the hand-offs per step are O(1), not O(requests); and a consumer that falls behind (a busy event
loop) gets one update with several tokens instead of a backlog of one-token updates, so its work
per step shrinks just when the loop is short of time.

A stream whose consumer stops early (``break``, an exception, a cancelled task — e.g. an HTTP
client that went away) queues an abort; the driver calls ``engine.abort(rid)`` before the next
step, which frees the request's slots and prefix-cache locks. If a step raises, the requests that
were running in it are aborted and their streams raise :class:`EngineStepError`; waiting requests
and later ones are served as usual (the engine rolls a failed step back, see engine/engine.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import gc
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable

import torch

from ..engine import HybridEngine, SamplingParams
from ..engine.request import RequestStatus
from ..engine.request_front import RequestFront

logger = logging.getLogger("hybrid_compile.serving")


class EngineStepError(RuntimeError):
    """An engine step raised while this request was running in it; the request was aborted."""


class EngineClosedError(RuntimeError):
    """The AsyncEngine was shut down before this request finished."""


@dataclass
class StreamOutput:
    """One update of one sequence of a request: the tokens it generated since its previous update.
    A request of ``n`` sequences (``SamplingParams.n``) has ``index`` 0 .. n-1."""

    request_id: int  # the engine's id of this sequence
    index: int
    new_token_ids: list[int]
    num_generated: int  # tokens generated so far, these included
    finished: bool
    finish_reason: str | None  # "stop", "length" or "abort" once finished
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache at admission
    # per new token, when the request asked for logprobs: (logprob of the token, {token: logprob}
    # of the top alternatives)
    logprobs: list | None = None
    # time.perf_counter() of arrival (generate_stream's first iteration), first token, this update
    arrival_time: float = 0.0
    first_token_time: float | None = None
    time: float = 0.0
    # time.perf_counter() when the driver handed the request to the engine (``add_request``): from
    # arrival to here is the request's way to the engine (a busy event loop, the hand-off to an
    # engine process, the step the driver was in); None if it never got there (aborted before)
    admission_time: float | None = None


@dataclass
class _Stream:
    """A request in flight: the driver thread's record, and what the event loop has received for
    it and its consumer has not taken yet."""

    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    arrival: float
    admitted: float | None = None  # when the driver added it to the engine (StreamOutput.admission_time)
    rids: list[int] = field(default_factory=list)  # its sequences' engine ids
    open: int = 0  # sequences not finished
    cached_tokens: int = 0
    done: bool = False
    abort_requested: bool = False
    # event loop side: per sequence index, the merged update not taken yet; an error ending it;
    # the future its consumer awaits while there is nothing
    pending: dict[int, StreamOutput] = field(default_factory=dict)
    error: BaseException | None = None
    waiter: asyncio.Future | None = None
    key: int = 0  # its id between a server and its engine process (serving/engine_process.py)


@dataclass
class _Seq:
    """One sequence (engine request id) of a stream."""

    stream: _Stream
    index: int
    generated: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass
class _Call:
    fn: Callable[[HybridEngine], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class EngineObserver:
    """The hook the driver thread calls once per step as tokens come out (the server's metrics
    implement it). It runs on the driver thread, inside the step loop: it must be quick."""

    def observe_step(self, first_token_latencies: list[float], inter_token_latencies: list[float],
                     finished: list[StreamOutput]) -> None:
        """One step's (or one abort's) measurements: the time to first token of each sequence
        that got its first token (arrival to first token); one inter-token latency per further
        token (several tokens of one sequence in one step share the gap); the last update of each
        sequence that finished (also when aborted)."""


def engine_stats(engine: HybridEngine) -> dict:
    """``engine.stats()`` (a module-level function: an engine in another process runs it too)."""
    return engine.stats()


class AsyncEngineBase:
    """The event-loop side of an asynchronous engine, whatever runs the engine (a driver thread:
    :class:`AsyncEngine`; a child process: :class:`~.engine_process.ProcessAsyncEngine`): the
    streams, the hand-off of the driver's updates to the event loops, and the request front
    (tokenizer, generation defaults, limits) that plans and checks requests without the model.

    A subclass implements :attr:`front`, :meth:`_submit` (add / abort / call / close commands to
    its driver) and :meth:`shutdown`; its driver hands every iteration's updates to :meth:`_post`."""

    failure: str | None = None  # why the engine ended unasked (an engine process that died), else None

    def __init__(self, observer: EngineObserver | None = None) -> None:
        self.observer = observer or EngineObserver()
        # driver -> event loops: the updates not delivered yet, per loop, and the loops with a
        # wake-up (call_soon_threadsafe) pending
        self._inbox: dict[asyncio.AbstractEventLoop, list] = {}
        self._wake_pending: set[asyncio.AbstractEventLoop] = set()
        self._inbox_lock = threading.Lock()
        self.num_posts = 0  # driver iterations that handed updates to the event loops
        self.num_handoffs = 0  # call_soon_threadsafe wake-ups of event loops (<= num_posts per loop)

    # -- public API -------------------------------------------------------------------------------
    @property
    def front(self) -> RequestFront:
        """The engine's tokenizer, generation defaults and limits (engine/request_front.py)."""
        raise NotImplementedError

    @property
    def tokenizer(self) -> Any:
        return self.front.tokenizer

    @property
    def max_context_len(self) -> int:
        return self.front.max_context_len

    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a request the engine would refuse (empty prompt, token ids outside
        the vocabulary, prompt + max_new_tokens over the context, bad sampling values). Reads only
        the engine's fixed configuration: safe from any thread."""
        self.front.validate_request(prompt, params)

    def generate_stream(self, prompt: Iterable[int], params: SamplingParams | None = None) -> AsyncIterator[StreamOutput]:
        """Queue one prompt (token ids) and return an async iterator over its updates; it ends after
        the update with ``finished=True`` of each of its ``params.n`` sequences (``index``). An
        update holds the tokens since the sequence's previous one: one step's, or several steps'
        when the consumer fell behind. Bad input raises ValueError here, before anything is
        queued. The request is queued on the first iteration; stopping the iteration early
        (break, exception, cancellation, or ``aclose()``) aborts it."""
        return _flatten(self.generate_batches(prompt, params))

    def generate_batches(self, prompt: Iterable[int],
                         params: SamplingParams | None = None) -> AsyncIterator[list[StreamOutput]]:
        """:meth:`generate_stream` by wake-ups: each item is every update that came since the
        consumer's previous item, at most one per sequence (a server formats them together)."""
        prompt, params = self._checked(prompt, params)
        return self._stream(prompt, params)

    def open_stream(self, prompt: Iterable[int], params: SamplingParams | None = None,
                    validated: bool = False) -> "RequestStream":
        """:meth:`generate_batches`, but the request is queued now, not at the first iteration (a
        server queues a request before its response starts, so the engine sees it one event-loop
        round earlier). The caller must end it: iterate it to its end, or close it
        (``aclose()``, ``close()``, ``contextlib.aclosing``), which aborts it if unfinished.
        ``validated``: ``prompt`` is a list of ints that :meth:`validate` passed with these
        ``params`` already (a server checks its requests before queueing any): not checked again."""
        if validated:
            if params is None or type(prompt) is not list:
                raise TypeError("open_stream(validated=True) takes the prompt as a list of ints and its params")
        else:
            prompt, params = self._checked(prompt, params)
        return RequestStream(self, prompt, params)

    def _checked(self, prompt: Iterable[int], params: SamplingParams | None) -> tuple[list[int], SamplingParams]:
        prompt = [int(t) for t in prompt]
        params = params if params is not None else SamplingParams()
        self.validate(prompt, params)
        return prompt, params

    async def generate(self, prompt: Iterable[int], params: SamplingParams | None = None) -> list[list[int]]:
        """The new tokens of each sequence of one prompt (a stream read to its end)."""
        params = params if params is not None else SamplingParams()
        tokens: list[list[int]] = [[] for _ in range(params.n)]
        async for out in self.generate_stream(prompt, params):
            tokens[out.index].extend(out.new_token_ids)
        return tokens

    async def call(self, fn: Callable[[HybridEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the driver between two steps and return its result (how to read
        ``engine.stats()`` or anything else of the engine while streams run). With the engine in
        another process ``fn`` and its result travel by pickle (a module-level function)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._submit(("call", _Call(fn, loop, future)))
        return await future

    async def stats(self) -> dict:
        """``engine.stats()``, taken between two steps."""
        return await self.call(engine_stats)

    def shutdown(self, close_engine: bool = False) -> None:
        raise NotImplementedError

    def _submit(self, command: tuple) -> None:
        raise NotImplementedError

    # -- event-loop side ---------------------------------------------------------------------------
    async def _stream(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[list[StreamOutput]]:
        handle = RequestStream(self, prompt, params)  # (queued here: at the first iteration)
        try:
            async for batch in handle:
                yield batch
        finally:
            handle.close()

    def _post(self, outbox: list) -> None:
        """Hand a driver iteration's updates ``(stream, StreamOutput or exception)`` to their event
        loops: appended to each loop's inbox, and the loop woken only if no wake-up of it is
        pending (the pending one will take these too)."""
        if not outbox:
            return
        self.num_posts += 1
        wake = []
        with self._inbox_lock:
            for item in outbox:
                loop = item[0].loop
                self._inbox.setdefault(loop, []).append(item)
                if loop not in self._wake_pending:
                    self._wake_pending.add(loop)
                    wake.append(loop)
        outbox.clear()
        for loop in wake:
            self.num_handoffs += 1
            try:
                loop.call_soon_threadsafe(self._deliver, loop)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                with self._inbox_lock:
                    self._inbox.pop(loop, None)
                    self._wake_pending.discard(loop)

    def _deliver(self, loop: asyncio.AbstractEventLoop) -> None:
        """(event loop) Everything the driver posted for this loop into its streams: a sequence's
        updates not taken yet are merged into one; an error ends its stream."""
        with self._inbox_lock:
            items = self._inbox.pop(loop, [])
            self._wake_pending.discard(loop)
        for stream, item in items:
            if isinstance(item, BaseException):
                stream.error = item
            else:
                held = stream.pending.get(item.index)
                if held is None:
                    stream.pending[item.index] = item
                else:
                    _merge(held, item)
            if stream.waiter is not None and not stream.waiter.done():
                stream.waiter.set_result(None)


class RequestStream:
    """One request queued to an asynchronous engine (:meth:`AsyncEngineBase.open_stream`): an async
    iterator over its batches of updates (at most one per sequence each), ending after the last
    sequence's finished update; :meth:`close` / :meth:`aclose` before that aborts it. Created on
    the event loop that iterates it."""

    def __init__(self, engine: AsyncEngineBase, prompt: list[int], params: SamplingParams) -> None:
        self._engine = engine
        self._stream = _Stream(prompt, params, asyncio.get_running_loop(), arrival=time.perf_counter())
        self._remaining = params.n
        engine._submit(("add", self._stream))
        self._ended = False  # finished, failed, or aborted: nothing left to abort

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> list[StreamOutput]:
        if self._ended:
            raise StopAsyncIteration
        stream = self._stream
        while not stream.pending and stream.error is None:
            stream.waiter = stream.loop.create_future()
            try:
                await stream.waiter
            finally:
                stream.waiter = None
        if stream.error is not None:
            self._ended = True  # the driver already let go of it
            raise stream.error
        batch = list(stream.pending.values())
        stream.pending.clear()
        self._remaining -= sum(out.finished for out in batch)
        self._ended = self._remaining == 0
        return batch

    def close(self) -> None:
        """Abort the request unless it ended (the driver frees it before its next step)."""
        if not self._ended:
            self._ended = True
            self._engine._submit(("abort", self._stream))

    async def aclose(self) -> None:
        self.close()


class AsyncEngine(AsyncEngineBase):
    """Asynchronous front of a :class:`~hybrid_compile.HybridEngine`::

        async_engine = hc.AsyncEngine(hc.from_pretrained(path))
        async for out in async_engine.generate_stream(prompt_ids, hc.SamplingParams(max_new_tokens=32)):
            print(out.new_token_ids)
        async_engine.shutdown()

    Any number of streams may run at once, from any number of tasks (of one or several event
    loops); the engine batches them continuously. The driver thread starts on first use.
    :meth:`from_pretrained` with ``engine_process=True`` runs the engine in a child process instead
    (:class:`~.engine_process.ProcessAsyncEngine`, the same API).
    """

    def __init__(self, engine: HybridEngine, observer: EngineObserver | None = None) -> None:
        super().__init__(observer)
        self.engine = engine
        self._commands: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._driver = _Driver(engine, lambda *m: self.observer.observe_step(*m))

    @classmethod
    def from_pretrained(cls, path: str, engine_process: bool = False, observer: EngineObserver | None = None,
                        **options) -> AsyncEngineBase:
        """``hc.from_pretrained(path, **options)`` behind an asynchronous engine: its step loop on a
        driver thread of this process, or with ``engine_process=True`` in a child process (spawned;
        it loads the model with the same options and steps, this process keeps the tokenizer and
        checks requests: see serving/engine_process.py). Returns once the engine is ready."""
        from ..loading import from_pretrained  # lazy: a convenience over the loader, which sits above serving

        if not engine_process:
            return cls(from_pretrained(path, **options), observer)
        from .engine_process import ProcessAsyncEngine  # lazy: serving.engine_process builds on this module

        return ProcessAsyncEngine(functools.partial(from_pretrained, path, **options), observer)

    @property
    def front(self) -> RequestFront:
        return self.engine.front

    @property
    def num_step_errors(self) -> int:
        return self._driver.num_step_errors

    def shutdown(self, close_engine: bool = False) -> None:
        """Stop the driver thread after its current step; streams still in flight raise
        :class:`EngineClosedError`. ``close_engine`` also closes the engine (unpatches the model)."""
        self._submit(("close", None))
        with self._lock:
            self._closed = True  # (also when the driver thread never started)
        if self._thread is not None:
            self._thread.join()
        if close_engine:
            self.engine.close()

    def _submit(self, command: tuple) -> None:
        with self._lock:
            if self._closed:
                if command[0] in ("abort", "close"):  # nothing left to abort or close
                    return
                raise EngineClosedError("the AsyncEngine has been shut down")
            if command[0] == "call":
                call = command[1]
                command = ("call", (call.fn, lambda result, error: _settle(call, result, error)))
            self._commands.append(command)
            if self._thread is None and command[0] != "close":
                self._thread = threading.Thread(target=self._drive, name="hybrid-compile-engine", daemon=True)
                self._thread.start()
        self._wake.set()

    def _take_commands(self) -> list:
        self._wake.clear()
        with self._lock:
            commands = list(self._commands)
            self._commands.clear()
        return commands

    def _drive(self) -> None:
        set_engine_device(self.engine)
        while True:
            outbox: list = []
            running = self._driver.iterate(self._take_commands(), outbox, self._wake.wait)
            if not running:
                with self._lock:
                    self._closed = True
            self._post(outbox)
            if not running:
                return


def freeze_long_lived_objects() -> None:
    """Collect once, then leave every object alive now out of the cyclic garbage collector's later
    passes (``gc.freeze``; vLLM's servers do the same after startup). Call it once the model is
    loaded: torch, transformers, the model and the libraries live as long as the process, and a
    full pass over them (0.25 s measured on CPU with the tiny model loaded: 500,000 objects) stops
    every thread of the process, event loop and engine steps alike, whenever the collector's
    counts trigger it (the first time soon after loading), e.g. in the middle of a burst. Undo it
    with ``gc.unfreeze()`` when the engine is shut down (the process's exit then collects them as
    usual: native extensions such as triton's report what is left uncollected)."""
    gc.collect()
    gc.freeze()


def set_engine_device(engine: HybridEngine) -> None:
    """Make the engine's CUDA device current on the calling thread (it is per thread)."""
    device = engine.device
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def _settle(call: _Call, result: Any, error: BaseException | None) -> None:
    """(driver) Hand a call's result to the future its caller awaits on its event loop."""

    def settle() -> None:
        if call.future.cancelled():
            return
        if error is not None:
            call.future.set_exception(error)
        else:
            call.future.set_result(result)

    try:
        call.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the caller's loop is closed
        pass


class _Driver:
    """The engine's side: applies the commands (add a stream, abort one, call a function, close),
    runs ``step()`` and turns its outputs into per-sequence updates ``(stream, StreamOutput)`` in
    an outbox, or ``(stream, exception)`` ending a stream. Runs on whatever owns the engine: the
    AsyncEngine's driver thread, or the main thread of an engine process. ``observe`` gets each
    step's measurements (:meth:`EngineObserver.observe_step`'s arguments)."""

    def __init__(self, engine: HybridEngine, observe: Callable[..., None]) -> None:
        self.engine = engine
        self.observe = observe
        self._seqs: dict[int, _Seq] = {}  # engine rid -> its sequence
        self._failed_last_step = False
        self.num_step_errors = 0

    def iterate(self, commands: list, outbox: list, wait: Callable[[], Any]) -> bool:
        """Apply ``commands``, then run one step, or ``wait()`` for a command while nothing is in
        flight. Returns False once closed. A defect here ends every stream in flight, not the loop."""
        try:
            return self._iterate(commands, outbox, wait)
        except Exception as e:  # noqa: BLE001 -- a defect here must not hang every stream
            logger.exception("the engine's driver failed; ending every request in flight")
            failed = EngineStepError(f"the engine's driver failed: {type(e).__name__}: {e}")
            for stream in self._open_streams():
                self._end(stream, outbox, error=failed)
            return True

    def _iterate(self, commands: list, outbox: list, wait: Callable[[], Any]) -> bool:
        engine = self.engine
        for kind, arg in commands:
            if kind == "add":
                self._add(arg, outbox)
            elif kind == "abort":
                self._abort(arg, outbox)
            elif kind == "call":
                fn, reply = arg
                try:
                    result, error = fn(engine), None
                except Exception as e:  # noqa: BLE001 -- handed to the caller
                    result, error = None, e
                reply(result, error)
            elif kind == "close":
                self._close_streams(outbox)
                return False
        if not engine.has_unfinished():
            if not outbox:
                wait()
            return True
        running = [r.rid for r in engine.scheduler.running]
        try:
            outputs = engine.step()
        except Exception as e:  # noqa: BLE001 -- fail the step's requests, keep serving
            self.num_step_errors += 1
            self._fail_step(e, running, everyone=self._failed_last_step, outbox=outbox)
            self._failed_last_step = True
            return True
        self._failed_last_step = False
        self._dispatch(outputs, outbox)
        return True

    def _add(self, stream: _Stream, outbox: list) -> None:
        if stream.abort_requested:
            return
        stream.admitted = time.perf_counter()
        try:
            first = self.engine.add_request(stream.prompt, stream.params)
        except Exception as e:  # noqa: BLE001 -- the request's own error, raised in its stream
            stream.done = True
            outbox.append((stream, e))
            return
        stream.rids = self.engine.sequence_ids(first) if stream.params.n > 1 else [first]
        stream.open = len(stream.rids)
        for index, rid in enumerate(stream.rids):
            self._seqs[rid] = _Seq(stream, index)

    def _abort(self, stream: _Stream, outbox: list) -> None:
        stream.abort_requested = True
        if not stream.done:
            self._end(stream, outbox)

    def _end(self, stream: _Stream, outbox: list, error: BaseException | None = None) -> None:
        """Abort a stream's unfinished sequences now (between steps) and end it: with each one's
        last update (finish reason "abort"), or with ``error`` raised in it. The engine's own
        final outputs for them, which a later step returns, are dropped (see _dispatch)."""
        now = time.perf_counter()
        stream.done = True
        for rid in stream.rids:
            seq = self._seqs.pop(rid, None)
            if seq is None:  # finished already
                continue
            try:
                self.engine.abort(rid)
                reason = self.engine.pop_finished(rid).finish_reason
            except Exception as e:  # noqa: BLE001 -- the request is gone from our side either way
                error = error or EngineStepError(f"aborting request {rid} failed: {type(e).__name__}: {e}")
                reason = "abort"
            update = StreamOutput(
                request_id=rid, index=seq.index, new_token_ids=[], num_generated=seq.generated, finished=True,
                finish_reason=reason, prompt_tokens=len(stream.prompt), cached_tokens=stream.cached_tokens,
                arrival_time=stream.arrival, first_token_time=seq.first_token_time, time=now,
                admission_time=stream.admitted,
            )
            self.observe([], [], [update])
            if error is None:
                outbox.append((stream, update))
        stream.open = 0
        if error is not None:
            outbox.append((stream, error))

    def _dispatch(self, outputs: list, outbox: list) -> None:
        """Group a step's StepOutputs per sequence into StreamOutputs for the streams."""
        now = time.perf_counter()
        updates: dict[int, StreamOutput] = {}
        for out in outputs:
            seq = self._seqs.get(out.rid)
            if seq is None:  # an aborted request's final output: it was ended already (_end)
                continue
            stream = seq.stream
            update = updates.get(out.rid)
            if update is None:
                if seq.first_token_time is None and out.token is not None and seq.index == 0:
                    stream.cached_tokens = self.engine.request(out.rid).num_cached_tokens
                update = updates[out.rid] = StreamOutput(
                    request_id=out.rid, index=seq.index, new_token_ids=[], num_generated=seq.generated,
                    finished=False, finish_reason=None, prompt_tokens=len(stream.prompt),
                    cached_tokens=stream.cached_tokens, arrival_time=stream.arrival, time=now,
                    admission_time=stream.admitted,
                )
            if out.token is not None:
                update.new_token_ids.append(out.token)
                if out.logprobs is not None:
                    update.logprobs = (update.logprobs or []) + [out.logprobs]
            if out.finished:
                update.finished, update.finish_reason = True, out.finish_reason
        ttfts: list[float] = []
        itls: list[float] = []
        finished: list[StreamOutput] = []
        for rid, update in updates.items():
            seq = self._seqs[rid]
            stream = seq.stream
            n = len(update.new_token_ids)
            if n:
                if seq.first_token_time is None:
                    seq.first_token_time = now
                    ttfts.append(now - stream.arrival)
                    itls.extend([0.0] * (n - 1))
                else:
                    itls.extend([(now - seq.last_token_time) / n] * n)
                seq.last_token_time = now
            seq.generated += n
            update.num_generated = seq.generated
            update.first_token_time = seq.first_token_time
            update.cached_tokens = stream.cached_tokens
            if update.finished:
                del self._seqs[rid]
                self.engine.pop_finished(rid)
                finished.append(update)
                stream.open -= 1
                stream.done = stream.open == 0
            outbox.append((stream, update))
        if updates:
            self.observe(ttfts, itls, finished)

    def _fail_step(self, error: Exception, running: list[int], everyone: bool, outbox: list) -> None:
        """A step raised: abort the requests it touched and fail their streams with
        :class:`EngineStepError`. Touched: those running before it, and those admitted by it
        (not waiting any more). A request that was only waiting is left alone, unless this is
        the second failed step in a row (``everyone``): then every request in flight is failed,
        so a request that makes every step raise cannot keep the engine failing."""
        failed = EngineStepError(f"the engine step failed: {type(error).__name__}: {error}")
        failed.__cause__ = error
        touched = set(running)
        for stream in self._open_streams():
            live = [rid for rid in stream.rids if rid in self._seqs]
            if everyone or any(rid in touched or self.engine.request(rid).status is not RequestStatus.WAITING
                               for rid in live):
                self._end(stream, outbox, error=failed)

    def _open_streams(self) -> list[_Stream]:
        return list({id(seq.stream): seq.stream for seq in self._seqs.values()}.values())

    def _close_streams(self, outbox: list) -> None:
        for stream in self._open_streams():
            stream.done = True
            outbox.append((stream, EngineClosedError("the AsyncEngine was shut down")))
        self._seqs.clear()


def _merge(held: StreamOutput, later: StreamOutput) -> None:
    """Fold a sequence's later update into the one its consumer has not taken yet."""
    held.new_token_ids.extend(later.new_token_ids)
    if later.logprobs:
        held.logprobs = (held.logprobs or []) + later.logprobs
    held.num_generated, held.finished, held.finish_reason = later.num_generated, later.finished, later.finish_reason
    held.cached_tokens, held.first_token_time, held.time = later.cached_tokens, later.first_token_time, later.time


async def _flatten(batches: AsyncIterator[list[StreamOutput]]) -> AsyncIterator[StreamOutput]:
    async with contextlib.aclosing(batches):  # closing this early aborts the request
        async for batch in batches:
            for out in batch:
                yield out


__all__ = ["AsyncEngine", "EngineClosedError", "EngineObserver", "EngineStepError", "RequestStream", "StreamOutput",
           "freeze_long_lived_objects"]
