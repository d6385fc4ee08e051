"""The KDA (per-channel gate) chunked-prefill intra kernel builds for sm_90 (H100 / H200) at the
launch settings the GPU tests run (``gdn_chunk.CONFIG``'s default and the others of
``tests/test_triton_kda.py::test_gpu_chunk_prefill_matches_torch_op``), on a machine without a GPU:
``benchmarks/kda_intra_build.py`` in a subprocess without Triton's interpreter. The interpreter
runs the kernels but not Triton's compiler (a loop-carried variable changing shape at BK 32 passed
it and failed the build). The sequential state kernel builds within sm_90's shared memory per block
at the launcher's setting for every input dtype (three pipeline stages of fp32 tiles at K = 128 did
not: an fp16 Kimi-Linear prefill failed to launch on an H200)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SM90_SHARED_PER_BLOCK = 232448  # bytes (227 KB), what a block may opt in to on H100 / H200


def _build(args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kda_intra_build.py"), *args], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.parametrize("args", [["--configs", "16/2,16/4,32/8"], ["--fp32", "--configs", "16/2"]], ids=["bf16", "fp32"])
def test_kda_intra_kernel_builds_for_sm90(args):
    out = _build(args)
    n = len(args[-1].split(","))
    rows = re.findall(r"BK +(\d+) / (\d+) warps: (\d+) regs, spills (\d+) B stored", out.stdout)
    assert len(rows) == n, out.stdout
    assert all(0 < int(r[2]) <= 255 for r in rows)


@pytest.mark.parametrize("args", [["--fp16"], ["--fp32"], ["--gdn", "--fp16"]], ids=["kda-fp16", "kda-fp32", "gdn-fp16"])
def test_state_kernel_fits_sm90_shared_memory(args):
    out = _build(["--kernel", "state", *args])
    shared = [int(x) for x in re.findall(r"(\d+) B shared", out.stdout)]
    assert len(shared) == 1, out.stdout
    assert 0 < shared[0] <= SM90_SHARED_PER_BLOCK, out.stdout
