"""The serving benchmark's load generator (``benchmarks/serving.py``): requests started at their
arrival offsets, one record per request, the run's summary, and the HTTP client spread over
several processes.

Why several processes: the official ``openai`` async client parses every streamed chunk into
pydantic objects in Python, about 300 us of CPU per token on an H200 host, so one client process
tops out near 3,000 streamed tokens/s whatever the server does (measured 2026-11-27: with all 64
requests at once, HTTP reached 46 % of the in-process throughput while the client's one core was
the limit). :class:`HttpClients` gives each of ``processes`` spawned processes its share of the
requests (every ``processes``-th, at its own arrival offset from one shared start time) and merges
their records, so what is measured is the server. This module imports no torch: a client process
starts in well under a second.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import multiprocessing
import time

__all__ = ["HttpClients", "gather_requests", "percentiles", "record", "run_load", "summarize"]


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "n": 0}
    xs = sorted(xs)

    def q(p):
        return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))]

    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "mean": sum(xs) / len(xs), "n": len(xs)}


def summarize(records: list[dict], wall: float) -> dict:
    """records: one per request {ttft, itls, e2e, tokens, error, send, admitted}. ``ingest_s``: from
    the client's send to the engine's admission of the request (``admitted``: the driver's
    ``add_request``, perf_counter time; requests without one are left out)."""
    ok = [r for r in records if r["error"] is None]
    tokens = sum(r["tokens"] for r in ok)
    ingest = [r["admitted"] - r["send"] for r in ok if r.get("admitted") is not None]
    return {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "errors": sorted({r["error"] for r in records if r["error"]})[:5],
        "duration_s": wall,
        "request_throughput": len(ok) / wall if wall else 0.0,
        "output_throughput": tokens / wall if wall else 0.0,
        "output_tokens": tokens,
        "ttft_s": percentiles([r["ttft"] for r in ok if r["ttft"] is not None]),
        "itl_s": percentiles([x for r in ok for x in r["itls"]]),
        "e2e_s": percentiles([r["e2e"] for r in ok]),
        "ingest_s": percentiles(ingest),
    }


def record(start: float, times: list[float], tokens: int, error: str | None = None,
           admitted: float | None = None, request_id: str | None = None) -> dict:
    """A finished request's record: ``times`` are the perf_counter() times of its token updates;
    ``send`` (= ``start``), ``first`` and ``admitted`` (the engine's admission, when known) are
    perf_counter times too, which every process of a Linux machine shares (CLOCK_MONOTONIC)."""
    end = time.perf_counter()
    return {
        "ttft": times[0] - start if times else None,
        "itls": [b - a for a, b in zip(times, times[1:])],
        "e2e": end - start,
        "tokens": tokens,
        "error": error,
        "send": start,
        "first": times[0] if times else None,
        "admitted": admitted,
        "id": request_id,
    }


async def gather_requests(prompts: list, offsets: list[float], one_request, t0: float) -> list[dict]:
    """Start ``one_request(prompt)`` at ``t0 + offset`` (perf_counter time) each; their records."""
    async def at(offset, prompt):
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        return await one_request(prompt)

    return list(await asyncio.gather(*(at(o, p) for o, p in zip(offsets, prompts))))


async def run_load(prompts: list, offsets: list[float], one_request) -> dict:
    """Start ``one_request(prompt)`` at each offset from now; the run's summary."""
    t0 = time.perf_counter()
    records = await gather_requests(prompts, offsets, one_request, t0)
    return summarize(records, time.perf_counter() - t0)


def http_request(client, model: str, output_len: int, transform_prompt: bool = False):
    """One streamed ``/v1/completions`` request of ``output_len`` greedy tokens (EOS ignored) per
    ``(request id, prompt)``; the id goes in the ``X-Request-Id`` header (the server's timing log
    names the request by it).

    A token-id prompt goes in ``extra_body`` (the same JSON body), unless ``transform_prompt``:
    the client's ``create`` runs its request transform over every element of ``prompt`` in Python
    (measured 2026-11-27 on CPU: about 5 ms of the client's CPU per 512-token prompt, 80 % of its
    time while a burst of 64 requests is sent), a cost of that client and not of the server, which
    delayed the later requests of a burst by the earlier ones' transforms."""
    async def one(item):
        request_id, prompt = item
        start = time.perf_counter()
        times, tokens = [], 0
        if transform_prompt or isinstance(prompt, str):
            prompt_arg, body = prompt, {"ignore_eos": True}
        else:  # the body's prompt: extra_body's keys replace the transformed ones
            prompt_arg, body = [], {"ignore_eos": True, "prompt": prompt}
        try:
            stream = await client.completions.create(
                model=model, prompt=prompt_arg, max_tokens=output_len, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body=body,
                extra_headers={"X-Request-Id": request_id},
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    times.append(time.perf_counter())
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
        except Exception as e:  # noqa: BLE001 -- counted as a failed request
            return record(start, times, tokens, f"{type(e).__name__}: {e}", request_id=request_id)
        return record(start, times, tokens, request_id=request_id)

    return one


async def _http_records(base_url: str, model: str, prompts, offsets, output_len: int, timeout: float,
                        t0: float, transform_prompt: bool) -> list[dict]:
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=timeout) as client:
        return await gather_requests(prompts, offsets, http_request(client, model, output_len, transform_prompt), t0)


def _client_process(base_url: str, model: str, prompts, offsets, output_len: int, timeout: float,
                    start_wall: float, transform_prompt: bool = False) -> dict:
    """One client process's share, started at ``start_wall`` (time.time(): the clock every process
    shares); its records, when it finished (time.time()) and its CPU seconds."""
    # what this process holds already (with one client process: the benchmark's own torch and
    # results) is left out of the collector's runs, whose full passes over it paused every request
    gc.collect()
    gc.freeze()
    cpu = time.process_time()
    try:
        t0 = time.perf_counter() + (start_wall - time.time())
        records = asyncio.run(_http_records(base_url, model, prompts, offsets, output_len, timeout, t0,
                                            transform_prompt))
    finally:
        gc.unfreeze()
    return {"records": records, "end_wall": time.time(), "cpu_s": time.process_time() - cpu}


def _ready(_worker: int) -> bool:
    import openai  # noqa: F401 -- the import a first request would otherwise pay for

    time.sleep(0.2)  # (so that each worker of the pool takes one)
    return True


class HttpClients:
    """Streamed completions against ``base_url`` from ``processes`` client processes (1: this
    process). :meth:`run` returns the run's summary plus ``client_cpu_s`` (the clients' CPU
    seconds). Use as a context manager (the processes stop at its end). ``transform_prompt``: token-id
    prompts through the client's own request transform (:func:`http_request`)."""

    def __init__(self, base_url: str, model: str, processes: int = 1, timeout: float = 600,
                 transform_prompt: bool = False) -> None:
        if processes < 1:
            raise ValueError(f"HttpClients: processes must be >= 1, got {processes}")
        self.base_url, self.model, self.processes, self.timeout = base_url, model, processes, timeout
        self.transform_prompt = transform_prompt
        self.pool = None
        if processes > 1:
            self.pool = concurrent.futures.ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"))
            list(self.pool.map(_ready, range(processes)))

    def __enter__(self) -> "HttpClients":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None

    def run(self, prompts: list, offsets: list[float], output_len: int, request_ids: list[str] | None = None,
            annotate=None) -> dict:
        """Stream every prompt at its offset; ``request_ids`` name them (``X-Request-Id``; default
        ``r0``, ``r1``, ...); ``annotate(records)``, if given, may add to the records (e.g. the
        server's admission times) before they are summarized."""
        ids = request_ids or [f"r{i}" for i in range(len(prompts))]
        prompts = list(zip(ids, prompts))
        n = self.processes
        if self.pool is None:
            start_wall = time.time()
            parts = [_client_process(self.base_url, self.model, prompts, offsets, output_len, self.timeout,
                                     start_wall, self.transform_prompt)]
        else:
            start_wall = time.time() + 0.5  # every process is waiting before the first arrival
            futures = [self.pool.submit(_client_process, self.base_url, self.model, prompts[i::n], offsets[i::n],
                                        output_len, self.timeout, start_wall, self.transform_prompt)
                       for i in range(n)]
            parts = [f.result() for f in futures]
        records = [r for part in parts for r in part["records"]]
        if annotate is not None:
            annotate(records)
        result = summarize(records, max(p["end_wall"] for p in parts) - start_wall)
        result["client_cpu_s"] = sum(p["cpu_s"] for p in parts)
        return result
