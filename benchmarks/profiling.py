"""Diagnostics shared by the benchmarks: where an engine's time goes.

- :class:`StepTrace` times every forward of an engine (device-synchronised before and after, so
  it serialises the overlap: use it in a diagnostic run, not a timed one) with the step's shape:
  mode, requests, new tokens, cached-prefix tokens, checkpoints tracked. ``summary()`` groups the
  steps by mode and token bucket.
- :func:`kernel_profile` runs a block under ``torch.profiler`` and writes the top kernels by
  device time (and the wall time of the block) to a text file.
"""

from __future__ import annotations

import contextlib
import time

import torch

from .reference_models import sync_device


class StepTrace:
    """``with StepTrace(engine) as trace: ...`` records one row per ``engine.runner.forward``."""

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
            sync_device(device)
            tracked = sum(1 for s in (batch.track_slots or []) if s >= 0)
            self.rows.append(dict(
                mode=batch.mode.value, requests=len(batch.requests), tokens=batch.num_tokens,
                prefix_tokens=sum(batch.prefix_lens), tracked=tracked, seconds=time.perf_counter() - t0,
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


class TritonCompiles:
    """``with TritonCompiles() as tc: ...`` counts the Triton JIT compiles (new kernel
    specialisations) launched inside the block, by kernel name (``tc.by_kernel``). Chains any
    hook already installed. Inductor's generated kernels compile elsewhere and are not counted."""

    def __init__(self):
        self.by_kernel: dict[str, int] = {}

    @property
    def total(self) -> int:
        return sum(self.by_kernel.values())

    def __enter__(self) -> "TritonCompiles":
        import triton

        self._runtime = triton.knobs.runtime
        self._previous = self._runtime.jit_post_compile_hook

        def hook(*args, **kwargs):
            fn = kwargs.get("fn")
            name = getattr(fn, "name", None) or str(fn)
            self.by_kernel[name] = self.by_kernel.get(name, 0) + 1
            return self._previous(*args, **kwargs) if self._previous is not None else None

        self._runtime.jit_post_compile_hook = hook
        return self

    def __exit__(self, *exc) -> None:
        self._runtime.jit_post_compile_hook = self._previous
