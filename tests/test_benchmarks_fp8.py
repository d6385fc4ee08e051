"""benchmarks/fp8.py runs end to end on CPU with --tiny (bf16 then FP8 on the same toy model).

Speed is not asserted; the JSON's structure is, and that the FP8 run really served FP8 weights
(fewer weight bytes than the bf16 run of the same model)."""

import json
import math
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_tiny_cpu_run(tmp_path):
    out = tmp_path / "fp8.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "fp8.py"), "--tiny", "--device", "cpu", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["env"]["tiny"] and run["env"]["quantize_seconds"] >= 0
    for mode in ("bf16", "fp8"):
        assert set(run[mode]["decode"]) == {"1", "2"} and set(run[mode]["prefill"]) == {"64"}
        # (a difference of two timings of a few toy steps: its sign is noise on a busy CPU)
        assert all(math.isfinite(v["ms_per_step"]) for v in run[mode]["decode"].values())
    assert run["fp8"]["weight_bytes"] < run["bf16"]["weight_bytes"]
    assert "FP8" in proc.stdout and "kernels" not in run  # the kernel table needs CUDA
