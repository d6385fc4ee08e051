"""Model runner: turns a scheduled batch into a ForwardContext and runs the patched HF model.

The HF model runs over the step's packed tokens as a batch of one row
(``input_ids[None]``, ``position_ids[None]``, ``use_cache=False``); ``logits_to_keep`` is a
tensor of the packed indices whose logits are needed (the last token of each request), so
only those go through the LM head.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers.context import ForwardContext, ForwardMetadata, forward_context
from ..memory import MemoryPools
from .scheduler import ScheduledBatch


def _segment_arange(lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of arange(n) for each n in lengths."""
    total = int(lengths.sum())
    starts = torch.cumsum(lengths, 0) - lengths
    return torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(starts, lengths)


class ModelRunner:
    def __init__(self, model: nn.Module, pools: MemoryPools, device: torch.device) -> None:
        self.model = model
        self.pools = pools
        self.device = device
        kv = pools.kv
        self.kv_caches = {layer: kv.kv_cache(layer) for layer in kv.layer_ids}
        mamba = pools.mamba
        self.mamba_caches = {layer: (mamba.conv(layer), mamba.ssm(layer)) for layer in mamba.layer_ids}

    def build_metadata(self, batch: ScheduledBatch) -> tuple[torch.Tensor, ForwardMetadata]:
        """(packed input ids, metadata) of one step, on the device."""
        dev = self.device
        prefix = torch.tensor(batch.prefix_lens, dtype=torch.int64)
        extend = torch.tensor(batch.extend_lens, dtype=torch.int64)
        seq = prefix + extend
        ids: list[int] = []
        for r, p, n in zip(batch.requests, batch.prefix_lens, batch.extend_lens):
            ids.extend(r.token_ids(p, p + n))
        positions = torch.repeat_interleave(prefix, extend) + _segment_arange(extend)
        req_slots = torch.tensor([r.req_slot for r in batch.requests], dtype=torch.int64)
        self.pools.req_to_token.set_tokens_batch(req_slots, prefix, extend, batch.out_cache_loc)

        qsl = torch.zeros(len(batch.requests) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(extend, 0)
        kv_indptr = torch.zeros_like(qsl)
        kv_indptr[1:] = torch.cumsum(seq, 0)
        # KV slots of every token of every request, gathered on the device from req_to_token
        rows = torch.repeat_interleave(req_slots, seq).to(dev)
        cols = _segment_arange(seq).to(dev)
        kv_indices = self.pools.req_to_token.req_to_token[rows, cols]
        mamba = torch.tensor([r.mamba_slot for r in batch.requests], dtype=torch.int32)
        md = ForwardMetadata(
            mode=batch.mode,
            positions=positions.to(dev),
            query_start_loc=qsl.to(dev),
            seq_lens=seq.to(torch.int32).to(dev),
            prefix_lens=prefix.to(torch.int32).to(dev),
            mamba_cache_indices=mamba.to(dev),
            has_initial_state=(prefix > 0).to(dev),
            out_cache_loc=batch.out_cache_loc.to(dev),
            kv_indptr=kv_indptr.to(dev),
            kv_indices=kv_indices,
            logits_indices=(qsl[1:].to(torch.int64) - 1).to(dev),
            extend_lens_cpu=list(batch.extend_lens),
            seq_lens_cpu=seq.tolist(),
            prompt_lens=torch.tensor([len(r.prompt) for r in batch.requests], dtype=torch.int32).to(dev),
        )
        return torch.tensor(ids, dtype=torch.int64, device=dev), md

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run one step; returns the logits ``[B, vocab]`` of each request's last new token."""
        input_ids, md = self.build_metadata(batch)
        ctx = ForwardContext(md, self.kv_caches, self.mamba_caches)
        with forward_context(ctx):
            out = self.model(
                input_ids=input_ids[None],
                position_ids=md.positions[None],
                use_cache=False,
                logits_to_keep=md.logits_indices,
            )
        return out.logits[0]
