"""KV pool: the K and V cache of the full-attention layers only.

Linear layers get no KV storage at all; :attr:`KVPool.layer_to_kv_index` maps a model layer
id to its index among the full-attention layers (SGLang's HybridLinearKVPool mapping).

Layout (fixed by the attention kernel ops, ``hybrid_compile.ops.attention``): per layer
``k: [num_token_slots, num_kv_heads, head_dim]`` and ``v: [num_token_slots, num_kv_heads,
v_head_dim]``. Layers with identical shapes and dtype share one stacked tensor
``[num_layers_in_group, num_token_slots, ...]``; :meth:`KVPool.k_cache` / :meth:`KVPool.v_cache`
return per-layer views of it (contiguous, except V of a compressed MLA cache: the
first ``v_head_dim`` channels of K, :attr:`~.specs.AttentionLayerSpec.v_from_k`). Slots are token-level (``slot = page * page_size +
offset``) and handed out by the pool's :class:`~.allocator.TokenSlotAllocator`. Slot 0 (in
the reserved page 0) is the dummy slot: padded tokens of a CUDA-graph batch write their K/V
there, and no request ever reads it. K/V of allocated slots are not cleared: every position
is written by the forward pass before attention reads it.

FP8 KV cache (an :class:`~.specs.AttentionLayerSpec` of dtype ``float8_e4m3fn``): K and V hold e4m3
values and, beside them, fp32 scales ``k_scale / v_scale [num_token_slots, num_kv_heads]`` (one
per token and head, stacked per group like the values; :meth:`KVPool.kv_scales`). The attention
ops quantize on write and dequantize on read (``hybrid_compile.ops.fp8_cache``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .allocator import TokenSlotAllocator
from .specs import AttentionLayerSpec, group_layer_specs, kv_bytes_per_token


class KVPool:
    """K/V buffers of the full-attention layers plus the token-slot allocator.

    Args:
        specs: the full-attention layers (may be empty: a pure SSM model keeps token slots
            for bookkeeping but stores no K/V).
        max_total_tokens: usable token slots; a multiple of ``page_size``.
        page_size: tokens per page.
        device: where the buffers live.
    """

    PADDING_SLOT = TokenSlotAllocator.PADDING_SLOT

    def __init__(
        self,
        specs: Sequence[AttentionLayerSpec],
        max_total_tokens: int,
        *,
        page_size: int = 1,
        device: torch.device | str = "cpu",
    ) -> None:
        if page_size < 1:
            raise ValueError(f"KVPool: page_size must be >= 1, got {page_size}")
        if max_total_tokens < 0 or max_total_tokens % page_size != 0:
            raise ValueError(
                f"KVPool: max_total_tokens ({max_total_tokens}) must be a non-negative multiple of page_size ({page_size})"
            )
        self.specs = group_layer_specs(specs)
        self.device = torch.device(device)
        self.page_size = page_size
        self.allocator = TokenSlotAllocator(max_total_tokens // page_size, page_size)
        self.num_token_slots = self.allocator.num_slots
        self.layer_ids: list[int] = sorted(i for s in self.specs for i in s.layer_ids)
        self.layer_to_kv_index: dict[int, int] = {layer: idx for idx, layer in enumerate(self.layer_ids)}

        self._build()
        self.bytes_per_token = kv_bytes_per_token(self.specs)
        # tensor parallelism (hybrid_compile.distributed): rank 0's pool tells the other ranks' pools
        # about every K/V write outside a forward (copy_slots)
        self.observer = None

    def _build(self, old: "tuple[list, list, list] | None" = None) -> None:
        """Allocate the buffers for ``num_token_slots`` (copying the slots both sizes have from
        ``old`` = the previous (k, v, scale) buffers) and make the per-layer views."""
        self.k_buffers: list[torch.Tensor] = []  # one stacked tensor per spec group
        self.v_buffers: list[torch.Tensor] = []
        self.scale_buffers: list[torch.Tensor] = []  # FP8 groups: [2 (k, v), layers, slots, heads] fp32
        k_views: dict[int, torch.Tensor] = {}
        v_views: dict[int, torch.Tensor] = {}
        scale_views: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        for g, spec in enumerate(self.specs):
            k = torch.zeros((spec.num_layers, self.num_token_slots, *spec.k_shape), dtype=spec.dtype, device=self.device)
            if old is not None:
                _copy_common_slots(k, old[0][g], 1)
            self.k_buffers.append(k)
            if spec.v_from_k:  # MLA's compressed cache: V is a view of K's first channels, stored once
                v = k[..., : spec.v_head_dim]
            else:
                v = torch.zeros((spec.num_layers, self.num_token_slots, *spec.v_shape), dtype=spec.dtype,
                                device=self.device)
                if old is not None:
                    _copy_common_slots(v, old[1][len(self.v_buffers)], 1)
                self.v_buffers.append(v)
            scales = None
            if spec.is_fp8:
                scales = torch.zeros((2, spec.num_layers, self.num_token_slots, spec.num_kv_heads),
                                     dtype=torch.float32, device=self.device)
                if old is not None:
                    _copy_common_slots(scales, old[2][len(self.scale_buffers)], 2)
                self.scale_buffers.append(scales)
            for pos, layer_id in enumerate(spec.layer_ids):
                k_views[layer_id] = k[pos]
                v_views[layer_id] = v[pos]
                scale_views[layer_id] = (None, None) if scales is None else (scales[0, pos], scales[1, pos])
        # Per-layer views in kv-index order (index = layer_to_kv_index[layer_id]).
        self.k_caches: list[torch.Tensor] = [k_views[i] for i in self.layer_ids]
        self.v_caches: list[torch.Tensor] = [v_views[i] for i in self.layer_ids]
        self.kv_scale_views: list[tuple[torch.Tensor | None, torch.Tensor | None]] = [
            scale_views[i] for i in self.layer_ids
        ]

    def resize(self, num_pages: int) -> None:
        """Grow or shrink to ``num_pages`` usable pages between steps (elastic pools): new
        buffers, the slots both sizes have copied over, the old ones released; shrinking takes
        free pages off the top only (:meth:`TokenSlotAllocator.free_pages_at_top`). Every
        per-layer view changes: whoever keeps views asks for them again."""
        self.allocator.resize(num_pages)
        self.num_token_slots = self.allocator.num_slots
        old = (self.k_buffers, self.v_buffers, self.scale_buffers)
        self.k_buffers = self.v_buffers = self.scale_buffers = []  # (the old ones go as soon as copied)
        self._build(old)

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    def kv_index(self, layer_id: int) -> int:
        """Index of a full-attention layer in the pool; KeyError names the known layers."""
        try:
            return self.layer_to_kv_index[layer_id]
        except KeyError:
            raise KeyError(
                f"layer {layer_id} has no KV cache (full-attention layers: {self.layer_ids})"
            ) from None

    def k_cache(self, layer_id: int) -> torch.Tensor:
        """``[num_token_slots, num_kv_heads, head_dim]`` view of one layer's K cache."""
        return self.k_caches[self.kv_index(layer_id)]

    def v_cache(self, layer_id: int) -> torch.Tensor:
        """``[num_token_slots, num_kv_heads, v_head_dim]`` view of one layer's V cache."""
        return self.v_caches[self.kv_index(layer_id)]

    def kv_cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.kv_index(layer_id)
        return self.k_caches[idx], self.v_caches[idx]

    def kv_scales(self, layer_id: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``([num_token_slots, num_kv_heads], same)`` fp32 K / V scales of an FP8 layer, else (None, None)."""
        return self.kv_scale_views[self.kv_index(layer_id)]

    @property
    def dtypes(self) -> list[str]:
        return sorted({str(s.dtype).replace("torch.", "") for s in self.specs})

    def nbytes(self) -> int:
        """Device bytes of all K/V buffers and FP8 scales (including the reserved page)."""
        return sum(t.numel() * t.element_size() for t in (*self.k_buffers, *self.v_buffers, *self.scale_buffers))

    def copy_slots(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """``K/V[dst_slots[i]] = K/V[src_slots[i]]`` in every layer (a request forked from another,
        ``n > 1``). Both sides must be allocated; device-side (host->device index copies only)."""
        alloc = self.allocator
        src, dst = torch.as_tensor(src_slots, dtype=torch.int64), torch.as_tensor(dst_slots, dtype=torch.int64)
        if src.numel() != dst.numel():
            raise ValueError(f"KVPool.copy_slots: {src.numel()} sources but {dst.numel()} destinations")
        if src.numel() == 0:
            return
        both = torch.cat([src, dst])
        if not bool(alloc.is_allocated(both).all()):
            raise ValueError("KVPool.copy_slots: every source and destination slot must be allocated")
        # (one pinned host->device copy of both index lists)
        src_d, dst_d = (both.pin_memory() if self.device.type == "cuda" else both).to(
            self.device, non_blocking=True).split(src.numel())
        if self.observer is not None:
            self.observer.copy_kv_slots(src_d, dst_d)
        self.copy_state(src_d, dst_d)

    def copy_state(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """The K/V write of :meth:`copy_slots` (device indices, no allocator checks)."""
        for buf in (*self.k_buffers, *self.v_buffers):
            bits = buf.view(torch.uint8) if buf.dtype == torch.float8_e4m3fn else buf  # (no CPU float8 index_copy_)
            bits.index_copy_(1, dst, bits.index_select(1, src))
        for buf in self.scale_buffers:
            buf.index_copy_(2, dst, buf.index_select(2, src))

    # Allocation goes through the token allocator; these delegate for convenience.
    def alloc(self, n: int) -> torch.Tensor | None:
        return self.allocator.alloc(n)

    def free(self, slots) -> None:
        self.allocator.free(slots)

    def available(self) -> int:
        return self.allocator.available()

    def total(self) -> int:
        return self.allocator.total()


def _copy_common_slots(new: torch.Tensor, old: torch.Tensor, dim: int) -> None:
    """``new[..., :n, ...] = old[..., :n, ...]`` along the slot dimension ``dim`` (elastic resize)."""
    n = min(new.shape[dim], old.shape[dim])
    bits = (lambda t: t.view(torch.uint8)) if new.dtype == torch.float8_e4m3fn else (lambda t: t)
    bits(new).narrow(dim, 0, n).copy_(bits(old).narrow(dim, 0, n))
