"""Diagnostics shared by the benchmarks: where an engine's time goes.

- :class:`StepTrace` times every forward of an engine (device-synchronised before and after, so
  it serialises the overlap: use it in a diagnostic run, not a timed one) with the step's shape:
  mode, requests, new tokens, cached-prefix tokens, checkpoints tracked. ``summary()`` groups the
  steps by mode and token bucket.
- :func:`kernel_profile` runs a block under ``torch.profiler`` and writes the top kernels by
  device time (and the wall time of the block) to a text file.
- :func:`decode_profile` / :func:`prefill_profile`: a few decode steps or one prompt's prefill under
  ``torch.profiler`` as a dict per step (wall, GPU-busy and all-reduce ms, top host ops, top kernels)
  for a benchmark's JSON (``tensor_parallel.py`` on rank 0, ``fp8.py`` per engine);
  :func:`step_profile`, the same for given prompts (``speculative.py``: verify steps of a draft source).
"""

from __future__ import annotations

import contextlib
import time

import torch

from .reference_models import random_token_prompts, sync_device


class StepTrace:
    """``with StepTrace(engine) as trace: ...`` records one row per ``engine.runner.forward``:
    ``seconds`` until the device finished it, ``host_seconds`` until the call returned (the host's
    work, the device running behind it), and the step's shape (``decode_rows``: a mixed step's)."""

    def __init__(self, engine):
        self.engine, self.rows = engine, []

    def __enter__(self) -> "StepTrace":
        runner = self.engine.runner
        inner = runner.forward
        device = self.engine.device

        def timed(batch, *args, **kwargs):
            sync_device(device)
            t0 = time.perf_counter()
            out = inner(batch, *args, **kwargs)
            host = time.perf_counter() - t0
            sync_device(device)
            tracked = sum(1 for s in (batch.track_slots or []) if s >= 0)
            rows = batch.decode_rows
            self.rows.append(dict(
                mode=batch.mode.value, requests=len(batch.requests), tokens=batch.num_tokens,
                prefix_tokens=sum(batch.prefix_lens), tracked=tracked, seconds=time.perf_counter() - t0,
                host_seconds=host, decode_rows=0 if rows is None else rows[1] - rows[0],
            ))
            return out

        runner.forward = timed
        self._restore = lambda: delattr(runner, "forward") if "forward" in vars(runner) else None
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def summary(self) -> list[dict]:
        """Rows grouped by (mode, power-of-two token bucket): count, seconds, tokens, prefix tokens."""
        groups: dict[tuple, dict] = {}
        for r in self.rows:
            bucket = 1 << max(0, r["tokens"] - 1).bit_length()
            g = groups.setdefault((r["mode"], bucket), dict(mode=r["mode"], tokens_bucket=bucket, steps=0, seconds=0.0,
                                                            tokens=0, prefix_tokens=0, requests=0, tracked=0))
            g["steps"] += 1
            for k in ("seconds", "tokens", "prefix_tokens", "requests", "tracked"):
                g[k] += r[k]
        out = sorted(groups.values(), key=lambda g: -g["seconds"])
        for g in out:
            g["ms_per_step"] = 1e3 * g["seconds"] / g["steps"]
        return out

    def format(self) -> str:
        lines = [f"{'mode':>8} {'tokens<=':>8} {'steps':>6} {'ms/step':>9} {'total s':>8} {'tok/step':>9} "
                 f"{'prefix/step':>11} {'reqs/step':>9} {'tracked':>7}"]
        for g in self.summary():
            n = g["steps"]
            lines.append(f"{g['mode']:>8} {g['tokens_bucket']:>8} {n:>6} {g['ms_per_step']:>9.2f} {g['seconds']:>8.3f} "
                         f"{g['tokens'] / n:>9.0f} {g['prefix_tokens'] / n:>11.0f} {g['requests'] / n:>9.1f} {g['tracked']:>7}")
        return "\n".join(lines)


@contextlib.contextmanager
def kernel_profile(path: str, device: torch.device, row_limit: int = 30):
    """Profile the block (CPU + CUDA activities) and write the top ``row_limit`` ops by device
    time, plus the block's wall time and total device time, to ``path``."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync_device(device)
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        yield prof
        sync_device(device)
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    total_us = sum(getattr(e, key, 0.0) for e in events)
    with open(path, "w") as f:
        f.write(f"wall {wall:.4f} s; summed self {key} {total_us / 1e6:.4f} s\n")
        f.write(events.table(sort_by=key, row_limit=row_limit, max_name_column_width=70))


def _profiled(engine, run) -> tuple:
    """``run()`` (returns the number of steps it took) under torch.profiler on rank 0 (CPU events, and
    CUDA kernels on a GPU); returns (profiler, steps, wall seconds)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        n = run()
        sync_device(engine.device)
        wall = time.perf_counter() - t0
    return prof, max(1, n), wall


def _profile_summary(prof, n: int, wall: float, cuda: bool, kernels_shown: int = 10, **fields) -> dict:
    """Per step of ``n``: wall and all-reduce time, rank 0's host ops with the most own CPU time and,
    on CUDA, the GPU's busy time (every kernel's and copy's own time, CUDA-graph replays included)
    and the kernels that take most of it."""

    def device_us(e, own: bool) -> float:
        names = ("self_device_time_total", "self_cuda_time_total") if own else ("device_time_total", "cuda_time_total")
        return float(next((getattr(e, k) for k in names if hasattr(e, k)), 0.0))

    def is_all_reduce(key: str) -> bool:
        # the transport's own events only: NCCL's all-reduce kernels and torch's one-shot kernel
        # (tensor_parallel_all_reduce; graph replays included) or gloo's call (not the c10d ops around
        # them, nor Inductor kernels named after a fused all_reduce's users)
        k = key.lower()
        if not cuda:
            return k == "gloo:all_reduce"
        return (k.startswith("nccl") and "kernel" in k and "allreduce" in k) or "one_shot_all_reduce_kernel" in k

    us, count, kernels, host = 0.0, 0, [], []
    for e in prof.key_averages():
        if is_all_reduce(e.key):
            us += device_us(e, own=True) if cuda else e.cpu_time_total
            count += e.count
        if cuda and device_us(e, own=True) > 0:
            kernels.append((device_us(e, own=True), e.count, e.key))
        if e.self_cpu_time_total > 0:
            host.append((e.self_cpu_time_total, e.count, e.key))
    host.sort(reverse=True)
    out = dict(fields, steps=n, all_reduce_ms_per_step=us / 1e3 / n, all_reduce_calls=count,
               wall_ms_per_step=wall * 1e3 / n,
               # rank 0's host side: the ops (and runtime calls, e.g. a synchronize that waits for the
               # GPU, a gloo broadcast) with the most own CPU time per step
               top_host_ops=[dict(name=k[2][:120], ms_per_step=k[0] / 1e3 / n, calls_per_step=k[1] / n)
                             for k in host[:15]])
    if cuda:
        kernels.sort(reverse=True)
        out["gpu_busy_ms_per_step"] = sum(k[0] for k in kernels) / 1e3 / n
        out["top_kernels"] = [dict(name=k[2][:120], ms_per_step=k[0] / 1e3 / n, calls_per_step=k[1] / n)
                              for k in kernels[:kernels_shown]]
    return out


def decode_profile(engine, batch: int, vocab: int, steps: int = 4, kernels_shown: int = 10) -> dict:
    """A few decode steps of ``batch`` random prompts under torch.profiler, on rank 0
    (:func:`step_profile`: where busy time is far below wall time, the step waits on the host or on
    the other ranks; the profiler's own host cost inflates the wall time, so the decode rows, not
    this, give the step rate)."""
    prompts = random_token_prompts(batch, 16, vocab, seed=99)
    return step_profile(engine, prompts, steps, kernels_shown, batch=batch)


def step_profile(engine, prompts: list[list[int]], steps: int = 4, kernels_shown: int = 10,
                 max_new_tokens: int | None = None, **fields) -> dict:
    """``steps`` engine steps of ``prompts`` after their prefill under torch.profiler, on rank 0, per
    forward (:func:`_profile_summary`): decode steps, or verify steps with speculative decoding (the
    prompts of a replay draft's continuations then draft as in the timed run). The requests run to
    their end after it (``max_new_tokens``, default ``steps + 2``: enough for decode steps; a verify
    step emits several tokens) and the prefix cache is emptied."""
    from hybrid_compile import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens or steps + 2, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in prompts]
    reqs = [engine.request(r) for r in rids]
    while not all(r.output for r in reqs):
        engine.step()

    def run() -> int:
        # forwards, not step() calls: with overlap (the engine's default) the first step() also launches
        # the next decode step ahead, so `steps` calls run (and the profile holds) steps + 1 forwards
        before = engine.stats()["steps"]
        n = 0
        while engine.has_unfinished() and n < steps:
            engine.step()
            n += 1
        return engine.stats()["steps"] - before

    prof, n, wall = _profiled(engine, run)
    while engine.has_unfinished():
        engine.step()
    for r in rids:
        engine.pop_finished(r)
    engine.clear_prefix_cache()
    return _profile_summary(prof, n, wall, engine.device.type == "cuda", kernels_shown, **fields)


def prefill_profile(engine, length: int, vocab: int, kernels_shown: int = 10) -> dict:
    """One prompt of ``length`` tokens (one chunk or a few) under torch.profiler, on rank 0, per
    engine step (:func:`_profile_summary`): whether a prefill waits on the other ranks (all-reduce
    kernels far above their transfer time) or on the host (GPU busy far below wall)."""
    prompt = random_token_prompts(1, length, vocab, seed=7)[0]

    def run() -> int:
        before = engine.stats()["steps"]
        engine.generate_batch([prompt], max_new_tokens=1)
        return engine.stats()["steps"] - before

    prof, n, wall = _profiled(engine, run)
    engine.clear_prefix_cache()
    return _profile_summary(prof, n, wall, engine.device.type == "cuda", kernels_shown, length=length)
