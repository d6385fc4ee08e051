"""Serving benchmark: Poisson arrivals against ``hybrid-compile serve`` (HTTP, the official
``openai`` async client) and against the in-process AsyncEngine at the same load, in one run.

    python benchmarks/serving.py --tiny                       # CPU smoke run (toy model)
    python benchmarks/serving.py                              # CUDA: reference Qwen3-Next (1.9 B, bf16)
    python benchmarks/serving.py --model DIR --rates 4,8,16,inf --num-requests 300 --dataset shared-prefix

Model: ``--model DIR`` (a checkpoint with its tokenizer), or the reference random-weight Qwen3-Next
of ``benchmarks/reference_models.py`` saved once into ``--cache-dir`` with a word-level tokenizer
of its vocabulary (token ``i`` is the word ``t<i>``: every token decodes to text on its own).

Workload: at each request rate (requests/s; ``inf`` = all at once) ``--num-requests`` requests
arrive as a Poisson process (exponential gaps, seeded). Prompts are token ids: ``random``
(``--input-len`` random tokens each) or ``shared-prefix`` (``--groups`` system prompts of
``--system-len`` tokens, each request = one of them + ``--input-len`` random tokens). Every request
generates ``--output-len`` tokens greedily with EOS ignored. Each rate uses prompts of its own
(another seed), so no rate finds the previous rate's prompts in the prefix cache.

Modes (``--modes``): ``inprocess`` drives :class:`hybrid_compile.AsyncEngine` directly in this
process; ``http`` starts ``python -m hybrid_compile serve`` on 127.0.0.1 with the same engine
options and streams ``/v1/completions`` with the ``openai`` client; ``http-process``
(``--engine-process`` adds it) does the same with ``serve --engine-process`` (the engine steps in
a child process of the server), so that both server modes meet the same load in one run. Per rate: request and output
token throughput over the run (first arrival to last finish), TTFT (send to first token),
inter-token latency (gaps between a request's token updates) and end-to-end latency, each p50 /
p90 / p99 / mean; in ``http`` also the server's own mean TTFT (its ``/metrics`` histogram, scraped
before and after the rate: from the request's arrival at the AsyncEngine to its first token out of the
engine), so that the client's TTFT splits into the server's part and the HTTP way in and out. The summary names the highest rate whose p99 TTFT stays under
``--ttft-slo`` seconds, per mode, and compares HTTP with in-process throughput and latency at each
rate. Host cost (Linux): the CPU seconds of the process that serves the streams, its main thread
(the event loop: HTTP, SSE, detokenization in ``http``; the consumers in ``inprocess``) and the
rest (the engine's driver thread, torch's threads), per output token; in ``http`` also the
clients' (the ``openai`` client parsing every chunk), which on a machine with few cores takes CPU
from the server and lowers HTTP throughput for a reason outside the server. The HTTP load comes
from ``--client-processes`` processes (``benchmarks/serving_client.py``: one client process tops
out near 3,000 streamed tokens/s, below what the server sends with every request at once). JSON under
``benchmarks/results/`` (or ``--out``) and PNG plots of latency and throughput vs
rate beside it (with matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hybrid_compile as hc  # noqa: E402
from hybrid_compile.serving.async_engine import freeze_long_lived_objects  # noqa: E402
from benchmarks.reference_models import build_qwen3_next_reference, random_token_prompts  # noqa: E402
from benchmarks.serving_client import HttpClients, percentiles, record, run_load  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVED_NAME = "bench-model"


# -- model -----------------------------------------------------------------------------------------


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer of exactly ``vocab_size`` tokens: token ``i`` is the word ``t<i>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")


def reference_checkpoint(cache_dir: str, tiny: bool, dtype: torch.dtype) -> str:
    """The reference Qwen3-Next saved (safetensors) with :func:`word_tokenizer`, once per settings."""
    path = os.path.join(cache_dir, f"qwen3_next_reference{'_tiny' if tiny else ''}_{str(dtype).split('.')[-1]}")
    if os.path.exists(os.path.join(path, "config.json")) and os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    device = "cpu" if tiny or not torch.cuda.is_available() else "cuda"
    model = build_qwen3_next_reference(dtype, device, seed=0, tiny=tiny)
    model.save_pretrained(path, safe_serialization=True)
    word_tokenizer(model.config.vocab_size).save_pretrained(path)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return path


# -- workload --------------------------------------------------------------------------------------


def make_prompts(args, vocab: int, seed: int) -> list[list[int]]:
    if args.dataset == "random":
        return random_token_prompts(args.num_requests, args.input_len, vocab, seed)
    systems = random_token_prompts(args.groups, args.system_len, vocab, seed + 10_000)
    questions = random_token_prompts(args.num_requests, args.input_len, vocab, seed)
    rng = random.Random(seed)
    return [systems[rng.randrange(args.groups)] + q for q in questions]


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Offsets (s) of ``n`` Poisson arrivals at ``rate`` per second (all 0 for an infinite rate)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def cpu_seconds(pid: int) -> dict | None:
    """CPU seconds (user + system) of process ``pid`` so far: its main thread and the whole
    process (Linux /proc; None elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def read(path):
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        return (int(fields[11]) + int(fields[12])) / tick  # utime, stime

    try:
        return {"main_thread": read(f"/proc/{pid}/task/{pid}/stat"), "process": read(f"/proc/{pid}/stat")}
    except OSError:
        return None


def with_host_cost(result: dict, before: dict | None, after: dict | None,
                   engine_before: dict | None = None, engine_after: dict | None = None) -> dict:
    """Add the serving process's CPU time over a run (and per output token) to its summary; with
    the engine in its own process (``http-process``) also that process's."""
    if before is None or after is None:
        return result
    main, total = after["main_thread"] - before["main_thread"], after["process"] - before["process"]
    tokens = max(result["output_tokens"], 1)
    result["host_cpu_s"] = {"event_loop": main, "other_threads": total - main,
                            "event_loop_us_per_token": 1e6 * main / tokens,
                            "other_threads_us_per_token": 1e6 * (total - main) / tokens}
    if engine_before is not None and engine_after is not None:
        engine = engine_after["process"] - engine_before["process"]
        result["host_cpu_s"].update(engine_process=engine, engine_process_us_per_token=1e6 * engine / tokens)
    return result


def engine_process_pid(server_pid: int) -> int | None:
    """The pid of ``serve --engine-process``'s engine process (the server's spawned child; Linux /proc)."""
    try:
        for task in os.listdir(f"/proc/{server_pid}/task"):
            with open(f"/proc/{server_pid}/task/{task}/children") as f:
                for pid in map(int, f.read().split()):
                    with open(f"/proc/{pid}/cmdline", "rb") as c:
                        if b"spawn_main" in c.read():
                            return pid
    except OSError:
        pass
    return None


# -- in-process mode --------------------------------------------------------------------------------


def inprocess_request(async_engine: hc.AsyncEngine, output_len: int):
    params = hc.SamplingParams(max_new_tokens=output_len, ignore_eos=True)

    async def one(prompt):
        start = time.perf_counter()
        times, tokens, admitted = [], 0, None
        try:
            async for out in async_engine.generate_stream(prompt, params):
                admitted = out.admission_time
                if out.new_token_ids:
                    times.append(time.perf_counter())
                    tokens += len(out.new_token_ids)
        except Exception as e:  # noqa: BLE001 -- counted as a failed request
            return record(start, times, tokens, f"{type(e).__name__}: {e}", admitted)
        return record(start, times, tokens, admitted=admitted)

    return one


# -- http mode ---------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m hybrid_compile serve`` on 127.0.0.1 (log in a file; its request timing log,
    ``--request-timing-log``, in ``timing_path``)."""

    def __init__(self, model_dir: str, cli_options: list[str], log_path: str, timing_path: str | None = None) -> None:
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.timing_path = timing_path
        if timing_path is not None:
            open(timing_path, "w").close()  # (the server appends)
            cli_options = [*cli_options, "--request-timing-log", timing_path]
        self._log = open(log_path, "wb")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
                   NO_PROXY="127.0.0.1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hybrid_compile", "serve", "--model", model_dir, "--served-model-name",
             SERVED_NAME, "--host", "127.0.0.1", "--port", str(self.port), "--no-progress", "--no-access-log",
             "--log-level", "warning", *cli_options],
            env=env, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{open(self.log_path).read()[-3000:]}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server was not ready after {timeout} s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


# -- run ---------------------------------------------------------------------------------------------


def engine_options(args) -> dict:
    options = dict(max_running_requests=args.max_running_requests, chunked_prefill_size=args.chunked_prefill_size,
                   memory_fraction=args.memory_fraction)
    if args.max_total_tokens is not None:
        options["max_total_tokens"] = args.max_total_tokens
    return options


def cli_options(args, device: str, dtype: torch.dtype) -> list[str]:
    opts = ["--device", device, "--dtype", str(dtype).split(".")[-1],
            "--max-running-requests", str(args.max_running_requests),
            "--chunked-prefill-size", str(args.chunked_prefill_size), "--memory-fraction", str(args.memory_fraction)]
    if args.max_total_tokens is not None:
        opts += ["--max-total-tokens", str(args.max_total_tokens)]
    if args.threads:
        opts += ["--threads", str(args.threads)]
    if args.stream_interval != 1:
        opts += ["--stream-interval", str(args.stream_interval)]
    return opts


def run_inprocess(args, model_dir, device, dtype, rates, vocab) -> dict:
    engine = hc.from_pretrained(model_dir, dtype=dtype, device=device, tokenizer=False, progress=False,
                                **engine_options(args))
    async_engine = hc.AsyncEngine(engine)
    freeze_long_lived_objects()  # as the server does once its model is loaded (both modes): the same collector work
    results = {}
    try:
        warm = make_prompts(args, vocab, seed=999)[: min(4, args.num_requests)]
        asyncio.run(run_load(warm, [0.0] * len(warm), inprocess_request(async_engine, 4)))
        for i, rate in enumerate(rates):
            prompts = make_prompts(args, vocab, seed=args.seed + i)
            offsets = arrival_times(len(prompts), rate, seed=args.seed + i)
            before = cpu_seconds(os.getpid())
            result = asyncio.run(run_load(prompts, offsets, inprocess_request(async_engine, args.output_len)))
            results[_rate_key(rate)] = with_host_cost(result, before, cpu_seconds(os.getpid()))
            _print_row("inprocess", rate, results[_rate_key(rate)])
    finally:
        async_engine.shutdown(close_engine=True)
        gc.unfreeze()
        del engine, async_engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def server_ttft(base: str) -> tuple[float, float]:
    """(sum, count) of the server's time-to-first-token histogram (``/metrics``: from the request's
    arrival at the AsyncEngine to its first token out of the engine, so without the HTTP request's way
    in and the SSE event's way out)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "hybrid_compile_time_to_first_token_seconds":
            for sample in family.samples:
                if sample.name.endswith("_sum"):
                    total += sample.value
                elif sample.name.endswith("_count"):
                    count += sample.value
    return total, count


def server_times(timing_path: str) -> dict[str, dict]:
    """The server's request timing log (``serve --request-timing-log``) by request id."""
    with open(timing_path) as f:
        return {line["id"]: line for line in map(json.loads, f) if line.get("id")}


def add_server_times(records: list[dict], timing_path: str, breakdown: dict) -> None:
    """Give each client record the engine's admission time from the server's timing log, and fill
    ``breakdown`` with where the way in and out went (percentiles, seconds): client send ->
    handler start (the client's own work, the connection, uvicorn's parsing, a busy event loop),
    handler -> queued to the engine (JSON, validation, the request's checks), queued -> admitted
    (the hand-off to the driver: a thread or an engine process, and the step it was in), and the
    engine's first token -> the client's first token (the way out)."""
    wanted = {r["id"] for r in records if r["error"] is None}
    deadline = time.monotonic() + 5
    times = server_times(timing_path)
    while not wanted <= times.keys() and time.monotonic() < deadline:  # a line written just after the response
        time.sleep(0.05)
        times = server_times(timing_path)
    parts: dict[str, list[float]] = {"send_to_handler": [], "handler_to_queued": [], "queued_to_admitted": [],
                                     "first_token_to_client": []}
    for r in records:
        t = times.get(r["id"])
        if t is None or r["error"] is not None:
            continue
        r["admitted"] = t["admitted"]
        parts["send_to_handler"].append(t["received"] - r["send"])
        if t["submitted"] is not None:
            parts["handler_to_queued"].append(t["submitted"] - t["received"])
            if t["admitted"] is not None:
                parts["queued_to_admitted"].append(t["admitted"] - t["submitted"])
        if t["first_token"] is not None and r["first"] is not None:
            parts["first_token_to_client"].append(r["first"] - t["first_token"])
    breakdown.update({k: percentiles(v) for k, v in parts.items()})


def run_http(args, model_dir, device, dtype, rates, vocab, log_path, engine_process: bool = False) -> dict:
    """``http`` (the engine on the server's driver thread) or, with ``engine_process``,
    ``http-process`` (``serve --engine-process``): the same rates, prompts and client processes."""
    mode = "http-process" if engine_process else "http"
    timing_path = os.path.splitext(log_path)[0] + "_timing.jsonl"
    server = Server(model_dir, cli_options(args, device, dtype) + ["--engine-process" if engine_process
                                                                   else "--no-engine-process"], log_path,
                    timing_path)
    results = {}
    try:
        server.wait_ready(args.server_timeout)
        engine_pid = engine_process_pid(server.proc.pid) if engine_process else None
        if engine_process and engine_pid is None:
            raise RuntimeError("serve --engine-process: no engine process found under the server")
        with HttpClients(server.base + "/v1", SERVED_NAME, args.client_processes, args.request_timeout,
                         args.client_transforms_prompt) as clients:
            warm = make_prompts(args, vocab, seed=999)[: min(4 * args.client_processes, args.num_requests)]
            clients.run(warm, [0.0] * len(warm), 4)
            for i, rate in enumerate(rates):
                prompts = make_prompts(args, vocab, seed=args.seed + i)
                offsets = arrival_times(len(prompts), rate, seed=args.seed + i)
                before, ttft_before = cpu_seconds(server.proc.pid), server_ttft(server.base)
                engine_before = cpu_seconds(engine_pid) if engine_pid else None
                breakdown: dict = {}
                result = clients.run(prompts, offsets, args.output_len, [f"{_rate_key(rate)}-{j}" for j in
                                                                       range(len(prompts))],
                                     annotate=lambda records: add_server_times(records, timing_path, breakdown))
                result["ingest_breakdown_s"] = breakdown
                # the client processes' CPU over the run per process: near 1, the clients (parsing every
                # chunk) set the pace, and the first-token -> client part grows with it
                result["client_busy_fraction"] = result["client_cpu_s"] / (args.client_processes * result["duration_s"])
                results[_rate_key(rate)] = with_host_cost(result, before, cpu_seconds(server.proc.pid), engine_before,
                                                          cpu_seconds(engine_pid) if engine_pid else None)
                ttft_after = server_ttft(server.base)
                if ttft_after[1] > ttft_before[1]:  # the server's own view of the mean TTFT, beside the client's
                    result["server_ttft_mean_s"] = (ttft_after[0] - ttft_before[0]) / (ttft_after[1] - ttft_before[1])
                if "host_cpu_s" in result:  # the openai clients' own share (every client process's)
                    result["host_cpu_s"]["client_us_per_token"] = (
                        1e6 * result["client_cpu_s"] / max(result["output_tokens"], 1))
                _print_row(mode, rate, results[_rate_key(rate)])
                print(" " * 10 + "way in, ms p50 / p99: " + ", ".join(
                    f"{k.replace('_to_', ' -> ').replace('_', ' ')} {_ms(v['p50']).strip()} / {_ms(v['p99']).strip()}"
                    for k, v in breakdown.items())
                    + f" | client processes busy {100 * result['client_busy_fraction']:.0f} % of the run", flush=True)
    finally:
        server.stop()
    return results


def _rate_key(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _ms(x) -> str:
    return "   -  " if x is None else f"{1000 * x:7.1f}"


def _print_row(mode: str, rate: float, r: dict) -> None:
    print(f"{mode:>9} rate {_rate_key(rate):>5}/s: {r['request_throughput']:7.2f} req/s {r['output_throughput']:9.1f} "
          f"tok/s | TTFT ms p50 {_ms(r['ttft_s']['p50'])} p99 {_ms(r['ttft_s']['p99'])} | ITL ms p50 "
          f"{_ms(r['itl_s']['p50'])} p99 {_ms(r['itl_s']['p99'])} | e2e ms p50 {_ms(r['e2e_s']['p50'])} | "
          f"failed {r['failed']}"
          + (f" | ingest ms p50 {_ms(r['ingest_s']['p50'])} p99 {_ms(r['ingest_s']['p99'])}"
             if r.get("ingest_s", {}).get("n") else "")
          + (f" | TTFT mean ms client {_ms(r['ttft_s']['mean'])} server {_ms(r['server_ttft_mean_s'])}"
             if "server_ttft_mean_s" in r else "")
          + (f" | CPU us/token: event loop {r['host_cpu_s']['event_loop_us_per_token']:.0f}, "
                                     f"other threads {r['host_cpu_s']['other_threads_us_per_token']:.0f}"
                                     + (f", engine process {r['host_cpu_s']['engine_process_us_per_token']:.0f}"
                                        if "engine_process_us_per_token" in r["host_cpu_s"] else "")
                                     + (f", client {r['host_cpu_s']['client_us_per_token']:.0f}"
                                        if "client_us_per_token" in r["host_cpu_s"] else "")
                                     if "host_cpu_s" in r else ""), flush=True)


def compare(results: dict, rates: list[float], slo: float) -> dict:
    """Per mode: the highest rate with p99 TTFT under the SLO and its throughput; HTTP / in-process
    ratios at every rate both measured, and at each HTTP mode's own highest rate under the SLO."""
    out = {"ttft_slo_s": slo, "best_rate_under_slo": {}, "http_vs_inprocess": {}, "http-process_vs_inprocess": {},
           "http_at_its_slo_rate": None, "http-process_at_its_slo_rate": None}
    for mode, per_rate in results.items():
        ok = [k for k in map(_rate_key, rates) if k in per_rate and per_rate[k]["failed"] == 0
              and per_rate[k]["ttft_s"]["p99"] is not None and per_rate[k]["ttft_s"]["p99"] < slo]
        best = ok[-1] if ok else None
        out["best_rate_under_slo"][mode] = (
            {"rate": best, "output_throughput": per_rate[best]["output_throughput"],
             "request_throughput": per_rate[best]["request_throughput"], "ttft_p99_s": per_rate[best]["ttft_s"]["p99"]}
            if best else None
        )
    for http in ("http", "http-process"):
        if http not in results or "inprocess" not in results:
            continue
        # the test: at the server's highest rate under the SLO, HTTP throughput against
        # in-process at that same rate (goal: at most 5 % less)
        best = out["best_rate_under_slo"].get(http)
        p = results["inprocess"].get(best["rate"]) if best else None
        out[f"{http}_at_its_slo_rate"] = (
            {"rate": best["rate"], "throughput_ratio": best["output_throughput"] / p["output_throughput"],
             "within_5_percent": best["output_throughput"] >= 0.95 * p["output_throughput"]}
            if p and p["output_throughput"] else None)
        for k in map(_rate_key, rates):
            h, p = results[http].get(k), results["inprocess"].get(k)
            if h and p and p["output_throughput"]:
                out[f"{http}_vs_inprocess"][k] = {
                    "throughput_ratio": h["output_throughput"] / p["output_throughput"],
                    "throughput_overhead": 1 - h["output_throughput"] / p["output_throughput"],
                    "ttft_p50_added_s": _diff(h["ttft_s"]["p50"], p["ttft_s"]["p50"]),
                    "itl_p50_added_s": _diff(h["itl_s"]["p50"], p["itl_s"]["p50"]),
                    "e2e_p50_added_s": _diff(h["e2e_s"]["p50"], p["e2e_s"]["p50"]),
                    "ingest_p50_added_s": _diff(h["ingest_s"]["p50"], p["ingest_s"]["p50"]),
                }
    return out


def _diff(a, b):
    return None if a is None or b is None else a - b


def make_plots(run: dict, prefix: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install -e '.[bench]')")
        return []
    files = []
    keys = [_rate_key(r) for r in run["settings"]["rates"]]
    xs = [float(k) if k != "inf" else None for k in keys]
    finite = [x for x in xs if x is not None]
    inf_x = (max(finite) * 2 if finite else 1.0)
    xs = [x if x is not None else inf_x for x in xs]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, metric, title in zip(axes, ("ttft_s", "itl_s", "e2e_s"), ("TTFT", "inter-token latency", "end-to-end")):
        for mode, per_rate in run["results"].items():
            for q, style in (("p50", "-"), ("p99", "--")):
                ys = [per_rate.get(k, {}).get(metric, {}).get(q) for k in keys]
                pts = [(x, 1000 * y) for x, y in zip(xs, ys) if y is not None]
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", label=f"{mode} {q}")
        ax.set_xscale("log")
        ax.set_xlabel("request rate (req/s; rightmost = all at once)" if "inf" in keys else "request rate (req/s)")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle(f"{run['model']} on {run['device']}: latency vs request rate")
    fig.tight_layout()
    files.append(prefix + "_latency.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for mode, per_rate in run["results"].items():
        ys = [per_rate.get(k, {}).get("output_throughput") for k in keys]
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=mode)
    ax.set_xscale("log")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{run['model']} on {run['device']}: throughput vs request rate")
    ax.legend()
    fig.tight_layout()
    files.append(prefix + "_throughput.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    return files


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="toy reference model on CPU, few short requests (smoke run)")
    p.add_argument("--model", default=None, help="checkpoint directory with tokenizer; default: the reference model")
    p.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "hybrid_compile_bench"),
                   help="where the reference checkpoint is saved once")
    p.add_argument("--modes", default="inprocess,http", help="comma-separated: inprocess, http, http-process "
                   "(the server with --engine-process)")
    p.add_argument("--engine-process", action="store_true",
                   help="also run http-process: the server with its engine in its own process, at the same rates "
                        "and from the same client processes as http")
    p.add_argument("--rates", default=None, help="comma-separated requests/s; inf = all at once")
    p.add_argument("--num-requests", type=int, default=None, help="requests per rate")
    p.add_argument("--dataset", default="random", choices=["random", "shared-prefix"])
    p.add_argument("--input-len", type=int, default=None, help="random prompt tokens (after the system prompt)")
    p.add_argument("--output-len", type=int, default=None, help="generated tokens per request")
    p.add_argument("--groups", type=int, default=8, help="shared-prefix: number of system prompts")
    p.add_argument("--system-len", type=int, default=None, help="shared-prefix: tokens per system prompt")
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--memory-fraction", type=float, default=0.8)
    p.add_argument("--threads", type=int, default=0, help="CPU threads of torch (both modes); 0 = default")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="http: the server's --stream-interval (a choice's text every N tokens)")
    p.add_argument("--client-processes", type=int, default=None,
                   help="http: processes running the openai client (default: 1 with --tiny, else min(8, CPUs / 4))")
    p.add_argument("--client-transforms-prompt", action="store_true",
                   help="http: pass the token-id prompts through the openai client's own request transform (Python "
                        "per token id, in the client: how runs before 2026-11-27 sent them); default: in the body as is")
    p.add_argument("--ttft-slo", type=float, default=1.0, help="p99 TTFT bound (s) of the summary's best rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-timeout", type=float, default=1200, help="seconds to wait for the server to load")
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument("--no-plots", dest="plots", action="store_false")
    p.add_argument("--out", default=None, help="JSON path (plots beside it)")
    args = p.parse_args(argv)
    tiny = dict(rates="4,inf", num_requests=8, input_len=16, output_len=6, system_len=32, max_running_requests=16,
                max_total_tokens=2048, chunked_prefill_size=128)
    full = dict(rates="2,4,8,16,32,inf", num_requests=128, input_len=512, output_len=128, system_len=2048,
                max_running_requests=64, max_total_tokens=None, chunked_prefill_size=2048)
    if args.client_processes is None:
        args.client_processes = 1 if args.tiny else min(8, max(1, (os.cpu_count() or 1) // 4))
    for k, v in (tiny if args.tiny else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def server_stack_versions() -> dict:
    """Versions of the server's event loop and HTTP parser packages in this environment (the server
    runs with the same interpreter): uvicorn uses uvloop and httptools when installed, asyncio and
    h11 otherwise, which changes the event loop's CPU per token. None: not installed."""
    from importlib import metadata

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {name: version(name) for name in ("uvicorn", "uvloop", "httptools")}


def main(argv=None) -> dict:
    args = parse_args(argv)
    stack = server_stack_versions()
    print("server stack: " + ", ".join(f"{k} {v or 'not installed'}" for k, v in stack.items())
          + ("" if stack["uvloop"] else " (uvicorn falls back to asyncio's event loop)"), flush=True)
    if args.tiny:
        device, dtype = "cpu", torch.float32
    else:
        if not torch.cuda.is_available():
            raise SystemExit("the full benchmark needs a CUDA device (use --tiny on CPU)")
        device, dtype = "cuda", torch.bfloat16
    if args.threads:
        torch.set_num_threads(args.threads)
    rates = [math.inf if r.strip() == "inf" else float(r) for r in args.rates.split(",")]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.engine_process and "http-process" not in modes:
        modes.append("http-process")
    unknown = sorted(set(modes) - {"inprocess", "http", "http-process"})
    if unknown:
        raise SystemExit(f"unknown mode(s): {', '.join(unknown)}")
    os.makedirs(args.cache_dir, exist_ok=True)
    model_dir = args.model or reference_checkpoint(args.cache_dir, args.tiny, dtype)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    device_name = "cpu" if device == "cpu" else torch.cuda.get_device_name(0)
    out = args.out or os.path.join(ROOT, "benchmarks", "results",
                                   f"serving_{'tiny' if args.tiny else device_name.replace(' ', '_').lower()}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    results = {}
    # the server first: its process gives all its device memory back when it exits, while this
    # process keeps what an in-process engine reserved (compiled graphs' pools), which would shrink
    # the server's memory budget
    if "http" in modes:
        results["http"] = run_http(args, model_dir, device, dtype, rates, vocab, os.path.splitext(out)[0] + "_server.log")
    if "http-process" in modes:
        results["http-process"] = run_http(args, model_dir, device, dtype, rates, vocab,
                                           os.path.splitext(out)[0] + "_server_engine_process.log", engine_process=True)
    if "inprocess" in modes:
        results["inprocess"] = run_inprocess(args, model_dir, device, dtype, rates, vocab)
    run = {
        "model": args.model or ("qwen3_next_reference" + ("_tiny" if args.tiny else "")),
        "device": device_name,
        "dtype": str(dtype).split(".")[-1],
        "settings": {**{k: v for k, v in vars(args).items() if k not in ("rates",)},
                     "rates": [_rate_key(r) for r in rates], "engine_options": engine_options(args)},
        "versions": {"torch": torch.__version__, "hybrid_compile": hc.__version__, **stack},
        "results": results,
        "summary": compare(results, rates, args.ttft_slo),
    }
    run["settings"]["rates"] = [math.inf if k == "inf" else float(k) for k in run["settings"]["rates"]]
    if args.plots:
        run["plots"] = make_plots(run, os.path.splitext(out)[0])
    run["settings"]["rates"] = [_rate_key(r) for r in rates]
    with open(out, "w") as f:
        json.dump(run, f, indent=2)
    s = run["summary"]
    for mode, best in s["best_rate_under_slo"].items():
        if best:
            print(f"{mode}: highest rate with p99 TTFT < {args.ttft_slo:g} s: {best['rate']}/s -> "
                  f"{best['output_throughput']:.1f} output tok/s")
        else:
            print(f"{mode}: no rate kept p99 TTFT under {args.ttft_slo:g} s")
    for http, name in (("http", "HTTP"), ("http-process", "HTTP, engine process")):
        at = s.get(f"{http}_at_its_slo_rate")
        if at:
            print(f"{name} at its highest rate under the SLO ({at['rate']}/s): {100 * at['throughput_ratio']:.1f} % of "
                  f"in-process at that rate ({'within' if at['within_5_percent'] else 'not within'} 5 %)")
        for k, c in s[f"{http}_vs_inprocess"].items():
            print(f"rate {k:>5}/s: {name} throughput = {100 * c['throughput_ratio']:.1f} % of in-process "
                  f"(TTFT p50 +{_ms(c['ttft_p50_added_s']).strip()} ms, "
                  f"ITL p50 +{_ms(c['itl_p50_added_s']).strip()} ms)")
    print(f"wrote {out}")
    return run


if __name__ == "__main__":
    main()
