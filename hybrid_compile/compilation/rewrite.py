"""Rewrite pass on Inductor's post-grad graph: fuse the projections that share an input into one
matmul over a packed weight ("horizontal" matmul fusion).

The hybrid models project the same hidden states several times in a row: the MLP's
``gate_proj``/``up_proj``, the Gated DeltaNet mixer's ``in_proj_qkvz``/``in_proj_ba``
(Qwen3.5: ``in_proj_qkv``/``z``/``b``/``a``), attention's ``q_proj``/``k_proj``/``v_proj``, a MoE
block's router (the fused router's linear) with its shared expert's ``gate_proj``/``up_proj`` and
``shared_expert_gate``. Each
is its own GEMM (GEMV at decode) in Inductor's output; Inductor does not merge them by itself:
its concat-linear patterns (``fx_passes/freezing_patterns.py``) only run under ``freezing``, on
weights that are graph constants (``get_attr``; our pieces get the parameters as inputs), fold a
concatenated copy of them (memory x2 unless the originals are discarded) and match two- or
three-way groups (not Qwen3.5's four). Merged, a layer issues one larger matmul per group: fewer
kernels (decode is launch-bound) and one pass over the activations. Measured on the reference
Qwen3-Next (H200, torch 2.11, ``benchmarks/rewrite_pass.py``): decode step under a CUDA graph
2.194 -> 1.969 ms at batch 1 (1.11x), 2.692 -> 2.463 ms at batch 16 (1.09x), 505 -> 457 kernels.

Two steps, so that no weight is copied per call:

1. :func:`pack_shared_input_weights` (the backend, once, on the real parameters of the Dynamo
   graph): the weights of every group of bias-free ``linear`` calls on one input are copied once
   into one contiguous buffer and the parameters are re-pointed at adjacent slices of it
   (``param.data = packed[rows]``): same values, same memory, eager code unchanged. A graph
   specialised otherwise (the folded MoE block's one-token step projects its input by fewer weights)
   reuses weights that already lie back to back and never re-points one that a live graph reads
   packed (that graph's guard would refuse to run): its group then stays apart.
2. :class:`SharedInputMatmulFusion` (``post_grad_custom_pre_pass``): ``mm(x, w_i.T)`` nodes on one
   input whose weights are graph inputs lying back to back in one storage (read from the fake
   tensors' storage and offsets, the first at offset 0) become one ``mm(x, W.T)`` over
   ``W = as_strided(w_0, [sum n_i, k], [k, 1], 0)`` (``sum n_i`` rounded up to 16-byte output rows
   over the buffer's spare rows, :func:`_aligned_rows`; a view of the packed storage: Inductor
   passes the input buffer reinterpreted, no copy) followed by column slices, each made dense
   again (``clone``: the layout every consumer was traced with; Inductor inlines it into pointwise
   consumers, so a copy is only written where a dense buffer leaves the piece or feeds an op; an op
   that reads rows at any stride, the fused router's ``moe_topk_softmax``, takes the slice itself).

3. Skinny matmuls (same pass, after step 2): every projection ``mm(x, w.T)`` on CUDA becomes
   ``hybrid_compile::skinny_mm(x, w)`` (:mod:`hybrid_compile.ops.linear`): a Triton
   matrix-vector kernel at one row (decode at batch 1) and at two rows for long rows, where it
   beats cuBLAS; ``torch.mm`` elsewhere. The pieces are compiled for a dynamic token count, so
   the op picks its kernel at run time (inside a CUDA graph: once, at capture).

4. Block-FP8 projections (``hybrid_compile::fp8_block_linear``, :class:`~hybrid_compile.quantization.Fp8Linear`)
   the same way: step 1 packs a group's e4m3 weights in one buffer and their ``weight_scale_inv``
   block scales in another, in the same order (every weight but the last filling whole 128-row
   scale blocks, so that scale row ``r // 128`` belongs to packed weight row ``r``; one weight with a
   partial block goes last, others stay alone), and the pass makes the run one ``fp8_block_linear``
   over both packed views: one activation quantization and one GEMM (GEMV at decode) launch
   instead of one each per projection (the shared experts' gate / up, attention's q / k / v).

The backend builds the pieces' fake inputs as views of the packed buffer
(:func:`packed_fake_inputs`), so the adjacency the pass reads is the one of the real weights.
The packing is undone when the engine closes (:func:`unpack_weights`: every parameter gets its own
storage again, same values, same ``Parameter`` object) once no other live backend compiled against
it (the target model drafting for itself, two engines on one model): each backend registers as a
user of the buffers it packed or reused.
The pass's ``uuid`` keys Inductor's FX graph cache on this file and on the packing layout
(the cache key ignores input storage offsets).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .. import ops as _ops  # noqa: F401  (registers hybrid_compile::skinny_mm)

aten = torch.ops.aten

_LINEAR_TARGETS = (torch._C._nn.linear, torch.nn.functional.linear)
_FP8_LINEAR_TARGETS = (torch.ops.hybrid_compile.fp8_block_linear, torch.ops.hybrid_compile.fp8_block_linear.default)
_VIEW_TARGETS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
# our ops whose kernels read their input rows at any stride (a column slice of a packed projection)
_STRIDED_ROW_OPS = (torch.ops.hybrid_compile.moe_topk_softmax.default,)
_SKINNY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------------
# step 1: pack the weights of linears that share an input (Dynamo graph, real parameters)
# ---------------------------------------------------------------------------------------------


@dataclass
class PackedGroup:
    """Weights packed back to back in ``packed`` (rows ``offsets[i] : offsets[i] + rows[i]``)."""

    input_indices: tuple[int, ...]  # positions of the weights among the graph's inputs
    packed: torch.Tensor  # [>= sum rows, in_features] (spare rows: _aligned_rows), the parameters views of it
    rows: tuple[int, ...]
    weights: tuple[torch.nn.Parameter, ...]  # the packed parameters, in row order

    @property
    def offsets(self) -> tuple[int, ...]:
        out, start = [], 0
        for n in self.rows:
            out.append(start)
            start += n
        return tuple(out)


def _linear_weight_groups(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """Weight placeholders of bias-free ``linear`` calls, grouped by their (shared) input node;
    groups of two or more, each weight in one group only."""
    by_input: dict[fx.Node, list[fx.Node]] = collections.defaultdict(list)
    uses: collections.Counter = collections.Counter()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _LINEAR_TARGETS:
            continue
        x = node.args[0] if node.args else node.kwargs.get("input")
        w = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if bias is not None or not isinstance(w, fx.Node) or w.op != "placeholder":
            continue
        uses[w] += 1
        if w not in by_input[_input_key(x)]:
            by_input[_input_key(x)].append(w)
    return [ws for ws in by_input.values() if len(ws) > 1 and all(uses[w] == 1 for w in ws)]


def _input_key(x: Any) -> Any:
    """What a projection reads: ``x``, or (root, shape) for a chain of reshapes / views of a tensor
    (Dynamo's ``x.reshape(*shape)`` / ``x.view(*shape)`` method calls, the post-grad graph's aten
    views) ending in ``shape``: views of one tensor to one shape feed the same rows (each
    ``Fp8Linear`` flattens its input itself; a fused MoE router reshapes the ``[T, H]`` rows the
    block's shared expert reads once more)."""
    if not isinstance(x, fx.Node):
        return x
    if x.op == "call_method" and x.target in ("reshape", "view"):
        shape = x.args[1:]
    elif x.target in _VIEW_TARGETS:
        shape = x.args[1]
    else:
        return x
    shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
    source = _input_key(x.args[0])
    return (source[0] if isinstance(source, tuple) else source, shape)


def _fp8_linear_args(node: fx.Node) -> tuple[Any, Any, Any, Any]:
    """(x, weight, weight_scale_inv, bias) of an ``fp8_block_linear`` call node."""
    args = (*node.args, None, None, None, None)[:4]
    names = ("x", "weight", "weight_scale_inv", "bias")
    return tuple(node.kwargs.get(name, a) for name, a in zip(names, args))


def _fp8_weight_groups(gm: fx.GraphModule) -> list[tuple[list[fx.Node], list[fx.Node]]]:
    """(weight placeholders, scale placeholders) of bias-free ``fp8_block_linear`` calls on one input,
    in call order; groups of two or more, each parameter used by one call only."""
    by_input: dict[Any, list[tuple[fx.Node, fx.Node]]] = collections.defaultdict(list)
    uses: collections.Counter = collections.Counter()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _FP8_LINEAR_TARGETS:
            continue
        x, w, scale, bias = _fp8_linear_args(node)
        if bias is not None or not all(isinstance(t, fx.Node) and t.op == "placeholder" for t in (w, scale)):
            continue
        uses[w] += 1
        uses[scale] += 1
        by_input[_input_key(x)].append((w, scale))
    return [([w for w, _ in pairs], [sc for _, sc in pairs]) for pairs in by_input.values()
            if len(pairs) > 1 and all(uses[w] == 1 and uses[sc] == 1 for w, sc in pairs)]


def _fp8_packing_order(weights: Sequence[torch.Tensor]) -> list[int] | None:
    """The order in which block-FP8 weights can lie back to back, or None: every weight but the last
    must fill whole 128-row scale blocks (its scales' rows then follow the previous weight's); one
    weight with a partial block goes last, a second one is left out."""
    from ..ops.fp8 import FP8_BLOCK

    whole = [i for i, w in enumerate(weights) if w.shape[0] % FP8_BLOCK == 0]
    partial = [i for i, w in enumerate(weights) if w.shape[0] % FP8_BLOCK]
    order = whole + partial[:1]
    return order if len(order) > 1 else None


def _packed_order(weights: Sequence[torch.Tensor]) -> list[int] | None:
    """The order in which ``weights`` lie back to back from offset 0 of one storage (ascending
    offsets), or None when they do not."""
    order = sorted(range(len(weights)), key=lambda i: weights[i].storage_offset())
    storage, start = _storage_id(weights[0]), 0
    for i in order:
        w = weights[i]
        if _storage_id(w) != storage or not w.is_contiguous() or w.storage_offset() != start:
            return None
        start += w.numel()
    return order


def _in_live_buffer(w: torch.Tensor) -> bool:
    """``w`` lies in a buffer that a live backend's compiled graphs read packed."""
    users = _packing_users.get(_storage_id(w))
    return users is not None and len(users) > 0


# the live users (backends) of every packed buffer, by storage: the last one to release it unpacks
_packing_users: dict[int, weakref.WeakSet] = {}


def pack_shared_input_weights(gm: fx.GraphModule, example_inputs: Sequence[Any], user: object) -> list[PackedGroup]:
    """Pack the weights of every group of bias-free linears on one input (see the module doc).

    Only 2-D contiguous ``nn.Parameter`` weights of one dtype/device and one ``in_features`` that
    are graph inputs (Dynamo lifts parameters) are packed; weights already lying back to back from the
    start of one buffer (an earlier compile of the same model, :func:`pack_parameters`) are reused as
    they lie, in any order; a group that would move a weight another live backend's graphs read
    packed stays apart (:func:`_layout`). ``user`` (the backend) is registered as a user of every
    returned group's buffer until it calls :func:`unpack_weights`."""
    index_of = {node: i for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    groups = []
    for nodes in _linear_weight_groups(gm):
        idx = tuple(index_of[n] for n in nodes)
        ws = [example_inputs[i] for i in idx]
        if _packable(ws) and (layout := _layout(ws, any_order=True)) is not None:
            groups.append(_pack(*_reordered(idx, ws, layout), layout is not _NEW, user))
    # block-FP8 projections: the weights packed in one buffer and their block scales in another, in
    # the same order, so that the fused call's scale rows line up with its weight rows
    for weight_nodes, scale_nodes in _fp8_weight_groups(gm):
        ws = [example_inputs[index_of[n]] for n in weight_nodes]
        scales = [example_inputs[index_of[n]] for n in scale_nodes]
        if not (_packable(ws) and _packable(scales)):
            continue
        order = _fp8_packing_order(ws)
        if order is None:
            continue
        ws, scales = [ws[i] for i in order], [scales[i] for i in order]
        layouts = (_layout(ws, any_order=False), _layout(scales, any_order=False))
        if None in layouts:
            continue
        for nodes, ts, layout in ((weight_nodes, ws, layouts[0]), (scale_nodes, scales, layouts[1])):
            groups.append(_pack(tuple(index_of[nodes[i]] for i in order), ts, layout is not _NEW, user))
    return groups


def _packable(ws: Sequence[Any]) -> bool:
    """2-D contiguous parameters of one dtype, device and width. Parameters only: the same tensors come
    back every call (a per-call weight input could not be packed)."""
    if not all(isinstance(w, torch.nn.Parameter) and not isinstance(w, torch._subclasses.FakeTensor) for w in ws):
        return False
    w0 = ws[0]
    return all(w.dim() == 2 and w.is_contiguous() and w.dtype == w0.dtype and w.device == w0.device
               and w.shape[1] == w0.shape[1] for w in ws)


def _aligned_rows(rows: int, element_size: int) -> int:
    """``rows`` rounded up to whole 16 bytes of rows (8 for 2-byte weights): a packed buffer has that many,
    the spare ones zero, so that the fused matmul's output rows are 16-byte aligned (cuBLAS takes its
    slow unaligned kernels for an odd width: a Qwen3-Next MoE block's router, ``shared_expert_gate``
    and shared gate / up are 512 + 1 + 2 x 128 = 769 columns at TP 4, 9.5 us a call at 64 tokens on an
    H200)."""
    per = max(1, 16 // element_size)
    return -(-rows // per) * per


def pack_parameters(ws: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    """Copy 2-D parameters of one width into one buffer, back to back in this order, and re-point each
    at its rows (``param.data = buffer[rows]``: same values, same ``Parameter`` objects); returns the
    buffer (with zero spare rows up to :func:`_aligned_rows`). A later compile finds such a group packed
    (:func:`pack_shared_input_weights`)."""
    with torch.inference_mode(False), torch.no_grad():
        total = sum(int(w.shape[0]) for w in ws)
        packed = ws[0].new_zeros((_aligned_rows(total, ws[0].element_size()), ws[0].shape[1]))
        torch.cat([w.detach() for w in ws], out=packed[:total])
        start = 0
        for w in ws:
            w.data = packed[start:start + w.shape[0]]
            start += w.shape[0]
    return packed


_NEW = "new"  # _layout: the group gets a buffer of its own


def _layout(ws: Sequence[torch.nn.Parameter], any_order: bool) -> str | list[int] | None:
    """How a group's weights are packed: the order in which they already lie back to back from
    offset 0 of one buffer (an earlier compile's, in any order when ``any_order``, else in theirs), else
    :data:`_NEW` (copied into a buffer of their own) -- unless one of them lies in a buffer that a live
    backend's graphs read packed (a graph specialised otherwise, e.g. a one-token step that skips some
    of the group's projections): re-pointing it would move a weight under that graph, so None (the
    group's matmuls stay apart)."""
    order = _packed_order(ws)
    if order is not None and (any_order or order == list(range(len(ws)))):
        return order
    return None if any(_in_live_buffer(w) for w in ws) else _NEW


def _reordered(idx: tuple[int, ...], ws: Sequence[Any], layout: str | list[int]) -> tuple[tuple[int, ...], list]:
    """``idx`` / ``ws`` in the order of the buffer they lie in (a :func:`_layout` order), else as given."""
    if layout is _NEW:
        return idx, list(ws)
    return tuple(idx[i] for i in layout), [ws[i] for i in layout]


def _pack(idx: tuple[int, ...], ws: Sequence[torch.nn.Parameter], reuse: bool, user: object) -> PackedGroup:
    """Re-point ``ws`` at adjacent row slices of one new buffer, or (``reuse``) take the buffer they
    already lie in, in this order."""
    w0 = ws[0]
    rows = tuple(int(w.shape[0]) for w in ws)
    if reuse:  # the whole storage (a buffer of pack_parameters: its spare rows too)
        storage_rows = w0.untyped_storage().nbytes() // (w0.shape[1] * w0.element_size())
        packed = w0.new_empty(0).set_(w0.untyped_storage(), 0, (storage_rows, w0.shape[1]), (w0.shape[1], 1))
    else:
        packed = pack_parameters(ws)
    _packing_users.setdefault(_storage_id(packed), weakref.WeakSet()).add(user)
    return PackedGroup(idx, packed, rows, tuple(ws))


def unpack_weights(groups: Sequence[PackedGroup], user: object) -> int:
    """``user`` stops using ``groups``' buffers; each buffer no other live user needs is unpacked:
    every parameter still lying in it gets its own storage again (``param.data = clone``: same
    values, dtype, device and ``requires_grad``, same ``Parameter`` object, so references to it
    stay valid). Graphs compiled against an unpacked buffer refuse to run
    (:class:`PackedWeightsGuard`). Idempotent; returns the number of parameters unpacked."""
    unpacked = 0
    for g in groups:
        storage = _storage_id(g.packed)
        users = _packing_users.get(storage)
        if users is not None:
            users.discard(user)
            if len(users):
                continue  # another live backend still reads these weights packed
            del _packing_users[storage]
        with torch.inference_mode(False), torch.no_grad():
            for w in g.weights:
                if _storage_id(w) == storage:  # not replaced or unpacked since
                    w.data = w.detach().clone()
                    unpacked += 1
    return unpacked


def packed_fake_inputs(fake_mode, fakes: list[Any], groups: Sequence[PackedGroup]) -> list[Any]:
    """The graph's fake inputs with every packed weight replaced by a fake view of a fake of its
    packed buffer (Dynamo's fakes were made before packing and do not share storage)."""
    fakes = list(fakes)
    with fake_mode:
        for g in groups:
            packed = fake_mode.from_tensor(g.packed, static_shapes=True)
            for i, start, n in zip(g.input_indices, g.offsets, g.rows):
                fakes[i] = packed[start:start + n]
    return fakes


class PackedWeightsGuard:
    """Calls the compiled graph after checking that every packed weight it gets still lies where
    the packing put it: the fused matmuls read a group's weights through its first one, so a
    parameter replaced after the compile (``load_state_dict(..., assign=True)``, ``param.data =``)
    would be read out of bounds. ``load_state_dict``'s in-place copies keep the packing."""

    def __init__(self, fn, groups: Sequence[PackedGroup]) -> None:
        self.fn = fn
        self.expected = [
            (i, g.packed.data_ptr() + start * g.packed.stride(0) * g.packed.element_size())
            for g in groups for i, start in zip(g.input_indices, g.offsets)
        ]

    def __call__(self, *args):
        for i, ptr in self.expected:
            if args[i].data_ptr() != ptr:
                raise RuntimeError(
                    "hybrid_compile: a projection weight packed at compile time was replaced (graph input "
                    f"{i}); the fused matmuls need the packed layout. Wrap the model again after replacing "
                    "weights, or load them in place (load_state_dict without assign=True)."
                )
        return self.fn(*args)


def packing_signature(groups: Sequence[PackedGroup]) -> str:
    """A short stable description of a packing layout (part of the pass's cache key)."""
    text = ";".join(f"{g.input_indices}:{g.rows}/{g.packed.shape[0]}x{g.packed.shape[1]}:{g.packed.dtype}"
                    for g in groups)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# step 2: the post-grad pass
# ---------------------------------------------------------------------------------------------


@dataclass
class _Projection:
    mm: fx.Node
    weight: fx.Node  # placeholder
    value: torch.Tensor  # its fake tensor


def _mm_of_transposed(node: fx.Node) -> tuple[Any, Any] | None:
    """``mm(x, permute(w, [1, 0]))`` (a bias-free linear after decomposition) -> (x, w)."""
    if node.op != "call_function" or node.target is not aten.mm.default:
        return None
    x, wt = node.args
    if not (isinstance(wt, fx.Node) and wt.target is aten.permute.default and list(wt.args[1]) == [1, 0]):
        return None
    return x, wt.args[0]


def _projection(node: fx.Node) -> tuple[Any, _Projection] | None:
    """``mm(x, permute(w, [1, 0]))`` with ``w`` a 2-D contiguous graph input -> (key of x, match)."""
    match = _mm_of_transposed(node)
    if match is None:
        return None
    x, w = match
    value = w.meta.get("val") if isinstance(w, fx.Node) else None
    if w.op != "placeholder" or not isinstance(value, torch.Tensor) or value.dim() != 2 or not value.is_contiguous():
        return None
    return _input_key(x), _Projection(node, w, value)


@dataclass
class _Fp8Projection:
    mm: fx.Node  # the fp8_block_linear call
    weight: fx.Node  # placeholder of the e4m3 weight
    value: torch.Tensor  # its fake tensor
    scale: fx.Node  # placeholder of its block scales
    scale_value: torch.Tensor


def _fp8_projection(node: fx.Node) -> tuple[Any, _Fp8Projection] | None:
    """A bias-free ``fp8_block_linear(x, w, scale)`` with ``w`` and ``scale`` 2-D contiguous graph
    inputs -> (key of x, match)."""
    if node.op != "call_function" or node.target is not torch.ops.hybrid_compile.fp8_block_linear.default:
        return None
    x, w, scale, bias = _fp8_linear_args(node)
    if bias is not None or not all(isinstance(t, fx.Node) and t.op == "placeholder" for t in (w, scale)):
        return None
    values = [t.meta.get("val") for t in (w, scale)]
    if not all(isinstance(v, torch.Tensor) and v.dim() == 2 and v.is_contiguous() for v in values):
        return None
    return _input_key(x), _Fp8Projection(node, w, values[0], scale, values[1])


def _scales_follow(run: list[_Fp8Projection]) -> bool:
    """The run's block scales lie back to back from offset 0 in one storage, in the weights' order,
    and every weight but the last fills whole 128-row blocks (so scale row ``r // 128`` belongs to
    packed weight row ``r``)."""
    from ..ops.fp8 import FP8_BLOCK

    start = 0
    for i, p in enumerate(run):
        v = p.scale_value
        if (_storage_id(v) != _storage_id(run[0].scale_value) or v.storage_offset() != start
                or v.shape[1] != run[0].scale_value.shape[1] or v.dtype != run[0].scale_value.dtype):
            return False
        if i < len(run) - 1 and p.value.shape[0] % FP8_BLOCK:
            return False
        start += v.numel()
    return True


def _storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _adjacent_runs(projections: list[_Projection]) -> list[list[_Projection]]:
    """Runs of >= 2 projections whose weights lie back to back in one storage from offset 0."""
    by_storage: dict[int, list[_Projection]] = collections.defaultdict(list)
    for p in projections:
        by_storage[_storage_id(p.value)].append(p)
    runs = []
    for ps in by_storage.values():
        ps = sorted(ps, key=lambda p: p.value.storage_offset())
        run: list[_Projection] = []
        for p in ps:
            v = p.value
            if run and (v.storage_offset() == run[-1].value.storage_offset() + run[-1].value.numel()
                        and v.shape[1] == run[0].value.shape[1] and v.dtype == run[0].value.dtype):
                run.append(p)
                continue
            if len(run) > 1:
                runs.append(run)
            run = [p] if v.storage_offset() == 0 else []
        if len(run) > 1:
            runs.append(run)
    return runs


def _fake_mode_of(graph: fx.Graph):
    from torch._guards import detect_fake_mode

    return detect_fake_mode([n.meta["val"] for n in graph.nodes if n.op == "placeholder" and "val" in n.meta])


def _call(graph: fx.Graph, fake_mode, target, args, kwargs=None) -> fx.Node:
    node = graph.call_function(target, args, kwargs)
    with fake_mode:
        node.meta["val"] = target(*fx.node.map_arg(args, lambda a: a.meta["val"]), **(kwargs or {}))
    return node


@dataclass
class RewriteCounts:
    """What :class:`SharedInputMatmulFusion` did over all the graphs it ran on."""

    graphs: int = 0  # graphs the pass ran on (pieces served by Inductor's cache skip it)
    fused_groups: int = 0  # matmul groups merged into one
    matmuls_removed: int = 0  # sum over groups of (members - 1)
    group_sizes: dict[int, int] = field(default_factory=dict)  # members -> groups
    skinny_matmuls: int = 0  # mm nodes routed to hybrid_compile::skinny_mm
    fp8_fused_groups: int = 0  # of fused_groups: block-FP8 projections (one fp8_block_linear call)
    strided_slices: int = 0  # members whose slice feeds only ops that read any stride (no dense copy)

    def copy(self) -> "RewriteCounts":
        return dataclasses.replace(self, group_sizes=dict(self.group_sizes))

    def add_shared(self, after: "RewriteCounts", before: "RewriteCounts", times: int) -> None:
        """Count ``times`` more pieces that share the compiled code of the piece whose pass run took the
        counts from ``before`` to ``after`` (the backend's shared pieces, ``backend.piece_key``): what
        the model's forward does, not how often the pass ran (``graphs`` stays the runs)."""
        for name in ("fused_groups", "matmuls_removed", "skinny_matmuls", "fp8_fused_groups", "strided_slices"):
            setattr(self, name, getattr(self, name) + times * (getattr(after, name) - getattr(before, name)))
        for size, count in after.group_sizes.items():
            extra = times * (count - before.group_sizes.get(size, 0))
            if extra:
                self.group_sizes[size] = self.group_sizes.get(size, 0) + extra

    def as_dict(self) -> dict:
        return {"pass_runs": self.graphs, "fused_groups": self.fused_groups, "matmuls_removed": self.matmuls_removed,
                "group_sizes": dict(self.group_sizes), "skinny_matmuls": self.skinny_matmuls,
                "fp8_fused_groups": self.fp8_fused_groups, "strided_slices": self.strided_slices}


class SharedInputMatmulFusion(CustomGraphPass):
    """Post-grad pass: one ``mm`` over the packed weight for the projections of one input; then
    every projection ``mm(x, w.T)`` on a CUDA tensor becomes ``hybrid_compile::skinny_mm(x, w)``
    (its Triton matrix-vector kernel at a few rows, cuBLAS above; :mod:`hybrid_compile.ops.linear`).

    Args:
        layout: description of the packing the graphs' inputs follow (:func:`packing_signature`);
            part of :meth:`uuid`, hence of Inductor's FX graph cache key.
        skinny_matmuls: None (default): route CUDA matmuls to ``skinny_mm``; True: on every device
            (tests: the CPU op is ``torch.mm``); False: never.
    """

    def __init__(self, layout: str = "", skinny_matmuls: bool | None = None) -> None:
        self.layout = layout
        self.skinny_matmuls = skinny_matmuls
        self.counts = RewriteCounts()

    def uuid(self) -> Any:
        return (_SOURCE_HASH, self.layout, self.skinny_matmuls)

    def __call__(self, graph: fx.Graph) -> None:
        self.counts.graphs += 1
        groups: dict[Any, list[_Projection]] = collections.defaultdict(list)
        fp8_groups: dict[Any, list[_Fp8Projection]] = collections.defaultdict(list)
        for node in graph.nodes:
            for find, found in ((_projection, groups), (_fp8_projection, fp8_groups)):
                match = find(node)
                if match is not None:
                    found[match[0]].append(match[1])
        runs = [run for ps in groups.values() if len(ps) > 1 for run in _adjacent_runs(ps)]
        fp8_runs = [run for ps in fp8_groups.values() if len(ps) > 1 for run in _adjacent_runs(ps)
                    if _scales_follow(run)]
        fake_mode = _fake_mode_of(graph)
        order = {node: i for i, node in enumerate(graph.nodes)}
        for run in runs:
            self._fuse(graph, fake_mode, sorted(run, key=lambda p: order[p.mm]))
        for run in fp8_runs:
            self._fuse(graph, fake_mode, sorted(run, key=lambda p: order[p.mm]), fp8=True)
        if self.skinny_matmuls is not False and fake_mode is not None:
            self._route_skinny(graph, fake_mode)
        graph.eliminate_dead_code()
        graph.lint()

    def _route_skinny(self, graph: fx.Graph, fake_mode) -> None:
        """``mm(x, permute(w, [1, 0]))`` -> ``skinny_mm(x, w)`` (the op picks its kernel by the
        row count at run time: the pieces are compiled for a dynamic token count)."""
        for node in list(graph.nodes):
            match = _mm_of_transposed(node)
            if match is None:
                continue
            out = node.meta.get("val")
            if not isinstance(out, torch.Tensor) or out.dtype not in _SKINNY_DTYPES:
                continue
            if self.skinny_matmuls is None and out.device.type != "cuda":
                continue
            with graph.inserting_before(node):
                skinny = _call(graph, fake_mode, torch.ops.hybrid_compile.skinny_mm.default, match)
            node.replace_all_uses_with(skinny)
            graph.erase_node(node)
            self.counts.skinny_matmuls += 1

    def _fuse(self, graph: fx.Graph, fake_mode, run: list, fp8: bool = False) -> None:
        """One call over the run's packed weight (``mm``, or ``fp8_block_linear`` over the packed weight
        and packed block scales with ``fp8``), then each member's columns sliced out of it."""
        first = run[0]  # earliest in the graph: its input is defined before every member
        first_weight = min(run, key=lambda p: p.value.storage_offset())
        k = first.value.shape[1]
        total = sum(p.value.shape[0] for p in run)
        rows = total
        if not fp8:  # over the spare rows after the run where its storage has them (pack_parameters): output
            # rows 16-byte aligned; the extra columns are never read
            size = first_weight.value.element_size()
            aligned = _aligned_rows(total, size)
            if aligned * k * size <= first_weight.value.untyped_storage().nbytes():
                rows = aligned
        with graph.inserting_before(first.mm):
            packed = _call(graph, fake_mode, aten.as_strided.default, (first_weight.weight, [rows, k], [k, 1], 0))
            if fp8:
                ks = first.scale_value.shape[1]
                scale_rows = sum(p.scale_value.shape[0] for p in run)
                scales = _call(graph, fake_mode, aten.as_strided.default,
                               (first_weight.scale, [scale_rows, ks], [ks, 1], 0))
                out = _call(graph, fake_mode, torch.ops.hybrid_compile.fp8_block_linear.default,
                            (_fp8_linear_args(first.mm)[0], packed, scales))
            else:
                packed_t = _call(graph, fake_mode, aten.permute.default, (packed, [1, 0]))
                out = _call(graph, fake_mode, aten.mm.default, (first.mm.args[0], packed_t))
            for p in run:
                start = p.value.storage_offset() // k
                sliced = _call(graph, fake_mode, aten.slice.Tensor, (out, 1, start, start + p.value.shape[0]))
                # the mm's output was dense: downstream views, piece outputs (whose strides the next piece
                # was compiled for) and ops keep the layout they were traced with; Inductor inlines the
                # copy into pointwise consumers and only materialises it where a dense buffer is needed.
                # Ops that read rows at any stride (the fused router's logits) take the slice itself: a
                # materialised copy would be one more kernel a decode step
                if p.mm.users and all(u.target in _STRIDED_ROW_OPS for u in p.mm.users):
                    p.mm.replace_all_uses_with(sliced)
                    self.counts.strided_slices += 1
                    continue
                dense = _call(graph, fake_mode, aten.clone.default, (sliced,), {"memory_format": torch.contiguous_format})
                p.mm.replace_all_uses_with(dense)
        for p in run:
            graph.erase_node(p.mm)
        c = self.counts
        c.fused_groups += 1
        c.fp8_fused_groups += fp8
        c.matmuls_removed += len(run) - 1
        c.group_sizes[len(run)] = c.group_sizes.get(len(run), 0) + 1


def _source_hash() -> str:
    from torch._inductor.custom_graph_pass import get_hash_for_files

    return get_hash_for_files((__file__,)).hex()


_SOURCE_HASH = _source_hash()
