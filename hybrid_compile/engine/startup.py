"""The start-up of an engine, phase by phase: each phase's wall seconds (``engine.stats()["startup"]``)
and, with progress on, a tqdm bar on stderr whose postfix names the phase that runs.

The phases, in the order they run:

- ``load``: reading the weights (:func:`hybrid_compile.from_pretrained`; an MTP head's weights
  read at wrap). 0 when ``wrap`` got a model already in memory.
- ``pools``: the memory layout of the model and the KV / Mamba-state pools (:mod:`hybrid_compile.memory`).
- ``patch``: the family's layer patches (:mod:`hybrid_compile.models`) and the model runner.
- ``compile``: with ``EngineConfig.compile``, Dynamo's trace of the forward, our backend (split +
  Inductor per piece: compiled, or loaded from Inductor's on-disk caches) and one run on a padding
  step (:meth:`.graph_setup.CompiledGraphs.compile`).
- ``capture``: the CUDA graphs, warm-up runs of every bucket included
  (:meth:`.graph_setup.CompiledGraphs.capture_cuda_graphs`).
- ``speculative``: the speculative decoder (its draft source).
- ``warmup``: two short requests served and forgotten, so that the Triton kernels' JIT compiles
  happen before the first real request (:meth:`.engine.HybridEngine._warm_up_kernels`).

``total_s`` is the wall time from the start (before ``load`` for ``from_pretrained``) to the
engine being ready; the phases are parts of it.

``engine.stats()["startup_work"]`` says what each phase that ran compiled
(:class:`~hybrid_compile.compilation.compile_counts.CompileWork`): Dynamo graphs traced, Inductor
graphs compiled and served from its cache, Triton JIT compiles of the package's kernels.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Iterator

from ..compilation.compile_counts import WORK_KEYS, CompileWork

PHASES = ("load", "pools", "patch", "compile", "capture", "speculative", "warmup")


class Startup:
    """Times the start-up phases of one engine and shows them (``progress``: a tqdm bar on stderr,
    nothing printed otherwise). A component announces the phases it will run with :meth:`plan`
    (the bar's total) and runs each inside :meth:`phase`; :meth:`finish` records ``total_s`` and
    closes the bar. Also a context manager that closes the bar when start-up fails."""

    def __init__(self, progress: bool = False, desc: str = "starting engine") -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.work: dict[str, dict] = {}  # phase -> compile counts (CompileWork), summed over its runs
        self.total_seconds: float | None = None
        self.progress = progress
        self._desc = desc
        self._t0 = time.perf_counter()
        self._planned = 0
        self._bar = None  # shown from the first phase on, with the phases planned so far as its total

    def __enter__(self) -> "Startup":
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.close()

    def _shown(self):
        if self._bar is None:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self._planned, desc=self._desc, disable=not self.progress, file=sys.stderr,
                             bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} phases [{elapsed}{postfix}]")
        return self._bar

    @staticmethod
    def _check(name: str) -> None:
        if name not in PHASES:
            raise ValueError(f"unknown start-up phase {name!r} (one of {', '.join(PHASES)})")

    def plan(self, *names: str) -> None:
        """Phases about to run (each one step of the bar)."""
        for name in names:
            self._check(name)
        self._planned += len(names)
        if self._bar is not None:
            self._bar.total = self._planned
            self._bar.refresh()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Run one phase: its seconds add to ``<name>_s``, the bar names it while it runs."""
        self._check(name)
        bar = self._shown()
        bar.set_postfix_str(name)
        t0 = time.perf_counter()
        work = CompileWork()
        try:
            with work:
                yield
        finally:
            self.seconds[name] += time.perf_counter() - t0
            summed = self.work.setdefault(name, dict.fromkeys(WORK_KEYS, 0))
            for key, count in work.counts.items():
                summed[key] = None if count is None or summed[key] is None else summed[key] + count
        bar.update()

    def finish(self) -> None:
        """The engine is ready: record ``total_s`` and close the bar."""
        self.total_seconds = time.perf_counter() - self._t0
        bar = self._shown()
        bar.set_postfix_str("ready")
        bar.close()

    def work_dict(self) -> dict:
        """``{phase: {"dynamo_graphs", "inductor_compiles", "inductor_cache_hits", "triton_compiles",
        "triton_cache_hits"}}`` for every phase that ran (the Triton counts None where Triton's compile
        hook is missing)."""
        return {name: dict(counts) for name, counts in self.work.items()}

    def as_dict(self) -> dict:
        """``{"load_s", "pools_s", "patch_s", "compile_s", "capture_s", "speculative_s", "warmup_s",
        "total_s"}`` in seconds (``total_s`` None until :meth:`finish`)."""
        return {**{f"{name}_s": s for name, s in self.seconds.items()}, "total_s": self.total_seconds}
