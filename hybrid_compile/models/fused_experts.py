"""The fused MoE experts patch (``EngineConfig.fused_moe``), family-independent: every transformers
experts module of the 3-D layout (``gate_up_proj [E, 2I, H]`` with ``act(gate) * up``, or
``up_proj [E, I, H]`` and ``act(up)`` without a gate, then ``down_proj [E, H, I]``; float weights, no
biases, not transposed) gets a forward that, inside an engine step, runs
:func:`hybrid_compile.ops.moe.fused_moe_experts` on the module's own weights (one
``moe_grouped_linear`` per projection for all experts, SiLU-gate / relu2 fused into the first) instead of transformers' experts forward
(the eager per-expert loop or ``torch._grouped_mm`` with its sort / histogram kernels). Outside an
engine step (no forward context) the module runs transformers' forward, so ``model.generate`` on a
wrapped model is HF's; ``handle.undo()`` restores it. Under tensor parallelism a rank's experts
module holds its slice of the intermediate dim (distributed/plans.py ``fused_experts``): the same
forward serves it. Families with such experts in transformers 5.17 - 5.24: Qwen3-Next, Qwen3.5-MoE,
NemotronH, Granite-4 (GraniteMoeHybrid), LFM2-MoE, Jamba, MiniMax, Kimi-Linear.
:func:`resolve_fused_moe` turns the option's default (None) into on or off for a model.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers.context import get_forward_context
from ..ops.moe import fused_moe_experts, warm_activation_classes
from ..quantization.fp8_modules import Fp8Experts, is_experts_module
from .base import PatchHandle, patch_forward

__all__ = ["experts_modules", "install_fused_experts", "resolve_fused_moe", "resolve_fused_routers", "unfused_experts",
           "unsupported_reason"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def unsupported_reason(module: nn.Module) -> str | None:
    """Why the fused path cannot run ``module`` (an experts module), or None when it can."""
    if not is_experts_module(module):
        return "its experts are not 3-D stacked weights (gate_up_proj or up_proj, and down_proj) with an act_fn"
    has_gate = hasattr(module, "gate_up_proj")
    up = module.gate_up_proj if has_gate else module.up_proj
    down = module.down_proj
    if up.dtype not in _FLOAT_DTYPES or down.dtype != up.dtype:
        return f"its expert weights are {up.dtype} / {down.dtype}, not one float dtype"
    if getattr(module, "is_transposed", False):
        return "its expert weights are transposed ([E, in, out])"
    if getattr(module, "has_bias", False):
        return "its experts have biases"
    gate_fn = getattr(type(module), "_apply_gate", None)
    if gate_fn is not None and getattr(gate_fn, "__name__", "") != "_default_apply_gate":
        return f"{type(module).__name__} defines its own gate activation (_apply_gate)"
    e, n, k = up.shape
    if down.shape[0] != e or down.shape[1] != k or n != (2 if has_gate else 1) * down.shape[2]:
        return (f"its weight shapes do not pair up: {'gate_up_proj' if has_gate else 'up_proj'} {tuple(up.shape)}, "
                f"down_proj {tuple(down.shape)}")
    return None


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's MoE experts modules (FP8 ones excluded: they have their own grouped GEMMs): the
    3-D experts layout, or a module transformers calls ``*Experts`` / that sits at ``.experts`` (e.g.
    an ``nn.ModuleList`` of per-expert MLPs, which :func:`unsupported_reason` then names)."""
    return [(name, module) for name, module in model.named_modules()
            if not isinstance(module, Fp8Experts)
            and (is_experts_module(module) or type(module).__name__.endswith("Experts")
                 or name.rsplit(".", 1)[-1] == "experts")]


def _fused_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor:
    if get_forward_context() is None:
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
    has_gate = hasattr(self, "gate_up_proj")
    up = self.gate_up_proj if has_gate else self.up_proj
    return fused_moe_experts(hidden_states, top_k_index, top_k_weights, up, self.down_proj, self.act_fn, has_gate)


def resolve_fused_moe(model: nn.Module, option: bool | None, device: torch.device | str) -> bool:
    """``EngineConfig.fused_moe`` as applied to ``model``: True / False as given; None (the default)
    is on for a model on a CUDA device whose MoE experts modules are all of the fused path's layout
    (on one GPU it measured 1.05-1.45x transformers' experts path end to end; under tensor
    parallelism, 8 layers of the Qwen3-Next-80B shape at TP 2 on an H200, 1.07-1.19x decode and
    1.23-1.27x prefill, README "Fused MoE experts"), and off otherwise: on the CPU the fused path is
    the plain-torch reference loop."""
    if option is not None:
        return option
    if torch.device(device).type != "cuda":
        return False
    modules = experts_modules(model)
    return bool(modules) and all(unsupported_reason(m) is None for _, m in modules)


def resolve_fused_routers(model: nn.Module, option: bool | None, device: torch.device | str, fused_moe: bool) -> bool:
    """Whether ``model``'s softmax top-k routers run on ``moe_topk_softmax`` (the same option,
    ``EngineConfig.fused_moe``): True / False as given; None: on where the experts are fused
    (``fused_moe``, as resolved) and also for a CUDA model whose experts are all FP8 (:class:`Fp8Experts`
    serve them, not the fused path; the router before them is the same top-k softmax, which
    transformers' forward runs as four kernels)."""
    if option is not None:
        return option
    if fused_moe:
        return True
    if torch.device(device).type != "cuda":
        return False
    return any(isinstance(m, Fp8Experts) for m in model.modules()) and not experts_modules(model)


def unfused_experts(model: nn.Module) -> list[str]:
    """Names of ``model``'s experts modules the fused path could serve that run transformers'
    forward (not patched by :func:`install_fused_experts`)."""
    return [name for name, m in experts_modules(model)
            if unsupported_reason(m) is None
            and getattr(m.__dict__.get("forward"), "__func__", None) is not _fused_forward]


def install_fused_experts(model: nn.Module, handle: PatchHandle, option: bool, required: bool = True) -> int:
    """Apply ``EngineConfig.fused_moe`` = ``option`` to ``model``; returns the number of experts
    modules patched. True: patch (any device), a ValueError naming the option when the model has an
    experts module of another layout, or (``required``: the served model, not a draft model or an
    MTP head beside it) no experts module at all; False: nothing (None is resolved first:
    :func:`resolve_fused_moe`)."""
    if not option:
        return 0
    modules = experts_modules(model)
    bad = [(name, why) for name, m in modules if (why := unsupported_reason(m)) is not None]
    if bad:
        name, why = bad[0]
        raise ValueError(f"EngineConfig.fused_moe={option!r}: {type(model).__name__}'s experts module {name!r} "
                         f"({type(model.get_submodule(name)).__name__}) is not supported: {why}; use fused_moe=False "
                         "(transformers' experts forward)")
    if not modules and not required:
        return 0
    if not modules:
        fp8 = any(isinstance(m, Fp8Experts) for m in model.modules())
        raise ValueError(f"EngineConfig.fused_moe={option!r} but {type(model).__name__} has no float MoE experts module"
                         + (" (its experts are FP8: quantization serves them with Fp8Experts' grouped GEMMs)"
                            if fp8 else "") + "; use fused_moe=None or False")
    warm_activation_classes()  # (outside the compiled forward that asks for them)
    for _, module in modules:
        patch_forward(module, _fused_forward, handle)
    return len(modules)
