"""Model runner: runs one step of the patched HF model, eager, compiled or by replaying a CUDA graph.

The HF model runs over the step's packed tokens as a batch of one row
(``input_ids[None]``, ``position_ids[None]``, ``use_cache=False``); ``logits_to_keep`` is a
tensor of the packed indices whose logits are needed (the last token of each request), so
only those go through the LM head. A step's forward batch (packed input ids and
``ForwardMetadata``) comes from :mod:`.forward_batch` (:attr:`ModelRunner.batch_builder`); the
runner installs its forward context (the metadata and the pools' views per layer) around the
model call.

The compiled forward and its CUDA graphs are set up at construction by :mod:`.graph_setup`
(:attr:`ModelRunner.graphs`). Each step then takes one path (:meth:`ModelRunner.forward`): eager
when compile is off; with compile on, a DECODE step of at most the largest decode bucket replays
a full graph (its metadata built straight into the graph's stable buffers, rows padded up to the
bucket); other DECODE / EXTEND steps of at most the largest token bucket are padded up to the
smallest bucket that holds them and replay the pieces' graphs with the layer ops eager between them,
unless that takes more than ``max_padding`` padding tokens (then the compiled forward runs at the
step's own size: ``unpadded_steps``); any other step runs the compiled forward without graphs
(counted as an eager fallback; a step of one request padded to two, :func:`~.forward_batch.pad_requests`).

Speculative verify steps (:meth:`ModelRunner.forward_verify`, ``draft_len = k + 1`` tokens per
request) take the same path: a full TARGET_VERIFY graph of the batch-size bucket when one fits
(draft trees: a draft-tree verify graph, the tree's mask and parents in its buffers), else the
compiled forward (an eager fallback with graphs on).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..layers.context import ForwardContext, ForwardMetadata, ForwardMode, forward_context
from ..memory import MemoryPools
from ..compilation import cuda_graphs as cg
from .forward_batch import ForwardBatch, ForwardBatchBuilder, pad_requests
from .graph_setup import CompiledGraphs
from .startup import Startup

if TYPE_CHECKING:
    from .config import EngineConfig
    from .scheduler import ScheduledBatch

# compiled steps have at least this many requests (and so tokens): see graph_setup.py
_MIN_COMPILED_BATCH = cg.MIN_GRAPH_SIZE


def _forward_of(model: nn.Module):
    def forward(input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False, logits_to_keep=logits_indices)
        return out.logits[0]

    return forward


def hidden_states_forward(model: nn.Module):
    """The forward of a causal LM whose head is ``lm_head(final hidden states)`` (the families
    with MTP heads) that also returns the final (normed) hidden states of every token:
    ``-> (logits [len(logits_indices), V], hidden [N, H])``. A speculative MTP head reads them."""
    def forward(input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor):
        hidden = model.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False).last_hidden_state[0]
        return model.lm_head(hidden[logits_indices]), hidden

    return forward


def _views(*tensors: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """A layer's pool views without the absent (None) scales of float pools."""
    return tuple(t for t in tensors if t is not None)


class ModelRunner:
    def __init__(
        self, model: nn.Module, pools: MemoryPools, device: torch.device, config: "EngineConfig | None" = None,
        forward_fn=None, extra_inputs: tuple = (), startup: "Startup | None" = None,
    ) -> None:
        """``forward_fn(model) -> forward(input_ids, positions, logits_indices, *extra)`` builds the
        function that runs the model (default: the HF causal LM's forward -> logits); one that returns
        ``(logits, hidden)`` leaves each step's hidden states in :attr:`hidden_states`.
        ``extra_inputs``: ``(trailing shape, dtype)`` of each per-token tensor the forward takes after
        the logits indices (``forward(batch, extra=...)``; padding rows are zeros). ``startup``: the
        engine's :class:`~.startup.Startup`, which times the compile and capture phases (default: a
        silent one of this runner's own)."""
        self.model = model
        self._forward_fn = forward_fn or _forward_of
        self._extra_specs = tuple(extra_inputs)
        # the hidden states of every token of the last step, when the forward returns them
        self.hidden_states: torch.Tensor | None = None
        self.pools = pools
        self.device = device
        # tensor parallelism (hybrid_compile.distributed): on rank 0, told of every model call (inside its
        # forward context) so that it broadcasts the step to the other ranks, which run the same call
        self.step_observer = None
        self.refresh_pool_views()
        mamba = pools.mamba
        # speculative verify (engine/speculative) of L = k + 1 tokens per request: the pools of a target
        # engine are built for it (a draft model's runner gets none), with the per-draft-step buffers
        # its linear layers write (ForwardContext.intermediate_caches)
        self.draft_len = mamba.num_draft_steps
        self.intermediate_caches = (
            {layer: _views(mamba.intermediate_conv(layer), mamba.intermediate_ssm(layer),
                           mamba.layer_cache(layer).intermediate_ssm_scale) for layer in mamba.layer_ids}
            if self.draft_len else {}
        )
        # each step's forward batch (forward_batch.py)
        self.batch_builder = ForwardBatchBuilder(pools, device, self.draft_len)
        # the compiled forward and its CUDA graphs (graph_setup.py)
        self.graphs = CompiledGraphs(model, self._forward_fn, device, config)
        self.compiled = self.graphs.enabled
        try:
            self.graphs.setup(self, startup if startup is not None else Startup())
        except BaseException:
            self.release_packed_weights()  # a failed construction leaves the model's weights as they were
            raise
        self.batch_builder.full_graphs = self.graphs.full_graphs

    def refresh_pool_views(self) -> None:
        """The per-layer pool views of the forward context (again after elastic pools resized them)."""
        kv, mamba = self.pools.kv, self.pools.mamba
        # FP8 pools' scales after their values (float pools: none)
        self.kv_caches = {layer: _views(*kv.kv_cache(layer), *kv.kv_scales(layer)) for layer in kv.layer_ids}
        self.mamba_caches = {
            layer: _views(mamba.conv(layer), mamba.ssm(layer), mamba.ssm_scale(layer)) for layer in mamba.layer_ids
        }

    @property
    def extra_inputs(self) -> tuple:
        """``(trailing shape, dtype)`` of each per-token extra input of the forward (``__init__``)."""
        return self._extra_specs

    @property
    def full_graphs(self) -> "cg.FullGraphRunner | None":
        """The full CUDA graphs (decode, verify), or None."""
        return self.graphs.full_graphs

    @property
    def piecewise_graphs(self) -> "cg.PiecewiseGraphs | None":
        """The piecewise CUDA graphs of the compiled pieces, or None."""
        return self.graphs.piecewise_graphs

    def release_packed_weights(self) -> int:
        """Undo the rewrite pass's packing of the model's projection weights (the engine's ``close``;
        :meth:`~hybrid_compile.compilation.backend.HybridCompileBackend.release_packed_weights`). A compiled
        runner refuses to run afterwards (its CUDA graphs read the packed buffers, and a recompile
        would pack the weights again). Idempotent; a no-op when nothing was compiled."""
        released = self.graphs.release_packed_weights()
        if self.graphs.released:
            self.batch_builder.full_graphs = None  # no step is built into a graph's buffers any more
        return released

    def release(self) -> None:
        """The engine's ``close`` (after :meth:`release_packed_weights`): the compiled forward and
        its CUDA graphs (:meth:`~.graph_setup.CompiledGraphs.release`), the pool views and the last
        hidden states go, so that no reference to this runner outliving its engine holds device
        memory. Idempotent; the runner does not run again."""
        self.graphs.release()
        self.kv_caches, self.mamba_caches, self.intermediate_caches = {}, {}, {}
        self.hidden_states = None
        self.batch_builder.full_graphs = None

    def _refuse_after_release(self) -> None:
        if self.graphs.released:
            raise RuntimeError("hybrid_compile: this engine was closed (its compiled forward's packed projection "
                               "weights went back to the model); wrap the model again to serve it")

    def compile_stats(self) -> dict:
        """What ``engine.stats()["compile"]`` reports (:meth:`.graph_setup.CompiledGraphs.stats`)."""
        return self.graphs.stats()

    # -- the step's forward batch (forward_batch.py) -------------------------------------------
    def build_metadata(self, batch: ScheduledBatch, input_ids: torch.Tensor | None = None) -> ForwardBatch:
        """(packed input ids, metadata) of one step, on the device
        (:meth:`.forward_batch.ForwardBatchBuilder.build`). A DECODE step's input ids already on
        the device (``input_ids``, else ``batch.input_ids`` when set: the tokens the previous step
        sampled, engine overlap) are used as they are."""
        return self.batch_builder.build(batch, input_ids)

    def build_verify_metadata(self, batch: ScheduledBatch, drafts: list[list[int]] | torch.Tensor,
                              tree: tuple | None = None) -> ForwardBatch:
        """(packed input ids, metadata) of a TARGET_VERIFY step
        (:meth:`.forward_batch.ForwardBatchBuilder.build_verify`), for :meth:`forward_verify`."""
        return self.batch_builder.build_verify(batch, drafts, tree)

    # -- model calls ----------------------------------------------------------------------------
    def _model_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor, *extra):
        """Packed tokens -> logits ``[B, vocab]`` (the eager path)."""
        if self.step_observer is not None:
            self.step_observer.forward(False, input_ids, extra)
        return self._forward_fn(self.model)(input_ids, positions, logits_indices, *extra)

    def call_unobserved(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor, *extra):
        """The model call (compiled where the runner compiles, else eager) without telling the step
        observer: for steps every tensor-parallel rank runs by itself (the MTP proposal graphs' body)."""
        if self.compiled:
            return self.graphs.call(input_ids, positions, logits_indices, *extra)
        return self._forward_fn(self.model)(input_ids, positions, logits_indices, *extra)

    def _call_compiled(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor, *extra):
        """Packed tokens -> logits through the compiled forward (:meth:`.graph_setup.CompiledGraphs.call`)."""
        if self.step_observer is not None:
            pw = self.graphs.piecewise_graphs
            self.step_observer.forward(True, input_ids, extra, piecewise=pw is not None and pw.mode == pw.REPLAY)
        return self.graphs.call(input_ids, positions, logits_indices, *extra)

    def _run_compiled(self, input_ids: torch.Tensor, md: ForwardMetadata, graphs_mode: str | None = None,
                      extra: tuple = ()):
        """The compiled forward over one step under its forward context; ``graphs_mode``: replay or
        capture the pieces' CUDA graphs (``cg.PiecewiseGraphs`` modes)."""
        extra = self._pad_extra(extra, input_ids.shape[0])
        with forward_context(ForwardContext(md, self.kv_caches, self.mamba_caches)):
            if graphs_mode is None:
                return self._call_compiled(input_ids, md.positions, md.logits_indices, *extra)
            with self.graphs.piecewise_graphs.active(graphs_mode):
                return self._call_compiled(input_ids, md.positions, md.logits_indices, *extra)

    def _replay_full_graph(self, md: ForwardMetadata):
        """Replay the full graph whose buffers ``md`` was built into (``md.graph_key``); under tensor
        parallelism the step observer first sends the buffers' step to the other ranks, which replay
        the same graph."""
        full = self.graphs.full_graphs
        if self.step_observer is not None:
            self.step_observer.replay(full.buffers, md)
        return full.replay(md.graph_key, md.batch_size)

    def _extra_zeros(self, n: int) -> tuple[torch.Tensor, ...]:
        return tuple(torch.zeros(n, *shape, dtype=dtype, device=self.device) for shape, dtype in self._extra_specs)

    @staticmethod
    def _pad_extra(extra: tuple, n: int) -> tuple:
        """Extra inputs padded with zero rows up to ``n`` tokens (the padding requests')."""
        return tuple(torch.cat([e, e.new_zeros(n - e.shape[0], *e.shape[1:])]) if e.shape[0] < n else e for e in extra)

    def _outputs(self, out, rows: int | None, tokens: int):
        """The logits (first ``rows`` rows) of a forward's output; a ``(logits, hidden)`` output
        leaves the hidden states of the step's ``tokens`` tokens in :attr:`hidden_states`."""
        if isinstance(out, tuple):
            out, hidden = out
            self.hidden_states = hidden[:tokens]
        return out[:rows]

    # -- steps ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, input_ids: torch.Tensor | None = None, extra: tuple = ()) -> torch.Tensor:
        """Run one step; returns the logits ``[B, vocab]`` of each request's last new token
        (``input_ids``: see :meth:`build_metadata`; ``extra``: the per-token extra inputs of the
        forward, ``extra_inputs``)."""
        if len(extra) != len(self._extra_specs):
            raise ValueError(f"forward: this runner's model takes {len(self._extra_specs)} extra input(s), got {len(extra)}")
        return self.forward_built(*self.build_metadata(batch, input_ids), extra=extra)

    @torch.inference_mode()
    def forward_built(self, input_ids: torch.Tensor, md: ForwardMetadata, extra: tuple = ()) -> torch.Tensor:
        """:meth:`forward` of a step whose forward batch is already built (``build_metadata``, or
        ``batch_builder.build_uniform`` for a uniform EXTEND step: an MTP head's window); returns the
        logits at ``md.logits_indices`` (at most the batch size of rows through piecewise graphs)."""
        if len(extra) != len(self._extra_specs):
            raise ValueError(f"forward: this runner's model takes {len(self._extra_specs)} extra input(s), got {len(extra)}")
        n = md.num_tokens
        if not self.compiled:
            with forward_context(ForwardContext(md, self.kv_caches, self.mamba_caches)):
                return self._outputs(self._model_forward(input_ids, md.positions, md.logits_indices, *extra), None, n)
        self._refuse_after_release()
        graphs = self.graphs
        b = md.batch_size
        if md.graph_key is not None:  # built into the full graph's buffers
            return self._outputs(self._replay_full_graph(md), b, n)
        if graphs.piecewise_graphs is not None and md.mode in (ForwardMode.DECODE, ForwardMode.EXTEND):
            bucket, unpadded = graphs.piecewise_bucket(md.num_tokens, b)
            if bucket is not None:
                pad = bucket - md.num_tokens
                # decode steps stay decode steps: one-token padding requests; else one request of them all
                pad_lens = ([1] * pad if md.mode is ForwardMode.DECODE else [pad]) if pad else []
                padded_ids, padded = pad_requests(input_ids, md, pad_lens, self.pools.kv.PADDING_SLOT,
                                                  graphs.logits_rows(bucket))
                out = self._run_compiled(padded_ids, padded, graphs_mode=graphs.piecewise_graphs.REPLAY, extra=extra)
                graphs.piecewise_graphs.replays += 1
                return self._outputs(out, b, md.num_tokens)
        else:
            unpadded = False
        if graphs.graph_pool is not None and not unpadded:  # graphs on, but no graph fits this step
            graphs.counters["eager_fallbacks"] += 1
        if b < _MIN_COMPILED_BATCH:
            input_ids, md = pad_requests(input_ids, md, [1] * (_MIN_COMPILED_BATCH - b), self.pools.kv.PADDING_SLOT)
            graphs.counters["padded_steps"] += 1
        return self._outputs(self._run_compiled(input_ids, md, extra=extra), b, n)

    @torch.inference_mode()
    def forward_verify(self, input_ids: torch.Tensor, md: ForwardMetadata) -> torch.Tensor:
        """Run one TARGET_VERIFY step (``md.draft_len`` tokens per request: ``input_ids`` holds each
        request's pending token and drafts, ``md.logits_indices`` every token); returns the logits
        ``[B * draft_len, vocab]`` of every verify position. Same dispatch as :meth:`forward`: a full
        verify graph when a bucket fits, else the compiled forward (an eager fallback when graphs
        are on; one request padded to two), else the eager model."""
        if md.mode is not ForwardMode.TARGET_VERIFY or md.draft_len != self.draft_len or not self.draft_len:
            raise ValueError(f"forward_verify: a TARGET_VERIFY step of draft_len {self.draft_len} (the engine's "
                             f"speculative k + 1), got {md.mode.value} with draft_len {md.draft_len}")
        self._refuse_after_release()
        n = md.num_tokens
        if md.graph_key is not None:  # built into the verify graph's buffers
            return self._outputs(self._replay_full_graph(md), n, n)
        if self.compiled:
            graphs = self.graphs
            if graphs.graph_pool is not None:  # graphs on, but no verify graph fits this step
                graphs.counters["eager_fallbacks"] += 1
            if md.batch_size < _MIN_COMPILED_BATCH:  # padding requests of draft_len tokens each
                pad = [md.draft_len] * (_MIN_COMPILED_BATCH - md.batch_size)
                input_ids, md = pad_requests(input_ids, md, pad, self.pools.kv.PADDING_SLOT)
                graphs.counters["padded_steps"] += 1
        with forward_context(ForwardContext(md, self.kv_caches, self.mamba_caches, self.intermediate_caches)):
            if self.compiled:
                return self._outputs(self._call_compiled(input_ids, md.positions, md.logits_indices), n, n)
            return self._outputs(self._model_forward(input_ids, md.positions, md.logits_indices), n, n)
