"""Model families: detect a model's family and patch its layer classes. One module per mechanism
patched: :mod:`.gated_deltanet` (the Gated DeltaNet mixers of Qwen3-Next, Qwen3.5 and OLMo-Hybrid),
:mod:`.mamba2` (Mamba2 mixers and attention, one HF layer index each: Mamba2, NemotronH, Bamba,
Granite-4), :mod:`.falcon_h1` (parallel attention + Mamba2 in every layer), :mod:`.zamba2`
(Mamba2 layers + a shared attention block), :mod:`.short_conv` (LFM2's and LFM3's short convolutions),
:mod:`.kimi_linear` (Kimi Delta Attention + multi-head latent attention over a compressed cache);
:mod:`.recurrent_gemma` (RecurrentGemma's RG-LRU blocks, on the Mamba1 scan ops, + local attention);
:mod:`.mamba1` (Mamba1 mixers and attention: Mamba, FalconMamba, Jamba), :mod:`.zamba` (multi-head
Mamba1 layers + a shared attention block), :mod:`.minimax` (MiniMax lightning attention + softmax
attention, MoE);
:mod:`.mamba2_common` holds the Mamba2 mixer forward they share, :mod:`.mtp` the
multi-token-prediction heads, :mod:`.base` the patch handle and the attention hook, :mod:`.fused_experts`
the family-independent MoE experts patch and :mod:`.fused_router` the softmax top-k router patch
(both ``EngineConfig.fused_moe``, applied by the engine).

``FAMILIES`` maps ``config.model_type`` to the family module, which provides
``layout(model) -> ModelLayout`` (what the pools need) and ``patch(model, handle)`` (per
instance; ``handle.undo()`` restores HF's behaviour). Weights are never copied or renamed.
"""

from __future__ import annotations

from types import ModuleType

from torch import nn

from . import (
    falcon_h1, gated_deltanet, kimi_linear, mamba1, mamba2, minimax, recurrent_gemma, short_conv, zamba, zamba2,
)
from .base import ModelLayout, PatchHandle

_FAMILY_MODULES = (
    gated_deltanet, kimi_linear, mamba2, falcon_h1, zamba2, short_conv, mamba1, zamba, minimax, recurrent_gemma,
)
FAMILIES: dict[str, ModuleType] = {t: family for family in _FAMILY_MODULES for t in family.MODEL_TYPES}


def supported_model_types() -> list[str]:
    return sorted(FAMILIES)


def family_of(model: nn.Module) -> ModuleType:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(
            f"hybrid_compile does not support model type {model_type!r} ({type(model).__name__}); "
            f"supported model types: {', '.join(supported_model_types())}"
        )
    return family


__all__ = ["FAMILIES", "ModelLayout", "PatchHandle", "family_of", "supported_model_types"]
