"""How much compiling a span of work did: Dynamo graphs traced, Inductor graphs compiled or served
from its FX-graph cache, Triton JIT compiles (new kernel specialisations) of the package's kernels
and how many of those Triton served from its on-disk cache.

The engine's start-up counts them per phase (``engine.stats()["startup_work"]``,
:mod:`hybrid_compile.engine.startup`): which phase a minute of start-up compiles in. The benchmarks
and the GPU tests count Triton compiles while serving (:class:`TritonCompiles`: after ``wrap``
none should happen). Dynamo and Inductor counts are torch's process-wide counters
(``torch._dynamo.utils.counters``); Inductor's own generated kernels compile in its workers and are
not Triton compiles here.
"""

from __future__ import annotations

__all__ = ["CompileWork", "TritonCompiles", "WORK_KEYS"]

#: the counts of a :class:`CompileWork`
WORK_KEYS = ("dynamo_graphs", "inductor_compiles", "inductor_cache_hits", "triton_compiles", "triton_cache_hits")


class TritonCompiles:
    """``with TritonCompiles() as tc: ...`` counts the Triton JIT compiles launched inside the
    block, by kernel name (``tc.by_kernel``), through Triton's ``jit_post_compile_hook``, and of
    them those that Triton's on-disk cache served (``tc.cache_hits``: no code generation, no
    ``ptxas``), through its compilation listener (Inductor's kernels, which it compiles through
    Triton directly, are not counted). Both chain whatever was installed before. ``available`` is
    False where Triton or the hook is missing (then nothing is counted); ``cache_hits`` stays 0
    where the listener is missing."""

    def __init__(self) -> None:
        self.by_kernel: dict[str, int] = {}
        self.cache_hits = 0
        self.available = False
        self._runtime = self._compilation = None

    @property
    def total(self) -> int:
        return sum(self.by_kernel.values())

    def __enter__(self) -> "TritonCompiles":
        try:
            import triton

            runtime = triton.knobs.runtime
            previous = runtime.jit_post_compile_hook
        except (ImportError, AttributeError):
            return self
        self._runtime, self._previous, self.available = runtime, previous, True

        def hook(*args, **kwargs):
            fn = kwargs.get("fn")
            name = getattr(fn, "name", None) or str(fn)
            self.by_kernel[name] = self.by_kernel.get(name, 0) + 1
            return previous(*args, **kwargs) if previous is not None else None

        runtime.jit_post_compile_hook = hook
        compilation = getattr(triton.knobs, "compilation", None)
        if compilation is not None and hasattr(compilation, "listener"):
            self._compilation, previous_listener = compilation, compilation.listener

            def listener(*args, **kwargs):
                module = getattr(getattr(kwargs.get("src"), "fn", None), "__module__", None) or ""
                if kwargs.get("cache_hit") and not module.startswith("torch."):  # (Inductor's generated modules)
                    self.cache_hits += 1
                if previous_listener is not None:
                    previous_listener(*args, **kwargs)

            self._previous_listener = previous_listener
            compilation.listener = listener
        return self

    def __exit__(self, *exc) -> None:
        if self._runtime is not None:
            self._runtime.jit_post_compile_hook = self._previous
            self._runtime = None
        if self._compilation is not None:
            self._compilation.listener = self._previous_listener
            self._compilation = None


def _torch_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return {"dynamo_graphs": counters["stats"]["unique_graphs"],
            "inductor_compiles": inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_bypass"],
            "inductor_cache_hits": inductor["fxgraph_cache_hit"]}


class CompileWork:
    """``with CompileWork() as work: ...``; then ``work.counts``: :data:`WORK_KEYS` -> how many
    happened inside the block (``triton_compiles`` and ``triton_cache_hits`` None where Triton's hook
    is missing)."""

    def __init__(self) -> None:
        self.counts: dict[str, int | None] = {}

    def __enter__(self) -> "CompileWork":
        self._before = _torch_counts()
        self._triton = TritonCompiles().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._triton.__exit__(*exc)
        after = _torch_counts()
        self.counts = {k: after[k] - self._before[k] for k in after}
        available = self._triton.available
        self.counts["triton_compiles"] = self._triton.total if available else None
        self.counts["triton_cache_hits"] = self._triton.cache_hits if available else None
