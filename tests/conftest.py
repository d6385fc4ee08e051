"""Test configuration: deterministic seeds, and the `gpu` marker that skips without CUDA."""

import os

import pytest
import torch

# Triton kernels (issue: GPU kernels) run in Triton's interpreter on CPU tensors; this must be set
# before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped on CPU-only machines")


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
