"""Memory pools: KV pool (full-attention layers only), Mamba pool (conv windows + SSM states,
plus speculative intermediate buffers), request-to-token and request-to-Mamba maps, and the
sizing of all of them from one memory budget.

Modules, one job each:

- ``specs``        layer specs (:class:`AttentionLayerSpec`, :class:`MambaLayerSpec`) and bytes per token / slot
- ``allocator``    exact host-side slot allocators (:class:`SlotAllocator`, paged :class:`TokenSlotAllocator`)
- ``kv_pool``      :class:`KVPool`: K/V buffers of the full-attention layers, layer id -> KV index
- ``mamba_pool``   :class:`MambaPool`: conv windows, SSM states, speculative buffers; zero on alloc
- ``req_to_token`` :class:`ReqToTokenPool`: request slot -> token slots and -> Mamba slot
- ``sizing``       :func:`plan_memory` -> :class:`MemoryPlan` from a budget and ``mamba_full_memory_ratio``
- ``host_pool``    :class:`HostPool`: host-memory copies of KV token slots and Mamba slots (prefix-cache host tier)
- ``pools``        :class:`MemoryPools`: all of the above, with ``summary()`` and leak checks

Reserved entries: KV slot 0 (page 0) is the dummy slot padded tokens write to; request row 0
is the padding request (all-zero token row, Mamba slot -1). Mamba slots have no padding
entry: padded rows use index -1. Pools do not grow on demand: ``alloc`` returns ``None`` when
full; only the engine's elastic pools (``engine/elastic.py``) resize them, between steps, by moving
free entries' bytes from one pool to the other (``MemoryPools.move_*``).
"""

from .allocator import InvalidSlotError, SlotAllocator, TokenSlotAllocator
from .host_pool import HostPool, RangeAllocator
from .kv_pool import KVPool
from .mamba_pool import MambaLayerCache, MambaPool
from .pools import MemoryPools
from .req_to_token import ReqToTokenPool
from .sizing import MemoryPlan, available_device_memory, plan_memory
from .specs import (
    AttentionLayerSpec,
    MambaLayerSpec,
    group_layer_specs,
    kv_bytes_per_token,
    mamba_bytes_per_slot,
)

__all__ = [
    "AttentionLayerSpec",
    "HostPool",
    "InvalidSlotError",
    "KVPool",
    "MambaLayerCache",
    "MambaLayerSpec",
    "MambaPool",
    "MemoryPlan",
    "MemoryPools",
    "RangeAllocator",
    "ReqToTokenPool",
    "SlotAllocator",
    "TokenSlotAllocator",
    "available_device_memory",
    "group_layer_specs",
    "kv_bytes_per_token",
    "mamba_bytes_per_slot",
    "plan_memory",
]
