"""The engine in its own process: :class:`ProcessAsyncEngine`, the AsyncEngine API over a child
process that owns the :class:`~hybrid_compile.HybridEngine` and runs its step loop.

Why: in :class:`~.async_engine.AsyncEngine` the event loop (HTTP parsing, tokenization, SSE) and
the engine's driver thread (Python-heavy scheduling and kernel launches) share one interpreter
and its global lock; with the engine in a child process (vLLM V1's EngineCore, SGLang's
scheduler process) neither waits for the other's Python.

- Child (``spawn`` start method, :func:`run_engine_process`): calls ``load()`` (a picklable
  callable returning the engine, e.g. ``functools.partial(hc.from_pretrained, path, **options)``),
  sends the engine's :class:`~hybrid_compile.engine.request_front.RequestFront` (tokenizer,
  generation config, limits), then runs the same :class:`~.async_engine._Driver` as the thread
  mode: commands in, one message per driver iteration out with every stream's new updates and
  the step's metric observations.
- Parent: keeps the front (tokenization, chat template, generation defaults, request checks and
  detokenization never wait on a step), sends commands (add, abort, call, close) on a
  ``multiprocessing.Queue`` (pickled by the caller, so an unpicklable request raises at once; the
  queue's feeder thread writes them, so the event loop never blocks on a full pipe), and one
  reader thread receives the child's messages from a ``multiprocessing`` pipe and hands them to
  the event loops exactly as the driver thread does (:meth:`AsyncEngineBase._post`).
- The child dies: the reader sees the pipe close, every stream in flight and every pending call
  raises :class:`EngineClosedError` naming the exit code, new requests are refused, and
  :attr:`ProcessAsyncEngine.failure` says why (the server's ``/health`` reports it). The parent
  dies: the child notices (a broken pipe, or its parent gone while it idles) and exits.
"""

from __future__ import annotations

import collections
import gc
import itertools
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
from typing import Any, Callable

from ..engine import HybridEngine
from ..engine.request_front import RequestFront
from .async_engine import (
    AsyncEngineBase, EngineClosedError, EngineObserver, EngineStepError, _Call, _Driver, _settle, _Stream,
    freeze_long_lived_objects, set_engine_device,
)

logger = logging.getLogger("hybrid_compile.serving")

_PARENT_CHECK_SECONDS = 1.0  # an idle child checks this often whether its parent is still alive


class ProcessAsyncEngine(AsyncEngineBase):
    """:class:`~.async_engine.AsyncEngine`'s API with the engine in a child process (module
    docstring). The constructor starts the child and returns once its engine is loaded (raising
    the child's load error, or RuntimeError if it exits while loading)."""

    def __init__(self, load: Callable[[], HybridEngine], observer: EngineObserver | None = None,
                 shutdown_timeout: float = 30.0) -> None:
        super().__init__(observer)
        ctx = multiprocessing.get_context("spawn")
        self.shutdown_timeout = shutdown_timeout
        self.failure: str | None = None  # why the engine process ended, when it ended unasked
        self._lock = threading.Lock()
        self._closing = False
        self._keys = itertools.count(1)
        self._streams: dict[int, _Stream] = {}  # key -> stream in flight
        self._calls: dict[int, _Call] = {}  # key -> call awaiting its result
        self._commands = ctx.Queue()
        self._commands.cancel_join_thread()  # a dead child must not hang this process's exit
        self._updates, child_end = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=run_engine_process, args=(load, self._commands, child_end),
                                   name="hybrid-compile-engine", daemon=True)
        self.process.start()
        child_end.close()  # the child holds the only write end: its exit closes the pipe
        try:
            kind, payload = self._updates.recv()
        except (EOFError, OSError):
            self.process.join(self.shutdown_timeout)
            raise RuntimeError(f"the engine process exited with code {self.process.exitcode} while loading "
                               "the model") from None
        if kind == "load_error":
            self.process.join(self.shutdown_timeout)
            raise payload
        self._front = payload
        self._reader = threading.Thread(target=self._read, name="hybrid-compile-engine-reader", daemon=True)
        self._reader.start()

    @property
    def front(self) -> RequestFront:
        return self._front

    def shutdown(self, close_engine: bool = False) -> None:
        """Stop the engine process after its current step (its engine ends with it, whatever
        ``close_engine`` says: only the child could use it) and wait for it; streams still in
        flight raise :class:`EngineClosedError`. A child that does not exit within
        ``shutdown_timeout`` seconds is terminated."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        if self.process.is_alive():
            self._commands.put(pickle.dumps(("close",)))
        self.process.join(self.shutdown_timeout)
        if self.process.is_alive():
            logger.warning("the engine process did not exit in %.0f s: terminating it", self.shutdown_timeout)
            self.process.terminate()
            self.process.join(5)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        self._reader.join()
        self._commands.close()

    def _submit(self, command: tuple) -> None:
        kind, arg = command[0], command[1] if len(command) > 1 else None
        with self._lock:
            if kind in ("abort", "close"):
                if kind == "abort" and arg.key in self._streams and not self._closing:
                    self._commands.put(pickle.dumps(("abort", arg.key)))
                return
            if self._closing or self.failure is not None:
                raise EngineClosedError(self.failure or "the AsyncEngine has been shut down")
            key = next(self._keys)
            if kind == "add":
                # pickled here: a request that cannot travel raises in its caller, not in the feeder thread
                data = pickle.dumps(("add", key, arg.prompt, arg.params, arg.arrival), pickle.HIGHEST_PROTOCOL)
                arg.key, arg.open = key, arg.params.n
                self._streams[key] = arg
            else:  # call
                data = pickle.dumps(("call", key, pickle.dumps(arg.fn)), pickle.HIGHEST_PROTOCOL)
                self._calls[key] = arg
            self._commands.put(data)

    # -- reader thread ------------------------------------------------------------------------------
    def _read(self) -> None:
        """Hand the child's messages to the event loops until its pipe closes."""
        while True:
            try:
                message = self._updates.recv()
            except (EOFError, OSError):
                break
            if message[0] == "step":
                _, items, observations = message
                for measurements in observations:
                    self.observer.observe_step(*measurements)
                self._post(self._own_updates(items))
            elif message[0] == "result":
                _, key, result, error = message
                with self._lock:
                    call = self._calls.pop(key, None)
                if call is not None:
                    _settle(call, result, error)
        self.process.join(self.shutdown_timeout)
        with self._lock:
            if not self._closing:
                self.failure = f"the engine process exited unexpectedly (exit code {self.process.exitcode})"
                logger.error("%s; failing every request in flight", self.failure)
            error = EngineClosedError(self.failure or "the AsyncEngine was shut down")
            streams, self._streams = list(self._streams.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        self._post([(stream, error) for stream in streams])
        for call in calls:
            _settle(call, None, error)

    def _own_updates(self, items: list) -> list:
        """``(key, update or error)`` of the child -> ``(stream, ...)``; ended streams are forgotten."""
        outbox = []
        with self._lock:
            for key, item in items:
                stream = self._streams.get(key)
                if stream is None:
                    continue
                if isinstance(item, BaseException):
                    del self._streams[key]
                elif item.finished:
                    stream.open -= 1
                    if stream.open == 0:
                        del self._streams[key]
                outbox.append((stream, item))
        return outbox


# -- the child --------------------------------------------------------------------------------------


def run_engine_process(load: Callable[[], HybridEngine], commands: Any, conn: Any) -> None:
    """The engine process's main: load, report the front, drive the engine until closed (or until
    the parent is gone), close the engine."""
    # Ctrl-C reaches the whole process group: the server shuts down and closes this process
    # itself (its streams then end cleanly), so the child must not die of the same SIGINT mid-step
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = load()
    except BaseException as e:  # noqa: BLE001 -- reported to the parent, which raises it
        conn.send(("load_error", _picklable(e)))
        return
    try:
        set_engine_device(engine)
        freeze_long_lived_objects()  # (the loaded model: no full collection pass over it mid-burst)
        conn.send(("ready", engine.front))
        _EngineLoop(engine, commands, conn).run()
    except (BrokenPipeError, EOFError, ConnectionResetError):  # the parent is gone
        pass
    finally:
        engine.close()
        gc.unfreeze()  # (frozen once loaded: the exit collects everything as usual)


class _EngineLoop:
    """The child's side of the commands and updates around one :class:`_Driver`."""

    def __init__(self, engine: HybridEngine, commands: Any, conn: Any) -> None:
        self.commands, self.conn = commands, conn
        self.observations: list[tuple] = []
        self.replies: list[bytes] = []  # calls' results, sent after the iteration's updates
        self.driver = _Driver(engine, lambda *m: self.observations.append(m))
        self.streams: dict[int, _Stream] = {}  # key -> stream in flight
        self.received: collections.deque = collections.deque()  # raw commands taken while waiting
        self.parent = multiprocessing.parent_process()

    def run(self) -> None:
        while True:
            outbox: list = []
            running = self.driver.iterate(self._take(), outbox, self._wait)
            items = []
            for stream, item in outbox:
                items.append((stream.key, _picklable(item) if isinstance(item, BaseException) else item))
                if stream.done:
                    self.streams.pop(stream.key, None)
            self._flush(items)
            if not running:
                return

    def _flush(self, items: list) -> None:
        """Send an iteration's updates and observations (one message), then its calls' results:
        a caller's stats already count what the iteration did (an abort, say)."""
        if items or self.observations:
            self.conn.send(("step", items, self.observations))
            self.observations = []
        for data in self.replies:
            self.conn.send_bytes(data)
        self.replies.clear()

    def _wait(self) -> None:
        """Nothing in flight: block until a command comes (or the parent is gone: close)."""
        self._flush([])  # the results of this iteration's calls must not wait for the next command
        while True:
            try:
                self.received.append(self.commands.get(timeout=_PARENT_CHECK_SECONDS))
                return
            except queue.Empty:
                if self.parent is not None and not self.parent.is_alive():
                    self.received.append(pickle.dumps(("close",)))
                    return

    def _take(self) -> list:
        """The driver's commands from everything the parent sent since the last iteration."""
        raw = list(self.received)
        self.received.clear()
        while True:
            try:
                raw.append(self.commands.get_nowait())
            except queue.Empty:
                break
        out = []
        for data in raw:
            command = pickle.loads(data)
            kind = command[0]
            if kind == "add":
                _, key, prompt, params, arrival = command
                stream = self.streams[key] = _Stream(prompt, params, None, arrival, key=key)
                out.append(("add", stream))
            elif kind == "abort":
                stream = self.streams.get(command[1])
                if stream is not None:  # (else it ended already)
                    out.append(("abort", stream))
            elif kind == "call":
                _, key, fn_data = command
                try:
                    fn = pickle.loads(fn_data)
                except Exception as e:  # noqa: BLE001 -- handed to the caller
                    self._reply(key, None, e)
                    continue
                out.append(("call", (fn, lambda result, error, key=key: self._reply(key, result, error))))
            elif kind == "close":
                out.append(("close", None))
        return out

    def _reply(self, key: int, result: Any, error: BaseException | None) -> None:
        try:
            data = pickle.dumps(("result", key, result, None if error is None else _picklable(error)))
        except Exception as e:  # noqa: BLE001 -- a result that cannot travel: its caller gets why
            data = pickle.dumps(("result", key, None, EngineStepError(f"the call's result cannot be pickled: {e}")))
        self.replies.append(data)


def _picklable(e: BaseException) -> BaseException:
    """``e`` if it survives pickling, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(e).__name__}: {e}")


__all__ = ["ProcessAsyncEngine", "run_engine_process"]
