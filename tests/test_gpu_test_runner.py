"""The GPU suite's runner (scripts/gpu_tests.py, scripts/pytest_timings.py) and the smoke subset.

CPU: the timings plugin logs every test phase of a real pytest run (pass, fail, skip, setup
error) and the per-file table counts them, names each failure with its error line and counts a
test whose lines are missing as not run; the runner refuses to run without CUDA; every kernel op
of ``hybrid_compile.ops.KERNEL_OPS`` is called by some test of the ``gpu and smoke`` subset (a
new op needs a smoke test).
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import hybrid_compile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_tests  # noqa: E402

SAMPLE = '''
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "one is not two"

def test_skips():
    pytest.skip("not here")

def test_setup_error(broken):
    pass
'''


def test_timings_plugin_and_per_file_table(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    log = tmp_path / "timings.jsonl"
    env = dict(os.environ, HC_TEST_TIMINGS=str(log), PYTHONPATH=str(ROOT / "scripts"))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "pytest_timings", "-p", "no:cacheprovider",
                           "test_sample.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert sorted(lines[0]["collected"]) == sorted(f"test_sample.py::{n}" for n in
                                                   ("test_passes", "test_fails", "test_skips", "test_setup_error"))
    phases = {(r["nodeid"].split("::")[1], r["when"]) for r in lines[1:]}
    assert ("test_passes", "teardown") in phases and ("test_fails", "call") in phases

    table = gpu_tests.summarize(str(log), wall=1.0, device="cpu")
    assert table["totals"] == dict(tests=4, passed=1, failed=1, error=1, skipped=1, not_run=0,
                                   seconds=table["totals"]["seconds"])
    [row] = table["files"]
    assert row["file"] == "test_sample.py" and row["tests"] == 4
    failures = {f["test"].split("::")[1]: f["errors"] for f in table["failures"]}
    assert set(failures) == {"test_fails", "test_setup_error"}
    assert "one is not two" in failures["test_fails"][0] and failures["test_fails"][0].startswith("call: ")
    assert "fixture broke" in failures["test_setup_error"][0] and failures["test_setup_error"][0].startswith("setup: ")
    assert "| test_sample.py | 4 | 1 | 1 | 1 | 1 | 0 |" in table["markdown"]

    # a run stopped early: the tests without lines count as not run
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(json.dumps(r) + "\n" for r in lines if "test_setup_error" not in r.get("nodeid", "")))
    assert gpu_tests.summarize(str(cut), wall=1.0)["totals"]["not_run"] == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_runner_refuses_without_cuda():
    with pytest.raises(SystemExit, match="no CUDA device"):
        gpu_tests.main(["--smoke"])


def _smoke_gpu_test_sources() -> dict[str, str]:
    """Source of every test function with a ``smoke`` mark (on the function or on one of its
    parameters) that is also a ``gpu`` test, by ``file::name``."""
    found = {}
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        text = path.read_text()
        for node in ast.parse(text).body:
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test")):
                continue
            marks = " ".join(ast.get_source_segment(text, d) for d in node.decorator_list)
            if "mark.smoke" in marks and "mark.gpu" in marks:
                found[f"{path.name}::{node.name}"] = ast.get_source_segment(text, node)
    return found


def test_smoke_subset_calls_every_kernel_op():
    sources = _smoke_gpu_test_sources()
    assert len(sources) >= 20, sorted(sources)
    text = "\n".join(sources.values())
    missing = [op for op in hybrid_compile.ops.KERNEL_OPS if op not in text]
    assert not missing, f"kernel ops no `gpu and smoke` test calls: {missing}"
    for mode in ("compiled", "full", "piecewise", "both"):  # engine modes: tests/test_cuda_graphs.py
        assert f'"{mode}"' in sources["test_cuda_graphs.py::test_greedy_equal_across_modes"]
