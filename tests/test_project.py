"""Project wiring: the README commands, CI, the op registry and the self-check command."""

import pathlib
import re

import torch

import hybrid_compile
from hybrid_compile.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_readme_opens_with_main_job_and_test_command_and_ci_runs_the_latter():
    main_job, test_cmd = readme_commands()[:2]
    assert "hybrid-compile" in main_job
    assert "pytest" in test_cmd
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_cmd in ci_lines, "CI must run exactly the README's test command"


def test_every_kernel_op_is_registered_with_a_fake_impl_and_docstring():
    from torch._library.simple_registry import singleton

    for name in hybrid_compile.ops.KERNEL_OPS:
        assert hasattr(torch.ops.hybrid_compile, name), name
        assert singleton.find(f"hybrid_compile::{name}").fake_impl.kernel is not None, f"{name} has no fake impl"
        module_fn = next(
            getattr(m, name) for m in (hybrid_compile.ops.attention, hybrid_compile.ops.conv1d, hybrid_compile.ops.gdn,
                                        hybrid_compile.ops.mamba2, hybrid_compile.ops.norm, hybrid_compile.ops.state,
                                        hybrid_compile.ops.linear, hybrid_compile.ops.metadata,
                                        hybrid_compile.ops.sampling, hybrid_compile.ops.fp8)
            if hasattr(m, name)
        )
        assert len((module_fn.__doc__ or "").strip()) > 100, f"{name} needs a docstring with shapes and dtypes"


def test_selfcheck_command_passes(capsys):
    assert main(["selfcheck", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "11/11 ops match" in out


def test_demo_command_matches_transformers(capsys):
    assert main(["demo", "--num-prompts", "3", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "3/3 prompts give exactly the engine's tokens" in out
    assert "all free again" in out
