"""Serving: the engine behind asyncio and over HTTP.

- :mod:`.async_engine` — :class:`AsyncEngine`: many concurrent token streams
  (``async for out in engine.generate_stream(prompt_ids, params)``) over one
  :class:`~hybrid_compile.HybridEngine`, whose step loop runs on one driver thread; a stream
  whose consumer stops is aborted at the next step boundary.
- :mod:`.engine_process` — :class:`ProcessAsyncEngine`: the same API with the engine in a child
  process (``serve --engine-process``, ``AsyncEngine.from_pretrained(..., engine_process=True)``).
- :mod:`.protocol` — OpenAI's request fields parsed and checked into the engine's
  :class:`~hybrid_compile.SamplingParams`, and OpenAI's error bodies.
- :mod:`.detokenize` — incremental text of a growing token sequence (for streaming).
- :mod:`.metrics` — the Prometheus metrics of a server.
- :mod:`.request_timing` — the server's per-request timing log (``serve --request-timing-log``).
- :mod:`.server` — the FastAPI app (``/v1/completions``, ``/v1/chat/completions``,
  ``/v1/models``, ``/health``, ``/metrics``) and ``hybrid-compile serve``.

Only :mod:`.async_engine` and :mod:`.engine_process` are imported here; the HTTP modules need the ``serve`` extra
(FastAPI, uvicorn, prometheus-client) and are imported on use.
"""

from .async_engine import AsyncEngine, EngineStepError, RequestStream, StreamOutput
from .engine_process import ProcessAsyncEngine

__all__ = ["AsyncEngine", "EngineStepError", "ProcessAsyncEngine", "RequestStream", "StreamOutput"]
