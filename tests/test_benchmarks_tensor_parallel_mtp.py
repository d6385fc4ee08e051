"""benchmarks/tensor_parallel.py ``--mtp K`` (speculative decoding by a random MTP head under tensor
parallelism) on CPU: the head written once beside the tiny checkpoint, TP 2 served with its drafts,
the speculative stats in the JSON. (MTP drafts under tensor parallelism themselves:
tests/test_tensor_parallel_mtp.py.)
"""

from __future__ import annotations

import json
import os

from checkout_env import checkout_env


def test_benchmark_mtp_smoke_run(tmp_path):
    """benchmarks/tensor_parallel.py --device cpu --tiny --tp 2 --mtp 2 --mtp-baseline: a random MTP head
    written beside the checkpoint, every decode step a verify step of the head's drafts; the same size
    served without them, the same tokens decoded, and the ratios of the two."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "tp.json"
    cmd = [sys.executable, os.path.join(root, "benchmarks", "tensor_parallel.py"), "--device", "cpu", "--tiny",
           "--tp", "2", "--mtp", "2", "--batches", "2", "--prefill", "24", "--prompt-len", "8", "--new-tokens", "4",
           "--mtp-baseline", "--workdir", str(tmp_path / "ckpt"), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=root,
                          env=checkout_env(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (r,) = json.loads(out.read_text())["results"]
    assert r["tp"] == 2 and r["decode"]["2"]["decode_tokens"] == 2 * 3
    spec = r["speculative"]
    assert spec["method"] == "mtp" and spec["verify_steps"] > 0 and spec["drafted"] == 2 * spec["verified_requests"]
    assert spec["draft_source"]["head_decode_steps"] > 0
    assert os.path.isfile(str(tmp_path / "ckpt" / "tiny_checkpoint_mtp" / "mtp.safetensors"))
    plain, (b, ratio) = r["plain"]["decode"]["2"], *r["mtp_vs_plain"].items()
    assert b == "2" and plain["decode_tokens"] == r["decode"]["2"]["decode_tokens"]
    assert plain["steps"] > 0 and "speculative" not in r["plain"]
    assert abs(ratio["cycle_vs_decode_step"] - ratio["cycle_ms"] / ratio["decode_step_ms"]) < 1e-9
    assert abs(ratio["tok_s_ratio"] - r["decode"]["2"]["tokens_per_s"] / plain["tokens_per_s"]) < 1e-9


def test_sizes_measured_apart_get_the_arguments_less_tp_and_out(monkeypatch):
    """On CUDA each of several ``--tp`` sizes runs the script again with that size alone (a second
    engine of one process would all-reduce on NCCL): its arguments are the caller's without ``--tp``
    and ``--out`` in either spelling."""
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(os.path.join(root, "benchmarks"))
    monkeypatch.setattr(sys, "argv", ["tensor_parallel.py"])
    import tensor_parallel

    argv = ["--shape", "qwen3_next_80b", "--tp", "4,2", "--out=x.json", "--batches", "1,64", "--tp=2"]
    assert tensor_parallel.without_options(argv, ("--tp", "--out")) == ["--shape", "qwen3_next_80b", "--batches",
                                                                        "1,64"]


def test_mtp_baseline_needs_mtp(monkeypatch):
    """``--mtp-baseline`` without ``--mtp K`` is one clear error before anything is built."""
    import sys

    import pytest

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(os.path.join(root, "benchmarks"))
    monkeypatch.setattr(sys, "argv", ["tensor_parallel.py", "--device", "cpu", "--tiny", "--mtp-baseline"])
    import tensor_parallel

    with pytest.raises(SystemExit, match="--mtp-baseline .* needs --mtp K"):
        tensor_parallel.main()
