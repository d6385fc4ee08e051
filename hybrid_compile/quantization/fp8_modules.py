"""Modules holding block-FP8 weights, and :func:`quantize_model` (a float model -> FP8 in place).

:class:`Fp8Linear` replaces an ``nn.Linear`` (same ``in_features`` / ``out_features``, same
parameter names as the checkpoints: ``weight`` in e4m3 and ``weight_scale_inv``); its forward is
``fp8_block_linear`` over the flattened tokens. :class:`Fp8Experts` replaces a transformers MoE
experts module (the 5.x layout: ``gate_up_proj [E, 2I, H]`` + ``down_proj [E, H, I]``, or
``up_proj`` + ``down_proj`` for experts without a gate, e.g. NemotronH) with the same call
signature ``(hidden_states, top_k_index, top_k_weights)`` and the float experts' fused forward
(``ops.moe.fused_moe_experts``): the ``T * top_k`` (token, expert) pairs are sorted by expert and each
projection is one ``fp8_grouped_linear`` launch for all experts, the first reading each token's row
itself with SiLU-and-mul (or relu2) in its epilogue, the second writing its rows back in (token, k) order.

What stays in high precision (as the FP8 releases leave it): embeddings, the LM head, norms,
convolutions, SSM parameters, MoE routers (``mlp.gate``, ``shared_expert_gate``, ``router``) and
Qwen3-Next's ``in_proj_ba`` (the per-head gate / beta projection): :data:`KEEP_HIGH_PRECISION`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.fp8 import FP8_DTYPE, quantize_weight_blocks
from ..ops.moe import fused_moe_experts, warm_activation_classes

__all__ = ["Fp8Experts", "Fp8Linear", "KEEP_HIGH_PRECISION", "fp8_weight_bytes", "has_fp8_layers", "quantize_model"]

#: Module-name endings of linear layers that :func:`quantize_model` keeps in high precision.
KEEP_HIGH_PRECISION = ("mlp.gate", "shared_expert_gate", "router", "in_proj_ba")


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class Fp8Linear(nn.Module):
    """``y = x @ dequant(weight).T + bias`` with an e4m3 ``weight [out, in]`` and per-block
    ``weight_scale_inv [cdiv(out, 128), cdiv(in, 128)]``; the activation is quantized per token and
    group of 128 channels (the checkpoints' dynamic activation scheme)."""

    def __init__(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if weight.dtype != FP8_DTYPE or weight.dim() != 2:
            raise ValueError(f"Fp8Linear: weight must be a 2-D {FP8_DTYPE}, got {weight.dtype} {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.weight = _frozen(weight)
        self.weight_scale_inv = _frozen(weight_scale_inv.float())
        self.bias = _frozen(bias) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        q, s = quantize_weight_blocks(linear.weight.detach())
        return cls(q, s, linear.bias.detach() if linear.bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.hybrid_compile.fp8_block_linear(x.reshape(-1, self.in_features), self.weight,
                                                      self.weight_scale_inv, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 128x128 blocks"


class Fp8Experts(nn.Module):
    """MoE experts in block FP8: ``gate_up_proj [E, 2I, H]`` (or ``up_proj [E, I, H]`` without a
    gate) and ``down_proj [E, H, I]`` in e4m3, each with its ``*_scale_inv`` block scales."""

    def __init__(self, up: torch.Tensor, up_scale_inv: torch.Tensor, down: torch.Tensor,
                 down_scale_inv: torch.Tensor, act_fn, has_gate: bool):
        super().__init__()
        self.has_gate = has_gate
        self.num_experts = up.shape[0]
        self.hidden_dim = down.shape[1]
        self.intermediate_dim = down.shape[2]
        self.act_fn = act_fn
        warm_activation_classes()  # (fused_moe_experts asks for them inside the compiled forward)
        name = "gate_up_proj" if has_gate else "up_proj"
        self.register_parameter(name, _frozen(up))
        self.register_parameter(f"{name}_scale_inv", _frozen(up_scale_inv.float()))
        self.down_proj = _frozen(down)
        self.down_proj_scale_inv = _frozen(down_scale_inv.float())

    @property
    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.has_gate:
            return self.gate_up_proj, self.gate_up_proj_scale_inv
        return self.up_proj, self.up_proj_scale_inv

    @classmethod
    def from_experts(cls, experts: nn.Module) -> "Fp8Experts":
        """Quantize a transformers experts module's 3-D weights."""
        has_gate = hasattr(experts, "gate_up_proj")
        up = experts.gate_up_proj if has_gate else experts.up_proj
        uq, us = quantize_weight_blocks(up.detach())
        dq, ds = quantize_weight_blocks(experts.down_proj.detach())
        return cls(uq, us, dq, ds, experts.act_fn, has_gate)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        # the float experts' fused forward on the e4m3 weights: rows gathered, activated and scattered
        # inside the grouped GEMMs, then the fixed-order sum over k (not an atomic index_add_)
        up, up_scale = self.up_weights
        return fused_moe_experts(hidden_states, top_k_index, top_k_weights, up, self.down_proj, self.act_fn,
                                 self.has_gate, up_scale=up_scale, down_scale=self.down_proj_scale_inv)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
                f"gate={self.has_gate}, fp8 e4m3 128x128 blocks")


def is_experts_module(module: nn.Module) -> bool:
    """A transformers 5.x MoE experts module (3-D expert weights and the routed-call signature)."""
    down = getattr(module, "down_proj", None)
    up = getattr(module, "gate_up_proj", getattr(module, "up_proj", None))
    return (isinstance(down, torch.Tensor) and isinstance(up, torch.Tensor) and down.dim() == 3 and up.dim() == 3
            and hasattr(module, "act_fn"))


def _keep(name: str) -> bool:
    return any(name == k or name.endswith("." + k) for k in KEEP_HIGH_PRECISION)


def fp8_targets(model: nn.Module) -> tuple[list[str], list[str]]:
    """(linear layer names, experts module names) :func:`quantize_model` converts: every
    ``nn.Linear`` and experts module under the decoder except the LM head and
    :data:`KEEP_HIGH_PRECISION`."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linears, experts = [], []
    for name, module in model.named_modules():
        if module is head or _keep(name):
            continue
        if type(module) is nn.Linear:
            linears.append(name)
        elif is_experts_module(module):
            experts.append(name)
    return linears, experts


@torch.no_grad()
def quantize_model(model: nn.Module) -> int:
    """Swap ``model``'s projections and MoE experts for FP8 modules in place, one layer at a time
    on the device each weight lives on (each float weight is freed as its layer is converted).
    Modules that already are FP8 stay. Returns the number of modules converted."""
    linears, experts = fp8_targets(model)
    for name in linears:
        model.set_submodule(name, Fp8Linear.from_linear(model.get_submodule(name)))
    for name in experts:
        model.set_submodule(name, Fp8Experts.from_experts(model.get_submodule(name)))
    return len(linears) + len(experts)


def has_fp8_layers(model: nn.Module) -> bool:
    """Whether ``model`` already holds FP8 layers (loaded from an FP8 checkpoint or quantized)."""
    return any(isinstance(m, (Fp8Linear, Fp8Experts)) for m in model.modules())


def fp8_weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of e4m3 weights, bytes of every other parameter) of ``model``."""
    fp8 = sum(p.numel() for p in model.parameters() if p.dtype == FP8_DTYPE)
    other = sum(p.numel() * p.element_size() for p in model.parameters() if p.dtype != FP8_DTYPE)
    return fp8, other

