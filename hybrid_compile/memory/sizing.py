"""Sizing: how many KV token slots and Mamba slots fit in one memory budget.

:func:`plan_memory` turns layer specs and serving limits into a :class:`MemoryPlan`:

1. Fixed costs come first: ``req_to_token`` / ``req_to_mamba`` (int32 maps) and the
   speculative intermediate buffers (sized by batch, not by slot).
2. Explicit capacities (``max_total_tokens``, ``mamba_cache_size``) are taken as given.
3. What the budget has left is split between the pools by ``mamba_full_memory_ratio`` =
   Mamba bytes / KV bytes (``mamba = rest * ratio / (1 + ratio)``). When one
   capacity is explicit, the other pool gets all that is left of the budget after it.
   A pool whose layers cost no bytes (no full-attention layers, or no linear layers) takes
   no share of the budget.
4. Bounds: the KV pool must hold one request of ``max_context_len`` tokens, and there must
   be a Mamba slot for every running request plus ``mamba_prefix_cache_slots``; otherwise
   ValueError says which knob to turn.

The budget is ``memory_budget_bytes`` if given, else ``memory_fraction`` of the free memory
of ``device`` (``torch.cuda.mem_get_info`` on CUDA; MemAvailable of the host on CPU). Size
after the model weights are on the device: the budget is meant for the pools alone.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Sequence

import torch

from .specs import (
    AttentionLayerSpec,
    MambaLayerSpec,
    check_disjoint_layers,
    group_layer_specs,
    kv_bytes_per_token,
    mamba_bytes_per_slot,
)

# KV token slots given to a model without full-attention layers (the slots cost no device
# memory, only host bookkeeping): enough for every running request at full length, capped.
MAX_BOOKKEEPING_ONLY_TOKENS = 1 << 22
_INT32_MAX = torch.iinfo(torch.int32).max


@dataclass(frozen=True)
class MemoryPlan:
    """Capacities and byte accounting of all pools. ``*_bytes`` are device bytes."""

    max_running_requests: int
    max_context_len: int
    page_size: int
    max_total_tokens: int  # usable KV token slots (a multiple of page_size; excludes the padding page)
    mamba_cache_size: int  # Mamba slots
    num_draft_steps: int
    max_draft_batch: int
    bytes_per_token: int  # K+V of one token over all full-attention layers
    bytes_per_mamba_slot: int  # conv window + SSM state of one slot over all linear layers
    kv_bytes: int  # whole KV pool, padding page included
    mamba_bytes: int  # whole Mamba pool (slot-indexed buffers)
    speculative_bytes: int  # intermediate conv/SSM buffers
    req_to_token_bytes: int  # req_to_token + req_to_mamba
    budget_bytes: int | None  # the budget used, None when both capacities were explicit
    max_total_tokens_source: str  # "explicit" | "budget" | "no-kv-layers"
    mamba_cache_size_source: str  # "explicit" | "budget" | "no-mamba-layers"

    @property
    def num_pages(self) -> int:
        return self.max_total_tokens // self.page_size

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.mamba_bytes + self.speculative_bytes + self.req_to_token_bytes

    def as_dict(self) -> dict:
        d = asdict(self)
        d["num_pages"] = self.num_pages
        d["total_bytes"] = self.total_bytes
        return d


def available_device_memory(device: torch.device | str) -> int:
    """Free bytes on ``device`` now: CUDA free memory, or the host's available memory on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        raise ValueError(f"cannot measure free memory of device {device}; pass memory_budget_bytes")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil  # optional

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def plan_memory(
    attention: Sequence[AttentionLayerSpec],
    mamba: Sequence[MambaLayerSpec],
    *,
    max_running_requests: int,
    max_context_len: int,
    page_size: int = 1,
    max_total_tokens: int | None = None,
    mamba_cache_size: int | None = None,
    memory_budget_bytes: int | None = None,
    memory_fraction: float = 0.8,
    mamba_full_memory_ratio: float = 0.2,
    mamba_prefix_cache_slots: int = 0,
    num_draft_steps: int = 0,
    max_draft_batch: int | None = None,
    kv_token_cap: int | None = None,
    mamba_slot_cap: int | None = None,
    elastic: bool = False,
    device: torch.device | str = "cpu",
) -> MemoryPlan:
    """Capacities of the KV and Mamba pools (see the module docstring for the rules).

    Args:
        attention, mamba: layer specs of the full-attention and linear layers.
        max_running_requests: request slots; each running request holds one Mamba slot.
        max_context_len: longest request (prompt + output) in tokens.
        page_size: KV tokens per page; ``max_total_tokens`` is rounded down to whole pages.
        max_total_tokens, mamba_cache_size: explicit capacities; they win over the budget.
        memory_budget_bytes: bytes for all pools; default ``memory_fraction`` of free memory.
        memory_fraction: share of the device's free memory used when no budget is given.
        mamba_full_memory_ratio: Mamba pool bytes / KV pool bytes when both come from the budget.
        mamba_prefix_cache_slots: Mamba slots required beyond ``max_running_requests``
            (checkpoints of the prefix cache; 0 without one).
        num_draft_steps: tokens per request in a speculative verify pass (0 = no speculation).
        max_draft_batch: rows of the speculative buffers (default ``max_running_requests``).
        kv_token_cap, mamba_slot_cap: upper bounds on the capacities that come from the budget
            (not on explicit ones): more than a workload can use is only memory taken from others,
            e.g. a pure-SSM model would otherwise turn the whole budget into Mamba slots.
        elastic: the engine moves memory between the pools at run time (``EngineConfig.elastic_pools``);
            only the wording of a too-small-Mamba-pool error depends on it.
        device: whose free memory to measure.
    """
    for name, value in (("max_running_requests", max_running_requests), ("max_context_len", max_context_len),
                        ("page_size", page_size)):
        if int(value) < 1:
            raise ValueError(f"plan_memory: {name} must be >= 1, got {value}")
    if mamba_prefix_cache_slots < 0 or num_draft_steps < 0:
        raise ValueError("plan_memory: mamba_prefix_cache_slots and num_draft_steps must be >= 0")
    if mamba_full_memory_ratio <= 0:
        raise ValueError(f"plan_memory: mamba_full_memory_ratio must be > 0, got {mamba_full_memory_ratio}")
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"plan_memory: memory_fraction must be in (0, 1], got {memory_fraction}")
    attention = group_layer_specs(attention)
    mamba = group_layer_specs(mamba)
    check_disjoint_layers(attention, mamba)

    bpt = kv_bytes_per_token(attention)
    bps = mamba_bytes_per_slot(mamba)
    draft_batch = (max_running_requests if max_draft_batch is None else max_draft_batch) if num_draft_steps else 0
    spec_bytes = draft_batch * num_draft_steps * bps
    rows = max_running_requests + 1  # + the padding request row
    map_bytes = rows * max_context_len * 4 + rows * 4
    min_slots = max_running_requests + mamba_prefix_cache_slots
    min_pages = -(-max_context_len // page_size)

    tokens_source = "explicit" if max_total_tokens is not None else ("budget" if bpt else "no-kv-layers")
    slots_source = "explicit" if mamba_cache_size is not None else ("budget" if bps else "no-mamba-layers")
    if max_total_tokens is None and not bpt:
        max_total_tokens = max(min(max_running_requests * max_context_len, MAX_BOOKKEEPING_ONLY_TOKENS),
                               min_pages * page_size)
    if mamba_cache_size is None and not bps:
        mamba_cache_size = min_slots

    budget = None
    if max_total_tokens is None or mamba_cache_size is None:
        budget = int(memory_budget_bytes if memory_budget_bytes is not None
                     else memory_fraction * available_device_memory(device))
        rest = budget - map_bytes - spec_bytes
        if max_total_tokens is not None:
            rest -= (max_total_tokens // page_size + 1) * page_size * bpt
        if mamba_cache_size is not None:
            rest -= mamba_cache_size * bps
        if rest <= 0:
            raise ValueError(
                f"memory budget of {_mib(budget)} leaves nothing for the pools after fixed buffers "
                f"(request maps {_mib(map_bytes)}, speculative buffers {_mib(spec_bytes)}) and explicit "
                "capacities; raise memory_fraction / memory_budget_bytes, or lower max_running_requests, "
                "max_context_len, num_draft_steps or the explicit capacities"
            )
        if max_total_tokens is None and mamba_cache_size is None:
            mamba_share = rest * mamba_full_memory_ratio / (1 + mamba_full_memory_ratio)
            mamba_cache_size = int(mamba_share // bps)
            rest -= mamba_cache_size * bps
        if max_total_tokens is None:
            # The padding page costs one page of KV too.
            max_total_tokens = max(int(rest // (page_size * bpt)) - 1, 0) * page_size
        elif mamba_cache_size is None:
            mamba_cache_size = int(rest // bps)
        if tokens_source == "budget" and kv_token_cap is not None:
            max_total_tokens = min(max_total_tokens, kv_token_cap)
        if slots_source == "budget" and mamba_slot_cap is not None:
            mamba_cache_size = min(mamba_cache_size, mamba_slot_cap)

    max_total_tokens = int(max_total_tokens) // page_size * page_size
    mamba_cache_size = int(mamba_cache_size)
    if max_total_tokens < min_pages * page_size:
        raise ValueError(
            f"KV pool holds {max_total_tokens} tokens but one request of max_context_len={max_context_len} needs "
            f"{min_pages * page_size} (page_size={page_size}, {bpt} bytes/token); "
            + ("raise max_total_tokens or lower max_context_len" if tokens_source == "explicit" else
               "raise memory_fraction / memory_budget_bytes, lower mamba_full_memory_ratio or mamba_cache_size, "
               "or lower max_context_len / max_running_requests")
        )
    if mamba_cache_size < min_slots:
        short = min_slots - mamba_cache_size
        # every running request holds one slot, and the prefix cache's slots come on top
        fits = max(mamba_cache_size - mamba_prefix_cache_slots, 0)
        raise ValueError(
            f"Mamba pool holds {mamba_cache_size} slots but max_running_requests={max_running_requests} + "
            f"mamba_prefix_cache_slots={mamba_prefix_cache_slots} need {min_slots} ({bps} bytes/slot): "
            f"{short} slot(s) ({_mib(short * bps)}) short, so the Mamba pool caps concurrency at {fits} "
            f"running request(s) instead of {max_running_requests} "
            + ("(elastic pools move memory between KV and Mamba at run time, but only once requests run: the "
               "start-up split must hold a Mamba slot for every running request and the prefix cache's); "
               if elastic else "(the pools are sized once and do not move memory between KV and Mamba at run "
               "time unless elastic_pools=True); ")
            + ("raise mamba_cache_size or lower max_running_requests" if slots_source == "explicit" else
               "raise memory_fraction / memory_budget_bytes or mamba_full_memory_ratio, lower max_total_tokens, "
               "or lower max_running_requests / mamba_prefix_cache_slots")
        )
    if (max_total_tokens // page_size + 1) * page_size > _INT32_MAX:
        raise ValueError(f"max_total_tokens={max_total_tokens} does not fit int32 slot indices")

    return MemoryPlan(
        max_running_requests=max_running_requests,
        max_context_len=max_context_len,
        page_size=page_size,
        max_total_tokens=max_total_tokens,
        mamba_cache_size=mamba_cache_size,
        num_draft_steps=num_draft_steps,
        max_draft_batch=draft_batch,
        bytes_per_token=bpt,
        bytes_per_mamba_slot=bps,
        kv_bytes=(max_total_tokens + page_size) * bpt,
        mamba_bytes=mamba_cache_size * bps,
        speculative_bytes=spec_bytes,
        req_to_token_bytes=map_bytes,
        budget_bytes=budget,
        max_total_tokens_source=tokens_source,
        mamba_cache_size_source=slots_source,
    )
