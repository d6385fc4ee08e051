"""benchmarks/fused_moe.py runs end to end on CPU with --tiny (transformers' experts forward vs ours).

Speed is not asserted (a busy CPU; the script is for CUDA); the JSON's structure is, and that our
output matched transformers' eager forward (the script checks it before timing)."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_tiny_cpu_run(tmp_path):
    out = tmp_path / "fused_moe.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "fused_moe.py"), "--tiny", "--device", "cpu", "--tokens", "1", "4",
           "--iters", "2", "--tp", "2", "--dtype", "float32", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["env"]["tp"] == 2 and run["env"]["device"] == "cpu"
    assert {(r["shape"], r["tokens"]) for r in run["rows"]} == {
        (s, t) for s in ("qwen3_5_35b_a3b", "nemotron3_nano_30b") for t in (1, 4)}
    for r in run["rows"]:
        assert r["intermediate"] in (16, 20)  # the tiny widths 32 / 40 halved by --tp 2
        assert {"hf_eager", "ours"} <= set(r["times"]) and r["times"]["ours"]["ms"] > 0
        assert r["max_abs_diff_vs_eager"] < 1e-4
