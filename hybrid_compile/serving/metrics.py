"""The server's Prometheus metrics (prometheus-client), in a registry of their own.

Latencies are observed as tokens come out (:class:`ServerMetrics` is the AsyncEngine's
observer, called on the driver thread once per step with the step's measurements): time to first
token, inter-token latency and end-to-end request latency histograms, token and request counters.
The latency histograms are bucket counts of our own (:class:`_Histogram`, exported by the
collector as Prometheus histograms): one lock and one bisect per value, where prometheus-client's
Histogram takes a lock and scans its buckets per ``observe`` — the step loop pays for every value. Engine state (requests running /
waiting, pool usage, prefix-cache hit rate) is read from ``engine.stats()`` at each scrape,
between two steps (with the engine in its own process: a stats command answered by the child), and exported by a collector
(with the prefix cache's host tier and elastic pools, theirs too). Tokens/s is the generation rate over the last
``rate_window`` seconds.
"""

from __future__ import annotations

import bisect
import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .async_engine import EngineClosedError, EngineObserver, StreamOutput

PREFIX = "hybrid_compile_"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0)


class ServerMetrics(EngineObserver):
    """Every metric of one server; :meth:`render` is the ``/metrics`` text."""

    def __init__(self, model_name: str, rate_window: float = 10.0) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.rate_window = rate_window
        labels, values = ["model_name"], [model_name]
        r = self.registry
        self.ttft = _Histogram("time_to_first_token_seconds", "Time from a request's arrival to its first "
                               "generated token", _LATENCY_BUCKETS)
        self.itl = _Histogram("inter_token_latency_seconds", "Time between two generated tokens of a request",
                              _LATENCY_BUCKETS)
        self.e2e = _Histogram("e2e_request_latency_seconds", "Time from a request's arrival to its end", _E2E_BUCKETS)
        self._histogram_lock = threading.Lock()
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of finished requests", labels,
                                     registry=r).labels(*values)
        self.cached_prompt_tokens = Counter(f"{PREFIX}cached_prompt_tokens", "Prompt tokens of finished requests "
                                            "served from the prefix cache", labels, registry=r).labels(*values)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Generated tokens", labels,
                                         registry=r).labels(*values)
        self.requests = Counter(f"{PREFIX}request_finished", "Finished sequences (one per choice), by finish reason",
                                ["model_name", "finish_reason"], registry=r)
        self._recent: collections.deque = collections.deque()  # (time, tokens) within rate_window
        self._recent_lock = threading.Lock()
        self._snapshot: dict | None = None
        self.registry.register(_EngineCollector(self))

    # -- observer (driver thread) -----------------------------------------------------------------
    def observe_step(self, first_token_latencies: list[float], inter_token_latencies: list[float],
                     finished: list[StreamOutput]) -> None:
        with self._histogram_lock:
            self.ttft.observe_many(first_token_latencies)
            self.itl.observe_many(inter_token_latencies)
            self.e2e.observe_many([out.time - out.arrival_time for out in finished])
        tokens = len(first_token_latencies) + len(inter_token_latencies)
        if tokens:
            self._count_tokens(tokens)
        for output in finished:
            if output.index == 0:  # the n sequences of a request share its prompt
                self.prompt_tokens.inc(output.prompt_tokens)
                self.cached_prompt_tokens.inc(output.cached_tokens)
            self.requests.labels(self.model_name, output.finish_reason or "unknown").inc()

    def _count_tokens(self, n: int) -> None:
        self.generation_tokens.inc(n)
        now = time.perf_counter()
        with self._recent_lock:
            self._recent.append((now, n))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self.rate_window:
            self._recent.popleft()

    def tokens_per_second(self) -> float:
        now = time.perf_counter()
        with self._recent_lock:
            self._trim(now)
            return sum(n for _, n in self._recent) / self.rate_window

    # -- scrape (event loop) ------------------------------------------------------------------------
    async def render(self, async_engine) -> bytes:
        """The exposition text; engine gauges from a fresh ``engine.stats()`` (None while the
        engine is loading: then only the latency and token metrics)."""
        try:
            self._snapshot = await async_engine.stats() if async_engine is not None else None
        except EngineClosedError:  # an engine process that died: its gauges are gone
            self._snapshot = None
        return generate_latest(self.registry)


class _Histogram:
    """Bucket counts and sum of one latency histogram (callers hold ServerMetrics' lock)."""

    def __init__(self, name: str, doc: str, buckets: tuple) -> None:
        self.name, self.doc, self.bounds = name, doc, tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf only)
        self.sum = 0.0

    def observe_many(self, values: list[float]) -> None:
        bounds, counts = self.bounds, self.counts
        for v in values:
            counts[bisect.bisect_left(bounds, v)] += 1  # Prometheus' buckets are "<= le"
        self.sum += sum(values)

    def family(self, labels: list[str], values: list[str]) -> HistogramMetricFamily:
        cumulative, total = [], 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts):
            total += count
            cumulative.append((bound, total))
        h = HistogramMetricFamily(f"{PREFIX}{self.name}", self.doc, labels=labels)
        h.add_metric(values, cumulative, self.sum)
        return h


class _EngineCollector:
    """Gauges and counters read from the engine's latest stats() snapshot."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        m = self.metrics
        labels, values = ["model_name"], [m.model_name]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(f"{PREFIX}{name}", doc, labels=labels)
            g.add_metric(values, float(value))
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(f"{PREFIX}{name}", doc, labels=labels)
            c.add_metric(values, float(value))
            return c

        with m._histogram_lock:
            histograms = [h.family(labels, values) for h in (m.ttft, m.itl, m.e2e)]
        yield from histograms
        yield gauge("generation_tokens_per_second", f"Tokens generated per second over the last {m.rate_window:g} s",
                    m.tokens_per_second())
        s = m._snapshot
        if s is None:
            return
        yield gauge("num_requests_running", "Requests being prefilled or decoded", s["running"])
        yield gauge("num_requests_waiting", "Requests queued for admission", s["waiting"])
        yield counter("prefill_tokens", "Tokens prefilled by the engine (prompts and recomputation)",
                      s["prefill_tokens"])
        yield counter("engine_steps", "Engine steps run", s["steps"])
        yield counter("retractions", "Running requests retracted for lack of pool space", s["retractions"])
        mem = s["memory"]
        cap, free, used = mem["capacity"], mem["free"], mem["used"]
        for pool, unit in (("kv", "tokens"), ("mamba", "slots"), ("request", "slots")):
            key = {"kv": "kv_tokens", "mamba": "mamba_slots", "request": "request_slots"}[pool]
            yield gauge(f"{pool}_pool_capacity_{unit}", f"{pool} pool capacity", cap[key])
            yield gauge(f"{pool}_pool_free_{unit}", f"{pool} pool free {unit}", free[key])
        yield gauge("kv_pool_usage_ratio", "Share of the KV pool in use (running requests and prefix cache)",
                    used["kv_tokens"] / cap["kv_tokens"] if cap["kv_tokens"] else 0.0)
        yield gauge("mamba_pool_usage_ratio", "Share of the Mamba-state pool in use (running requests and prefix "
                    "cache)", used["mamba_slots"] / cap["mamba_slots"] if cap["mamba_slots"] else 0.0)
        pc = s.get("prefix_cache")
        if pc is not None:
            yield gauge("prefix_cache_kv_tokens", "KV tokens held by the prefix cache", pc["cached_tokens"])
            yield gauge("prefix_cache_mamba_slots", "Mamba slots held by the prefix cache", pc["mamba_slots"])
            yield gauge("prefix_cache_locked_kv_tokens", "Prefix-cache KV tokens locked by running requests",
                        pc["protected_tokens"])
            yield gauge("prefix_cache_locked_mamba_slots", "Prefix-cache Mamba slots locked by running requests",
                        pc["protected_mamba_slots"])
            yield counter("prefix_cache_queries", "Tokens of admitted requests looked up in the prefix cache",
                          pc["admitted_tokens"])
            yield counter("prefix_cache_hits", "Tokens of admitted requests served from the prefix cache",
                          pc["admitted_hit_tokens"])
            yield gauge("prefix_cache_hit_rate", "Prefix-cache hits / queries (tokens, since start)",
                        pc["token_hit_rate"])
            if pc.get("host_tier"):  # (serve --prefix-cache-host-tier)
                yield gauge("prefix_cache_host_kv_tokens", "KV tokens the prefix cache holds in host memory",
                            pc["host_cached_tokens"])
                yield gauge("prefix_cache_host_mamba_slots", "Mamba states the prefix cache holds in host memory",
                            pc["host_mamba_slots"])
                yield gauge("prefix_cache_host_bytes", "Host memory the prefix cache's copies take",
                            pc["host_bytes_held"])
                yield counter("prefix_cache_host_hits", "Prefix-cache matches that loaded nodes back "
                              "from host memory", pc["host_hits"])
                yield counter("prefix_cache_host_hit_tokens", "Prompt tokens served from the host tier",
                              pc["host_hit_tokens"])
                yield counter("prefix_cache_host_written_tokens", "KV tokens written to the host tier",
                              pc["host_written_tokens"])
                yield counter("prefix_cache_host_loaded_tokens", "KV tokens loaded back from the host tier",
                              pc["host_loaded_tokens"])
        elastic = s.get("elastic_pools")
        if elastic is not None:  # (serve --elastic-pools)
            yield counter("elastic_pool_moves_to_kv", "Moves of memory from the Mamba-state pool to the KV pool",
                          elastic["to_kv"])
            yield counter("elastic_pool_moves_to_mamba", "Moves of memory from the KV pool to the Mamba-state pool",
                          elastic["to_mamba"])
        spec = s.get("speculative")
        if spec is not None:  # (serve --speculative-config)
            yield counter("spec_decode_verify_steps", "Speculative verify steps run", spec["verify_steps"])
            yield counter("spec_decode_draft_tokens", "Draft tokens verified", spec["drafted"])
            yield counter("spec_decode_accepted_tokens", "Draft tokens accepted", spec["accepted"])
            yield gauge("spec_decode_acceptance_rate", "Accepted / verified draft tokens (since start)",
                        spec["acceptance_rate"])
