"""The GPU suite's runner (scripts/gpu_tests.py, scripts/pytest_timings.py) and the smoke subset.

CPU: the timings plugin logs every test phase of a real pytest run (pass, fail, skip, setup
error) and the per-file table counts them, names each failure with its error line and counts a
test whose lines are missing as not run; the runner refuses to run without CUDA; ``--gpus`` deals
the files out by their seconds and one table counts every shard's tests; every kernel op
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


def test_shards_deal_the_files_by_their_seconds():
    """``--gpus``: files dealt heaviest first onto the least loaded shard (an unknown file weighs the
    known files' median), each shard in the given order; pytest options told from paths; a folder
    expanded into its test files."""
    seconds = {"a": 10.0, "b": 7.0, "c": 5.0, "d": 4.0}
    shards = gpu_tests.plan_shards(["a", "b", "c", "d", "e"], 2, seconds)
    assert sorted(f for s in shards for f in s) == list("abcde")
    assert shards == [["a", "c"], ["b", "d", "e"]]  # 10 + 5 against 7 + 7 + 4 (e: the known median, 7)
    assert gpu_tests.plan_shards(["a"], 3, seconds) == [["a"]]  # no empty shards
    assert gpu_tests.plan_shards(["x", "y", "z"], 2, {}) == [["x", "z"], ["y"]]
    opts, targets = gpu_tests.split_targets(["-k", "qwen3_next or mamba", "tests/test_memory.py",
                                            "tests/test_memory.py::test_x", "-x"])
    assert opts == ["-k", "qwen3_next or mamba", "-x"]
    assert targets == ["tests/test_memory.py", "tests/test_memory.py::test_x"]
    files = gpu_tests.list_test_files(["tests/"])
    assert "tests/test_memory.py" in files and all(os.path.basename(f).startswith("test_") for f in files)


def test_sharded_run_merges_every_shard(tmp_path):
    """Three files of ``gpu`` tests over two shards (``--allow-cpu`` on this CPU machine): each shard
    writes its own folder, the table counts every test of both, the exit status is a failure's."""
    paths = []
    for i in range(3):
        path = tmp_path / f"test_shard{i}.py"
        path.write_text(f"import pytest\n\n\n@pytest.mark.gpu\ndef test_ok{i}():\n    pass\n\n\n"
                        f"@pytest.mark.gpu\ndef test_bad{i}():\n    assert {i} < 2\n")
        paths.append(str(path))
    out = tmp_path / "out"
    rc = gpu_tests.main(["--allow-cpu", "--gpus", "2", "--workers", "1", "--balance", "", "--out", str(out), "--", *paths])
    assert rc == 1
    table = json.loads((out / "timings.json").read_text())
    assert table["totals"]["tests"] == 6 and table["totals"]["passed"] == 5 and table["totals"]["failed"] == 1, table
    assert table["device"].startswith("2 x ")
    assert [f["test"].split("::")[1] for f in table["failures"]] == ["test_bad2"]
    for i in range(2):
        assert (out / f"gpu{i}" / "timings.jsonl").exists() and (out / f"gpu{i}.log").exists()
