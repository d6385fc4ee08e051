"""Project wiring: the README commands, CI, the op registry, the self-check command and the
package's import graph (no cycle, the layers of the architecture)."""

import ast
import pathlib
import re
import subprocess
import sys

import torch
from checkout_env import checkout_env

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
    if re.search(r"\s-n\s", test_cmd):  # (pytest-xdist workers: the extras the command installs must hold it)
        extras = re.search(r'install -e "\.\[([^\]]*)\]"', test_cmd).group(1).split(",")
        pyproject = (ROOT / "pyproject.toml").read_text()
        assert any(re.search(rf"^{e} = \[[^\]]*pytest-xdist", pyproject, re.S | re.M) for e in extras), extras


def test_every_kernel_op_is_registered_with_a_fake_impl_and_docstring():
    from torch._library.simple_registry import singleton

    for name in hybrid_compile.ops.KERNEL_OPS:
        assert hasattr(torch.ops.hybrid_compile, name), name
        assert singleton.find(f"hybrid_compile::{name}").fake_impl.kernel is not None, f"{name} has no fake impl"
        module_fn = next(
            getattr(m, name) for m in (hybrid_compile.ops.attention, hybrid_compile.ops.conv1d, hybrid_compile.ops.gdn,
                                        hybrid_compile.ops.lightning,
                                        hybrid_compile.ops.mamba1, hybrid_compile.ops.mamba2, hybrid_compile.ops.norm,
                                        hybrid_compile.ops.state,
                                        hybrid_compile.ops.linear, hybrid_compile.ops.metadata,
                                        hybrid_compile.ops.sampling, hybrid_compile.ops.fp8, hybrid_compile.ops.moe,
                                        hybrid_compile.ops.moe_router)
            if hasattr(m, name)
        )
        assert len((module_fn.__doc__ or "").strip()) > 100, f"{name} needs a docstring with shapes and dtypes"


def _ops_with_defaulted_mutated_args(namespace: str = "hybrid_compile") -> list[str]:
    import hybrid_compile.layers  # noqa: F401  (registers the layer-level ops too)

    found = []
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith(f"{namespace}::"):
            continue
        schema = torch._C._get_schema(name, "")
        for arg in schema.arguments:
            if arg.alias_info is not None and arg.alias_info.is_write and arg.has_default_value():
                found.append(f"{name}({arg.name})")
    return found


def test_no_op_gives_a_mutated_argument_a_default():
    """torch 2.11 (the GPU machine's) hands a Python kernel the arguments without the trailing ones equal to
    their defaults, and then bumps the version of each mutated argument by its position: a mutated argument
    with a default (``ssm_scales=None``) raises ``IndexError: tuple index out of range`` there. So every
    mutated argument is required; this walks every registered ``hybrid_compile::`` schema."""
    found = _ops_with_defaulted_mutated_args()
    assert len(torch._C._dispatch_get_all_op_names()) > 0
    assert not found, f"mutated arguments with a default (make them required): {found}"


def test_the_mutated_default_check_can_fail():
    lib = torch.library.Library("hybrid_compile_selftest", "FRAGMENT")
    lib.define("defaulted_mutation(Tensor x, Tensor(a!)? out=None) -> ()")
    found = _ops_with_defaulted_mutated_args("hybrid_compile_selftest")
    assert found == ["hybrid_compile_selftest::defaulted_mutation(out)"]

def _jit_string_defaults(files) -> list[str]:
    """``function(param)`` of every ``@triton.jit`` function in ``files`` whose parameter has a string default."""
    found = []
    for path in files:
        for node in ast.walk(ast.parse(pathlib.Path(path).read_text())):
            if not isinstance(node, ast.FunctionDef) or not any("jit" in ast.unparse(d) for d in node.decorator_list):
                continue
            args = node.args.posonlyargs + node.args.args
            defaults = [None] * (len(args) - len(node.args.defaults)) + node.args.defaults
            pairs = list(zip(args, defaults)) + list(zip(node.args.kwonlyargs, node.args.kw_defaults))
            found += [f"{node.name}({a.arg})" for a, d in pairs
                      if isinstance(d, ast.Constant) and isinstance(d.value, str)]
    return found


def test_no_triton_helper_has_a_string_default():
    """Triton 3.6 (the GPU machine's) passes a ``@triton.jit`` helper's string default through unwrapped
    (``AttributeError: 'str' object has no attribute 'type'`` at compile), where the interpreter and newer
    Triton accept it: every step kernel calling ``store_state_rows`` without its ``CACHE=""`` argument failed
    on the GPU that way. Flags and ints only; this walks every kernel module."""
    files = sorted((ROOT / "hybrid_compile").rglob("*.py"))
    assert any("triton.jit" in f.read_text() for f in files)
    found = _jit_string_defaults(files)
    assert not found, f"@triton.jit parameters with a string default (use a flag): {found}"


def test_the_jit_string_default_check_can_fail(tmp_path):
    src = tmp_path / "k.py"
    src.write_text("import triton\n@triton.jit\ndef f(x, A: tl.constexpr = 1, C: tl.constexpr = ''):\n    pass\n")
    assert _jit_string_defaults([src]) == ["f(C)"]


def test_selfcheck_command_passes(capsys):
    assert main(["selfcheck", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "24/24 ops match" in out  # (the six verify ops over draft trees, windowed tree attention, KDA / MLA, lightning)


def test_demo_command_matches_transformers(capsys):
    assert main(["demo", "--num-prompts", "3", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "3/3 prompts give exactly the engine's tokens" in out
    assert "all free again" in out


# -- the import graph -----------------------------------------------------------------------------
#
# The package's parts, lowest layer first: the architecture's ops -> memory -> cache/layers ->
# compilation/models -> engine, then what is built on the engine. A part is a top-level subpackage or
# top-level module of hybrid_compile ("__init__": the package root, which re-exports the API).
# quantization (FP8 linear modules, FP8 checkpoint reading) imports only ops and is used by models
# and engine; distributed (tensor parallelism) and serving (the async engine, the OpenAI server)
# drive an engine; loading builds one (wrap, from_pretrained); demo, cli (which runs the demo)
# and __main__ (which runs the cli) are the entry points.
LAYERS = [
    {"ops"},
    {"memory"},
    {"cache", "layers", "quantization"},
    {"compilation", "models"},
    {"engine"},
    {"distributed", "serving"},
    {"loading"},
    {"__init__"},
    {"demo"},
    {"cli"},
    {"__main__"},
]
# The rule: every import of a hybrid_compile module counts as an edge of the graph, wherever it
# is: at module level, under ``if TYPE_CHECKING:`` (a type-only import is still a dependency) or
# inside a function (deferred is still a dependency), except an import inside a function whose
# line carries a ``# lazy: <reason>`` comment (a deliberate break of a layering edge, or an
# optional dependency). Importing ``a.b.c`` also runs the ``__init__`` of the packages ``a.b`` /
# ``a`` that are not packages of the importer itself, so those are edges too. On that graph:
# no cycle at all, and an import across parts goes to a strictly lower layer.
LAZY_MARK = "# lazy:"


def _package_modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in sorted((ROOT / "hybrid_compile").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _part(module: str) -> str:
    names = module.split(".")
    return "__init__" if len(names) == 1 else names[1]


def _import_edges(module: str, path: pathlib.Path, modules: dict) -> list[tuple[str, int, str]]:
    """``(imported module, line, where)`` of every counted import of ``module`` (``where``:
    module / type-checking / function); a ``# lazy:`` import is left out (and must be in a
    function)."""
    source = path.read_text()
    lines = source.splitlines()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    ancestors = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
    edges = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inner = "function"
            elif isinstance(child, ast.If) and where == "module" and "TYPE_CHECKING" in ast.unparse(child.test):
                inner = "type-checking"
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                if isinstance(child, ast.Import):
                    targets = [alias.name for alias in child.names]
                else:
                    base = child.module or ""
                    if child.level:
                        pkg = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                        base = ".".join(pkg + ([child.module] if child.module else []))
                    # `from p import m` imports the module p.m when there is one, else names of p
                    targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in child.names]
                targets = [t for t in targets if t in modules]
                if not targets:
                    continue
                text = "\n".join(lines[child.lineno - 1: child.end_lineno])
                if LAZY_MARK in text:
                    assert inner == "function", (
                        f"{path.relative_to(ROOT)}:{child.lineno}: a '{LAZY_MARK}' import must be inside a function")
                    continue
                for target in targets:
                    names = target.split(".")
                    parents = {".".join(names[:i]) for i in range(1, len(names))} - ancestors
                    for t in sorted(parents) + [target]:
                        if t != module:
                            edges.append((t, child.lineno, inner))
            visit(child, inner)

    visit(ast.parse(source), "module")
    return edges


def _import_graph() -> tuple[dict, dict]:
    modules = _package_modules()
    graph, sites = {}, {}
    for module, path in modules.items():
        graph[module] = set()
        for target, line, where in _import_edges(module, path, modules):
            graph[module].add(target)
            sites.setdefault((module, target), f"{path.relative_to(ROOT)}:{line} ({where})")
    return graph, sites


def _find_cycle(graph: dict) -> list[str] | None:
    """A cycle of the graph as a list of modules (first == last), or None."""
    state, stack = {}, []

    def dfs(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = dfs(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = dfs(node)
            if found:
                return found
    return None


def test_import_graph_of_the_package_has_no_cycle():
    graph, sites = _import_graph()
    assert {"hybrid_compile.engine.speculative", "hybrid_compile.cache"} <= graph["hybrid_compile.engine.engine"]
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle:\n" + "\n".join(
        f"  {a} -> {b}   [{sites[(a, b)]}]" for a, b in zip(cycle, cycle[1:]))


def test_import_graph_follows_the_layers():
    graph, sites = _import_graph()
    layer = {part: i for i, parts in enumerate(LAYERS) for part in parts}
    parts = {_part(m) for m in graph}
    assert parts == set(layer), f"parts not placed in LAYERS: {sorted(parts - set(layer))}; " \
                                f"LAYERS names missing parts: {sorted(set(layer) - parts)}"
    bad = [f"  {a} ({_part(a)}, layer {layer[_part(a)]}) -> {b} ({_part(b)}, layer {layer[_part(b)]})   "
           f"[{sites[(a, b)]}]"
           for a in sorted(graph) for b in sorted(graph[a])
           if _part(a) != _part(b) and layer[_part(b)] >= layer[_part(a)]]
    assert not bad, "imports that do not go to a strictly lower layer:\n" + "\n".join(bad)


def test_the_checks_of_the_import_graph_can_fail(tmp_path):
    """The cycle finder and the edge reader catch what they are meant to (an oracle by hand)."""
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    pkg = tmp_path / "hybrid_compile" / "p"
    pkg.mkdir(parents=True)
    (pkg / "m.py").write_text(
        "from typing import TYPE_CHECKING\nfrom ..q import x\nif TYPE_CHECKING:\n    from . import n\n"
        "def f():\n    from ..q.r import y\n    from ..q import z  # lazy: a test\n")
    modules = {"hybrid_compile.p.m": None, "hybrid_compile.p.n": None, "hybrid_compile.q": None,
               "hybrid_compile.q.r": None}
    assert sorted(_import_edges("hybrid_compile.p.m", pkg / "m.py", modules)) == [
        ("hybrid_compile.p.n", 4, "type-checking"), ("hybrid_compile.q", 2, "module"),
        ("hybrid_compile.q", 6, "function"), ("hybrid_compile.q.r", 6, "function")]


def test_no_private_engine_attribute_is_used_outside_engine_py():
    """Other modules talk to HybridEngine through its public attributes (the speculative decoder
    gets what it needs passed explicitly); a subclass may use its own inherited ``self._*``.
    HybridEngine is defined by engine.py and its mixin in generate_api.py (the transformers API)."""
    own = {ROOT / "hybrid_compile" / "engine" / "engine.py": "HybridEngine",
           ROOT / "hybrid_compile" / "engine" / "generate_api.py": "GenerateAPI"}
    private = set()
    for path, name in own.items():
        cls = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == name)
        private |= {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith("_")
                    and not n.name.endswith("__")}
        private |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                    and isinstance(n.value, ast.Name) and n.value.id == "self" and n.attr.startswith("_")}
    assert {"_emit", "_counters", "_roll_back", "_plan", "_params_for", "_run"} <= private
    uses = []
    for module, path in _package_modules().items():
        if path in own:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in private and not (
                    isinstance(node.value, ast.Name) and node.value.id == "self"):
                uses.append(f"  {path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not uses, "private HybridEngine attributes used outside engine.py:\n" + "\n".join(uses)


# One fresh interpreter loads the third-party modules the package imports (torch, triton, ...),
# then forks one child per part, each importing that part into a process where no hybrid_compile
# module is loaded yet (the children run side by side; the parent reports each failure).
_IMPORT_EACH = """
import importlib, os, sys, traceback
import numpy, sympy, torch, tqdm, triton  # noqa: F401  (shared by the children)
assert not [m for m in sys.modules if m.partition(".")[0] == "hybrid_compile"]
children = {}
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException:
            print(f"import {name} failed:", flush=True)
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        os._exit(0)
    children[pid] = name
failed = [children[pid] for pid in children if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0]
print("failed:", " ".join(failed))
sys.exit(1 if failed else 0)
"""


def test_each_part_of_the_package_imports_alone_in_a_fresh_interpreter():
    parts = sorted({_part(m) for m in _package_modules()} - {"__init__", "__main__"})
    names = ["hybrid_compile"] + [f"hybrid_compile.{p}" for p in parts]
    env = checkout_env()
    run = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *names], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0 and "failed: \n" in run.stdout, run.stdout + run.stderr


def test_no_tracked_file_holds_merge_conflict_markers():
    root = pathlib.Path(__file__).resolve().parents[1]
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    marker = re.compile(r"^(<{7} |>{7} |={7}$)", re.M)
    found = []
    for name in files:
        path = root / name
        if path.suffix in {".py", ".md", ".toml", ".txt", ".cfg", ".sh", ".yaml", ".yml", ""} and path.is_file():
            text = path.read_text(errors="ignore")
            found += [f"{name}:{text.count(chr(10), 0, m.start()) + 1}" for m in marker.finditer(text)]
    assert len(files) > 50
    assert not found, f"merge conflict markers: {found}"
