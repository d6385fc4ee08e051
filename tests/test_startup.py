"""Start-up of an engine (``hybrid_compile.engine.startup``): the phases' seconds in
``engine.stats()["startup"]``, the progress bar (shown only when asked for), and the compiled
pieces reused across processes through Inductor's on-disk caches.

Oracles: the wall time measured around ``wrap`` / ``from_pretrained`` here (the phases are parts
of ``total_s``, which is at most that), the phases a configuration runs (an eager CPU engine
compiles, captures and warms up nothing), the backend's own compile seconds (inside the compile
phase), and for the caches a first process on an empty cache directory (every piece a miss) whose
greedy tokens the second process, served from the cache, must reproduce.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import pytest

import hybrid_compile as hc
from checkpoints import save_checkpoint
from engine_models import cached_model, make_engine

ROOT = pathlib.Path(__file__).resolve().parents[1]
PHASE_KEYS = {"load_s", "pools_s", "patch_s", "compile_s", "capture_s", "speculative_s", "warmup_s", "total_s"}


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _check_breakdown(startup: dict, wall: float, ran: set[str]) -> None:
    """The phases in ``ran`` took time, the others none; together they fit in ``total_s``, which
    fits in the wall time measured around the call."""
    assert set(startup) == PHASE_KEYS
    phases = {k: v for k, v in startup.items() if k != "total_s"}
    assert {k for k, v in phases.items() if v > 0} == {f"{p}_s" for p in ran}, startup
    assert sum(phases.values()) <= startup["total_s"] <= wall, (startup, wall)


def test_wrap_is_silent_and_reports_its_phases(capsys):
    model = cached_model("qwen3_next_dense", 0)
    engine, wall = _timed(lambda: make_engine(model))
    with engine:
        _check_breakdown(engine.stats()["startup"], wall, {"pools", "patch"})
        # an eager engine compiles nothing in any phase
        work = engine.stats()["startup_work"]
        assert set(work) == {"pools", "patch"} and all(
            c["dynamo_graphs"] == c["inductor_compiles"] == c["inductor_cache_hits"] == 0 for c in work.values()), work
    out, err = capsys.readouterr()
    assert out == "" and err == ""


def test_progress_bar_names_each_phase(capsys):
    model = cached_model("qwen3_next_dense", 0)
    with make_engine(model, progress=True):
        pass
    lines = capsys.readouterr().err.replace("\r", "\n").splitlines()
    named = [line.rsplit(", ", 1)[-1].rstrip("] ") for line in lines if "phases [" in line and ", " in line]
    # each phase named while it runs, in order, then "ready" over the full bar
    assert [p for i, p in enumerate(named) if i == 0 or named[i - 1] != p] == ["pools", "patch", "ready"], lines
    assert any("2/2 phases" in line and "ready" in line for line in lines), lines


def test_speculative_and_warm_up_phases():
    model = cached_model("qwen3_next_dense", 0)
    engine, wall = _timed(lambda: make_engine(model, warmup_kernels=True,
                                              speculative=dict(method="ngram", num_draft_tokens=2)))
    with engine:
        stats = engine.stats()
    _check_breakdown(stats["startup"], wall, {"pools", "patch", "speculative", "warmup"})
    assert 0 < stats["warmup_kernels_seconds"] <= stats["startup"]["warmup_s"]


def test_compiled_wrap_times_the_compile_phase():
    model = cached_model("qwen3_next_dense", 0)
    engine, wall = _timed(lambda: make_engine(model, compile=True))
    with engine:
        stats = engine.stats()
    startup, compiled = stats["startup"], stats["compile"]
    _check_breakdown(startup, wall, {"pools", "patch", "compile"})
    # the backend (split + Inductor per piece) runs inside the compile phase
    assert 0 < compiled["compile_seconds"] <= startup["compile_s"]
    # what each phase compiled: the trace and the pieces in the compile phase, nothing before it
    work = stats["startup_work"]
    assert set(work) == {"pools", "patch", "compile"}, work
    assert all(work[p]["dynamo_graphs"] == work[p]["inductor_compiles"] == work[p]["inductor_cache_hits"] == 0
               for p in ("pools", "patch")), work
    assert work["compile"]["dynamo_graphs"] >= 1, work
    assert work["compile"]["inductor_compiles"] + work["compile"]["inductor_cache_hits"] == compiled["pieces"], work
    caches = compiled["caches"]
    # every piece looked up once in each of Inductor's caches (hit or miss: this process may have
    # compiled the same model before)
    assert caches["fx_graph_hits"] + caches["fx_graph_misses"] == compiled["pieces"], caches
    assert caches["autograd_hits"] + caches["autograd_misses"] == compiled["pieces"], caches
    assert caches["fx_graph_bypasses"] == caches["autograd_bypasses"] == 0, caches


def test_from_pretrained_shows_and_times_the_load(tmp_path, capsys):
    path = save_checkpoint(tmp_path / "qwen3_next", "qwen3_next", seed=0)
    engine, wall = _timed(lambda: hc.from_pretrained(path, device="cpu", progress=True, max_total_tokens=1024,
                                                     max_running_requests=2))
    with engine:
        _check_breakdown(engine.stats()["startup"], wall, {"load", "pools", "patch"})
    err = capsys.readouterr().err.replace("\r", "\n")
    assert "loading qwen3_next" in err and ", load]" in err and "3/3 phases" in err, err


# ---------------------------------------------------------------------------------------------
# compiled pieces across processes
# ---------------------------------------------------------------------------------------------

def test_second_process_loads_every_piece_from_inductors_cache(tmp_path):
    """Through the start-up benchmark (``benchmarks/startup.py``): two fresh processes wrap its tiny
    reference Qwen3-Next on one cache directory, the first on empty caches."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import startup

    out = tmp_path / "startup.json"
    startup.main(["--tiny", "--device", "cpu", "--runs", "2", "--new-tokens", "6", "--max-running-requests", "2", "--cache-dir",
                  str(tmp_path / "caches"), "--out", str(out), "--timeout", "300"])
    result = json.loads(out.read_text())
    first, second = result["runs"]
    assert (first["caches"], second["caches"]) == ("empty", "warm")
    # each distinct piece goes through Inductor once (repeated layers share theirs)
    pieces = first["compile"]["distinct_pieces"]
    assert first["compile"]["pieces"] == second["compile"]["pieces"] >= pieces == second["compile"]["distinct_pieces"] > 0
    c1, c2 = first["compile"]["caches"], second["compile"]["caches"]
    assert c1["fx_graph_misses"] == pieces and c1["fx_graph_hits"] == 0, c1
    assert c2["fx_graph_hits"] == pieces and c2["fx_graph_misses"] == 0, c2
    assert c2["autograd_hits"] == pieces and c2["autograd_misses"] == 0, c2
    assert c2["fx_graph_bypasses"] == c2["autograd_bypasses"] == 0, c2
    # the phases' report agrees with the caches: compiled in the first process, loaded in the second
    assert first["startup_work"]["compile"]["inductor_compiles"] == pieces, first["startup_work"]
    assert second["startup_work"]["compile"]["inductor_compiles"] == 0, second["startup_work"]
    assert second["startup_work"]["compile"]["inductor_cache_hits"] == pieces, second["startup_work"]
    assert result["tokens_equal"] and all(len(t) == 6 for t in first["tokens"]) and len(first["tokens"]) == 2
    for run in (first, second):
        assert set(run["startup"]) == PHASE_KEYS and run["startup"]["compile_s"] > 0
        assert run["startup"]["total_s"] <= run["wrap_s"] <= run["process_s"], run
        # one Dynamo compile of the forward (no CUDA graphs here), its trace and our backend within the compile phase
        (frame,) = run["dynamo_frames"]
        assert 0 < frame["trace_s"] and 0 < frame["backend_s"], frame
        assert frame["trace_s"] + frame["backend_s"] <= run["startup"]["compile_s"], (frame, run["startup"])


# ---------------------------------------------------------------------------------------------
# our Triton kernels across processes
# ---------------------------------------------------------------------------------------------

_CACHE_HITS_CHILD = r'''
import json, os, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hybrid_compile.compilation.compile_counts import TritonCompiles


@triton.jit
def add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


@triton.jit
def add_two(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 2, mask=offs < n)


add_two.__module__ = "torch._inductor.runtime.compile_tasks.generated"  # as Inductor's kernels are named
seen = []
triton.knobs.compilation.listener = lambda **kw: seen.append(kw["cache_hit"])  # one installed before: chained
target = GPUTarget("cuda", 90, 64)  # an sm_90 build needs no GPU
counts = []
with TritonCompiles() as compiles:
    for kernel in (add_one, add_one, add_two, add_two):
        triton.compile(ASTSource(kernel, {"x_ptr": "*fp32", "n": "i32"}, {"BLOCK": 64}), target=target)
        counts.append(compiles.cache_hits)
print(json.dumps(dict(counts=counts, seen=seen, restored=triton.knobs.compilation.listener is not None
                      and triton.knobs.compilation.listener.__name__ == "<lambda>")))
'''


def test_triton_cache_hits_count_ours_not_inductors(tmp_path):
    """``TritonCompiles.cache_hits`` (``startup_work``'s ``triton_cache_hits``): a kernel compiled a
    second time comes from Triton's on-disk cache and counts; Inductor's kernels (their modules are
    torch's) do not; a listener installed before keeps being called and is restored. Real sm_90
    compiles through Triton (no GPU needed), in a process without the interpreter."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton"), PYTHONPATH=str(ROOT))
    script = tmp_path / "child.py"  # (Triton reads a kernel's source from its file)
    script.write_text(_CACHE_HITS_CHILD)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["counts"] == [0, 1, 1, 1], result  # ours: miss, hit; Inductor-named: miss, hit (not counted)
    assert result["seen"] == [False, True, False, True] and result["restored"], result


def test_our_kernels_use_inductors_ptxas_unless_the_user_set_one(monkeypatch):
    """``ops.triton.use_inductors_ptxas``: the variable Inductor sets before it compiles (its own
    choice, whatever this torch bundles), set at our import so that our kernels' cache keys name one
    assembler in every process; a user's value stays."""
    import os

    import torch._inductor.runtime.compile_tasks as compile_tasks

    from hybrid_compile.ops.triton import use_inductors_ptxas

    monkeypatch.setenv("TRITON_PTXAS_PATH", "/opt/users/ptxas")
    assert use_inductors_ptxas() == "/opt/users/ptxas"
    monkeypatch.delenv("TRITON_PTXAS_PATH")
    compile_tasks._set_triton_ptxas_path.cache_clear()
    compile_tasks._set_triton_ptxas_path()
    inductors = os.environ.pop("TRITON_PTXAS_PATH", None)
    compile_tasks._set_triton_ptxas_path.cache_clear()
    assert use_inductors_ptxas() == inductors == os.environ.get("TRITON_PTXAS_PATH")


@pytest.mark.gpu
def test_our_kernels_come_from_tritons_cache_in_the_next_process(tmp_path):
    """One of our kernels run in a fresh process, then in a second one on the same Triton cache
    directory in which Inductor set its assembler first (as it does when it loads its cached pieces
    before our kernels run): the second compiles nothing, every JIT compile a cache hit. Before our
    import set the assembler, the first process took Triton's ``ptxas`` and the second torch's, and
    every kernel of ours compiled again in every restart after the first (an H200, torch 2.11)."""
    import os
    import subprocess

    child = r'''
import json, sys, torch
if sys.argv[1] == "inductor_first":
    from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path
    _set_triton_ptxas_path()
import hybrid_compile  # noqa: F401
from hybrid_compile.compilation.compile_counts import TritonCompiles
x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
z = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
w = torch.ones(256, device="cuda", dtype=torch.bfloat16)
with TritonCompiles() as compiles:
    torch.ops.hybrid_compile.gated_rms_norm(x, w, z, 1e-6, 64, True)
    torch.cuda.synchronize()
print(json.dumps(dict(compiles=compiles.total, hits=compiles.cache_hits)))
'''
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_PTXAS_PATH")}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton"), PYTHONPATH=str(ROOT))
    results = []
    for order in ("ours_first", "inductor_first"):
        proc = subprocess.run([sys.executable, "-c", child, order], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first, second = results
    assert first["compiles"] >= 1 and first["hits"] == 0, results
    assert second["compiles"] == first["compiles"] and second["hits"] == second["compiles"], results
