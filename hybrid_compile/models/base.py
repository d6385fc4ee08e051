"""Family-independent patching: the attention hook, per-instance forward patches, model layout.

Everything here acts on ONE model instance. Full attention goes through an attention function
registered with transformers' ``AttentionInterface`` (plus a mask function registered with
``AttentionMaskInterface`` so HF builds no N x N mask for a packed batch); the instance's
modules get a private shallow copy of their config that selects it, so other instances built
from the same config object keep HF's attention. Outside an engine step (no forward context)
both functions hand over to the implementation the model had before, so ``model.generate``
on a wrapped model still gives HF's result.
"""

from __future__ import annotations

import copy
import sys
import types
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..memory import AttentionLayerSpec, MambaLayerSpec
from ..layers import attention as _attention_layer  # noqa: F401  (registers attention_layer)
from ..layers.context import get_forward_context

ATTN_IMPLEMENTATION = "hybrid_compile"
_FALLBACK_ATTR = "_hybrid_compile_fallback_attn"


@dataclass
class ModelLayout:
    """What the pools and the engine need to know about a model.

    ``attention`` / ``mamba`` are the memory pools' layer specs (one per layer), built with the
    cache dtypes the engine chose.
    """

    attention: list[AttentionLayerSpec]
    mamba: list[MambaLayerSpec]
    vocab_size: int
    max_position_embeddings: int
    ssm_chunk_size: int


@dataclass
class PatchHandle:
    """Undo information for one patched model instance."""

    restores: list[Callable[[], None]] = field(default_factory=list)

    def undo(self) -> None:
        while self.restores:
            self.restores.pop()()


# ---------------------------------------------------------------------------------------------
# attention + mask functions
# ---------------------------------------------------------------------------------------------


def _fallback_attention(module: nn.Module) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = getattr(module.config, _FALLBACK_ATTR, "sdpa")
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if name == "eager" or name not in ALL_ATTENTION_FUNCTIONS:
        if eager is None:
            raise RuntimeError(f"no eager attention function found for {type(module).__name__}")
        return eager
    return ALL_ATTENTION_FUNCTIONS[name]


def hybrid_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
):
    """HF attention-function signature: q ``[1, Hq, N, D]``, k/v ``[1, Hkv, N, D]`` -> ``[1, N, Hq, Dv]``."""
    if get_forward_context() is None:
        return _fallback_attention(module)(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
            sliding_window=sliding_window, softcap=softcap, **kwargs,
        )
    if query.shape[0] != 1:
        raise RuntimeError("hybrid_compile attention expects a packed batch of one row")
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out = torch.ops.hybrid_compile.attention_layer(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
        int(module.layer_idx), scale, int(sliding_window or -1), float(softcap or 0.0),
    )
    return out.unsqueeze(0), None


def hybrid_attention_mask(*args, config=None, **kwargs):
    """No mask inside an engine step (the attention op knows the request boundaries)."""
    if get_forward_context() is not None:
        return None
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    name = getattr(config, _FALLBACK_ATTR, "sdpa")
    return ALL_MASK_ATTENTION_FUNCTIONS[name](*args, config=config, **kwargs)


_registered = False


def register_attention_functions() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, hybrid_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, hybrid_attention_mask)
    _registered = True


def install_attention(model: nn.Module, handle: PatchHandle) -> None:
    """Point this instance's modules at a private config copy that selects our attention."""
    register_attention_functions()
    copies: dict[int, object] = {}
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is None or not hasattr(cfg, "_attn_implementation"):
            continue
        if getattr(cfg, _FALLBACK_ATTR, None) is not None:
            continue  # already one of our copies
        new = copies.get(id(cfg))
        if new is None:
            new = copy.copy(cfg)
            original = cfg._attn_implementation or "sdpa"
            setattr(new, _FALLBACK_ATTR, original)
            new._attn_implementation_internal = ATTN_IMPLEMENTATION
            copies[id(cfg)] = new
        module.__dict__["config"] = new
        handle.restores.append(lambda m=module, c=cfg: m.__dict__.__setitem__("config", c))


#: The instance attribute holding the forward that a tensor-parallel all-reduce wraps
#: (distributed/layers.py ``reduce_output``).
INNER_FORWARD = "_hc_inner_forward"


def patch_forward(module: nn.Module, forward: Callable, handle: PatchHandle) -> None:
    """Replace ``module.forward`` on this instance only (the class is untouched); a module whose output
    a tensor-parallel rank all-reduces gets the new forward inside the reduction (:data:`INNER_FORWARD`)."""
    inner = module.__dict__.get(INNER_FORWARD)
    if inner is not None:
        module.__dict__[INNER_FORWARD] = types.MethodType(forward, module)
        handle.restores.append(lambda m=module, f=inner: m.__dict__.__setitem__(INNER_FORWARD, f))
        return
    module.forward = types.MethodType(forward, module)
    handle.restores.append(lambda m=module: m.__dict__.pop("forward", None))


def require_hf_modules(model: nn.Module, class_name: str, family: str) -> list[nn.Module]:
    """The model's modules of transformers' class ``class_name``, or one clear error when there are
    none (e.g. a checkpoint's own ``trust_remote_code`` implementation of the family)."""
    found = [m for m in model.modules() if type(m).__name__ == class_name]
    if not found:
        raise ValueError(
            f"{type(model).__name__}: found no {class_name} layer to patch (hybrid_compile patches transformers' "
            f"own {family} classes, not a checkpoint's trust_remote_code model)"
        )
    return found
