"""Model runner: turns a scheduled batch into a ForwardContext and runs the patched HF model.

The HF model runs over the step's packed tokens as a batch of one row
(``input_ids[None]``, ``position_ids[None]``, ``use_cache=False``); ``logits_to_keep`` is a
tensor of the packed indices whose logits are needed (the last token of each request), so
only those go through the LM head.

With ``EngineConfig.compile`` the model forward runs through ``torch.compile(fullgraph=True)``
with our backend (:mod:`hybrid_compile.passes`): one Dynamo graph split at the layer ops,
pieces compiled by Inductor. The token count and the batch size are dynamic dimensions; a
step of one request is padded with one padding request (one token whose K/V are not stored,
attending over the dummy KV slot, Mamba index -1), so every compiled call sees >= 2 tokens and >= 2 requests and the
graph compiled once (at construction, on a padding-only batch) serves every later step
without a recompile (Dynamo specialises sizes 0 and 1). Per-step metadata never enters the
graph: the layer ops read it from the forward context at run time.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import types
from typing import TYPE_CHECKING

import torch
import torch.fx.experimental._config  # noqa: F401  (config patched around compiled calls)
from torch import nn

from ..layers.context import ForwardContext, ForwardMetadata, ForwardMode, forward_context
from ..memory import MemoryPools
from .scheduler import ScheduledBatch

if TYPE_CHECKING:
    from .config import EngineConfig

# compiled steps have at least this many requests (and so tokens): see the module docstring
_MIN_COMPILED_BATCH = 2


def _segment_arange(lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of arange(n) for each n in lengths."""
    total = int(lengths.sum())
    starts = torch.cumsum(lengths, 0) - lengths
    return torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(starts, lengths)


def _graph_break_count() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def _pad_one_request(input_ids: torch.Tensor, md: ForwardMetadata, padding_slot: int) -> tuple[torch.Tensor, ForwardMetadata]:
    """Append a padding request of one token: token id 0 at position 0, its K/V not stored
    (``out_cache_loc`` -1), attending over the dummy KV slot, Mamba index -1 (every kernel op
    skips it). Its logits row is last."""
    n = input_ids.shape[0]

    def cat(t: torch.Tensor, value) -> torch.Tensor:
        return torch.cat([t, torch.full((1,), value, dtype=t.dtype, device=t.device)])

    padded = dataclasses.replace(
        md,
        positions=cat(md.positions, 0),
        query_start_loc=cat(md.query_start_loc, n + 1),
        seq_lens=cat(md.seq_lens, 1),
        prefix_lens=cat(md.prefix_lens, 0),
        mamba_cache_indices=cat(md.mamba_cache_indices, -1),
        has_initial_state=cat(md.has_initial_state, False),
        out_cache_loc=cat(md.out_cache_loc, -1),
        kv_indptr=torch.cat([md.kv_indptr, md.kv_indptr[-1:] + 1]),  # no host sync
        kv_indices=cat(md.kv_indices, padding_slot),
        logits_indices=cat(md.logits_indices, n),
        extend_lens_cpu=list(md.extend_lens_cpu) + [1],
        seq_lens_cpu=list(md.seq_lens_cpu) + [1],
        prompt_lens=None if md.prompt_lens is None else cat(md.prompt_lens, 1),
    )
    return cat(input_ids, 0), padded


def _forward_of(model: nn.Module):
    def forward(input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False, logits_to_keep=logits_indices)
        return out.logits[0]

    return forward


_runner_ids = itertools.count()


def _own_code_copy(fn, name: str):
    """``fn`` with a private copy of its code object. Dynamo keeps its compiled graphs and its
    recompile limit per code object: without a copy every runner of the process would share
    one cache (and one limit of 8 entries) for the same forward function."""
    code = fn.__code__.replace(co_name=name)
    if hasattr(code, "co_qualname"):
        code = code.replace(co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


class ModelRunner:
    def __init__(
        self, model: nn.Module, pools: MemoryPools, device: torch.device, config: "EngineConfig | None" = None
    ) -> None:
        self.model = model
        self.pools = pools
        self.device = device
        kv = pools.kv
        self.kv_caches = {layer: kv.kv_cache(layer) for layer in kv.layer_ids}
        mamba = pools.mamba
        self.mamba_caches = {layer: (mamba.conv(layer), mamba.ssm(layer)) for layer in mamba.layer_ids}
        self.compiled = config is not None and config.resolved_compile(device)
        self._compiled_forward = None
        self._backend = None
        self._compile_counters = dict(warmup_seconds=0.0, graph_breaks=0, compiled_steps=0,
                                      padded_steps=0)
        if self.compiled:
            self._setup_compile()

    # -- compile ------------------------------------------------------------------------------
    def _model_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """Packed tokens -> logits ``[B, vocab]`` (the eager path)."""
        return _forward_of(self.model)(input_ids, positions, logits_indices)

    def _setup_compile(self) -> None:
        from ..passes.backend import HybridCompileBackend

        self._backend = HybridCompileBackend()
        self._compiled_forward = torch.compile(
            _own_code_copy(_forward_of(self.model), f"hybrid_compile_forward_{next(_runner_ids)}"),
            backend=self._backend, fullgraph=True, dynamic=True,
        )
        t0 = time.perf_counter()
        try:
            self._warmup()
        except torch._dynamo.exc.Unsupported as e:  # a graph break under fullgraph=True
            raise RuntimeError(
                f"EngineConfig.compile=True: the forward of {type(self.model).__name__} does not trace into one "
                f"graph (torch.compile graph break: {str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                "hybrid_compile needs a single graph to split at the layer ops. Serve this model with compile=False."
            ) from e
        self._compile_counters["warmup_seconds"] = time.perf_counter() - t0

    def _call_compiled(self, input_ids: torch.Tensor, md: ForwardMetadata) -> torch.Tensor:
        for t in (input_ids, md.positions, md.logits_indices):
            torch._dynamo.mark_dynamic(t, 0)
        breaks = _graph_break_count()
        # floats of the model (eps, attention scale) are constants, not graph inputs; no duck sizing,
        # so that equal token count and batch size at compile time do not become a guard
        with torch._dynamo.config.patch(specialize_float=True), torch.fx.experimental._config.patch(use_duck_shape=False):
            logits = self._compiled_forward(input_ids, md.positions, md.logits_indices)
        c = self._compile_counters
        c["graph_breaks"] += _graph_break_count() - breaks
        c["compiled_steps"] += 1
        return logits

    @torch.inference_mode()
    def _warmup(self) -> None:
        """Compile on a padding-only EXTEND batch (2 requests of 1 and 2 tokens whose K/V are not
        stored, attending over the dummy KV slot, Mamba indices -1: the pools are untouched), so the
        one graph is traced with symbolic sizes >= 2 before serving."""
        dev = self.device
        slot = self.pools.kv.PADDING_SLOT
        lens = [1, 2]
        n, b = sum(lens), len(lens)
        i32 = dict(dtype=torch.int32, device=dev)
        md = ForwardMetadata(
            mode=ForwardMode.EXTEND,
            positions=torch.tensor([0, 0, 1], dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor([0, 1, 3], **i32),
            seq_lens=torch.tensor(lens, **i32),
            prefix_lens=torch.zeros(b, **i32),
            mamba_cache_indices=torch.full((b,), -1, **i32),
            has_initial_state=torch.zeros(b, dtype=torch.bool, device=dev),
            out_cache_loc=torch.full((n,), -1, dtype=torch.int64, device=dev),
            kv_indptr=torch.tensor([0, 1, 3], **i32),
            kv_indices=torch.full((n,), slot, dtype=self.pools.req_to_token.req_to_token.dtype, device=dev),
            logits_indices=torch.tensor([0, 2], dtype=torch.int64, device=dev),
            extend_lens_cpu=list(lens),
            seq_lens_cpu=list(lens),
            prompt_lens=torch.tensor(lens, **i32),
        )
        input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        with forward_context(ForwardContext(md, self.kv_caches, self.mamba_caches)):
            self._call_compiled(input_ids, md)

    def compile_stats(self) -> dict:
        """What ``engine.stats()["compile"]`` reports: ``enabled``; with compile on also
        ``compile_seconds`` (split + Inductor, every graph), ``warmup_seconds`` (the compile at
        construction: Dynamo trace + backend + one run), ``graphs`` (Dynamo compiles of the forward),
        ``recompiles`` (graphs - 1), ``pieces`` (Inductor-compiled pieces), ``splitting_op_calls`` and
        ``split_ops_seen`` (layer ops left eager between them), ``graph_breaks``, ``compiled_steps``,
        ``padded_steps`` (steps of one request padded to two)."""
        if not self.compiled:
            return {"enabled": False}
        s = self._backend.stats
        c = self._compile_counters
        return {
            "enabled": True,
            "compile_seconds": s.backend_seconds,
            "warmup_seconds": c["warmup_seconds"],
            "graphs": s.graphs,
            "recompiles": max(0, s.graphs - 1),
            "pieces": s.pieces,
            "splitting_op_calls": s.splitting_op_calls,
            "split_ops_seen": dict(s.split_ops_seen),
            "graph_breaks": c["graph_breaks"],
            "compiled_steps": c["compiled_steps"],
            "padded_steps": c["padded_steps"],
        }

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
        if not self.compiled:
            with forward_context(ForwardContext(md, self.kv_caches, self.mamba_caches)):
                return self._model_forward(input_ids, md.positions, md.logits_indices)
        b = md.batch_size
        while md.batch_size < _MIN_COMPILED_BATCH:
            input_ids, md = _pad_one_request(input_ids, md, self.pools.kv.PADDING_SLOT)
        if md.batch_size != b:
            self._compile_counters["padded_steps"] += 1
        with forward_context(ForwardContext(md, self.kv_caches, self.mamba_caches)):
            return self._call_compiled(input_ids, md)[:b]
