"""Test configuration: deterministic seeds, the `gpu` marker that skips without CUDA, the `smoke`
marker of the quick GPU subset, and torch's CPU threads split between pytest-xdist workers."""

import os

import pytest
import torch

# Triton kernels (issue: GPU kernels) run in Triton's interpreter on CPU tensors; this must be set
# before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (scripts/gpu_tests.py runs the GPU suite in several workers on one GPU) each
# worker gets its share of the cores for torch's CPU ops (the plain-torch references the GPU
# tests compare against): every worker at torch's default, one thread per core, oversubscribes
# the cores several times over and made the CPU references of one test take minutes.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
if _WORKERS > 1:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _WORKERS))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped on CPU-only machines")
    config.addinivalue_line("markers", "smoke: the quick GPU subset (every kernel op and engine mode): -m 'gpu and smoke'")
    config.addinivalue_line("markers", "multi_gpu: needs 2 or more CUDA devices (tensor parallelism over NCCL); "
                                       "skipped with fewer")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        # Modules that set INTERPRETER_ONLY = True run Triton launchers on CPU tensors, which only
        # Triton's interpreter can do; on a CUDA machine their `gpu` tests cover the kernels.
        if os.environ.get("TRITON_INTERPRET") != "1":
            skip = pytest.mark.skip(reason="runs Triton's CPU interpreter; the gpu tests cover CUDA here")
            for item in items:
                if getattr(item.module, "INTERPRETER_ONLY", False) and "gpu" not in item.keywords:
                    item.add_marker(skip)
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
