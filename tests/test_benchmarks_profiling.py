"""The benchmarks' profile summaries (benchmarks/profiling.py) divide by the forwards they profiled.

``decode_profile`` reports per-step figures of a window of decode ``step()`` calls; with overlap (the
engine's default) the first call also launches the next decode step ahead, so the window holds one
forward more than calls. The oracle: the decode metadata builds (one per forward) counted by wrapping
the engine's batch builder, between the window's start and end; overlap on and off.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

from engine_models import cached_model, make_engine, single_threaded, vocab_size

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import benchmarks.profiling as profiling  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from single_threaded()


@pytest.mark.parametrize("overlap", [True, False])
def test_decode_profile_divides_by_forwards(overlap, monkeypatch):
    model = cached_model("qwen3_next_dense", 0)
    engine = make_engine(model)
    engine.overlap = overlap
    builder = engine.runner.batch_builder
    builds = []
    original_build = builder.build_decode

    def build_decode(*args, **kwargs):
        builds.append(1)
        return original_build(*args, **kwargs)

    monkeypatch.setattr(builder, "build_decode", build_decode)
    window = []
    original_profiled = profiling._profiled

    def profiled(engine, run):
        start = len(builds)
        out = original_profiled(engine, run)
        window.append(len(builds) - start)
        return out

    monkeypatch.setattr(profiling, "_profiled", profiled)
    summary = profiling.decode_profile(engine, batch=1, vocab=vocab_size(model), steps=4)
    engine.close()
    assert window == [summary["steps"]], (window, summary["steps"])
    assert summary["steps"] == (5 if overlap else 4)  # one forward launched ahead with overlap
