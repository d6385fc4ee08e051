"""FX split pass: cut a Dynamo graph at the layer ops ("splitting ops").

Every node of the graph gets a piece number; each splitting-op call is alone in its own
piece, the nodes between two of them form one piece. ``torch.fx.passes.split_module`` then
turns the pieces into submodules ``submod_<i>`` of a new top-level graph that calls them in
order (``keep_original_order=True``: the node order, hence the order of side effects, stays
the original one). The backend compiles the pieces without a splitting op and leaves the
others as eager calls of the opaque custom op (the op reads the forward context at run time).
This is vLLM's ``split_graph`` idea (SGLang's piecewise CUDA graphs cut the same way).

Tensor parallelism adds functional collectives (``_c10d_functional::all_reduce`` and its
``wait_tensor``) to the graph. They are ordinary nodes of the compute pieces, so each piece's CUDA
graph captures its NCCL collectives; a collective and its wait must then sit in one piece (a graph
cannot wait on a collective captured by another graph, nor eager code on one inside a graph), which
:func:`split_graph` checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence, Union

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

OpLike = Union[str, "torch._ops.OpOverload", "torch._ops.OpOverloadPacket"]

# The layer ops of hybrid_compile.layers (attention core, Kimi-Linear's MLA core, GDN / KDA core, Mamba2
# core, short conv (LFM2, Mamba1's conv), Mamba1 scan core, MiniMax lightning attention core).
DEFAULT_SPLITTING_OPS: tuple[str, ...] = (
    "hybrid_compile::attention_layer",
    "hybrid_compile::mla_layer",
    "hybrid_compile::gdn_layer",
    "hybrid_compile::kda_layer",
    "hybrid_compile::mamba2_layer",
    "hybrid_compile::short_conv_layer",
    "hybrid_compile::mamba1_ssm_layer",
    "hybrid_compile::lightning_layer",
)


def resolve_op(op: OpLike) -> torch._ops.OpOverload:
    """An op overload from an ``OpOverload``, an ``OpOverloadPacket`` (its ``.default``) or a
    name: ``"ns::name"``, ``"ns::name.overload"``, ``"ns.name"`` or ``"ns.name.overload"``."""
    if isinstance(op, torch._ops.OpOverload):
        return op
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op.default
    if not isinstance(op, str):
        raise TypeError(f"splitting op must be an op overload, an op packet or a name, got {type(op).__name__}")
    name = op.replace("::", ".")
    parts = name.split(".")
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(f"splitting op {op!r}: expected 'namespace::name' or 'namespace::name.overload'")
    namespace, opname = parts[0], parts[1]
    overload = parts[2] if len(parts) == 3 else "default"
    try:
        packet = getattr(getattr(torch.ops, namespace), opname)
        return getattr(packet, overload)
    except (AttributeError, RuntimeError) as e:
        raise ValueError(f"splitting op {op!r} is not a registered operator") from e


def resolve_ops(ops: Iterable[OpLike] | None) -> tuple[torch._ops.OpOverload, ...]:
    """Resolve a list of splitting ops (None: :data:`DEFAULT_SPLITTING_OPS`)."""
    if ops is None:
        ops = DEFAULT_SPLITTING_OPS
    return tuple(resolve_op(op) for op in ops)


def splitting_op_of(node: fx.Node, ops: Sequence[torch._ops.OpOverload]) -> torch._ops.OpOverload | None:
    """The splitting op ``node`` calls, or None. Dynamo graphs call the op packet
    (``torch.ops.ns.name``), post-grad graphs the overload (``torch.ops.ns.name.default``)."""
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = target.default
    return target if target in ops else None


_COLLECTIVES = "_c10d_functional::"
_WAIT = "_c10d_functional::wait_tensor"


def _op_name(node: fx.Node) -> str | None:
    """``namespace::name`` of the op a ``call_function`` node calls, or None."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.name()
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def _check_collectives_waited(item: "SplitItem") -> None:
    """Every functional collective of a compute piece is waited inside that piece (module docstring)."""
    for node in item.graph.graph.nodes:
        name = _op_name(node) if node.op == "call_function" else None
        if name is None or not name.startswith(_COLLECTIVES) or name == _WAIT:
            continue
        if not any(u.op == "call_function" and _op_name(u) == _WAIT for u in node.users):
            raise AssertionError(
                f"split pass: piece {item.name} returns the functional collective {name} unwaited (its wait_tensor "
                "is in another piece, which no CUDA graph of the pieces could capture)"
            )


@dataclass
class SplitItem:
    """One submodule of the split graph."""

    name: str  # attribute of the split module, "submod_<index>"
    index: int
    is_splitting_op: bool  # True: the piece is exactly one call of a splitting op
    op: torch._ops.OpOverload | None  # that op
    graph: fx.GraphModule


def split_graph(
    gm: fx.GraphModule, splitting_ops: Iterable[OpLike] | None = None
) -> tuple[fx.GraphModule, list[SplitItem]]:
    """Split ``gm`` at every call of a splitting op.

    Returns the split module (a GraphModule whose graph calls ``submod_<i>`` in order) and one
    :class:`SplitItem` per submodule, sorted by index. Each splitting-op call is alone in its
    submodule; the compute between two of them is one submodule. A graph without splitting ops
    becomes a single piece.
    """
    ops = resolve_ops(splitting_ops)
    piece = 0
    piece_of: dict[fx.Node, int] = {}
    op_pieces: dict[int, torch._ops.OpOverload] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        op = splitting_op_of(node, ops)
        if op is not None:
            piece += 1
            piece_of[node] = piece
            op_pieces[piece] = op
            piece += 1
        else:
            piece_of[node] = piece

    split_gm = split_module(gm, None, lambda node: piece_of[node], keep_original_order=True)

    items = []
    for name, module in split_gm.named_children():
        if not name.startswith("submod_"):
            continue
        index = int(name[len("submod_"):])
        op = op_pieces.get(index)
        items.append(SplitItem(name, index, op is not None, op, module))
    items.sort(key=lambda item: item.index)
    for item in items:
        if not item.is_splitting_op:
            _check_collectives_waited(item)
        if item.is_splitting_op:
            calls = [n for n in item.graph.graph.nodes if n.op == "call_function"]
            # getitem of a multi-output op would follow it into the piece; a layer op returns one tensor
            if len(calls) != 1 or splitting_op_of(calls[0], ops) is None:
                raise AssertionError(
                    f"split pass: piece {item.name} of splitting op {item.op} holds other calls: "
                    f"{[str(n.target) for n in calls]}"
                )
    return split_gm, items
