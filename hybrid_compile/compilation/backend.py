"""Our torch.compile backend: split Dynamo's graph at the layer ops, compile each piece with
Inductor, run the layer ops eagerly between the pieces.

Dynamo traces the patched HF model over packed tokens in one graph (``fullgraph=True``; the
layer ops are opaque custom ops whose fake impls give the output shape), with the token count
symbolic. :func:`~hybrid_compile.compilation.split.split_graph` cuts that graph at the splitting
ops; :class:`PiecewiseCompiler` runs the split module once on the graph's fake inputs (the
placeholders' ``example_value`` metadata: symbolic shapes included) and replaces every piece
without a splitting op by Inductor's compiled callable for it (``compile_fx`` on the piece, with
the piece's fake inputs, so each piece is compiled once for all token counts). Pieces with one
key (:func:`piece_key`: a model's repeated layers) share one compiled callable, and their fake
outputs are laid out from the first one's (:func:`_output_layout`) rather than run again. The
layer-op pieces stay as they are: calling them calls the op, which reads the forward context at
run time.

With ``piecewise_graphs`` (:class:`~hybrid_compile.compilation.cuda_graphs.PiecewiseGraphs`) every
compiled piece is wrapped in a per-token-bucket CUDA-graph runner. With ``rewrites`` (default on)
the weights of projections that share an input are packed once and every piece runs our
post-grad pass (:mod:`.rewrite`, Inductor's ``post_grad_custom_pre_pass``) that fuses them;
:meth:`HybridCompileBackend.release_packed_weights` undoes the packing (the engine's ``close``).

Every piece goes through Inductor's own caches: the AOTAutograd cache and the FX graph cache
(``torch._functorch.config.enable_autograd_cache``, ``torch._inductor.config.fx_graph_cache``,
on by default; on disk under ``TORCHINDUCTOR_CACHE_DIR``), so a second process compiling the same
model with the same settings loads each piece's compiled code instead of compiling it. The
rewrite pass is a ``CustomGraphPass`` whose ``uuid`` is part of the cache key. The cache
lookups of the backend's pieces are counted in ``CompileStats.caches``.
"""

from __future__ import annotations

import collections
import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher

from .rewrite import (
    PackedGroup, PackedWeightsGuard, RewriteCounts, SharedInputMatmulFusion, pack_shared_input_weights,
    packed_fake_inputs, packing_signature, unpack_weights,
)
from .split import OpLike, SplitItem, resolve_ops, split_graph

if TYPE_CHECKING:
    from .cuda_graphs import PiecewiseGraphs


# CompileStats.caches key -> (torch._dynamo.utils.counters group, counter) that Inductor increments
_CACHE_COUNTERS = {
    "fx_graph_hits": ("inductor", "fxgraph_cache_hit"),
    "fx_graph_misses": ("inductor", "fxgraph_cache_miss"),
    "fx_graph_bypasses": ("inductor", "fxgraph_cache_bypass"),
    "autograd_hits": ("aot_autograd", "autograd_cache_hit"),
    "autograd_misses": ("aot_autograd", "autograd_cache_miss"),
    "autograd_bypasses": ("aot_autograd", "autograd_cache_bypass"),
}


def _cache_counts() -> dict[str, int]:
    """The process's Inductor cache counters now (:data:`_CACHE_COUNTERS`)."""
    counters = torch._dynamo.utils.counters
    return {key: counters[group][name] for key, (group, name) in _CACHE_COUNTERS.items()}


@dataclass
class CompileStats:
    """What the backend did, accumulated over every graph it compiled (one per Dynamo compile
    of the frame: more than one means a recompile)."""

    graphs: int = 0  # backend invocations
    pieces: int = 0  # Inductor-compiled pieces of the latest graph
    distinct_pieces: int = 0  # of them, compiled (or loaded from the cache) once each: the rest share (piece_key)
    laid_out_pieces: int = 0  # of the rest, fake outputs laid out from their key's first piece (not run)
    splitting_op_calls: int = 0  # layer-op calls left eager in the latest graph
    split_ops_seen: dict[str, int] = field(default_factory=dict)  # op name -> calls (latest graph)
    backend_seconds: float = 0.0  # split + Inductor, all graphs
    last_graph_seconds: float = 0.0
    graph_nodes: int = 0  # call nodes of the latest Dynamo graph
    rewrites: dict = field(default_factory=dict)  # rewrite pass (.rewrite): packed weights, fused matmuls
    history: list[dict] = field(default_factory=list)  # per graph: pieces, seconds, symbolic inputs
    # Inductor's cache lookups for the pieces, all graphs: fx_graph_{hits,misses,bypasses} (FX graph
    # cache), autograd_{hits,misses,bypasses} (AOTAutograd cache)
    caches: dict = field(default_factory=lambda: dict.fromkeys(_CACHE_COUNTERS, 0))

    def as_dict(self) -> dict:
        return {
            "graphs": self.graphs,
            "pieces": self.pieces,
            "distinct_pieces": self.distinct_pieces,
            "laid_out_pieces": self.laid_out_pieces,
            "splitting_op_calls": self.splitting_op_calls,
            "split_ops_seen": dict(self.split_ops_seen),
            "backend_seconds": self.backend_seconds,
            "graph_nodes": self.graph_nodes,
            "rewrites": dict(self.rewrites),
            "caches": dict(self.caches),
        }


def _fake_inputs(example_inputs: Sequence[Any]):
    """The graph's inputs as Dynamo traced them: fake tensors with the symbolic sizes Dynamo gave
    them (the tracing context remembers each input's symbolic context), SymInts as they are.
    Returns (fake mode, fake inputs)."""
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        raise RuntimeError("hybrid_compile backend: no fake mode (must be called by torch.compile / Dynamo)")
    fakes = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    return fake_mode, fakes


def _inductor_compile(gm: fx.GraphModule, example_inputs: list[Any], config_patches: dict | None) -> Callable:
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=config_patches or None)


def _canonical(value: Any, index: dict) -> Any:
    """A node argument with every graph node replaced by its position (``index``): hashable."""
    if isinstance(value, fx.Node):
        return ("node", index[value])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_canonical(v, index) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((str(k), _canonical(v, index)) for k, v in value.items())))
    if isinstance(value, slice):
        return ("slice", _canonical(value.start, index), _canonical(value.stop, index), _canonical(value.step, index))
    if isinstance(value, (int, float, bool, str, type(None))):
        return (type(value).__name__, value)
    return (type(value).__name__, str(value))  # dtypes, devices, memory formats, SymInts, ops


def piece_key(gm: fx.GraphModule, args: Sequence[Any]) -> tuple:
    """What Inductor compiles for a piece, as a key: its nodes (op, target, arguments by position,
    not by name) and the fake inputs it is compiled for (symbolic sizes and strides, storage
    offset, dtype, device, and which inputs share a storage: the rewrite pass packs weights by
    storage). Two pieces with one key compile to the same code (a model's repeated layers: their
    pieces differ only in their placeholders' names); a piece holding constants (``get_attr``)
    keys on their identity, so it shares with no other piece."""
    storages: dict[int, int] = {}
    inputs = []
    for a in args:
        if isinstance(a, torch.Tensor):
            group = storages.setdefault(id(a.untyped_storage()), len(storages))
            inputs.append(("tensor", tuple(map(str, a.shape)), tuple(map(str, a.stride())), str(a.storage_offset()),
                           str(a.dtype), str(a.device), a.requires_grad, group))
        else:
            inputs.append(_canonical(a, {}))
    index: dict[fx.Node, int] = {}
    nodes = []
    for node in gm.graph.nodes:
        index[node] = len(index)
        target = node.target
        if node.op == "placeholder":  # (by position: the names differ from layer to layer)
            target = ""
        elif node.op == "get_attr":
            target = ("attr", id(functools.reduce(getattr, target.split("."), gm)))  # (dotted: a submodule's)
        elif callable(target):
            target = f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', str(target))}"
        nodes.append((node.op, str(target), _canonical(node.args, index), _canonical(node.kwargs, index)))
    return tuple(inputs), tuple(nodes)


def _output_layout(gm: fx.GraphModule, args: Sequence[Any], out: Any):
    """How a piece's fake outputs sit in memory, so that every piece with its :func:`piece_key` can
    get outputs laid out the same way without running its ops under fake mode again: per output
    leaf ``("arg", i)`` (input ``i`` itself), ``("in", i, view)`` (a view of input ``i``'s storage),
    ``("new", g, view)`` (a view of the ``g``-th storage the piece created) or ``("value", leaf)``
    (anything else, e.g. a SymInt), ``view`` = (size,
    stride, offset); and per created storage (dtype, device, elements it must hold). None when the
    outputs cannot be reproduced that way: an in-place op in the piece (it could change an input's
    metadata), an unbacked (data-dependent) size, or a view whose dtype is not its storage's."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    if any(n.op in ("call_function", "call_method") and str(getattr(n.target, "__name__", n.target)).endswith("_")
           for n in gm.graph.nodes):
        return None
    inputs = {id(a.untyped_storage()): (i, a.dtype) for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    created: dict[int, int] = {}
    storages: list[list] = []  # [dtype, device, elements]
    leaves = []
    for leaf in torch.utils._pytree.tree_leaves(out):
        if isinstance(leaf, (torch.Tensor, torch.SymInt)) and free_unbacked_symbols(leaf):
            return None
        if not isinstance(leaf, torch.Tensor):
            leaves.append(("value", leaf))
            continue
        same = [i for i, a in enumerate(args) if a is leaf]
        if same:
            leaves.append(("arg", same[0]))
            continue
        view = (tuple(leaf.size()), tuple(leaf.stride()), leaf.storage_offset())
        sid = id(leaf.untyped_storage())
        if sid in inputs:
            if inputs[sid][1] != leaf.dtype:
                return None
            leaves.append(("in", inputs[sid][0], view))
            continue
        if sid not in created:
            created[sid] = len(storages)
            storages.append([leaf.dtype, leaf.device, None])
        g = storages[created[sid]]
        if g[0] != leaf.dtype:
            return None
        end = leaf.storage_offset() + sum((n - 1) * st for n, st in zip(leaf.size(), leaf.stride())) + 1
        g[2] = end if g[2] is None else torch.sym_max(g[2], end)  # (no comparison: no guard)
        leaves.append(("new", created[sid], view))
    return leaves, storages, torch.utils._pytree.tree_structure(out)


def _outputs_from_layout(layout, args: Sequence[Any]) -> Any:
    """Fresh fake outputs for a piece's ``args`` laid out as :func:`_output_layout` recorded (under
    the active fake mode): new storages where the piece created them, views of the inputs where it
    returned them."""
    leaves, storages, spec = layout
    bases = [torch.empty(n, dtype=dtype, device=device) for dtype, device, n in storages]
    out = []
    for leaf in leaves:
        if leaf[0] == "value":
            out.append(leaf[1])
        elif leaf[0] == "arg":  # the input itself, passed through
            out.append(args[leaf[1]])
        else:
            base = args[leaf[1]] if leaf[0] == "in" else bases[leaf[1]]
            out.append(base.as_strided(*leaf[2]))
    return torch.utils._pytree.tree_unflatten(out, spec)


class PiecewiseCompiler(torch.fx.Interpreter):
    """Runs the split module on fake inputs; compiles each non-splitting piece with the fake
    values that reach it (so their shapes are the symbolic ones) and swaps it in. Pieces with one
    :func:`piece_key` (a model's repeated layers) share the first one's compiled callable: one
    Inductor compile or cache load per distinct piece instead of one per piece; and their fake
    outputs are laid out as the first one's were (:func:`_output_layout`) instead of running the
    piece's ops under fake mode again (Dynamo has propagated them once already).
    ``verify_reuse``: run the piece anyway and check that both layouts agree (tests)."""

    verify_reuse = False

    def __init__(self, split_gm: fx.GraphModule, items: list[SplitItem], compile_piece: Callable, fake_mode,
                 counts: "RewriteCounts | None" = None) -> None:
        super().__init__(split_gm)
        self.to_compile = {item.name for item in items if not item.is_splitting_op}
        self.compile_piece = compile_piece
        self.fake_mode = fake_mode
        self.compiled: dict[str, Callable] = {}
        self.by_key: dict[tuple, Callable] = {}
        # the rewrite pass's counts (None: no pass): a shared piece counts what its first compile did
        self.counts = counts
        self._count_deltas: dict[tuple, tuple] = {}
        self.layouts: dict[tuple, Any] = {}  # a distinct piece's output layout (_output_layout), when reproducible
        self.reused_outputs = 0
        self.extra_traceback = False

    def run(self, *args):
        with self.fake_mode, enable_python_dispatcher():
            return super().run(*args)

    def call_module(self, target, args, kwargs):
        assert isinstance(target, str)
        if target not in self.to_compile:
            return super().call_module(target, args, kwargs)
        if kwargs:
            raise RuntimeError(f"hybrid_compile backend: piece {target} called with keyword arguments")
        submod = self.fetch_attr(target)
        key = piece_key(submod, args)
        if key in self.layouts:
            out = _outputs_from_layout(self.layouts[key], args)
            self.reused_outputs += 1
            if self.verify_reuse:
                ran = super().call_module(target, args, kwargs)
                if _output_layout(submod, args, ran)[:2] != _output_layout(submod, args, out)[:2]:
                    raise AssertionError(f"piece {target}: the outputs laid out from its key's first piece differ "
                                         "from its own")
        else:
            out = super().call_module(target, args, kwargs)
            layout = _output_layout(submod, args, out)
            if layout is not None:
                self.layouts[key] = layout
        if key not in self.by_key:
            before = self.counts.copy() if self.counts is not None else None
            self.by_key[key] = self.compile_piece(submod, list(args))
            if self.counts is not None:
                self._count_deltas[key] = (self.counts.copy(), before)
        elif self.counts is not None:
            self.counts.add_shared(*self._count_deltas[key], 1)
        self.compiled[target] = self.by_key[key]
        return out


class HybridCompileBackend:
    """A torch.compile backend object: ``torch.compile(fn, backend=HybridCompileBackend())``.

    Args:
        splitting_ops: ops to cut the graph at (default: the three layer ops).
        inductor: compile the pieces with Inductor (False: run them as plain FX code, which is
            useful to test the split alone).
        inductor_config: Inductor config patches for every piece.
        rewrites: run our post-grad rewrite pass (:mod:`.rewrite`: projections that share an input
            become one matmul over weights packed once; CUDA matmuls become ``skinny_mm``) on every piece.
        skinny_matmuls: the rewrite pass's routing of matmuls to ``hybrid_compile::skinny_mm``: None
            (default) on CUDA, True on every device, False never.
        piecewise_graphs: wrap every compiled piece in a per-bucket CUDA-graph runner of this
            state (:mod:`.cuda_graphs`); None: the pieces are called directly.
    """

    def __init__(
        self,
        splitting_ops: Iterable[OpLike] | None = None,
        *,
        inductor: bool = True,
        inductor_config: dict | None = None,
        rewrites: bool = True,
        skinny_matmuls: bool | None = None,
        piecewise_graphs: "PiecewiseGraphs | None" = None,
    ) -> None:
        self.splitting_ops = resolve_ops(splitting_ops)
        self.inductor = inductor
        self.inductor_config = dict(inductor_config or {})
        self.rewrites = rewrites
        self.skinny_matmuls = skinny_matmuls
        self.rewrite_pass: SharedInputMatmulFusion | None = None
        self.packed_groups: list[PackedGroup] = []  # weight groups packed (or reused) for the pass, all graphs
        if rewrites and "post_grad_custom_pre_pass" in self.inductor_config:
            raise ValueError("HybridCompileBackend: inductor_config sets post_grad_custom_pre_pass, which the "
                             "rewrite pass uses; pass rewrites=False to run your own")
        self.piecewise_graphs = piecewise_graphs
        self.stats = CompileStats()
        self.split_gm: fx.GraphModule | None = None  # the latest split module (inspection)
        self.items: list[SplitItem] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        t0 = time.perf_counter()
        split_gm, items = split_graph(gm, self.splitting_ops)
        packed = []  # weight groups packed for the rewrite pass
        if self.inductor:
            fake_mode, fakes = _fake_inputs(example_inputs)
            config = self.inductor_config
            if self.rewrites:
                packed = pack_shared_input_weights(gm, example_inputs, user=self)
                self.packed_groups.extend(packed)
                fakes = packed_fake_inputs(fake_mode, fakes, packed)
                self.rewrite_pass = SharedInputMatmulFusion(packing_signature(packed), self.skinny_matmuls)
                config = {**config, "post_grad_custom_pre_pass": self.rewrite_pass}
                self.stats.rewrites = {"packed_groups": len(packed), "packed_weights": sum(len(g.rows) for g in packed)}
            compiler = PiecewiseCompiler(
                split_gm, items, lambda sub, args: _inductor_compile(sub, args, config), fake_mode,
                self.rewrite_pass.counts if self.rewrites else None,
            )
            before = _cache_counts()
            compiler.run(*fakes)
            for key, count in _cache_counts().items():
                self.stats.caches[key] += count - before[key]
            if self.rewrites:  # the pass's counts (it does not run on pieces served by Inductor's cache)
                self.stats.rewrites.update(self.rewrite_pass.counts.as_dict())
            for name, fn in compiler.compiled.items():
                # a plain attribute shadows the submodule: the split graph's `self.submod_i(...)` calls it
                if self.piecewise_graphs is not None:
                    fn = self.piecewise_graphs.wrap(name, fn)
                split_gm.__dict__[name] = fn
            pieces = len(compiler.compiled)
            distinct = len(compiler.by_key)
            self.stats.laid_out_pieces = compiler.reused_outputs
        else:
            pieces = distinct = sum(1 for item in items if not item.is_splitting_op)
        seconds = time.perf_counter() - t0

        seen = collections.Counter(str(item.op.name()) for item in items if item.is_splitting_op)
        s = self.stats
        s.graphs += 1
        s.pieces = pieces
        s.distinct_pieces = distinct
        s.splitting_op_calls = sum(seen.values())
        s.split_ops_seen = dict(seen)
        s.backend_seconds += seconds
        s.last_graph_seconds = seconds
        s.graph_nodes = sum(1 for n in gm.graph.nodes if n.op.startswith("call"))
        s.history.append({
            "pieces": pieces,
            "distinct_pieces": distinct,
            "splitting_op_calls": s.splitting_op_calls,
            "seconds": seconds,
            "symbolic_inputs": [str(x) for x in example_inputs if isinstance(x, torch.SymInt)],
        })
        self.split_gm, self.items = split_gm, items
        return PackedWeightsGuard(split_gm, packed) if packed else split_gm

    def release_packed_weights(self) -> int:
        """Stop using the packed weights: the parameters get their own storage again unless another
        live backend compiled against the same packing (:func:`.rewrite.unpack_weights`), and this
        backend drops its references to the packed buffers. What it compiled no longer runs once
        the weights are unpacked. Idempotent; returns the number of parameters unpacked."""
        unpacked = unpack_weights(self.packed_groups, self)
        self.packed_groups.clear()
        return unpacked


_default_backend: HybridCompileBackend | None = None


def hybrid_compile_backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """The backend as a plain function (default splitting ops, Inductor pieces); its stats
    accumulate in :func:`default_backend`. The engine uses its own
    :class:`HybridCompileBackend` instance per runner."""
    return default_backend()(gm, example_inputs)


def default_backend() -> HybridCompileBackend:
    global _default_backend
    if _default_backend is None:
        _default_backend = HybridCompileBackend()
    return _default_backend
