"""pytest plugin: append one JSON line per finished test phase to ``$HC_TEST_TIMINGS``.

Loaded by ``scripts/gpu_tests.py`` (``-p pytest_timings``). Lines are written and flushed as
each phase ends (on the controller when pytest-xdist runs workers), so a run stopped at its time
limit still leaves the timings of every test that finished. Each line: ``nodeid``, ``when``
(setup / call / teardown), ``outcome``, ``duration`` (s), ``start`` / ``stop`` (epoch s) and the
xdist ``worker`` ("main" without workers).
"""

from __future__ import annotations

import json
import os

import pytest

_file = None


def pytest_configure(config):
    global _file
    path = os.environ.get("HC_TEST_TIMINGS")
    if path and not hasattr(config, "workerinput"):  # the controller (or a run without xdist) writes
        _file = open(path, "a", buffering=1)


def _write_collected(ids) -> None:
    if _file is not None and ids:
        _file.write(json.dumps(dict(collected=list(ids))) + "\n")


def pytest_collection_finish(session):
    _write_collected(item.nodeid for item in session.items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    _write_collected(ids)  # the controller collects nothing itself; each worker reports the same ids


def pytest_runtest_logreport(report):
    if _file is None:
        return
    line = dict(
        nodeid=report.nodeid,
        when=report.when,
        outcome=report.outcome,
        duration=round(float(getattr(report, "duration", 0.0)), 3),
        start=float(getattr(report, "start", 0.0) or 0.0),
        stop=float(getattr(report, "stop", 0.0) or 0.0),
        worker=_worker(report),
    )
    if report.failed and report.when != "call":
        line["error"] = True
    if report.failed:
        line["message"] = _first_error_line(report)
    _file.write(json.dumps(line) + "\n")


def _worker(report) -> str:
    """The xdist worker id ("gw0", ...) that ran the test, "main" without xdist."""
    gateway = getattr(getattr(report, "node", None), "gateway", None)
    return str(getattr(gateway, "id", None) or getattr(report, "worker_id", None) or "main")


def _first_error_line(report) -> str:
    """The ``E   ...`` line of a failure (the exception), else the last line of its text."""
    text = str(report.longrepr or "")
    errors = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    if errors:
        return errors[0][:300]
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def pytest_unconfigure(config):
    global _file
    if _file is not None:
        _file.close()
        _file = None
