"""The fused MoE router patch (``EngineConfig.fused_moe``, beside :mod:`.fused_experts`): transformers'
softmax top-k routers get a forward that, inside an engine step, computes the router logits with the
module's own weight (``F.linear``) and then runs ``hybrid_compile::moe_topk_softmax`` (one kernel for
transformers' fp32 softmax, ``torch.topk``, renormalising sum + divide) before the casts transformers
applies; it returns transformers' tuple (same order, dtypes and shapes). The sigmoid group-limited
routers (:data:`GROUPED_ROUTERS`: Kimi-Linear, NemotronH) likewise run
``hybrid_compile::moe_topk_sigmoid_grouped`` after their fp32 linear (one kernel for transformers'
sigmoid, bias correction, group scores, two ``torch.topk`` passes, masks, gather, renormalisation and
routed scaling); their experts come by descending corrected score, where transformers'
``topk(sorted=False)`` promises no order (the experts' sum does not depend on it). Outside an engine
step (no forward context) the module runs transformers' forward; ``handle.undo()`` restores it.

Routers served (:data:`SOFTMAX_ROUTERS`, transformers 5.17 - 5.24): Qwen3-Next, Qwen3.5-MoE, MiniMax,
Granite-4 (its softmax over the top-k logits is the renormalised top-k of the full softmax) and
Jamba's ``JambaTopKRouter`` (5.24; in 5.17 Jamba's router is a plain ``nn.Linear`` and the block's
``route_tokens_to_experts``: no router module, left alone). Routers of another kind stay on
transformers' forward (:data:`OTHER_ROUTERS` says why). Ties between equal probabilities go to the
lower expert index (the op's order), where ``torch.topk`` promises no order.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.context import get_forward_context
from ..ops.moe_router import moe_topk_sigmoid_grouped, moe_topk_softmax
from .base import PatchHandle, patch_forward

__all__ = ["GROUPED_ROUTERS", "OTHER_ROUTERS", "SOFTMAX_ROUTERS", "RouterSpec", "fused_routers",
           "install_fused_routers", "softmax_routers"]


class RouterSpec(NamedTuple):
    """How one transformers router class computes its outputs around the softmax top-k."""

    renormalize: Callable[[nn.Module], bool]  # divide the top-k weights by their sum
    weights_dtype: str  # the weights' dtype: "logits" (the linear's), "hidden" (the input's) or "fp32"
    logits_fp32: bool  # the returned logits are cast to fp32
    flattens: bool  # the forward reshapes its input to [-1, hidden] (else outputs keep the leading dims)


SOFTMAX_ROUTERS: dict[str, RouterSpec] = {
    "Qwen3NextTopKRouter": RouterSpec(lambda m: bool(m.norm_topk_prob), "logits", False, True),
    "Qwen3_5MoeTopKRouter": RouterSpec(lambda m: True, "logits", False, True),
    "MiniMaxTopKRouter": RouterSpec(lambda m: True, "fp32", False, True),
    "JambaTopKRouter": RouterSpec(lambda m: False, "hidden", False, False),
    # softmax over the top-k fp32 logits = the top-k of the full softmax, renormalised
    "GraniteMoeHybridTopKRouter": RouterSpec(lambda m: True, "hidden", True, False),
}

#: Sigmoid group-limited routers (scores + expert-bias correction + group top-k + routed scaling):
#: transformers' fp32 linear, then its outputs (logits, weights, index), all fp32 / int64.
GROUPED_ROUTERS: dict[str, RouterSpec] = {
    name: RouterSpec(lambda m: bool(m.norm_topk_prob), "fp32", True, True)
    for name in ("NemotronHTopkRouter", "KimiLinearTopkRouter")
}

#: Router classes of the fused-experts families that neither op serves, and why.
OTHER_ROUTERS: dict[str, str] = {
    "Lfm2MoeTopKRouter": "sigmoid scores (+ optional expert bias) without groups, routed scaling",
}


def softmax_routers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's router modules of a class in :data:`SOFTMAX_ROUTERS`."""
    return [(name, m) for name, m in model.named_modules() if type(m).__name__ in SOFTMAX_ROUTERS]


def fused_routers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's router modules that the patch serves: :data:`SOFTMAX_ROUTERS` and :data:`GROUPED_ROUTERS`."""
    return [(name, m) for name, m in model.named_modules()
            if type(m).__name__ in SOFTMAX_ROUTERS or type(m).__name__ in GROUPED_ROUTERS]


def _index_first(module: nn.Module, spec: RouterSpec) -> bool:
    """Probe transformers' forward once on two zero tokens: whether it returns ``(index, weights,
    logits)`` (Granite-4 in 5.17) or ``(logits, weights, index)``; a ValueError naming the option when
    its outputs are not what :data:`SOFTMAX_ROUTERS` describes (a transformers change)."""
    weight = module.weight
    x = torch.zeros(2, weight.shape[1], dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        out = type(module).forward(module, x)
    logits_dtype = torch.float32 if spec.logits_fp32 else weight.dtype
    weights_dtype = {"logits": logits_dtype, "hidden": x.dtype, "fp32": torch.float32}[spec.weights_dtype]
    expected = {"index": ((2, module.top_k), torch.int64), "weights": ((2, module.top_k), weights_dtype),
                "logits": ((2, weight.shape[0]), logits_dtype)}
    for order in (("logits", "weights", "index"), ("index", "weights", "logits")):
        if isinstance(out, tuple) and len(out) == 3 and all(
                isinstance(t, torch.Tensor) and (tuple(t.shape), t.dtype) == expected[what]
                for t, what in zip(out, order)):
            return order[0] == "index"
    got = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
           for t in (out if isinstance(out, tuple) else (out,))]
    raise ValueError(f"EngineConfig.fused_moe: {type(module).__name__} returned {got}, not the (logits, weights, "
                     f"index) the fused router reproduces; use fused_moe=False")


def _router_forward(spec: RouterSpec, index_first: bool):
    def forward(self, hidden_states: torch.Tensor):
        if get_forward_context() is None:
            return type(self).forward(self, hidden_states)
        x = hidden_states.reshape(-1, self.weight.shape[1])
        logits = F.linear(x, self.weight)
        if spec.logits_fp32:
            logits = logits.float()
        weights, index = moe_topk_softmax(logits, self.top_k, spec.renormalize(self))
        if spec.weights_dtype == "logits":
            weights = weights.to(logits.dtype)
        elif spec.weights_dtype == "hidden":
            weights = weights.to(hidden_states.dtype)
        if not spec.flattens:  # transformers' linear / topk keep the input's leading dims
            lead = hidden_states.shape[:-1]
            logits, weights, index = (t.reshape(*lead, t.shape[-1]) for t in (logits, weights, index))
        return (index, weights, logits) if index_first else (logits, weights, index)

    return forward


def _grouped_router_forward(self, hidden_states: torch.Tensor):
    """Patched forward of a :data:`GROUPED_ROUTERS` router (transformers' outputs, see the module docstring)."""
    if get_forward_context() is None:
        return type(self).forward(self, hidden_states)
    x = hidden_states.reshape(-1, self.weight.shape[1])
    logits = F.linear(x.float(), self.weight.float())
    weights, index = moe_topk_sigmoid_grouped(
        logits, self.e_score_correction_bias.float(), self.top_k, int(self.num_group or 1), int(self.topk_group or 1),
        bool(self.norm_topk_prob), float(self.routed_scaling_factor),
    )
    return logits, weights, index


def install_fused_routers(model: nn.Module, handle: PatchHandle, option: bool) -> int:
    """Apply ``EngineConfig.fused_moe`` = ``option`` to ``model``'s softmax top-k and sigmoid
    group-limited routers; returns the number patched (0 when the option is off or the model has none:
    their absence is no error, the experts patch decides whether the model serves the option)."""
    if not option:
        return 0
    plans = []
    for _, m in fused_routers(model):
        name = type(m).__name__
        if name in SOFTMAX_ROUTERS:
            plans.append((m, _router_forward(SOFTMAX_ROUTERS[name], _index_first(m, SOFTMAX_ROUTERS[name]))))
        elif _index_first(m, GROUPED_ROUTERS[name]):  # (the probe checks the outputs; index first is not theirs)
            raise ValueError(f"EngineConfig.fused_moe: {name} returned (index, weights, logits), not the "
                             "(logits, weights, index) the fused router reproduces; use fused_moe=False")
        else:
            plans.append((m, _grouped_router_forward))
    for module, forward in plans:
        patch_forward(module, forward, handle)
    return len(plans)
