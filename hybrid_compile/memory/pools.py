"""MemoryPools: every pool of one engine, built from one :class:`~.sizing.MemoryPlan`.

Bundles the KV pool (with its token-slot allocator), the Mamba pool and the request maps,
and answers the questions the engine and the tests ask about all of them at once:
:meth:`MemoryPools.move_mamba_to_kv` / :meth:`MemoryPools.move_kv_to_mamba` re-partition the one
budget between the KV and Mamba pools between steps (elastic pools, see ``engine/elastic.py``);
:meth:`MemoryPools.summary` (for ``engine.stats()``), :meth:`MemoryPools.free_counts` and
:meth:`MemoryPools.check_all_free` (nothing leaked once every request is gone and the
prefix cache is cleared).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .kv_pool import KVPool
from .mamba_pool import MambaPool
from .req_to_token import ReqToTokenPool
from .sizing import MemoryPlan, plan_memory
from .specs import (
    AttentionLayerSpec,
    MambaLayerSpec,
    check_disjoint_layers,
    kv_bytes_per_token,
    mamba_bytes_per_slot,
)


class MemoryPools:
    """KV pool + Mamba pool + request maps of one engine.

    Args:
        attention, mamba: layer specs of the full-attention and linear layers.
        plan: capacities, from :func:`~.sizing.plan_memory` (or use :meth:`from_specs`).
        device: where every buffer lives.

    Attributes:
        kv: :class:`~.kv_pool.KVPool` (``kv.allocator`` hands out token slots).
        mamba: :class:`~.mamba_pool.MambaPool`.
        req_to_token: :class:`~.req_to_token.ReqToTokenPool` (allocates a Mamba slot per request).
    """

    def __init__(
        self,
        attention: Sequence[AttentionLayerSpec],
        mamba: Sequence[MambaLayerSpec],
        plan: MemoryPlan,
        *,
        device: torch.device | str = "cpu",
    ) -> None:
        check_disjoint_layers(attention, mamba)
        need = (kv_bytes_per_token(attention), mamba_bytes_per_slot(mamba))
        if need != (plan.bytes_per_token, plan.bytes_per_mamba_slot):
            raise ValueError(
                "MemoryPools: the plan was made for other layer specs (bytes per token / per Mamba slot "
                f"{plan.bytes_per_token} / {plan.bytes_per_mamba_slot}, these specs need {need[0]} / {need[1]})"
            )
        self.plan = plan
        self.device = torch.device(device)
        self.kv = KVPool(attention, plan.max_total_tokens, page_size=plan.page_size, device=self.device)
        self.mamba = MambaPool(
            mamba,
            plan.mamba_cache_size,
            device=self.device,
            num_draft_steps=plan.num_draft_steps,
            max_draft_batch=plan.max_draft_batch,
        )
        self.req_to_token = ReqToTokenPool(
            plan.max_running_requests, plan.max_context_len, device=self.device, mamba_pool=self.mamba
        )
        # elastic pools: bytes of the budget moved between the pools that make no whole page / slot yet
        self.spare_bytes = 0
        # (requests_relocated: running requests moved to a lower Mamba slot to free the top, engine/elastic.py)
        self.moves = dict.fromkeys(("to_kv", "to_mamba", "kv_tokens_gained", "kv_tokens_given",
                                    "mamba_slots_gained", "mamba_slots_given", "requests_relocated"), 0)

    @property
    def page_bytes(self) -> int:
        return self.kv.page_size * self.kv.bytes_per_token

    def move_mamba_to_kv(self, kv_tokens: int, keep_mamba_free: int = 0) -> int:
        """Give the KV pool at least ``kv_tokens`` more token slots, paid with free Mamba slots off
        the top of the Mamba pool (keeping ``keep_mamba_free`` free); as many as can be had.
        Returns the token slots gained (0: nothing moved)."""
        bps, page = self.mamba.bytes_per_slot, self.page_bytes
        pages = -(-kv_tokens // self.kv.page_size)
        can = min(self.mamba.allocator.free_at_top(), self.mamba.available() - keep_mamba_free)
        slots = min(max(can, 0), max(-(-(pages * page - self.spare_bytes) // bps), 0))
        gained = (slots * bps + self.spare_bytes) // page
        if gained <= 0:
            return 0
        self.spare_bytes += slots * bps - gained * page
        self.resize_to(self.kv.allocator.num_pages + gained, self.mamba.total() - slots)
        m = self.moves
        m["to_kv"] += 1
        m["kv_tokens_gained"] += gained * self.kv.page_size
        m["mamba_slots_given"] += slots
        return gained * self.kv.page_size

    def move_kv_to_mamba(self, mamba_slots: int, keep_kv_free: int = 0) -> int:
        """Give the Mamba pool at least ``mamba_slots`` more slots, paid with free KV pages off the
        top of the KV pool (keeping ``keep_kv_free`` token slots free); as many as can be had.
        Returns the Mamba slots gained (0: nothing moved)."""
        bps, page, ps = self.mamba.bytes_per_slot, self.page_bytes, self.kv.page_size
        can = min(self.kv.allocator.free_pages_at_top(), (self.kv.allocator.available() - keep_kv_free) // ps,
                  # one request of max_context_len must always fit (what sizing checked at start-up)
                  self.kv.allocator.num_pages - -(-self.plan.max_context_len // ps))
        pages = min(max(can, 0), max(-(-(mamba_slots * bps - self.spare_bytes) // page), 0))
        gained = (pages * page + self.spare_bytes) // bps
        if gained <= 0:
            return 0
        self.spare_bytes += pages * page - gained * bps
        self.resize_to(self.kv.allocator.num_pages - pages, self.mamba.total() + gained)
        m = self.moves
        m["to_mamba"] += 1
        m["mamba_slots_gained"] += gained
        m["kv_tokens_given"] += pages * ps
        return gained

    def resize_to(self, kv_pages: int, mamba_slots: int) -> None:
        """Give the KV pool ``kv_pages`` usable pages and the Mamba pool ``mamba_slots`` slots: the
        pool that shrinks first, so that the growing one's new buffers are paid with what it gave
        up (a move of :meth:`move_mamba_to_kv` / :meth:`move_kv_to_mamba`, or under tensor
        parallelism the sizes rank 0's move took, on the other ranks)."""
        if kv_pages < self.kv.allocator.num_pages:
            self.kv.resize(kv_pages)
            self.mamba.resize(mamba_slots)
        else:
            self.mamba.resize(mamba_slots)
            self.kv.resize(kv_pages)

    @classmethod
    def from_specs(
        cls,
        attention: Sequence[AttentionLayerSpec],
        mamba: Sequence[MambaLayerSpec],
        *,
        device: torch.device | str = "cpu",
        **plan_kwargs,
    ) -> "MemoryPools":
        """Plan with :func:`~.sizing.plan_memory` (``plan_kwargs`` are its keyword arguments,
        measured on ``device``) and build the pools."""
        plan = plan_memory(attention, mamba, device=device, **plan_kwargs)
        return cls(attention, mamba, plan, device=device)

    @property
    def token_allocator(self):
        """The KV token-slot allocator (``self.kv.allocator``)."""
        return self.kv.allocator

    def free_counts(self) -> dict[str, int]:
        """Free capacity of every allocator right now."""
        return {
            "kv_tokens": self.kv.allocator.available(),
            "kv_pages": self.kv.allocator.available_pages(),
            "mamba_slots": self.mamba.available(),
            "request_slots": self.req_to_token.allocator.available(),
        }

    def used_counts(self) -> dict[str, int]:
        """Handed-out entries of every allocator right now."""
        return {
            "kv_tokens": self.kv.allocator.used(),
            "kv_pages": self.kv.allocator.num_pages - self.kv.allocator.available_pages(),
            "mamba_slots": self.mamba.allocator.used(),
            "request_slots": self.req_to_token.allocator.used(),
        }

    def check_all_free(self) -> None:
        """Raise AssertionError naming every allocator that still has entries handed out."""
        leaks = {k: v for k, v in self.used_counts().items() if v}
        if leaks:
            detail = ", ".join(f"{k}: {v} in use" for k, v in leaks.items())
            raise AssertionError(f"memory pools are not all free ({detail})")

    def summary(self) -> dict:
        """Capacities, bytes and free counts, for ``engine.stats()``."""
        return {
            "device": str(self.device),
            "page_size": self.plan.page_size,
            "max_running_requests": self.plan.max_running_requests,
            "max_context_len": self.plan.max_context_len,
            "capacity": {
                "kv_tokens": self.kv.total(),
                "kv_pages": self.kv.allocator.num_pages,
                "mamba_slots": self.mamba.total(),
                "request_slots": self.req_to_token.total(),
            },
            "free": self.free_counts(),
            "used": self.used_counts(),
            "layers": {"full_attention": list(self.kv.layer_ids), "linear": list(self.mamba.layer_ids)},
            # pool element dtypes ("float8_e4m3fn": e4m3 values with fp32 scales beside them)
            "dtypes": {"kv": self.kv.dtypes, "ssm": self.mamba.ssm_dtypes},
            "bytes": {
                "per_token": self.kv.bytes_per_token,
                "per_mamba_slot": self.mamba.bytes_per_slot,
                "kv": self.kv.nbytes(),
                "mamba": self.mamba.nbytes(),
                "speculative": self.mamba.speculative_nbytes(),
                "request_maps": self.req_to_token.nbytes(),
                "total": self.nbytes(),
                "budget": self.plan.budget_bytes,
            },
            "sources": {
                "max_total_tokens": self.plan.max_total_tokens_source,
                "mamba_cache_size": self.plan.mamba_cache_size_source,
            },
            # the current KV / Mamba split of the pools' bytes and the elastic moves so far
            "split": {"kv_bytes": self.kv.nbytes(), "mamba_bytes": self.mamba.nbytes(), "spare_bytes": self.spare_bytes},
            "moves": dict(self.moves),
        }

    def nbytes(self) -> int:
        """Device bytes of every pool buffer."""
        return self.kv.nbytes() + self.mamba.nbytes() + self.mamba.speculative_nbytes() + self.req_to_token.nbytes()
