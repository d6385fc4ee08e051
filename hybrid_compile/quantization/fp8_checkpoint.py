"""Loading a checkpoint with FP8 weights: pre-quantized (fine-grained FP8) or quantized on load.

The fine-grained FP8 format (the Qwen and DeepSeek FP8 releases): ``config.json`` carries
``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
"activation_scheme": "dynamic", ...}``; each quantized linear layer ``L`` has ``L.weight`` in
``float8_e4m3fn`` and ``L.weight_scale_inv`` (fp32, one per ``128 x 128`` block); MoE experts are
stored per expert (``...experts.{e}.gate_proj.weight`` + ``weight_scale_inv``, ``up_proj``,
``down_proj``); everything else (embeddings, LM head, norms, SSM parameters, routers) in high
precision. Which layers are quantized is read from the checkpoint itself (the layers that have a
``weight_scale_inv``), so a release's ``modules_to_not_convert`` is honoured without being parsed.

:func:`load_quantized_model` builds the transformers model with its parameters on the meta device
(accelerate's ``init_empty_weights``, buffers real: rotary tables are computed as usual), swaps the
quantized layers for :class:`~.fp8_modules.Fp8Linear` / :class:`~.fp8_modules.Fp8Experts`, then reads
the safetensors files one tensor at a time straight into the device tensors: an FP8 weight never
exists as a float tensor (peak memory ~ the FP8 model plus one tensor). With ``quantize=True`` a
float checkpoint is loaded the same way and each projection / expert weight is quantized on the
device as it is read (the float model never exists either). transformers' ``FineGrainedFP8Config``
path is not used: it needs the ``kernels`` package (kernels downloaded from a hub at run time) and
dequantizes to bf16 on a machine without a GPU.
"""

from __future__ import annotations

import copy
import json
import os
import re
from typing import Any

import torch
from torch import nn

from ..ops.fp8 import FP8_BLOCK, FP8_DTYPE, quantize_weight_blocks
from .fp8_modules import Fp8Experts, Fp8Linear, fp8_targets, is_experts_module

__all__ = ["UnsupportedQuantizationError", "checkpoint_quantization", "load_quantized_model",
           "quantized_targets", "resolve_quantization"]

SUPPORTED_QUANTIZATION = ("fp8",)


class UnsupportedQuantizationError(ValueError):
    """A quantization method or setting hybrid_compile cannot serve; the message names it."""


def _as_dict(qc: Any) -> dict:
    if isinstance(qc, dict):
        return qc
    if hasattr(qc, "to_dict"):
        return qc.to_dict()
    return dict(vars(qc))


def checkpoint_quantization(config) -> str | None:
    """The quantization of a checkpoint's config: None (unquantized) or ``"fp8"`` (fine-grained
    block FP8). Any other method, or an FP8 variant the kernels do not implement, raises
    :class:`UnsupportedQuantizationError` naming it."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    qc = _as_dict(qc)
    method = qc.get("quant_method")
    if method != "fp8":
        raise UnsupportedQuantizationError(
            f"quantization method {method!r} of this checkpoint is not supported: hybrid_compile serves unquantized "
            "checkpoints and the fine-grained FP8 format (quant_method 'fp8', e4m3 weights, weight_block_size "
            "[128, 128], dynamic activation scales)")
    problems = []
    if qc.get("fmt", "e4m3") != "e4m3":
        problems.append(f"fmt {qc.get('fmt')!r} (only 'e4m3')")
    if list(qc.get("weight_block_size") or []) != [FP8_BLOCK, FP8_BLOCK]:
        problems.append(f"weight_block_size {qc.get('weight_block_size')!r} (only [128, 128]; per-tensor FP8 is "
                        "not supported)")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        problems.append(f"activation_scheme {qc.get('activation_scheme')!r} (only 'dynamic')")
    if qc.get("scale_fmt") not in (None, "float"):
        problems.append(f"scale_fmt {qc.get('scale_fmt')!r} (only fp32 scales)")
    if qc.get("expert_dtype") not in (None, "fp8"):
        problems.append(f"expert_dtype {qc.get('expert_dtype')!r} (only 'fp8')")
    if problems:
        raise UnsupportedQuantizationError("quantization method 'fp8' with unsupported settings: "
                                           + "; ".join(problems))
    return "fp8"


def resolve_quantization(requested: str | None, config=None) -> str | None:
    """The quantization to serve with: the checkpoint's own, else ``requested`` (None or ``"fp8"``)."""
    if requested not in (None, *SUPPORTED_QUANTIZATION):
        raise UnsupportedQuantizationError(
            f"quantization={requested!r} is not supported; use 'fp8' (block FP8 weights) or None")
    own = checkpoint_quantization(config) if config is not None else None
    return own or requested


# --------------------------------------------------------------------------------------------
# safetensors reading
# --------------------------------------------------------------------------------------------


class _Checkpoint:
    """The tensors of a directory's safetensors files, read one at a time."""

    def __init__(self, path: str):
        from safetensors import safe_open

        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no safetensors weights in {path!r}")
        self._handles = [safe_open(os.path.join(path, f), framework="pt", device="cpu") for f in files]
        self.where = {k: h for h in self._handles for k in h.keys()}
        self.used: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def get(self, key: str, device, dtype: torch.dtype | None = None) -> torch.Tensor:
        if key not in self.where:
            raise KeyError(key)
        self.used.add(key)
        t = self.where[key].get_tensor(key)
        return t.to(device=device, dtype=dtype or t.dtype)


def _fp8_pair(ckpt: _Checkpoint, prefix: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    w = ckpt.get(f"{prefix}.weight", device)
    if w.dtype != FP8_DTYPE:
        raise ValueError(f"{prefix}.weight has a weight_scale_inv but dtype {w.dtype}, not {FP8_DTYPE}")
    return w, ckpt.get(f"{prefix}.weight_scale_inv", device, torch.float32)


def _load_linear(ckpt, name, linear: nn.Linear, device, quantize: bool, dtype) -> Fp8Linear:
    bias = ckpt.get(f"{name}.bias", device, dtype) if linear.bias is not None else None
    if quantize:
        q, s = quantize_weight_blocks(ckpt.get(f"{name}.weight", device))
    else:
        q, s = _fp8_pair(ckpt, name, device)
    return Fp8Linear(q, s, bias)


def _load_experts(ckpt, name, experts: nn.Module, device, quantize: bool) -> Fp8Experts:
    has_gate = hasattr(experts, "gate_up_proj")
    up_name = "gate_up_proj" if has_gate else "up_proj"
    if f"{name}.{up_name}" in ckpt:  # already stored fused, 3-D
        def fused(attr):
            w = ckpt.get(f"{name}.{attr}", device)
            return quantize_weight_blocks(w) if quantize else (w, ckpt.get(f"{name}.{attr}_scale_inv", device))
        uq, us = fused(up_name)
        dq, ds = fused("down_proj")
        return Fp8Experts(uq, us, dq, ds, experts.act_fn, has_gate)
    num, inter = experts.down_proj.shape[0], experts.down_proj.shape[2]
    if has_gate and not quantize and inter % FP8_BLOCK:
        raise ValueError(f"{name}: FP8 experts with a gate need moe_intermediate_size divisible by {FP8_BLOCK} "
                         f"(gate and up block scales are stacked), got {inter}")
    ups, up_scales, downs, down_scales = [], [], [], []
    for e in range(num):
        parts = ("gate_proj", "up_proj") if has_gate else ("up_proj",)
        if quantize:
            u, us = quantize_weight_blocks(torch.cat([ckpt.get(f"{name}.{e}.{p}.weight", device) for p in parts]))
            d, ds = quantize_weight_blocks(ckpt.get(f"{name}.{e}.down_proj.weight", device))
        else:
            pairs = [_fp8_pair(ckpt, f"{name}.{e}.{p}", device) for p in parts]
            u, us = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
            d, ds = _fp8_pair(ckpt, f"{name}.{e}.down_proj", device)
        ups.append(u), up_scales.append(us), downs.append(d), down_scales.append(ds)
    return Fp8Experts(torch.stack(ups), torch.stack(up_scales), torch.stack(downs), torch.stack(down_scales),
                      experts.act_fn, has_gate)


def quantized_targets(model: nn.Module, ckpt) -> tuple[list[str], list[str]]:
    """Layers the checkpoint stores in FP8 (those with a ``weight_scale_inv``): linear layers and experts
    modules by name; ``ckpt`` answers ``key in ckpt`` for the model's names (here and in the
    tensor-parallel shard loader)."""
    linears, experts = [], []
    for name, module in model.named_modules():
        if type(module) is nn.Linear and f"{name}.weight_scale_inv" in ckpt:
            linears.append(name)
        elif is_experts_module(module) and (f"{name}.0.down_proj.weight_scale_inv" in ckpt
                                            or f"{name}.down_proj_scale_inv" in ckpt):
            experts.append(name)
    return linears, experts


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor, is_param: bool) -> None:
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    if is_param:
        module._parameters[attr] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[attr] = value


@torch.no_grad()
def load_quantized_model(path: str, config, *, device: str | torch.device, dtype: torch.dtype | str = "auto",
                         quantize: bool = False, trust_remote_code: bool = False) -> nn.Module:
    """A transformers causal LM of ``path`` with FP8 projections and experts on ``device``.

    ``quantize=False``: the checkpoint is in the fine-grained FP8 format (its FP8 layers stay FP8).
    ``quantize=True``: a float checkpoint whose projections and experts are quantized as they are read
    (:func:`~.fp8_modules.fp8_targets` picks them). Other parameters are loaded in ``dtype``
    (``"auto"``: the config's ``dtype``, else bfloat16). Checkpoint tensors the model does not have
    (beyond its ``_keys_to_ignore_on_load_unexpected``, e.g. Qwen3-Next's MTP layers) and model
    parameters the checkpoint lacks raise a ValueError naming them.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, GenerationConfig

    device = torch.device(device)
    if dtype in (None, "auto"):
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.bfloat16
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    ckpt = _Checkpoint(path)
    linears, experts = fp8_targets(model) if quantize else quantized_targets(model, ckpt)
    if not quantize and not (linears or experts):
        raise ValueError(f"{path!r} declares FP8 quantization but has no weight_scale_inv tensors for this model's "
                         "linear layers")
    for name in linears:
        model.set_submodule(name, _load_linear(ckpt, name, model.get_submodule(name), device, quantize, dtype))
    for name in experts:
        model.set_submodule(name, _load_experts(ckpt, name, model.get_submodule(name), device, quantize))
    missing = []
    for name, p in list(model.named_parameters()):
        if p.device.type != "meta":
            continue
        if name in ckpt:
            _set_tensor(model, name, ckpt.get(name, device, p.dtype), True)
        else:
            missing.append(name)
    tied = getattr(config, "tie_word_embeddings", False) and model.get_output_embeddings() is not None
    if tied:
        head = model.get_output_embeddings()
        head_names = [n for n, m in model.named_modules() if m is head]
        missing = [n for n in missing if n not in {f"{h}.weight" for h in head_names}]
        model.tie_weights()
    if missing:
        raise ValueError(f"{path!r} lacks {len(missing)} weight(s) of the model, e.g. {', '.join(missing[:4])}")
    for name, b in list(model.named_buffers()):
        value = ckpt.get(name, device, b.dtype) if name in ckpt else b.to(device)
        _set_tensor(model, name, value, False)
    ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    unexpected = [k for k in ckpt.where if k not in ckpt.used and not any(p.search(k) for p in ignore)]
    if unexpected:
        raise ValueError(f"{path!r} has {len(unexpected)} tensor(s) this model does not use, e.g. "
                         f"{', '.join(sorted(unexpected)[:4])} (renamed checkpoint keys are not supported by the FP8 "
                         "loader)")
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()
