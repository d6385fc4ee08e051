"""MoE experts in float weights: the routing sort shared by every experts path, the
``moe_grouped_linear`` op, and :func:`fused_moe_experts` (a whole experts forward from those pieces).

Routing. The ``T * top_k`` (token, expert) pairs of a step are sorted by expert
(:func:`sort_pairs_by_expert`, also used by the FP8 experts): row ``r`` of the sorted order is pair
``order[r]`` = token ``order[r] // top_k``; expert ``e`` owns sorted rows
``expert_offsets[e]:expert_offsets[e + 1]``. The ``moe_sort_pairs`` op does it: on CPU a stable argsort
and searchsorted; on CUDA one Triton kernel that ranks each pair by counting the pairs before it
(decode sizes: one launch where torch's radix sort, searchsorted and gathers took several, ~27 us
for the sort alone at 640 pairs on an H200). Shape-only either way: no host sync, CUDA-graph
capturable. A single token's sort stays plain torch (Inductor fuses it into the kernels around it).

``moe_grouped_linear(x, weight, expert_offsets, gather_index, scatter_index, activation)``: for each
sorted row ``r`` of expert ``e``, ``y[scatter_index[r]] = act(x[gather_index[r]] @ weight[e].T)`` (an
absent index is the identity). ``activation`` is applied to the fp32 accumulators before the one
rounding to the output dtype: ``"none"``; ``"silu_and_mul"``, weight rows ``[0, N/2)`` the gate and
``[N/2, N)`` the up projection, output ``[R, N/2]`` = ``silu(gate) * up``; ``"relu2"``,
``relu(.)**2``. The gather lets the first projection read the tokens' hidden states in place (no
``[T * top_k, H]`` copy); the scatter lets the second write each pair back in (token, k) order, so
the top-k weighted sum is a plain reduction over ``k`` (no atomics, deterministic). The CPU
implementation is a per-expert loop in plain torch; the CUDA one is a Triton grouped GEMM
(:mod:`.triton.moe`, one launch for every expert; a GEMV at decode sizes), or
for bf16 above decode size optionally ``torch._grouped_mm`` (:func:`grouped_mm_linear`, whose product
is rounded to bf16 once before the activation).

:func:`fused_moe_experts` is transformers' experts forward (``gate_up_proj [E, 2I, H]`` with the gate
rows first and ``act(gate) * up``, or ``up_proj [E, I, H]`` and ``act(up)``; then ``down_proj
[E, H, I]``; the top-k weighted sum in fp32): two ``moe_grouped_linear`` calls and
``moe_combine_top_k`` (the weighted sum over each token's ``top_k`` rows; a Triton kernel on CUDA). The activation is
fused into the first one for transformers' SiLU with a gate (``silu_and_mul``) and relu2 without one
(:func:`fused_activation`); any other ``act_fn`` runs between the two calls.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import nn

from ._validation import FLOAT_DTYPES, INDEX_DTYPES, check_same_device, check_tensor, should_check_values
from .registration import kernel_op

__all__ = ["GROUPED_ACTIVATIONS", "ExpertRouting", "activate_and_scatter", "check_activation", "check_sorted_rows",
           "fused_activation", "fused_moe_experts", "warm_activation_classes",
           "grouped_mm_linear", "grouped_output_width", "moe_combine_top_k", "moe_grouped_linear", "moe_sort_pairs",
           "reference_moe_combine_top_k", "reference_moe_grouped_linear", "reference_moe_sort_pairs", "scatter_rows",
           "sort_pairs_by_expert"]

# the activations moe_grouped_linear applies in its epilogue (the Triton kernel's ACT is the index)
GROUPED_ACTIVATIONS = ("none", "silu_and_mul", "relu2")


class ExpertRouting(NamedTuple):
    """The (token, expert) pairs of a step sorted by expert (see the module docstring)."""

    order: torch.Tensor  # [T * top_k] pair index (token * top_k + k) of each sorted row
    expert_offsets: torch.Tensor  # [E + 1] first sorted row of each expert, then T * top_k
    token_of_row: torch.Tensor  # [T * top_k] token of each sorted row


def sort_pairs_by_expert(top_k_index: torch.Tensor, num_experts: int) -> ExpertRouting:
    """Sort the pairs of ``top_k_index [T, top_k]`` by expert (stable: a token's pairs keep their order)."""
    tokens = top_k_index.shape[0]
    if isinstance(tokens, int) and tokens == 1:
        # one token (the batch-1 decode graph is specialised to it): plain torch, which Inductor fuses
        # with the kernels around it; an op would be one more launch
        return ExpertRouting(*reference_moe_sort_pairs(top_k_index, num_experts))
    return ExpertRouting(*torch.ops.hybrid_compile.moe_sort_pairs(top_k_index, num_experts))


def _check_sort(top_k_index: torch.Tensor, num_experts: int) -> None:
    check_tensor("moe_sort_pairs", "top_k_index", top_k_index, ndim=2, dtypes=INDEX_DTYPES)
    if num_experts < 1:
        raise ValueError(f"moe_sort_pairs: `num_experts` must be >= 1, got {num_experts}")


@kernel_op("hybrid_compile::moe_sort_pairs", mutates_args=())
def moe_sort_pairs(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, expert) pairs sorted by expert, stably (see the module docstring).

    Args:
        top_k_index: ``[T, top_k]`` int32/int64 expert of each pair (pair ``t * top_k + k``).
        num_experts: ``E``.

    Returns:
        ``(order [T * top_k], expert_offsets [E + 1], token_of_row [T * top_k])``, int64: the pair of
        each sorted row, the first sorted row of each expert (``expert_offsets[e]`` = the pairs whose
        expert is below ``e``), and the token of each sorted row. The CUDA kernel ranks every pair by
        counting (no sort, no host sync): shape-only, capturable in CUDA graphs.
    """
    _check_sort(top_k_index, num_experts)
    return reference_moe_sort_pairs(top_k_index, num_experts)


def reference_moe_sort_pairs(top_k_index: torch.Tensor, num_experts: int):
    """The CPU implementation in plain torch: a stable argsort of the expert ids, ``searchsorted`` for the
    offsets (shape-only: no data-dependent shape)."""
    top_k = top_k_index.shape[1]
    expert_ids = top_k_index.reshape(-1).long()
    order = torch.argsort(expert_ids, stable=True)
    sorted_ids = expert_ids[order]
    offsets = torch.searchsorted(sorted_ids, torch.arange(num_experts + 1, device=sorted_ids.device,
                                                          dtype=sorted_ids.dtype))
    return order, offsets, order // top_k


@moe_sort_pairs.register_fake
def _(top_k_index, num_experts):
    _check_sort(top_k_index, num_experts)
    pairs = top_k_index.shape[0] * top_k_index.shape[1]
    return (top_k_index.new_empty(pairs, dtype=torch.int64), top_k_index.new_empty(num_experts + 1, dtype=torch.int64),
            top_k_index.new_empty(pairs, dtype=torch.int64))


# --------------------------------------------------------------------------------------------
# moe_grouped_linear
# --------------------------------------------------------------------------------------------


def check_activation(activation: str, n: int, op: str = "moe_grouped_linear") -> None:
    """``activation`` is one of :data:`GROUPED_ACTIVATIONS` (and ``silu_and_mul`` has an even ``n``)."""
    if activation not in GROUPED_ACTIVATIONS:
        raise ValueError(f"{op}: `activation` must be one of {', '.join(map(repr, GROUPED_ACTIVATIONS))}, "
                         f"got {activation!r}")
    if activation == "silu_and_mul" and n % 2:
        raise ValueError(f"{op}: `activation`='silu_and_mul' needs an even number of weight rows "
                         f"(gate rows then up rows), got {n}")


def check_sorted_rows(op: str, x: torch.Tensor, experts: int, expert_offsets: torch.Tensor,
                      gather_index: torch.Tensor | None, scatter_index: torch.Tensor | None) -> None:
    """The grouped ops' row arguments: ``expert_offsets [experts + 1]`` rising from 0 to the sorted
    rows (``len(gather_index)``, else ``x``'s rows), the gather's values rows of ``x``, the scatter's
    rows of the output (what the values are checked for: ``should_check_values``)."""
    check_tensor(op, "expert_offsets", expert_offsets, ndim=1, dtypes=INDEX_DTYPES, shape=(experts + 1,))
    rows = x.shape[0]
    if gather_index is not None:
        check_tensor(op, "gather_index", gather_index, ndim=1, dtypes=INDEX_DTYPES)
        rows = gather_index.shape[0]
    if scatter_index is not None:
        check_tensor(op, "scatter_index", scatter_index, ndim=1, dtypes=INDEX_DTYPES, shape=(rows,))
    if should_check_values(expert_offsets):
        o = expert_offsets
        if int(o[0]) != 0 or int(o[-1]) != rows or bool((o[1:] < o[:-1]).any()):
            raise ValueError(f"{op}: `expert_offsets` must rise from 0 to the number of rows ({rows}), "
                             f"got {o.tolist()}")
    for name, idx, bound in (("gather_index", gather_index, x.shape[0]), ("scatter_index", scatter_index, rows)):
        if idx is not None and idx.numel() and should_check_values(idx) and not (
                int(idx.min()) >= 0 and int(idx.max()) < bound):
            raise ValueError(f"{op}: `{name}` values must lie in [0, {bound})")


def grouped_output_width(n: int, activation: str) -> int:
    """Columns of ``moe_grouped_linear``'s output for ``n`` weight rows."""
    return n // 2 if activation == "silu_and_mul" else n


def _check_grouped(x, weight, expert_offsets, gather_index, scatter_index, activation="none") -> None:
    op = "moe_grouped_linear"
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(op, "weight", weight, ndim=3, dtypes=(x.dtype,))
    check_activation(activation, weight.shape[1])
    if weight.shape[2] != x.shape[1]:
        raise ValueError(f"{op}: `weight` has {weight.shape[2]} input channels, `x` has {x.shape[1]}")
    check_same_device(op, x=x, weight=weight, expert_offsets=expert_offsets, gather_index=gather_index,
                      scatter_index=scatter_index)
    check_sorted_rows(op, x, weight.shape[0], expert_offsets, gather_index, scatter_index)


@kernel_op("hybrid_compile::moe_grouped_linear", mutates_args=())
def moe_grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, expert_offsets: torch.Tensor,
    gather_index: torch.Tensor | None = None, scatter_index: torch.Tensor | None = None, activation: str = "none",
) -> torch.Tensor:
    """Per-expert ``F.linear`` over rows sorted by expert, with an optional row gather and scatter.

    Args:
        x: ``[X, K]`` fp32/bf16/fp16 (any strides).
        weight: ``[E, N, K]`` in ``x.dtype`` (the experts' stacked weights, any strides).
        expert_offsets: ``[E + 1]`` int32/int64, non-decreasing from 0 to ``R`` (the sorted rows:
            ``R = len(gather_index)``, else ``X``).
        gather_index: optional ``[R]``, row ``r`` reads ``x[gather_index[r]]`` (else ``x[r]``).
        scatter_index: optional ``[R]``, a permutation of ``range(R)``: row ``r`` is written to
            ``y[scatter_index[r]]`` (else ``y[r]``).
        activation: ``"none"``, ``"silu_and_mul"`` (``N`` even: ``silu(x @ gate.T) * (x @ up.T)`` with
            gate = rows ``[0, N/2)``, up = rows ``[N/2, N)``) or ``"relu2"`` (``relu(x @ w.T)**2``),
            computed in fp32 on the fp32 accumulators.

    Returns:
        ``[R, N]`` (``[R, N/2]`` for ``silu_and_mul``) contiguous in ``x.dtype``, accumulated in fp32
        and rounded once.
    """
    _check_grouped(x, weight, expert_offsets, gather_index, scatter_index, activation)
    return reference_moe_grouped_linear(x, weight, expert_offsets, gather_index, scatter_index, activation)


def scatter_rows(y: torch.Tensor, scatter_index: torch.Tensor) -> torch.Tensor:
    """``out[scatter_index[r]] = y[r]`` for a permutation ``scatter_index``, done as a gather through
    the inverse permutation (``out = y[inverse]``): the row moves of a prefill's experts are hundreds
    of MB, and on CUDA ``index_select`` moves whole rows in 16-byte vectors where ``index_copy_`` moves
    element by element (an H200 profile of a 4k-token prefill, TP 4 shard of the Qwen3-Next-80B
    experts: 68 us a gather of the rows against 251 us a scatter of the same bytes); the inverse
    itself is a scatter of ``R`` integers."""
    rows = scatter_index.shape[0]
    inverse = torch.empty_like(scatter_index).scatter_(
        0, scatter_index, torch.arange(rows, device=scatter_index.device, dtype=scatter_index.dtype))
    return y.index_select(0, inverse)


def activate_and_scatter(y, activation, scatter_index, dtype):
    """The plain-torch implementations' epilogue: ``activation`` on the fp32 products ``y``, one
    rounding to ``dtype``, rows moved to ``scatter_index`` (after the rounding: half the bytes to move
    from fp32)."""
    if activation == "silu_and_mul":
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    elif activation == "relu2":
        y = torch.relu(y).square()
    y = y.to(dtype)
    return scatter_rows(y, scatter_index) if scatter_index is not None else y


def reference_moe_grouped_linear(x, weight, expert_offsets, gather_index=None, scatter_index=None, activation="none"):
    """The CPU implementation of ``moe_grouped_linear`` in plain torch: a loop over the experts, the
    activation on the fp32 products."""
    rows = x[gather_index] if gather_index is not None else x
    y = torch.zeros(rows.shape[0], weight.shape[1], dtype=torch.float32, device=x.device)
    offsets = expert_offsets.tolist()
    for e in range(weight.shape[0]):
        lo, hi = offsets[e], offsets[e + 1]
        if hi > lo:
            y[lo:hi] = rows[lo:hi].float() @ weight[e].float().t()
    return activate_and_scatter(y, activation, scatter_index, x.dtype)


def grouped_mm_linear(x, weight, expert_offsets, gather_index=None, scatter_index=None, activation="none"):
    """``moe_grouped_linear`` through ``torch._grouped_mm`` (on CUDA the bf16 grouped GEMM transformers'
    ``grouped_mm`` experts call): the gathered rows, one grouped GEMM with the experts' weights
    transposed as views, the activation in fp32, the scatter. bf16 only (what ``torch._grouped_mm``
    takes); its output is bf16, so unlike the op's other implementations the product is rounded to bf16
    once before the activation (as in transformers' path), then once after it."""
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        raise ValueError(f"grouped_mm_linear: torch._grouped_mm takes bf16 rows and weights, got {x.dtype} / "
                         f"{weight.dtype}")
    _check_grouped(x, weight, expert_offsets, gather_index, scatter_index, activation)
    rows = x.index_select(0, gather_index) if gather_index is not None else x.contiguous()
    if rows.shape[0] == 0 or weight.shape[0] == 0:
        y = rows.new_zeros(rows.shape[0], weight.shape[1])
    else:
        # offs: each expert's end row (int32); the weights as [E, K, N] views (column-major per expert)
        y = torch._grouped_mm(rows, weight.transpose(1, 2), offs=expert_offsets[1:].to(torch.int32))
    # the activation in fp32; without one the bf16 product is scattered as it is (the same values:
    # bf16 -> fp32 -> bf16 is exact), sparing a [rows, N] fp32 copy (the down projection's is the
    # largest tensor of the experts call)
    return activate_and_scatter(y if activation == "none" else y.float(), activation, scatter_index, x.dtype)


@moe_grouped_linear.register_fake
def _(x, weight, expert_offsets, gather_index=None, scatter_index=None, activation="none"):
    _check_grouped(x, weight, expert_offsets, gather_index, scatter_index, activation)
    rows = gather_index.shape[0] if gather_index is not None else x.shape[0]
    return x.new_empty(rows, grouped_output_width(weight.shape[1], activation))


# --------------------------------------------------------------------------------------------
# the experts forward
# --------------------------------------------------------------------------------------------


# exact classes (a subclass may change forward): transformers' SiLU (ACT2FN["silu"]; "swish" gives
# nn.SiLU) and relu2 (ACT2FN["relu2"]), the same classes in transformers 5.17 and 5.24
_SILU_FUNCTION = torch.nn.functional.silu  # LFM2-MoE's experts hold the function itself


_ACTIVATION_CLASSES: list = []


def _transformers_activation_classes() -> tuple[tuple[type, ...], type]:
    """(the SiLU classes, the relu2 class) of transformers' ``ACT2FN``: imported on first use, not
    with this module (transformers' ``activations`` imports its hub-kernels integration, which
    probes for a top-level ``kernels`` module: one that imports this package would be a cycle).
    Kept in a plain list, not a ``functools`` cache, which Dynamo would trace through when an
    experts forward asks under compile (the patches ask first, outside it: :func:`warm_activation_classes`)."""
    if not _ACTIVATION_CLASSES:
        from transformers.activations import ACT2FN

        _ACTIVATION_CLASSES.append(((nn.SiLU, type(ACT2FN["silu"])), type(ACT2FN["relu2"])))
    return _ACTIVATION_CLASSES[0]


def warm_activation_classes() -> None:
    """Import transformers' activation classes now (before an experts forward is compiled)."""
    _transformers_activation_classes()


def fused_activation(act_fn: Callable, has_gate: bool) -> str:
    """The ``moe_grouped_linear`` activation that computes the experts' ``act(gate) * up`` (``has_gate``)
    or ``act(up)`` inside the first grouped GEMM: ``"silu_and_mul"`` for transformers' SiLU with a
    gate (``nn.SiLU``, ``ACT2FN["silu"]``'s class, or ``torch.nn.functional.silu`` itself),
    ``"relu2"`` for its relu2 (``ACT2FN["relu2"]``'s class) without one, else ``"none"`` (the
    activation then runs as its own elementwise step between the two grouped GEMMs)."""
    silu_classes, relu2_class = _transformers_activation_classes()
    if has_gate and (type(act_fn) in silu_classes or act_fn is _SILU_FUNCTION):
        return "silu_and_mul"
    if not has_gate and type(act_fn) is relu2_class:
        return "relu2"
    return "none"


def fused_moe_experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                      up_proj: torch.Tensor, down_proj: torch.Tensor, act_fn: Callable[[torch.Tensor], torch.Tensor],
                      has_gate: bool, grouped_linear: Callable | None = None, up_scale: torch.Tensor | None = None,
                      down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' experts forward on float weights, or on block-FP8 ones (see the module docstring).

    ``hidden_states [T, H]``, ``top_k_index [T, k]``, ``top_k_weights [T, k]``; ``up_proj [E, 2I, H]``
    (gate rows first) when ``has_gate`` else ``[E, I, H]``; ``down_proj [E, H, I]``. Returns
    ``[T, H]`` in ``hidden_states.dtype``: ``sum_k weight[t, k] * expert_{index[t, k]}(x[t])``.
    The activation is fused into the first grouped GEMM for SiLU (``nn.SiLU``, transformers'
    ``ACT2FN["silu"]``, ``F.silu``) with a gate and ``ACT2FN["relu2"]`` without one
    (:func:`fused_activation`); any other ``act_fn`` (gelu, another function, a subclass, ...) is
    applied to the first GEMM's output between the two grouped GEMMs. ``up_scale`` / ``down_scale``:
    the block scales of e4m3 weights (``fp8_grouped_linear`` then serves both projections, with the
    same gather, activation and scatter).
    ``grouped_linear``: the ``moe_grouped_linear`` (or, with scales, ``fp8_grouped_linear``)
    implementation to call (default: the op; the tests pass the Triton launcher to run the whole
    forward under the interpreter).
    """
    if (up_scale is None) != (down_scale is None):
        raise ValueError("fused_moe_experts: FP8 experts need both up_scale and down_scale")
    ops = torch.ops.hybrid_compile
    fp8 = up_scale is not None
    linear = grouped_linear or (ops.fp8_grouped_linear if fp8 else ops.moe_grouped_linear)
    routing = sort_pairs_by_expert(top_k_index, up_proj.shape[0])

    def project(x, weight, scale, gather_index, scatter_index, activation="none"):
        head = (x, weight, scale) if fp8 else (x, weight)
        return linear(*head, routing.expert_offsets, gather_index, scatter_index, activation=activation)

    activation = fused_activation(act_fn, has_gate)
    h = project(hidden_states, up_proj, up_scale, routing.token_of_row, None, activation)
    if activation == "none":
        if has_gate:
            gate, up = h.chunk(2, dim=-1)
            h = act_fn(gate) * up
        else:
            h = act_fn(h)
    # rows written back in (token, k) order: the weighted sum over k is a reduction, no scatter-add
    out = project(h, down_proj, down_scale, None, routing.order)
    return combine_top_k(out, top_k_weights, hidden_states.dtype)


def combine_top_k(out: torch.Tensor, top_k_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sum_k weight[t, k] * out[t * top_k + k]`` in fp32, as ``dtype``: the experts' outputs in
    (token, k) order, reduced over k by the ``moe_combine_top_k`` op (a fixed summation order: no
    atomics, the same result on every run)."""
    return torch.ops.hybrid_compile.moe_combine_top_k(out, top_k_weights).to(dtype)


def _check_combine(out: torch.Tensor, top_k_weights: torch.Tensor) -> None:
    op = "moe_combine_top_k"
    check_tensor(op, "out", out, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(op, "top_k_weights", top_k_weights, ndim=2, dtypes=FLOAT_DTYPES)
    check_same_device(op, out=out, top_k_weights=top_k_weights)
    tokens, top_k = top_k_weights.shape
    if out.shape[0] != tokens * top_k:
        raise ValueError(f"{op}: `out` has {out.shape[0]} rows, `top_k_weights` {tuple(top_k_weights.shape)} "
                         f"asks for {tokens * top_k} (tokens * top_k)")


@kernel_op("hybrid_compile::moe_combine_top_k", mutates_args=())
def moe_combine_top_k(out: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' top-k weighted sum: ``y[t] = sum_k top_k_weights[t, k] * out[t * top_k + k]``.

    Args:
        out: ``[T * top_k, H]`` fp32/bf16/fp16, each token's ``top_k`` expert outputs in a row block
            (``moe_grouped_linear``'s second call writes them so, through its scatter).
        top_k_weights: ``[T, top_k]`` float.

    Returns:
        ``[T, H]`` contiguous in ``out.dtype``: the products and their sum in fp32 (``k`` in order from
        0), rounded once. An op (a Triton kernel on CUDA) rather than a traced reduction: Inductor's
        reduction over the small ``k`` axis read the rows of ``out`` across threads, not along them
        (on an H200 at 4,096 tokens of the Qwen3-Next-80B shape, 2.4-3.9 ms a call under tensor
        parallelism).
    """
    _check_combine(out, top_k_weights)
    return reference_moe_combine_top_k(out, top_k_weights)


def reference_moe_combine_top_k(out: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The CPU implementation of ``moe_combine_top_k`` in plain torch (fp32 products, summed over k in order)."""
    tokens, top_k = top_k_weights.shape
    weighted = out.view(tokens, top_k, out.shape[1]).float() * top_k_weights.float()[..., None]
    y = weighted[:, 0].clone() if top_k else out.new_zeros(tokens, out.shape[1], dtype=torch.float32)
    for j in range(1, top_k):
        y += weighted[:, j]
    return y.to(out.dtype)


@moe_combine_top_k.register_fake
def _(out, top_k_weights):
    _check_combine(out, top_k_weights)
    return out.new_empty(top_k_weights.shape[0], out.shape[1])
