"""The shared expert folded into the routed experts (with ``EngineConfig.fused_moe``): a MoE block
whose shared expert has the routed experts' shape is served as one more routed expert.

Qwen3-Next and Qwen3.5-MoE blocks compute ``experts(x, top-k) + sigmoid(shared_expert_gate(x)) *
shared_expert(x)``, and their shared expert (``gate_proj`` / ``up_proj`` / ``down_proj``, SiLU gate)
has the routed experts' width in the released checkpoints (512 in Qwen3-Next-80B-A3B). At decode its
three projections, its activation and the gated sum are four more kernels per layer, each near its
launch floor, beside a grouped GEMV that streams ten experts in one launch anyway. Folded, every token
gets an eleventh (token, expert) pair: expert ``E`` (the shared expert's weights, laid after the
routed experts' in one ``[E + 1, ...]`` tensor at wrap) with the weight ``sigmoid(shared_expert_gate(x))``,
and the block is one ``fused_moe_experts`` call (both grouped projections with the activation fused,
the weighted sum over the ``top_k + 1`` rows in fp32). The sum then rounds once where transformers
rounds the shared output, its gating and the final add each to the model dtype: tokens equal
transformers' on fp32 models; bf16 logits differ by that rounding.

Only a step of one token folds (the batch-1 decode graph, whose token count Dynamo specialises): on
an H200 (8 layers of the Qwen3-Next-80B shape, bf16, decode CUDA graph replayed alone, 2026-11-28) the
fold at every size took 0.728 -> 0.705 ms at batch 1 but 2.620 -> 2.619 at 16 and 6.802 -> 7.080 at 64,
where the shared expert's rows in the one-row-a-program GEMV re-read its weights that a tensor-core
matmul reads once. Other steps run transformers' block (the shared expert's parameters are views of
the packed rows; nothing is copied per step).

Parameters are re-pointed, not copied: the experts' ``gate_up_proj`` / ``down_proj`` become the
first ``E`` rows of the packed tensors and the shared expert's weights its last row (same values);
``handle.undo()`` gives each its own storage again. When the engine compiles with the rewrite pass,
the shared ``gate_proj`` / ``up_proj`` instead lie back to back with the router's and
``shared_expert_gate``'s weights, so that the one-token graph and the others fuse the block's input
projections over one buffer (:func:`_pack_input_projections`; their last experts row is then a copy).
FP8 blocks fold the same way (:class:`~hybrid_compile.quantization.Fp8Experts` routed experts and
:class:`~hybrid_compile.quantization.Fp8Linear` shared projections, quantized or loaded in 128 x 128
blocks): the e4m3 rows and their block scales are packed side by side, the shared gate / up scales
after the experts' (the width a whole number of 128-row blocks, so no scale block spans gate and
up rows), and the one call is ``fused_moe_experts`` with the packed scales (``fp8_grouped_linear``,
which quantizes the token's activation once for the eleven pairs, where the shared expert's own
projections quantized it twice). With the rewrite pass the FP8 shared gate / up stay where they are
(the pass packs them as an FP8 group in the other graphs; the packed experts' last row is a copy),
and the router and ``shared_expert_gate`` need no special layout: every graph projects by those two.
On an H200 (8 layers of the Qwen3-Next-80B shape, FP8, batch-1 decode, 2026-11-29) the FP8 step
ran 63 projection calls against the folded bf16 step's 41; the fold takes 16 of them away.
Blocks whose shared expert is of another width, activation or format than the routed experts, or
whose experts are not on the fused path, keep transformers' forward (:func:`fold_reason`). ``EngineConfig.extra["fold_shared_experts"] =
False`` turns the fold off.
Under tensor parallelism a rank's shared expert and routed experts are sliced along the same
intermediate dimension, so the rank's slices fold the same way, inside the block's all-reduce.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.context import get_forward_context
from ..ops.fp8 import FP8_BLOCK
from ..ops.moe import fused_activation, fused_moe_experts
from ..quantization.fp8_modules import Fp8Experts, Fp8Linear
from .base import PatchHandle, patch_forward
from .fused_experts import unsupported_reason

__all__ = ["FOLDABLE_BLOCKS", "fold_reason", "install_shared_expert_folds"]

#: transformers' MoE blocks of ``experts(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)``
FOLDABLE_BLOCKS = ("Qwen3NextSparseMoeBlock", "Qwen3_5MoeSparseMoeBlock")

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def fold_reason(block: nn.Module) -> str | None:
    """Why ``block``'s shared expert cannot fold into its routed experts, or None when it can."""
    experts = getattr(block, "experts", None)
    shared = getattr(block, "shared_expert", None)
    gate = getattr(block, "shared_expert_gate", None)
    if experts is None or shared is None or not isinstance(gate, nn.Linear) or gate.bias is not None:
        return "not an experts + gated shared expert block"
    if isinstance(experts, Fp8Experts):
        return _fp8_fold_reason(experts, shared)
    reason = unsupported_reason(experts)
    if reason is not None or not hasattr(experts, "gate_up_proj"):
        return f"its experts are not on the fused path ({reason or 'no gate'})"
    linears = [getattr(shared, name, None) for name in _PROJECTIONS]
    if not all(type(m) is nn.Linear and m.bias is None for m in linears):
        return "its shared expert's projections are not bias-free float nn.Linear modules (e.g. FP8)"
    gate_up, down = experts.gate_up_proj, experts.down_proj
    width = gate_up.shape[1] // 2
    if any(m.weight.dtype != gate_up.dtype or m.weight.device != gate_up.device for m in linears):
        return "its shared expert's weights are not in the experts' dtype and device"
    if (linears[0].weight.shape != (width, gate_up.shape[2]) or linears[1].weight.shape != linears[0].weight.shape
            or linears[2].weight.shape != (down.shape[1], width)):
        return (f"its shared expert's width ({linears[0].weight.shape[0]}) is not the routed experts' "
                f"({width})")
    act = fused_activation(experts.act_fn, True)
    if act != "silu_and_mul" or fused_activation(getattr(shared, "act_fn", None), True) != act:
        return "its shared expert's activation is not the experts' fused SiLU gate"
    return None


def _fp8_fold_reason(experts: Fp8Experts, shared: nn.Module) -> str | None:
    linears = [getattr(shared, name, None) for name in _PROJECTIONS]
    if not experts.has_gate:
        return "its FP8 experts have no gate projection (up_proj only)"
    if not all(type(m) is Fp8Linear and m.bias is None for m in linears):
        return "its routed experts are FP8 and its shared expert's projections are not bias-free Fp8Linear modules"
    width, hidden = experts.intermediate_dim, experts.hidden_dim
    if (linears[0].weight.shape != (width, hidden) or linears[1].weight.shape != linears[0].weight.shape
            or linears[2].weight.shape != (hidden, width)):
        return (f"its shared expert's width ({linears[0].weight.shape[0]}) is not the routed experts' "
                f"({width})")
    if width % FP8_BLOCK:
        return (f"its FP8 width ({width}) is not a whole number of {FP8_BLOCK}-row scale blocks (a block of the "
                "packed gate / up rows would span the shared expert's two projections)")
    act = fused_activation(experts.act_fn, True)
    if act != "silu_and_mul" or fused_activation(getattr(shared, "act_fn", None), True) != act:
        return "its shared expert's activation is not the experts' fused SiLU gate"
    return None


#: lays parameters back to back in one buffer, re-pointing each at its rows (the compile's packing:
#: ``compilation.rewrite.pack_parameters``, handed in by the engine)
PackParameters = Callable[[Sequence[nn.Parameter]], torch.Tensor]


def _pack(block: nn.Module, handle: PatchHandle,
          pack_projections: PackParameters | None) -> tuple[torch.Tensor, ...]:
    """``[E + 1, 2I, H]`` / ``[E + 1, H, I]`` tensors holding the routed experts' projections then the
    shared expert's (FP8: then their ``[E + 1, ...]`` block scales, laid out alike); the parameters are
    re-pointed at their rows, except (``pack_projections``) the shared ``gate_proj`` / ``up_proj``,
    laid out for the compile's projection packing instead (:func:`_pack_input_projections`; FP8: left
    where they are)."""
    experts, shared = block.experts, block.shared_expert
    fp8 = isinstance(experts, Fp8Experts)
    # (param of the routed experts, the shared expert's (gate, up) or down for that row, as tensors)
    pairs = [(experts.gate_up_proj, (shared.gate_proj.weight, shared.up_proj.weight)),
             (experts.down_proj, (shared.down_proj.weight,))]
    if fp8:
        pairs += [(experts.gate_up_proj_scale_inv, (shared.gate_proj.weight_scale_inv, shared.up_proj.weight_scale_inv)),
                  (experts.down_proj_scale_inv, (shared.down_proj.weight_scale_inv,))]
    e = experts.gate_up_proj.shape[0]
    packed, views = [], []
    with torch.no_grad():
        for routed, parts in pairs:
            # Parameters, not plain tensors: Dynamo keeps a Parameter's shape static, where a plain tensor the
            # forward closes over gets fresh size symbols per layer under the engine's dynamic=True compile, so
            # every layer's piece of the one-token graph was its own Inductor compile (no FX-cache hit
            # between identical layers: the 80B shape's capture phase compiled 49 pieces)
            row = torch.cat(parts)
            both = nn.Parameter(torch.cat([routed, row[None]]), requires_grad=False)
            packed.append(both)
            views.append((routed, both[:e]))
            if len(parts) == 1:  # down
                views.append((parts[0], both[e]))
            elif pack_projections is None:  # gate / up
                split = parts[0].shape[0]
                views += [(parts[0], both[e, :split]), (parts[1], both[e, split:])]
        for param, view in views:
            param.data = view
    params = [p for p, _ in views]
    if pack_projections is not None and not fp8:
        params += _pack_input_projections(block, pack_projections)
    handle.restores.append(lambda: [_own_storage(p) for p in params])
    return tuple(packed)


def _pack_input_projections(block: nn.Module, pack: PackParameters) -> list[nn.Parameter]:
    """Lay the router's weight, ``shared_expert_gate``'s, then the shared ``gate_proj`` / ``up_proj``
    back to back in one buffer (``pack``); returns them.

    The compile's rewrite pass fuses the projections of one input into one matmul over weights lying
    back to back, and never re-points a weight that a compiled graph reads packed. The one-token graph
    projects the input by the router and ``shared_expert_gate`` only, the other graphs by all four: laid
    out this way both find their projections packed, the first two a prefix of the four. (The shared
    ``gate_proj`` / ``up_proj`` values are then also in the packed experts' last row: a copy, 2 I x H
    per block.) A router without a plain 2-D weight of the input's width leaves the three."""
    linears = [block.shared_expert_gate.weight, block.shared_expert.gate_proj.weight,
               block.shared_expert.up_proj.weight]
    router = getattr(block.gate, "weight", None)
    if (isinstance(router, nn.Parameter) and router.dim() == 2 and router.shape[1] == linears[0].shape[1]
            and router.dtype == linears[0].dtype and router.device == linears[0].device):
        linears.insert(0, router)
    pack(linears)
    return linears


def _own_storage(param: torch.Tensor) -> None:
    with torch.no_grad():
        param.data = param.data.clone()


def _folded_forward(packed_up: torch.Tensor, packed_down: torch.Tensor, up_scale: torch.Tensor | None = None,
                    down_scale: torch.Tensor | None = None):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = hidden_states.shape
        if get_forward_context() is None or not (isinstance(batch * length, int) and batch * length == 1):
            # outside a step, or more tokens (a graph of several, its token count symbolic): transformers'
            # block, whose shared expert runs as its own matmuls (faster there) on its parameters, views of
            # the packed rows
            return type(self).forward(self, hidden_states)
        x = hidden_states.view(-1, hidden)
        _, weights, index = self.gate(x)
        # the shared expert: pair (token, E) weighted by its sigmoid gate, summed last like transformers' add
        shared_weight = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight).float())
        index = torch.cat([index, torch.full_like(index[:, :1], packed_up.shape[0] - 1)], dim=1)
        weights = torch.cat([weights.float(), shared_weight], dim=1)
        out = fused_moe_experts(x, index, weights, packed_up, packed_down, self.experts.act_fn, True,
                                up_scale=up_scale, down_scale=down_scale)
        return out.reshape(batch, length, hidden)

    return forward


def install_shared_expert_folds(model: nn.Module, handle: PatchHandle, option: bool,
                                pack_projections: PackParameters | None = None) -> int:
    """Fold the shared expert of every foldable block of ``model`` when ``option`` (the fused experts
    path, or the fused routers before FP8 experts, is on and ``extra["fold_shared_experts"]`` is not
    False); returns the number folded.
    ``pack_projections``: the compile's packing when the engine compiles with the rewrite pass
    (:func:`_pack_input_projections`), else None."""
    if not option:
        return 0
    blocks = [m for m in model.modules() if type(m).__name__ in FOLDABLE_BLOCKS and fold_reason(m) is None]
    for block in blocks:
        patch_forward(block, _folded_forward(*_pack(block, handle, pack_projections)), handle)
    return len(blocks)
