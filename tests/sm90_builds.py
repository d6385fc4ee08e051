"""Kernels built for sm_90 (H100 / H200) on a machine without a GPU, for the tests: a script that calls
``benchmarks/kda_intra_build.build_kernel`` and prints one JSON line per kernel runs in a subprocess
outside Triton's interpreter (which runs kernels but never compiles them), with a cold Triton cache."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def build_stats(script: str, tmp_path) -> list[dict]:
    """Runs ``script`` (Python source) and returns the JSON objects of its output lines; skips the test
    where this Triton build has no bundled ptxas / cuobjdump."""
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not all(os.path.exists(os.path.join(tools, t)) for t in ("ptxas", "cuobjdump")):
        pytest.skip("this Triton build has no bundled ptxas / cuobjdump")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=str(tmp_path / "triton"))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
