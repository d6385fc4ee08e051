"""benchmarks/collectives.py runs end to end on CPU (gloo, 2 ranks): a row per size with its time and
bandwidths, the bus bandwidth NCCL's ``2 (n - 1) / n`` of the algorithm bandwidth."""

import json
import pathlib
import subprocess
import sys

from checkout_env import checkout_env

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_cpu_two_ranks(tmp_path):
    out = tmp_path / "collectives.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "collectives.py"), "--device", "cpu", "--ranks", "2",
           "--sizes-mb", "0.01", "0.1", "--iters", "3", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=checkout_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["env"]["backend"] == "gloo" and run["env"]["ranks"] == 2
    rows = run["all_reduce"]
    assert [r["bytes"] for r in rows] == [int(0.01 * 2**20) // 4 * 4, int(0.1 * 2**20) // 4 * 4]
    for r in rows:
        assert r["ms"] > 0 and abs(r["algbw_gb_s"] - r["bytes"] / (r["ms"] / 1e3) / 1e9) < 1e-6 * r["algbw_gb_s"]
        assert abs(r["busbw_gb_s"] - r["algbw_gb_s"]) < 1e-9 * r["algbw_gb_s"]  # 2 (n - 1) / n = 1 at n = 2
    assert "all-reduce over 2 ranks" in proc.stdout
    # no CUDA graph or one-shot columns on the CPU, and the reason the one-shot kernel was not timed
    assert all("nccl_graph_us" not in r and "one_shot_ms" not in r for r in rows)
    assert "symmetric memory needs CUDA devices" in run["env"]["one_shot_unavailable"]
    bad = subprocess.run(cmd[:2] + ["--device", "cpu", "--ranks", "1"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env=checkout_env())
    assert bad.returncode != 0 and "--ranks must be at least 2" in bad.stderr
    for flags in (["--sizes-mb", "0"], ["--iters", "0"], ["--graph-reps", "0"], ["--one-shot-max-mb", "0"]):
        bad = subprocess.run(cmd[:2] + ["--device", "cpu", *flags], capture_output=True, text=True, timeout=120,
                             cwd=ROOT, env=checkout_env())
        assert bad.returncode != 0 and "--sizes-mb must be positive, --iters and --graph-reps at least 1" in bad.stderr
