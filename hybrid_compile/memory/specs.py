"""Layer specs: what the memory pools need to know about a model's layers, and nothing more.

The pools are model-agnostic. A model family describes its cache-carrying layers with

- :class:`AttentionLayerSpec` — full-attention layers (one K and one V tensor per token), and
- :class:`MambaLayerSpec` — linear-attention / state-space layers (one conv window and one
  recurrent state per request),

and the pools, the sizing and the byte accounting work from those alone. A spec covers one
or more layers with identical shapes and dtypes; :func:`group_layer_specs` merges specs that
agree, so a caller may pass one spec per layer or one per group and get the same pools
(one stacked tensor per group, per-layer views into it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Iterable, Sequence, TypeVar, Union

import torch

LayerIds = Union[int, Iterable[int]]


def _normalize_layer_ids(owner: str, layer_ids: LayerIds) -> tuple[int, ...]:
    ids = (layer_ids,) if isinstance(layer_ids, int) else tuple(layer_ids)
    if not ids:
        raise ValueError(f"{owner}: `layer_ids` must name at least one layer")
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise ValueError(f"{owner}: layer ids must be non-negative ints, got {i!r}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{owner}: duplicate layer ids in {ids}")
    return tuple(sorted(ids))


def _check_positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{owner}: `{name}` must be a positive int, got {value!r}")


def _check_dtype(owner: str, name: str, dtype: object) -> None:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{owner}: `{name}` must be a torch.dtype, got {dtype!r}")


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


#: The FP8 pool dtype (e4m3); its fp32 scales live beside it (``hybrid_compile.ops.fp8_cache``).
FP8_POOL_DTYPE = torch.float8_e4m3fn
_SCALE_BYTES = 4  # one fp32 scale per vector


@dataclass(frozen=True)
class AttentionLayerSpec:
    """Full-attention layers whose K/V live in the KV pool.

    Args:
        layer_ids: the model's layer index (or indices, for several identical layers).
        num_kv_heads: K/V heads per token.
        head_dim: K head dim.
        dtype: KV cache dtype; ``float8_e4m3fn`` adds one fp32 scale per token and head to K and
            to V (``[slots, num_kv_heads]`` each, counted in the bytes per token).
        v_head_dim: V head dim; ``None`` means equal to ``head_dim``.
        v_from_k: V is the first ``v_head_dim`` channels of K, stored once (multi-head latent
            attention's compressed cache: per token one latent ``[kv_lora_rank]`` then the shared
            rope key, read as K whole and as V without the rope part). Float dtypes only.
    """

    layer_ids: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    v_head_dim: int | None = None
    v_from_k: bool = False

    def __post_init__(self) -> None:
        owner = "AttentionLayerSpec"
        object.__setattr__(self, "layer_ids", _normalize_layer_ids(owner, self.layer_ids))
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        _check_positive(owner, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, v_head_dim=self.v_head_dim)
        _check_dtype(owner, "dtype", self.dtype)
        if self.v_from_k and self.v_head_dim > self.head_dim:
            raise ValueError(f"{owner}: with `v_from_k`, v_head_dim ({self.v_head_dim}) must be <= head_dim "
                             f"({self.head_dim})")
        if self.v_from_k and self.is_fp8:
            raise ValueError(f"{owner}: an FP8 KV cache (kv_cache_dtype='fp8') is not supported for a compressed "
                             f"MLA cache (`v_from_k`): K and V would need their own scales")

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def k_shape(self) -> tuple[int, int]:
        """Per-token K shape ``(num_kv_heads, head_dim)``."""
        return (self.num_kv_heads, self.head_dim)

    @property
    def v_shape(self) -> tuple[int, int]:
        """Per-token V shape ``(num_kv_heads, v_head_dim)``."""
        return (self.num_kv_heads, self.v_head_dim)

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8_POOL_DTYPE

    @property
    def bytes_per_token_per_layer(self) -> int:
        v_dim = 0 if self.v_from_k else self.v_head_dim
        values = self.num_kv_heads * (self.head_dim + v_dim) * _element_size(self.dtype)
        return values + (2 * self.num_kv_heads * _SCALE_BYTES if self.is_fp8 else 0)

    @property
    def bytes_per_token(self) -> int:
        """K + V bytes of one token over all layers of this spec."""
        return self.bytes_per_token_per_layer * self.num_layers


@dataclass(frozen=True)
class MambaLayerSpec:
    """Linear-attention / state-space layers whose per-request state lives in the Mamba pool.

    Args:
        layer_ids: the model's layer index (or indices, for several identical layers).
        conv_width: causal conv kernel size W; the pool keeps the last ``W - 1`` inputs.
        conv_dim: channels of the causal conv (e.g. GDN: ``2*K*Hk + V*Hv``; Mamba2:
            ``intermediate + 2*groups*state``).
        state_shape: per-request recurrent state shape (GDN ``(H, K, V)``, Mamba2 ``(H, P, N)``);
            ``()`` for a conv-only layer (LFM2's short conv): its only state is the conv window,
            and the pool keeps no SSM tensor for it.
        conv_dtype: conv window dtype (usually the model dtype).
        ssm_dtype: recurrent state dtype (fp32 by default: the state accumulates over the
            whole sequence, and low precision drifts). ``float8_e4m3fn`` adds one fp32 scale per
            vector along ``ssm_scale_dim`` (:attr:`ssm_scale_shape`, counted in the slot bytes).
        ssm_scale_dim: the state axis one FP8 scale covers, counted from the end (the axis the
            family's kernels hold whole: GDN ``-2`` = K of ``(H, K, V)``, Mamba2 ``-1`` = N).
    """

    layer_ids: tuple[int, ...]
    conv_width: int
    conv_dim: int
    state_shape: tuple[int, ...]
    conv_dtype: torch.dtype
    ssm_dtype: torch.dtype = torch.float32
    ssm_scale_dim: int = -1

    def __post_init__(self) -> None:
        owner = "MambaLayerSpec"
        object.__setattr__(self, "layer_ids", _normalize_layer_ids(owner, self.layer_ids))
        _check_positive(owner, conv_width=self.conv_width, conv_dim=self.conv_dim)
        shape = tuple(self.state_shape)  # () = conv-only layer
        for d in shape:
            _check_positive(owner, state_shape_dim=d)
        object.__setattr__(self, "state_shape", shape)
        _check_dtype(owner, "conv_dtype", self.conv_dtype)
        _check_dtype(owner, "ssm_dtype", self.ssm_dtype)
        if shape and not -len(shape) <= self.ssm_scale_dim < 0:
            raise ValueError(f"{owner}: `ssm_scale_dim` must be in [-{len(shape)}, -1], got {self.ssm_scale_dim}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def has_ssm_state(self) -> bool:
        """False for a conv-only layer (``state_shape == ()``): no recurrent state tensor."""
        return bool(self.state_shape)

    @property
    def conv_window_shape(self) -> tuple[int, int]:
        """Per-request conv window shape ``(conv_width - 1, conv_dim)``."""
        return (self.conv_width - 1, self.conv_dim)

    @property
    def conv_bytes_per_slot_per_layer(self) -> int:
        return math.prod(self.conv_window_shape) * _element_size(self.conv_dtype)

    @property
    def ssm_is_fp8(self) -> bool:
        return self.has_ssm_state and self.ssm_dtype == FP8_POOL_DTYPE

    @property
    def ssm_scale_shape(self) -> tuple[int, ...] | None:
        """Per-slot shape of the fp32 scales of an FP8 state (``state_shape`` without
        ``ssm_scale_dim``), None for a float state."""
        if not self.ssm_is_fp8:
            return None
        dim = self.ssm_scale_dim % len(self.state_shape)
        return tuple(d for i, d in enumerate(self.state_shape) if i != dim)

    @property
    def ssm_bytes_per_slot_per_layer(self) -> int:
        if not self.has_ssm_state:
            return 0
        scales = math.prod(self.ssm_scale_shape) * _SCALE_BYTES if self.ssm_is_fp8 else 0
        return math.prod(self.state_shape) * _element_size(self.ssm_dtype) + scales

    @property
    def bytes_per_slot_per_layer(self) -> int:
        return self.conv_bytes_per_slot_per_layer + self.ssm_bytes_per_slot_per_layer

    @property
    def bytes_per_slot(self) -> int:
        """Conv window + SSM state bytes of one request over all layers of this spec."""
        return self.bytes_per_slot_per_layer * self.num_layers


Spec = TypeVar("Spec", AttentionLayerSpec, MambaLayerSpec)


def group_layer_specs(specs: Sequence[Spec]) -> list[Spec]:
    """Merge specs with identical shapes and dtypes into one spec per group.

    Groups are ordered by their first layer id; a layer id named twice raises ValueError.
    """
    seen: dict[int, int] = {}
    groups: dict[tuple, list[int]] = {}
    templates: dict[tuple, Spec] = {}
    for spec in specs:
        if not isinstance(spec, (AttentionLayerSpec, MambaLayerSpec)):
            raise TypeError(f"expected AttentionLayerSpec or MambaLayerSpec, got {type(spec).__name__}")
        key = (type(spec),) + tuple(getattr(spec, f.name) for f in fields(spec) if f.name != "layer_ids")
        for layer_id in spec.layer_ids:
            if layer_id in seen:
                raise ValueError(f"layer {layer_id} is described by more than one layer spec")
            seen[layer_id] = 1
        groups.setdefault(key, []).extend(spec.layer_ids)
        templates.setdefault(key, spec)
    merged = [replace(templates[key], layer_ids=tuple(ids)) for key, ids in groups.items()]
    return sorted(merged, key=lambda s: s.layer_ids[0])


def check_disjoint_layers(attention: Sequence[AttentionLayerSpec], mamba: Sequence[MambaLayerSpec]) -> None:
    """A layer is either full attention or linear, never both."""
    attn_ids = {i for s in attention for i in s.layer_ids}
    both = sorted(attn_ids.intersection(i for s in mamba for i in s.layer_ids))
    if both:
        raise ValueError(f"layers {both} are described both as attention and as Mamba/linear layers")


def kv_bytes_per_token(attention: Sequence[AttentionLayerSpec]) -> int:
    """Bytes of K and V of one token summed over every full-attention layer."""
    return sum(s.bytes_per_token for s in attention)


def mamba_bytes_per_slot(mamba: Sequence[MambaLayerSpec]) -> int:
    """Bytes of conv window and SSM state of one Mamba slot summed over every linear layer."""
    return sum(s.bytes_per_slot for s in mamba)
