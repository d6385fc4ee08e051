"""benchmarks/fused_moe.py runs end to end on CPU with --tiny (transformers' experts forward vs ours).

Speed is not asserted (a busy CPU; the script is for CUDA); the JSON's structure is, and that our
output matched transformers' eager forward (the script checks it before timing)."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHAPES = ("qwen3_5_35b_a3b", "qwen3_next_80b_a3b", "nemotron3_nano_30b")


def test_tiny_cpu_run(tmp_path):
    out = tmp_path / "fused_moe.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "fused_moe.py"), "--tiny", "--device", "cpu", "--tokens", "1", "4",
           "--iters", "2", "--tp", "2", "--dtype", "float32", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["env"]["tp"] == 2 and run["env"]["device"] == "cpu"
    assert {(r["shape"], r["tokens"]) for r in run["rows"]} == {(s, t) for s in SHAPES for t in (1, 4)}
    for r in run["rows"]:
        assert r["intermediate"] in (16, 20)  # the tiny widths 32 / 40 halved by --tp 2
        assert r["path"] == "plain_torch"  # the op's CPU implementation (on CUDA: moe_path's kernel)
        assert {"hf_eager", "ours"} <= set(r["times"]) and r["times"]["ours"]["ms"] > 0
        assert r["max_abs_diff_vs_eager"] < 1e-4


def test_tiny_tile_sweep_under_the_interpreter(tmp_path):
    """``--sweep --sweep-paths gemv tensor_cores``: every tile of those grids (the GEMV at 1 token) timed for both projections
    of every shape, each output checked against the default's inside the script (it asserts), the
    default first (at 1 token the GEMV, the path the op takes)."""
    out = tmp_path / "sweep.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "fused_moe.py"), "--sweep", "--sweep-paths", "gemv", "tensor_cores",
           "--tiny", "--device", "cpu", "--tokens", "1", "--iters", "1", "--dtype", "float32", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["env"]["sweep"] is True
    assert {(r["shape"], r["projection"]) for r in run["rows"]} == {(s, p) for s in SHAPES for p in ("up", "down")}
    for r in run["rows"]:
        # the default + the tiny grids' 2 tensor-core and 2 GEMV tiles
        assert r["timings"][0] == r["default"] and len(r["timings"]) == 5
        assert r["calls_per_timing"] == 1  # (on CUDA 1 token is timed as 16 calls over 16 routing draws)
        assert r["default"]["path"] == "gemv" and r["default"]["rows_per_program"] == 1
        assert [t["path"] for t in r["timings"][1:]] == ["tensor_cores"] * 2 + ["gemv"] * 2
        assert [t.get("rows_per_program") for t in r["timings"][3:]] == [1, 2]
        assert all(t["ms"] > 0 for t in r["timings"]) and r["best"]["ms"] <= r["default"]["ms"]
        assert set(r["best_by_path"]) == {"gemv", "tensor_cores"}


def test_sweep_on_cpu_without_the_interpreter_says_how():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fused_moe.py"), "--sweep", "--tiny", "--device",
                           "cpu"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert proc.returncode != 0 and "TRITON_INTERPRET=1" in proc.stderr


def test_sweep_of_one_path_and_one_shape(tmp_path):
    """``--sweep-paths gemv_by_expert --shapes ...``: the default (the row GEMV at 1 token), then only the
    by-expert GEMV's grid, for the shape asked; ``--sweep-paths`` without ``--sweep`` is an error."""
    out = tmp_path / "sweep.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "fused_moe.py"), "--sweep", "--sweep-paths", "gemv_by_expert", "--shapes",
           "qwen3_next_80b_a3b", "--tiny", "--device", "cpu", "--tokens", "1", "--iters", "1", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert {(r["shape"], r["projection"]) for r in run["rows"]} == {("qwen3_next_80b_a3b", p) for p in ("up", "down")}
    for r in run["rows"]:
        # the default + the tiny by-expert grid's one tile (2 rows a pass)
        assert [(t["path"], t["rows_per_program"]) for t in r["timings"]] == [("gemv", 1), ("gemv_by_expert", 2)]
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fused_moe.py"), "--sweep-paths", "gemv",
                           "--tiny", "--device", "cpu"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0 and "pass --sweep too" in proc.stderr
