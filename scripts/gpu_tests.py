"""Run the GPU test suite (or its smoke subset) in one command; write JUnit XML and a per-file timing table.

    python scripts/gpu_tests.py [--smoke] [--workers N] [--out DIR] [--time-limit S] [--cold]
                                [-- extra pytest arguments]

What it runs: ``python -m pytest -m gpu tests/`` (``-m "gpu and smoke"`` with ``--smoke``) with
this checkout on ``PYTHONPATH`` (so the tree's package is tested even where another copy is
installed), ``pytest-xdist`` workers sharing the one GPU (``--dist loadgroup``: each free worker takes
the next tests, those marked ``xdist_group`` stay together on one worker; ``tests/conftest.py`` gives each worker its share of the CPU threads), a
``pytest-timeout`` limit per test when asked, and the ``pytest_timings`` plugin beside this file,
which logs every test phase as it ends.

What it writes under ``--out``: ``junit.xml`` (pytest's), ``pytest.log`` (the whole output),
``timings.jsonl`` (one line per test phase), ``timings.md`` / ``timings.json`` (the per-file
table printed at the end: tests, passed / failed / skipped / not run, summed test seconds, wall
span, slowest test; then every failure with its error line).

Workers share the Triton and Inductor on-disk caches (their default directories, or fresh empty
ones with ``--cold``, which measures a first run on a fresh machine), so a kernel variant or a
compiled graph is built once per run, not once per worker. ``--time-limit`` stops pytest with
SIGINT (pytest still writes the JUnit XML of what ran) and then kills it; the table is built
from ``timings.jsonl`` either way. The exit status is pytest's (124 when the time limit hit).
Needs a CUDA device.

``--gpus N`` (0: every visible device) splits the test files over N GPUs: one run of this script
per GPU (``CUDA_VISIBLE_DEVICES`` = that one, its own ``--workers``, out folder ``gpuI`` and time
limit), the files dealt out by their summed test seconds of an earlier run (``--balance``, default
``benchmarks/results/gpu_tests/file_seconds.json``; a file it lacks counts as their median),
heaviest first onto the least loaded GPU; then one table over all of them. A test that needs
several GPUs (``multi_gpu``) sees one in a shard and skips: run those on all GPUs apart.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))


def _has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def pytest_command(args, out: str) -> list[str]:
    marker = "gpu and smoke" if args.smoke else "gpu"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", marker, "-p", "pytest_timings", "-p", "no:cacheprovider",
           f"--junitxml={os.path.join(out, 'junit.xml')}", "-rfE", "--durations=25"]
    if args.workers > 1:
        if not _has_module("xdist"):
            raise SystemExit(f"--workers {args.workers} needs pytest-xdist (pip install pytest-xdist), or pass --workers 1")
        # loadgroup: like load, except that tests marked xdist_group(name) share one worker (the
        # tensor-parallel GPU tests share one group of spawned ranks over every GPU of the host)
        cmd += ["-n", str(args.workers), "--dist", "loadgroup"]
    if args.test_timeout > 0:
        if not _has_module("pytest_timeout"):
            raise SystemExit("--test-timeout needs pytest-timeout (pip install pytest-timeout), or pass --test-timeout 0")
        cmd += [f"--timeout={args.test_timeout}"]
    return cmd + list(args.pytest_args or ["tests/"])


BALANCE = os.path.join(ROOT, "benchmarks", "results", "gpu_tests", "file_seconds.json")


def split_targets(pytest_args: list[str]) -> tuple[list[str], list[str]]:
    """(pytest options, test paths) of the pytest arguments: a path is an argument naming an
    existing file or folder (from the checkout's root), ``::`` node ids included."""
    options, targets = [], []
    for a in pytest_args:
        path = a.split("::")[0]
        (targets if path and os.path.exists(os.path.join(ROOT, path)) else options).append(a)
    return options, targets


def list_test_files(targets: list[str]) -> list[str]:
    """Every test file the targets name: a folder's ``test_*.py`` files (sorted), files as given."""
    files = []
    for t in targets:
        full = os.path.join(ROOT, t.split("::")[0])
        if os.path.isdir(full):
            files += sorted(os.path.relpath(os.path.join(full, f), ROOT) for f in os.listdir(full)
                            if f.startswith("test_") and f.endswith(".py"))
        else:
            files.append(t)
    return files


def plan_shards(files: list[str], n: int, seconds: dict[str, float]) -> list[list[str]]:
    """``files`` dealt out to at most ``n`` shards, heaviest first onto the least loaded one (a file's
    weight: its ``seconds``, else the median of those known, else 1); each shard keeps the files'
    given order. Empty shards are dropped."""
    known = sorted(seconds[f.split("::")[0]] for f in files if f.split("::")[0] in seconds)
    default = known[len(known) // 2] if known else 1.0
    weight = {f: seconds.get(f.split("::")[0], default) for f in files}
    loads, shards = [0.0] * n, [[] for _ in range(n)]
    for f in sorted(files, key=lambda f: -weight[f]):
        i = loads.index(min(loads))
        shards[i].append(f)
        loads[i] += weight[f]
    order = {f: i for i, f in enumerate(files)}
    return [sorted(s, key=order.get) for s in shards if s]


def run_sharded(args, out: str, gpus: int) -> int:
    """``--gpus``: this script once per GPU over its share of the files, then one table (module docstring)."""
    import torch

    options, targets = split_targets(list(args.pytest_args or ["tests/"]))
    seconds = {}
    if args.balance and os.path.exists(args.balance):
        with open(args.balance) as f:
            seconds = json.load(f)["seconds"]
    shards = plan_shards(list_test_files(targets or ["tests/"]), gpus, seconds)
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    visible = visible or [str(i) for i in range(torch.cuda.device_count() if torch.cuda.is_available() else gpus)]
    if len(visible) < len(shards):
        raise SystemExit(f"gpu_tests: --gpus {gpus} needs {len(shards)} devices, {len(visible)} visible")
    started = time.time()
    procs = []
    for i, files in enumerate(shards):
        sub = os.path.join(out, f"gpu{i}")
        cmd = [sys.executable, os.path.abspath(__file__), "--workers", str(args.workers), "--out", sub,
               "--time-limit", str(args.time_limit), "--test-timeout", str(args.test_timeout)]
        cmd += [flag for flag, on in (("--smoke", args.smoke), ("--cold", args.cold), ("--allow-cpu", args.allow_cpu))
                if on]
        print(f"gpu_tests: GPU {visible[i]}: {len(files)} files", flush=True)
        log = open(os.path.join(out, f"gpu{i}.log"), "w")
        procs.append((subprocess.Popen(cmd + ["--"] + options + files, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                       env=dict(os.environ, CUDA_VISIBLE_DEVICES=visible[i])), log))
    codes = []
    for proc, log in procs:
        codes.append(proc.wait())
        log.close()
    merged = os.path.join(out, "timings.jsonl")
    with open(merged, "w") as f:
        for i in range(len(shards)):
            part = os.path.join(out, f"gpu{i}", "timings.jsonl")
            if os.path.exists(part):
                with open(part) as p:
                    f.write(p.read())
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    timed_out = 124 in codes
    table = summarize(merged, wall=time.time() - started, device=f"{len(shards)} x {device}",
                      command=[sys.executable, os.path.abspath(__file__), "--gpus", str(gpus)], timed_out=timed_out)
    _write_table(out, table)
    return 124 if timed_out else max(codes, default=0)


def _write_table(out: str, table: dict) -> None:
    with open(os.path.join(out, "timings.md"), "w") as f:
        f.write(table["markdown"])
    with open(os.path.join(out, "timings.json"), "w") as f:
        json.dump({k: v for k, v in table.items() if k != "markdown"}, f, indent=1)
    print("\n" + table["markdown"], flush=True)


def run(args) -> int:
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        raise SystemExit("gpu_tests: no CUDA device here; the gpu tests only skip on a CPU machine")
    out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="hc-gpu-tests-"))
    os.makedirs(out, exist_ok=True)
    gpus = args.gpus or (torch.cuda.device_count() if torch.cuda.is_available() else 1)
    if gpus > 1:
        return run_sharded(args, out, gpus)
    timings = os.path.join(out, "timings.jsonl")
    if os.path.exists(timings):
        os.remove(timings)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, HERE] + [p for p in [env.get("PYTHONPATH")] if p])
    env["HC_TEST_TIMINGS"] = timings
    env["PYTHONUNBUFFERED"] = "1"
    if args.workers > 1:
        # Inductor's pool of compile processes: a share of the cores per worker, not all of them each
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, len(os.sched_getaffinity(0)) // args.workers)))
    if args.cold:
        caches = tempfile.mkdtemp(prefix="hc-gpu-tests-caches-")
        env["TRITON_CACHE_DIR"] = os.path.join(caches, "triton")
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(caches, "inductor")
    cmd = pytest_command(args, out)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"gpu_tests: {device}; torch {torch.__version__}; out {out}\n  {' '.join(cmd)}", flush=True)

    started = time.time()
    timed_out = False
    with open(os.path.join(out, "pytest.log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1, start_new_session=True)
        deadline = started + args.time_limit if args.time_limit > 0 else None

        def pump():
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        while proc.poll() is None:
            if deadline is not None and time.time() > deadline and not timed_out:
                timed_out = True
                print(f"\ngpu_tests: time limit {args.time_limit:.0f} s reached: stopping pytest", flush=True)
                os.killpg(proc.pid, signal.SIGINT)  # pytest writes its JUnit XML on an interrupt
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
            time.sleep(0.5)
        reader.join(timeout=10)
    wall = time.time() - started
    table = summarize(timings, wall=wall, device=device, command=cmd, timed_out=timed_out)
    _write_table(out, table)
    return 124 if timed_out else proc.returncode


def summarize(path: str, *, wall: float, device: str = "", command=(), timed_out: bool = False) -> dict:
    """Per-file table from a ``timings.jsonl`` of the ``pytest_timings`` plugin."""
    tests: dict[str, dict] = {}
    collected: set[str] = set()
    if os.path.exists(path):
        with open(path) as f:
            for raw in f:
                rec = json.loads(raw)
                if "collected" in rec:
                    collected.update(rec["collected"])
                    continue
                t = tests.setdefault(rec["nodeid"], dict(seconds=0.0, outcome="passed", start=None, stop=None))
                t["seconds"] += rec["duration"]
                if rec.get("start"):
                    t["start"] = rec["start"] if t["start"] is None else min(t["start"], rec["start"])
                    t["stop"] = max(t["stop"] or 0.0, rec["stop"])
                if rec["outcome"] == "failed":
                    t["outcome"] = "error" if rec.get("error") and t["outcome"] != "failed" else "failed"
                    t.setdefault("messages", []).append(f"{rec['when']}: {rec.get('message', '')}")
                elif rec["outcome"] == "skipped" and t["outcome"] == "passed":
                    t["outcome"] = "skipped"
    per_file: dict[str, dict] = {}
    for nodeid in sorted(collected | set(tests)):
        fname = nodeid.split("::")[0]
        row = per_file.setdefault(fname, dict(file=fname, tests=0, passed=0, failed=0, error=0, skipped=0, not_run=0,
                                               seconds=0.0, start=None, stop=None, slowest="", slowest_s=0.0))
        row["tests"] += 1
        t = tests.get(nodeid)
        if t is None:
            row["not_run"] += 1
            continue
        row[t["outcome"]] += 1
        row["seconds"] += t["seconds"]
        if t["start"] is not None:
            row["start"] = t["start"] if row["start"] is None else min(row["start"], t["start"])
            row["stop"] = max(row["stop"] or 0.0, t["stop"])
        if t["seconds"] > row["slowest_s"]:
            row["slowest"], row["slowest_s"] = nodeid.split("::", 1)[-1], t["seconds"]
    rows = sorted(per_file.values(), key=lambda r: -r["seconds"])
    for r in rows:
        r["wall_span"] = (r["stop"] - r["start"]) if r["start"] is not None else 0.0
        r.pop("start"), r.pop("stop")
    total = collections.Counter()
    for r in rows:
        for k in ("tests", "passed", "failed", "error", "skipped", "not_run"):
            total[k] += r[k]
        total["seconds"] += r["seconds"]
    failures = [(n, t.get("messages", [])) for n, t in sorted(tests.items()) if t["outcome"] in ("failed", "error")]

    lines = [f"GPU test timings ({device}); wall {wall:.0f} s{' (time limit hit)' if timed_out else ''}; "
             f"{total['passed']} passed, {total['failed']} failed, {total['error']} errors, {total['skipped']} skipped, "
             f"{total['not_run']} not run of {total['tests']}; summed test time {total['seconds']:.0f} s", "",
             "| file | tests | pass | fail | err | skip | not run | test s | wall span s | slowest test (s) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['file']} | {r['tests']} | {r['passed']} | {r['failed']} | {r['error']} | {r['skipped']} | "
                     f"{r['not_run']} | {r['seconds']:.1f} | {r['wall_span']:.1f} | {r['slowest']} ({r['slowest_s']:.1f}) |")
    lines.append(f"| **total** | {total['tests']} | {total['passed']} | {total['failed']} | {total['error']} | "
                 f"{total['skipped']} | {total['not_run']} | {total['seconds']:.1f} | {wall:.1f} | |")
    if failures:
        lines += ["", "Failures:"]
        for n, msgs in failures:
            lines.append(f"- {n}: " + " / ".join(msgs))
    return dict(device=device, wall_seconds=wall, timed_out=timed_out, command=list(command), totals=dict(total),
                files=rows, failures=[dict(test=n, errors=m) for n, m in failures], markdown="\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help='only the smoke subset (-m "gpu and smoke")')
    p.add_argument("--workers", "-n", type=int, default=8,
                   help="pytest-xdist workers sharing the GPU (default 8; 1 = no xdist)")
    p.add_argument("--out", help="folder for junit.xml, pytest.log and the timing table (default: a new temp folder)")
    p.add_argument("--time-limit", type=float, default=0, help="stop pytest after this many seconds (0 = none)")
    p.add_argument("--test-timeout", type=float, default=0,
                   help="pytest-timeout limit per test in seconds (0 = none; needs pytest-timeout)")
    p.add_argument("--cold", action="store_true", help="fresh empty Triton / Inductor caches (a fresh machine's cost)")
    p.add_argument("--gpus", type=int, default=1,
                   help="split the test files over this many GPUs, one run per GPU (0: every visible one; module docstring)")
    p.add_argument("--balance", default=BALANCE,
                   help="--gpus: JSON {'seconds': {file: seconds}} of an earlier run to deal the files out by")
    p.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("pytest_args", nargs="*", help="instead of tests/: paths or pytest options (after --)")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
