"""The server's request timing log (``serve --request-timing-log FILE``): one JSON line per
request with the times of its way through the server, to find where a request's latency goes.

Times are ``time.perf_counter()`` seconds, which on Linux is the system-wide monotonic clock: a
client on the same machine (``benchmarks/serving.py``) compares them with its own send and receive
times, and an engine in its own process stamps its part with the same clock. A request names
itself with an ``X-Request-Id`` header (else the line carries the response's id). Fields:

- ``received``: the endpoint's handler started (the HTTP request was parsed by uvicorn and routed);
- ``submitted``: the first of its prompts was queued to the engine (``StreamOutput.arrival_time``);
- ``admitted``: the last of its prompts was added to the engine by the driver
  (``StreamOutput.admission_time``; null if the request ended before);
- ``first_token``: the engine produced its first token (null if none);
- ``first_sent``: the first SSE event with text was handed to the server for sending (streaming);
- ``finished``: the response was complete (its last event, or the whole JSON body, handed over);
- ``prompts`` and ``status`` (200, or the status of an error response).
"""

from __future__ import annotations

import json
import threading
from typing import Any

REQUEST_ID_HEADER = "x-request-id"


class RequestTimingLog:
    """Appends one line per request to ``path`` (line-buffered: a reader sees every finished request)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = open(path, "a", buffering=1, encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record) + "\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(line)

    def close(self) -> None:
        with self._lock:
            self._file.close()


class RequestTimes:
    """The times of one request, filled in as it goes (see the module docstring for the fields)."""

    __slots__ = ("request_id", "received", "submitted", "admitted", "first_token", "first_sent", "prompts")

    def __init__(self, request_id: str | None, received: float) -> None:
        self.request_id, self.received = request_id, received
        self.submitted = self.admitted = self.first_token = self.first_sent = None
        self.prompts = 0

    def observe(self, arrival: float, admission: float | None, first_token: float | None) -> None:
        """One prompt's times, from any of its updates (StreamOutput)."""
        self.submitted = arrival if self.submitted is None else min(self.submitted, arrival)
        if admission is not None:
            self.admitted = admission if self.admitted is None else max(self.admitted, admission)
        if first_token is not None:
            self.first_token = first_token if self.first_token is None else min(self.first_token, first_token)

    def record(self, fallback_id: str, finished: float, status: int) -> dict[str, Any]:
        return {"id": self.request_id or fallback_id, "received": self.received, "submitted": self.submitted,
                "admitted": self.admitted, "first_token": self.first_token, "first_sent": self.first_sent,
                "finished": finished, "prompts": self.prompts, "status": status}


__all__ = ["REQUEST_ID_HEADER", "RequestTimes", "RequestTimingLog"]
