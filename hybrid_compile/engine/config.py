"""Engine configuration: :class:`EngineConfig`, with validation and keyword overrides."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class EngineConfig:
    """Settings of one :class:`~hybrid_compile.engine.HybridEngine`.

    Capacities left as None are derived from a memory budget: ``memory_fraction`` of the free
    device memory (or of available RAM on CPU), split between the Mamba pool and the KV pool
    so that mamba bytes / KV bytes = ``mamba_full_memory_ratio`` (seed 001 §6).
    """

    device: str | torch.device | None = None  # default: the model's device
    dtype: torch.dtype | str | None = None  # activations; default: the model's dtype
    ssm_state_dtype: torch.dtype | str = torch.float32
    max_running_requests: int = 16
    max_total_tokens: int | None = None  # KV token capacity
    mamba_cache_size: int | None = None  # Mamba slots
    memory_fraction: float = 0.5
    mamba_full_memory_ratio: float = 0.5
    max_context_len: int | None = None  # default: min(model max positions, max_total_tokens)
    page_size: int = 1
    chunked_prefill_size: int = 2048  # max prefill tokens per step
    max_prefill_tokens: int | None = None  # alias budget per step; default chunked_prefill_size
    enable_prefix_cache: bool = False  # HybridRadixCache: reuse KV + Mamba states of finished requests
    speculative: Any = None
    # torch.compile with our backend (hybrid_compile.passes): Dynamo graph split at the layer ops, pieces
    # compiled by Inductor. None will mean "on for CUDA" once CUDA graphs exist; until then None means off
    # everywhere (see resolved_compile).
    compile: bool | None = None
    cuda_graphs: bool | None = None
    seed: int = 0
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_args(cls, config: "EngineConfig | dict | None" = None, **overrides) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if isinstance(config, dict):
            unknown += sorted(set(config) - names)
        if unknown:
            raise TypeError(
                f"unknown EngineConfig field(s): {', '.join(unknown)}; valid fields: {', '.join(sorted(names))}"
            )
        if config is None:
            base = cls()
        elif isinstance(config, dict):
            base = cls(**config)
        elif isinstance(config, cls):
            base = dataclasses.replace(config)
        else:
            raise TypeError(f"config must be an EngineConfig or a dict, got {type(config).__name__}")
        result = dataclasses.replace(base, **overrides)
        result.validate()
        return result

    def validate(self) -> None:
        def positive(name):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v <= 0):
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {v!r}")

        for name in ("max_running_requests", "max_total_tokens", "mamba_cache_size", "page_size",
                     "chunked_prefill_size", "max_prefill_tokens", "max_context_len"):
            positive(name)
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"EngineConfig.memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if not self.mamba_full_memory_ratio > 0:
            raise ValueError(f"EngineConfig.mamba_full_memory_ratio must be > 0, got {self.mamba_full_memory_ratio}")
        if self.speculative is not None:
            raise NotImplementedError("EngineConfig.speculative: speculative decoding is not implemented yet")
        if self.compile not in (None, True, False):
            raise ValueError(f"EngineConfig.compile must be True, False or None, got {self.compile!r}")
        if self.cuda_graphs:
            raise NotImplementedError("EngineConfig.cuda_graphs: CUDA graphs are not implemented yet")

    def resolved_compile(self, device: torch.device) -> bool:
        """Whether the engine compiles the model forward. ``compile=None`` (the default) is meant to
        become "on for CUDA" together with CUDA graphs (compile issue, GPU half); until those exist it
        means off on every device, so only ``compile=True`` turns it on."""
        return bool(self.compile)

    def resolved_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return _as_dtype(self.dtype) if self.dtype is not None else model_dtype


def _as_dtype(d: torch.dtype | str) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    value = getattr(torch, str(d).replace("torch.", ""), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {d!r}")
    return value
