"""benchmarks/kernels.py and benchmarks/profile_gdn_chunk.py need a GPU to run, so their op calls are
checked here against the ops' signatures: every ``ops.<name>(...)`` call (``torch.ops.hybrid_compile``) and every
``plain(<module>.<name>)(...)`` call (the plain-torch implementation) binds, with the arguments it
passes, to the op's schema / Python signature. (An H100 run found the plain rows of the GDN and
Mamba2 ops failing on arguments the ops had gained since.)"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import hybrid_compile  # noqa: F401  (registers the ops)
from hybrid_compile.ops.registration import KernelOp

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
SOURCES = ("kernels.py", "profile_gdn_chunk.py")
sys.path.insert(0, str(BENCHMARKS))
KERNELS = importlib.import_module("kernels")
sys.path.remove(str(BENCHMARKS))


def _calls(source: str):
    """(line, kind, target, positional count, keyword names) of the op calls in a benchmark;
    kind ``op``: target an op name; kind ``plain``: target (module, function)."""
    tree = ast.parse((BENCHMARKS / source).read_text())
    modules = {a.asname or a.name: f"{node.module}.{a.name}" for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and node.module == "hybrid_compile.ops" for a in node.names}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        kw = [k.arg for k in node.keywords]
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "ops":
            out.append((f"{source}:{node.lineno}", "op", f.attr, _positional(node.args), kw))
        elif (isinstance(f, ast.Call) and isinstance(f.func, ast.Name) and f.func.id == "plain"
              and isinstance(f.args[0], ast.Attribute) and isinstance(f.args[0].value, ast.Name)):
            out.append((f"{source}:{node.lineno}", "plain", (modules[f.args[0].value.id], f.args[0].attr),
                        _positional(node.args), kw))
    return out


def _positional(args) -> int:
    """How many positional arguments a call passes: a ``*x[a:b]`` star of a constant slice counts
    ``b - a`` (the benchmarks pass packed inputs that way); any other star fails the test."""
    n = 0
    for a in args:
        if not isinstance(a, ast.Starred):
            n += 1
            continue
        sl = a.value.slice if isinstance(a.value, ast.Subscript) else None
        assert isinstance(sl, ast.Slice) and isinstance(sl.upper, ast.Constant), ast.unparse(a)
        n += sl.upper.value - (sl.lower.value if sl.lower is not None else 0)
    return n


CALLS = [c for source in SOURCES for c in _calls(source)]


def test_the_benchmarks_have_op_calls_of_both_kinds():
    assert {c[1] for c in _calls("kernels.py")} == {"op", "plain"} and len(CALLS) >= 20
    assert any(c[0].startswith("profile_gdn_chunk.py") for c in CALLS)


@pytest.mark.parametrize("line,kind,target,npos,kw", CALLS, ids=[c[0] for c in CALLS])
def test_call_binds_to_the_op(line, kind, target, npos, kw):
    if kind == "plain":
        module, name = target
        # through kernels.plain itself: the plain function must be reachable from the registered op
        fn = KERNELS.plain(getattr(importlib.import_module(module), name))
        assert not isinstance(fn, KernelOp), f"line {line}: plain({name}) is still the op"
        inspect.signature(fn).bind(*[None] * npos, **dict.fromkeys(kw))
        return
    schema = getattr(torch.ops.hybrid_compile, target).default._schema
    names = [a.name for a in schema.arguments]
    assert npos <= len(names), f"line {line}: {npos} positional arguments, {target} takes {len(names)}"
    assert set(kw) <= set(names[npos:]), f"line {line}: keywords {kw} not among {target}'s {names[npos:]}"
    given = set(names[:npos]) | set(kw)
    missing = [a.name for a in schema.arguments if a.name not in given and not a.has_default_value()]
    assert not missing, f"line {line}: {target} called without {missing}"


def test_chunk_config_overrides_gdn_chunk_config(monkeypatch):
    """``benchmarks/kernels.py --chunk-config``: gdn_chunk.CONFIG overrides (the KDA intra kernel's
    variants, one run each), unknown keys and non-objects refused."""
    from hybrid_compile.ops.triton import gdn_chunk

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    for key in gdn_chunk.CONFIG:
        monkeypatch.setitem(gdn_chunk.CONFIG, key, gdn_chunk.CONFIG[key])  # restored afterwards
    kernels = importlib.import_module("kernels")
    assert kernels.apply_chunk_config('{"kda_intra_bk": 32, "kda_intra_warps": 8}') == {"kda_intra_bk": 32,
                                                                                        "kda_intra_warps": 8}
    assert gdn_chunk.CONFIG["kda_intra_bk"] == 32 and gdn_chunk.CONFIG["kda_intra_warps"] == 8
    with pytest.raises(SystemExit, match="unknown key.*kda_intra_bkk"):
        kernels.apply_chunk_config('{"kda_intra_bkk": 32}')
    with pytest.raises(SystemExit, match="JSON object"):
        kernels.apply_chunk_config("[16]")


@pytest.mark.parametrize("args,message", [
    (["--sweep", '[{}, {"kda_intra_wraps": 8}]'], "--sweep: unknown key.*kda_intra_wraps"),
    (["--sweep", '{"kda_intra_warps": 8}'], "--sweep: a JSON list"),
    (["--cfg", '{"state_bvv": 32}'], "--cfg: unknown key.*state_bvv"),
])
def test_profile_gdn_chunk_refuses_unknown_config_keys(args, message):
    """``benchmarks/profile_gdn_chunk.py --sweep`` / ``--cfg``: an override of a key gdn_chunk.CONFIG
    does not have is an error before anything runs (it was silently ignored), no GPU needed."""
    run = subprocess.run([sys.executable, str(BENCHMARKS / "profile_gdn_chunk.py"), *args],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert re.search(message, run.stderr), run.stderr[-2000:]
