"""Mamba pool: per-request conv windows and recurrent (SSM) states of the linear layers.

Layout (fixed by the kernel ops ``hybrid_compile.ops.conv1d`` / ``gdn`` / ``mamba2`` /
``state``), per linear layer:

- ``conv[layer]: [num_slots, conv_width - 1, conv_dim]`` (token-major window, conv dtype),
- ``ssm[layer]: [num_slots, *state_shape]`` (GDN ``[H, K, V]``, Mamba2 ``[H, P, N]``; SSM dtype);
  a conv-only layer (``state_shape == ()``, LFM2's short conv) has no SSM state: its ``ssm`` view
  is an empty ``[num_slots, 0]`` tensor that no slot operation touches,
- with speculative decoding, indexed by batch row (not by slot):
  ``intermediate_conv[layer]: [max_batch, num_draft_steps, conv_width - 1, conv_dim]`` and
  ``intermediate_ssm[layer]: [max_batch, num_draft_steps, *state_shape]``.

FP8 state (a spec with ``ssm_dtype=float8_e4m3fn``): ``ssm`` holds e4m3 values and
``ssm_scale[layer]: [num_slots, *ssm_scale_shape]`` fp32 scales beside it (one per vector along the
spec's ``ssm_scale_dim``), likewise ``intermediate_ssm_scale``; the scales are slot-indexed like the
states, so zeroing, copying and committing a slot move them too. The conv windows stay in the
model dtype: a window is ``W - 1`` inputs (a few percent of a slot's bytes next to the state) and is
overwritten, not accumulated, each step.

Layers with identical shapes and dtypes share one stacked tensor per kind
(``[num_layers_in_group, num_slots, ...]``); the per-layer accessors return contiguous views.
A slot is handed out per request (or per prefix-cache checkpoint) by :meth:`MambaPool.alloc`,
which zeroes the slot in every layer on the device — one ``index_fill_`` per stacked tensor,
no host sync — because a new request starts from the zero state. There is no padding slot:
padded batch rows use index -1, which every kernel op skips.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

from .allocator import IndexLike, SlotAllocator
from .specs import MambaLayerSpec, group_layer_specs, mamba_bytes_per_slot


@dataclass(frozen=True)
class MambaLayerCache:
    """The per-layer views one linear layer's ops need. Intermediate buffers are ``None``
    without speculative decoding; ``ssm`` / ``intermediate_ssm`` of a conv-only layer
    (``has_ssm_state`` False) are empty tensors."""

    conv: torch.Tensor
    ssm: torch.Tensor
    intermediate_conv: torch.Tensor | None
    intermediate_ssm: torch.Tensor | None
    has_ssm_state: bool = True
    # FP8 state: fp32 scales beside ``ssm`` / ``intermediate_ssm`` (None for a float state)
    ssm_scale: torch.Tensor | None = None
    intermediate_ssm_scale: torch.Tensor | None = None


class MambaPool:
    """Conv-window and SSM-state buffers of the linear layers plus their slot allocator.

    Args:
        specs: the linear-attention / state-space layers (may be empty for a pure
            transformer: slots are then bookkeeping only).
        num_slots: Mamba slots (running requests + prefix-cache checkpoints).
        device: where the buffers live.
        num_draft_steps: tokens per request in a speculative target-verify pass; 0 (default)
            allocates no intermediate buffers.
        max_draft_batch: batch rows of the intermediate buffers (the largest verify batch).
    """

    def __init__(
        self,
        specs: Sequence[MambaLayerSpec],
        num_slots: int,
        *,
        device: torch.device | str = "cpu",
        num_draft_steps: int = 0,
        max_draft_batch: int = 0,
    ) -> None:
        if num_slots < 0:
            raise ValueError(f"MambaPool: num_slots must be >= 0, got {num_slots}")
        if num_draft_steps < 0 or max_draft_batch < 0:
            raise ValueError("MambaPool: num_draft_steps and max_draft_batch must be >= 0")
        if (num_draft_steps > 0) != (max_draft_batch > 0):
            raise ValueError(
                "MambaPool: speculative buffers need both num_draft_steps and max_draft_batch > 0 "
                f"(got {num_draft_steps} and {max_draft_batch})"
            )
        self.specs = group_layer_specs(specs)
        self.device = torch.device(device)
        self.num_slots = num_slots
        self.num_draft_steps = num_draft_steps
        self.max_draft_batch = max_draft_batch
        self.allocator = SlotAllocator(num_slots, name="Mamba slot")
        self.layer_ids: list[int] = sorted(i for s in self.specs for i in s.layer_ids)
        self.layer_to_mamba_index: dict[int, int] = {layer: i for i, layer in enumerate(self.layer_ids)}

        speculative = num_draft_steps > 0
        self.conv_buffers: list[torch.Tensor] = []  # one stacked tensor per spec group
        self.ssm_buffers: list[torch.Tensor] = []
        self.intermediate_conv_buffers: list[torch.Tensor] = []
        self.intermediate_ssm_buffers: list[torch.Tensor] = []
        self.ssm_scale_buffers: list[torch.Tensor] = []  # FP8 state groups only
        self.intermediate_ssm_scale_buffers: list[torch.Tensor] = []
        caches: dict[int, MambaLayerCache] = {}
        for spec in self.specs:
            n = spec.num_layers
            state_shape = spec.state_shape if spec.has_ssm_state else (0,)  # conv-only: empty SSM views
            conv = torch.zeros((n, num_slots, *spec.conv_window_shape), dtype=spec.conv_dtype, device=self.device)
            ssm = torch.zeros((n, num_slots, *state_shape), dtype=spec.ssm_dtype, device=self.device)
            self.conv_buffers.append(conv)
            if spec.has_ssm_state:
                self.ssm_buffers.append(ssm)
            scale = inter_scale = None
            if spec.ssm_is_fp8:
                scale = torch.zeros((n, num_slots, *spec.ssm_scale_shape), dtype=torch.float32, device=self.device)
                self.ssm_scale_buffers.append(scale)
            inter_conv = inter_ssm = None
            if speculative:
                rows = (n, max_draft_batch, num_draft_steps)
                inter_conv = torch.zeros((*rows, *spec.conv_window_shape), dtype=spec.conv_dtype, device=self.device)
                inter_ssm = torch.zeros((*rows, *state_shape), dtype=spec.ssm_dtype, device=self.device)
                self.intermediate_conv_buffers.append(inter_conv)
                if spec.has_ssm_state:
                    self.intermediate_ssm_buffers.append(inter_ssm)
                if spec.ssm_is_fp8:
                    inter_scale = torch.zeros((*rows, *spec.ssm_scale_shape), dtype=torch.float32, device=self.device)
                    self.intermediate_ssm_scale_buffers.append(inter_scale)
            for pos, layer_id in enumerate(spec.layer_ids):
                caches[layer_id] = MambaLayerCache(
                    conv=conv[pos],
                    ssm=ssm[pos],
                    intermediate_conv=None if inter_conv is None else inter_conv[pos],
                    intermediate_ssm=None if inter_ssm is None else inter_ssm[pos],
                    has_ssm_state=spec.has_ssm_state,
                    ssm_scale=None if scale is None else scale[pos],
                    intermediate_ssm_scale=None if inter_scale is None else inter_scale[pos],
                )
        # Per-layer views in mamba-index order (index = layer_to_mamba_index[layer_id]).
        self.layer_caches: list[MambaLayerCache] = [caches[i] for i in self.layer_ids]
        self.bytes_per_slot = mamba_bytes_per_slot(self.specs)
        # tensor parallelism (hybrid_compile.distributed): rank 0's pool tells the other ranks' pools
        # about every state write outside a forward (zero_slots / copy_slots / a speculative commit)
        self.observer = None

    # -- per-layer access ---------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def has_speculative_buffers(self) -> bool:
        return self.num_draft_steps > 0

    def mamba_index(self, layer_id: int) -> int:
        try:
            return self.layer_to_mamba_index[layer_id]
        except KeyError:
            raise KeyError(f"layer {layer_id} has no Mamba state (linear layers: {self.layer_ids})") from None

    def layer_cache(self, layer_id: int) -> MambaLayerCache:
        return self.layer_caches[self.mamba_index(layer_id)]

    def conv(self, layer_id: int) -> torch.Tensor:
        """``[num_slots, conv_width - 1, conv_dim]`` view of one layer's conv windows."""
        return self.layer_cache(layer_id).conv

    def ssm(self, layer_id: int) -> torch.Tensor:
        """``[num_slots, *state_shape]`` view of one layer's SSM states (``[num_slots, 0]``, empty,
        for a conv-only layer)."""
        return self.layer_cache(layer_id).ssm

    def intermediate_conv(self, layer_id: int) -> torch.Tensor:
        """``[max_draft_batch, num_draft_steps, conv_width - 1, conv_dim]``, by batch row."""
        return self._speculative(self.layer_cache(layer_id).intermediate_conv)

    def intermediate_ssm(self, layer_id: int) -> torch.Tensor:
        """``[max_draft_batch, num_draft_steps, *state_shape]``, by batch row."""
        return self._speculative(self.layer_cache(layer_id).intermediate_ssm)

    def ssm_scale(self, layer_id: int) -> torch.Tensor | None:
        """``[num_slots, *ssm_scale_shape]`` fp32 scales of an FP8 state, None for a float state."""
        return self.layer_cache(layer_id).ssm_scale

    def state_tensors(self) -> list[torch.Tensor]:
        """Every per-layer slot-indexed view (conv, SSM and an FP8 state's scales of each layer;
        conv only for a conv-only layer), for the state ops (``copy_state_slots``,
        ``commit_speculative_state``) that take a list of pool tensors."""
        return [t for c in self.layer_caches for t in (c.conv, c.ssm, c.ssm_scale)[: _num_state_tensors(c)]]

    def intermediate_state_tensors(self) -> list[torch.Tensor]:
        """The intermediate buffers matching :meth:`state_tensors` one to one."""
        self._speculative(None if not self.layer_caches else self.layer_caches[0].intermediate_conv)
        return [
            t for c in self.layer_caches
            for t in (c.intermediate_conv, c.intermediate_ssm, c.intermediate_ssm_scale)[: _num_state_tensors(c)]
        ]

    @property
    def ssm_dtypes(self) -> list[str]:
        return sorted({str(s.ssm_dtype).replace("torch.", "") for s in self.specs if s.has_ssm_state})

    def _speculative(self, t: torch.Tensor | None) -> torch.Tensor:
        if t is None:
            raise RuntimeError(
                "MambaPool has no speculative buffers: build it with num_draft_steps > 0 and max_draft_batch > 0"
            )
        return t

    # -- slots --------------------------------------------------------------------------
    def total(self) -> int:
        return self.allocator.total()

    def available(self) -> int:
        return self.allocator.available()

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` slots whose conv windows and SSM states are zero in every layer, or ``None``."""
        slots = self.allocator.alloc(n)
        if slots is not None and slots.numel():
            self.zero_slots(slots)
        return slots

    def free(self, slots: IndexLike) -> None:
        self.allocator.free(slots)

    def resize(self, num_slots: int) -> None:
        """Grow or shrink to ``num_slots`` between steps (elastic pools): new slot-indexed
        buffers, the slots both sizes have copied over; shrinking takes free slots off the top
        only (:meth:`SlotAllocator.free_at_top`). The speculative buffers (by batch row) stay.
        Every per-layer slot view changes: whoever keeps views asks for them again."""
        self.allocator.resize(num_slots)
        self.num_slots = num_slots
        by_layer = dict(zip(self.layer_ids, self.layer_caches))
        conv_bufs, ssm_bufs, scale_bufs = [], [], []
        old_ssm, old_scale = iter(self.ssm_buffers), iter(self.ssm_scale_buffers)
        for spec, old_conv in zip(self.specs, self.conv_buffers):
            conv = _resized(old_conv, num_slots)
            conv_bufs.append(conv)
            if spec.has_ssm_state:
                ssm = _resized(next(old_ssm), num_slots)
                ssm_bufs.append(ssm)
            else:
                ssm = torch.zeros((spec.num_layers, num_slots, 0), dtype=spec.ssm_dtype, device=self.device)
            scale = None
            if spec.ssm_is_fp8:
                scale = _resized(next(old_scale), num_slots)
                scale_bufs.append(scale)
            for pos, layer_id in enumerate(spec.layer_ids):
                by_layer[layer_id] = dataclasses.replace(
                    by_layer[layer_id], conv=conv[pos], ssm=ssm[pos], ssm_scale=None if scale is None else scale[pos]
                )
        self.conv_buffers, self.ssm_buffers, self.ssm_scale_buffers = conv_bufs, ssm_bufs, scale_bufs
        self.layer_caches = [by_layer[i] for i in self.layer_ids]

    def zero_slots(self, slots: IndexLike) -> None:
        """Zero the conv window and SSM state of these slots in every layer (device-side)."""
        idx = self._device_index(self.allocator.check_allocated(slots, action="zero"))
        if self.observer is not None:
            self.observer.zero_slots(idx)
        self.zero_state(idx)

    def zero_state(self, idx: torch.Tensor) -> None:
        """The state write of :meth:`zero_slots` (device indices, no allocator checks)."""
        for buf in self._slot_buffers():
            _bits(buf).index_fill_(1, idx, 0)  # (e4m3 zero is all-zero bits)

    def copy_slots(self, src_slots: IndexLike, dst_slots: IndexLike) -> None:
        """``state[dst_slots[i]] = state[src_slots[i]]`` in every layer (copy-on-write of a
        prefix-cache hit). Both sides must be allocated; destinations must be distinct."""
        src = self.allocator.check_allocated(src_slots, action="copy from", unique=False)
        dst = self.allocator.check_allocated(dst_slots, action="copy into")
        if src.numel() != dst.numel():
            raise ValueError(f"MambaPool.copy_slots: {src.numel()} sources but {dst.numel()} destinations")
        if src.numel() == 0:
            return
        src_d, dst_d = self._device_index(src), self._device_index(dst)
        if self.observer is not None:
            self.observer.copy_slots(src_d, dst_d)
        self.copy_state(src_d, dst_d)

    def copy_state(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """The state write of :meth:`copy_slots` (device indices, no allocator checks)."""
        for buf in self._slot_buffers():
            bits = _bits(buf)
            bits.index_copy_(1, dst, bits.index_select(1, src))

    def fork(self, src_slots: IndexLike) -> torch.Tensor | None:
        """New slots holding copies of ``src_slots`` (a prefix-cache checkpoint), or ``None``."""
        src = self.allocator.check_allocated(src_slots, action="fork", unique=False)
        dst = self.allocator.alloc(src.numel())
        if dst is None:
            return None
        self.copy_slots(src, dst)
        return dst

    def _slot_buffers(self) -> tuple[torch.Tensor, ...]:
        return (*self.conv_buffers, *self.ssm_buffers, *self.ssm_scale_buffers)

    def nbytes(self) -> int:
        """Device bytes of the slot-indexed buffers (conv + SSM + FP8 scales)."""
        return sum(t.numel() * t.element_size() for t in self._slot_buffers())

    def speculative_nbytes(self) -> int:
        """Device bytes of the intermediate (speculative) buffers."""
        bufs = (*self.intermediate_conv_buffers, *self.intermediate_ssm_buffers, *self.intermediate_ssm_scale_buffers)
        return sum(t.numel() * t.element_size() for t in bufs)

    def _device_index(self, idx: torch.Tensor) -> torch.Tensor:
        # Host -> device copy of a small index tensor; asynchronous on CUDA (no stream sync).
        return idx.to(self.device, non_blocking=True)


def _num_state_tensors(c: MambaLayerCache) -> int:
    """Conv only (conv-only layer), conv + SSM, or conv + SSM + scales (FP8 state)."""
    return 1 if not c.has_ssm_state else (3 if c.ssm_scale is not None else 2)


def _resized(old: torch.Tensor, num_slots: int) -> torch.Tensor:
    """A ``[layers, num_slots, ...]`` copy of ``old`` (its first slots; zeros beyond them)."""
    new = torch.zeros((old.shape[0], num_slots, *old.shape[2:]), dtype=old.dtype, device=old.device)
    n = min(num_slots, old.shape[1])
    _bits(new)[:, :n].copy_(_bits(old)[:, :n])
    return new


def _bits(buf: torch.Tensor) -> torch.Tensor:
    """A float8 buffer as uint8 (torch has no CPU ``index_copy_`` / ``index_fill_`` for float8)."""
    return buf.view(torch.uint8) if buf.dtype == torch.float8_e4m3fn else buf
