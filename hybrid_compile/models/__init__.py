"""Model families: one module per HF family that detects it and patches its layer classes.

``FAMILIES`` maps ``config.model_type`` to the family module, which provides
``layout(model) -> ModelLayout`` (what the pools need) and ``patch(model, handle)`` (per
instance; ``handle.undo()`` restores HF's behaviour). Weights are never copied or renamed.
"""

from __future__ import annotations

from types import ModuleType

from torch import nn

from . import falcon_h1, lfm2, mamba2_per_layer, qwen3_next, zamba2
from .base import ModelLayout, PatchHandle

_FAMILY_MODULES = (qwen3_next, mamba2_per_layer, falcon_h1, zamba2, lfm2)
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
