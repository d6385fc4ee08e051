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

With CUDA graphs (``EngineConfig.cuda_graphs``, :mod:`hybrid_compile.passes.cuda_graphs`) a
DECODE step of at most the largest decode bucket replays a full graph (its metadata built
straight into the graph's stable buffers, rows padded up to the bucket); other DECODE / EXTEND
steps of at most the largest token bucket are padded up to it and replay the pieces' graphs with
the layer ops eager between them; any other step runs the compiled forward without graphs
(counted as an eager fallback). Graphs are captured at construction, after the compile.

Speculative verify steps (:meth:`ModelRunner.forward_verify`, ``draft_len = k + 1`` tokens per
request) take the same path: a full TARGET_VERIFY graph of the batch-size bucket when one fits,
else the compiled forward (an eager fallback with graphs on).

Metadata: a DECODE step (the common case) takes a fast path (``_build_decode_metadata``: one
staged row per request from Python lists, one host->device copy, then one op,
``uniform_step_metadata``, writes the new ``req_to_token`` entries and every tensor, into fresh
tensors or into a full graph's buffers); its input ids may already be on the device (the engine's
overlap feeds a step's sampled tokens straight into the next step launched ahead). A
TARGET_VERIFY step takes the same path (``build_verify_metadata``). Every other step takes the
general path (``_build_extend_metadata``); all give the same tensors.
"""

from __future__ import annotations

import gc
import itertools
import time
import types
from typing import TYPE_CHECKING

import torch
import torch.fx.experimental._config  # noqa: F401  (config patched around compiled calls)
from torch import nn

from ..layers.context import ForwardContext, ForwardMetadata, ForwardMode, forward_context
from ..memory import MemoryPools
from ..ops import metadata as md_ops
from ..passes import cuda_graphs as cg
from .scheduler import ScheduledBatch
from .transfer import aligned as _aligned, to_device_packed as _to_device_packed

if TYPE_CHECKING:
    from .config import EngineConfig

# compiled steps have at least this many requests (and so tokens): see the module docstring
_MIN_COMPILED_BATCH = cg.MIN_GRAPH_SIZE


def _segment_arange(lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of arange(n) for each n in lengths."""
    total = int(lengths.sum())
    starts = torch.cumsum(lengths, 0) - lengths
    return torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(starts, lengths)


def _graph_break_count() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


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


_runner_ids = itertools.count()


def _own_code_copy(fn, name: str):
    """``fn`` with a private copy of its code object. Dynamo keeps its compiled graphs and its
    recompile limit per code object: without a copy every runner of the process would share
    one cache (and one limit of 8 entries) for the same forward function."""
    code = fn.__code__.replace(co_name=name)
    if hasattr(code, "co_qualname"):
        code = code.replace(co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def _default_inductor_config(device: torch.device) -> dict:
    """Inductor patches the engine applies unless ``extra["inductor_config"]`` overrides them:
    ``triton.enable_pdl`` where our Triton kernels launch as programmatic dependents."""
    import torch._inductor.config as inductor_config

    from ..ops.triton.launch import programmatic_launch_supported

    if hasattr(inductor_config.triton, "enable_pdl") and programmatic_launch_supported(torch.device(device)):
        return {"triton.enable_pdl": True}
    return {}


def _views(*tensors: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """A layer's pool views without the absent (None) scales of float pools."""
    return tuple(t for t in tensors if t is not None)


class ModelRunner:
    def __init__(
        self, model: nn.Module, pools: MemoryPools, device: torch.device, config: "EngineConfig | None" = None,
        forward_fn=None, extra_inputs: tuple = (),
    ) -> None:
        """``forward_fn(model) -> forward(input_ids, positions, logits_indices, *extra)`` builds the
        function that runs the model (default: the HF causal LM's forward -> logits); one that returns
        ``(logits, hidden)`` leaves each step's hidden states in :attr:`hidden_states`.
        ``extra_inputs``: ``(trailing shape, dtype)`` of each per-token tensor the forward takes after
        the logits indices (``forward(batch, extra=...)``; padding rows are zeros)."""
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
        kv = pools.kv
        # pool views per layer (ForwardContext), FP8 pools' scales after their values (float pools: none)
        self.kv_caches = {layer: _views(*kv.kv_cache(layer), *kv.kv_scales(layer)) for layer in kv.layer_ids}
        mamba = pools.mamba
        self.mamba_caches = {
            layer: _views(mamba.conv(layer), mamba.ssm(layer), mamba.ssm_scale(layer)) for layer in mamba.layer_ids
        }
        self.compiled = config is not None and config.resolved_compile(device)
        full, piecewise = config.resolved_cuda_graphs(device) if config is not None else (False, False)
        self._compiled_forward = None
        self._backend = None
        self._released = False  # release_packed_weights ran: the compiled forward must not run again
        self._compile_counters = dict(warmup_seconds=0.0, graph_breaks=0, compiled_steps=0,
                                      padded_steps=0, eager_fallbacks=0)
        # CUDA graphs (passes/cuda_graphs.py): full graphs of decode steps, piecewise graphs of the pieces
        self._graph_pool = cg.GraphPool() if full or piecewise else None
        self.piecewise_graphs = cg.PiecewiseGraphs(self._graph_pool) if piecewise else None
        self.full_graphs: cg.FullGraphRunner | None = None
        self._max_running_requests = config.max_running_requests if config is not None else 1
        # speculative verify (engine/speculative) of L = k + 1 tokens per request: the pools of a target
        # engine are built for it (a draft model's runner gets none), with the per-draft-step buffers
        # its linear layers write (ForwardContext.intermediate_caches)
        self.draft_len = mamba.num_draft_steps
        self.intermediate_caches = (
            {layer: _views(mamba.intermediate_conv(layer), mamba.intermediate_ssm(layer),
                           mamba.layer_cache(layer).intermediate_ssm_scale) for layer in mamba.layer_ids}
            if self.draft_len else {}
        )
        # our post-grad rewrite pass (passes/rewrite.py); EngineConfig.extra["rewrite_passes"]=False turns it off
        self._rewrite_passes = bool(config.extra.get("rewrite_passes", True)) if config is not None else True
        # its routing of matmuls to skinny_mm (ops/linear.py): None = on CUDA; extra["skinny_matmuls"] True/False forces
        self._skinny_matmuls = config.extra.get("skinny_matmuls") if config is not None else None
        # Inductor config patches for every compiled piece (extra["inductor_config"]). Inductor's combo kernels
        # ({"combo_kernels": True}: independent pointwise kernels launched as one) cut a batch-1 decode step of
        # the reference Qwen3-Next from 395 to 311 kernels (H200, 1.76 -> 1.67 ms) but gave wrong tokens with
        # the one-token decode graph on the tiny Qwen3-Next (torch 2.11), so they stay off by default.
        # Inductor's kernels launch as programmatic dependents where ours do (ops/triton/launch.py: only
        # both sides together pay off)
        self._inductor_config = _default_inductor_config(device)
        if config is not None:
            self._inductor_config.update(config.extra.get("inductor_config") or {})
        self._token_buckets: tuple[int, ...] = ()
        if piecewise:
            self._token_buckets = cg.normalize_buckets(
                config.piecewise_cuda_graph_tokens
                or cg.default_token_buckets(config.chunked_prefill_size, config.max_running_requests)
            )
        try:
            if self.compiled:
                self._setup_compile()
            self._capture_cuda_graphs(config, full, piecewise)
        except BaseException:
            self.release_packed_weights()  # a failed construction leaves the model's weights as they were
            raise

    def _capture_cuda_graphs(self, config: "EngineConfig | None", full: bool, piecewise: bool) -> None:
        try:
            if full:
                self._capture_full(config.cuda_graph_batch_sizes
                                   or cg.default_decode_batch_sizes(config.max_running_requests))
            if piecewise:
                self._capture_piecewise()
            if piecewise or full:
                # the graphs, their buffers and the compiled code live as long as the engine: keep the
                # cyclic garbage collector from rescanning them every step (SGLang does the same)
                gc.freeze()
        except RuntimeError as e:
            raise RuntimeError(
                f"EngineConfig.cuda_graphs={config.cuda_graphs!r}: CUDA graph capture of the "
                f"{type(self.model).__name__} forward failed "
                f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); a graph cannot hold host "
                "syncs or CPU<->GPU copies. Serve this model with cuda_graphs=False (compiled without graphs)."
            ) from e

    def release_packed_weights(self) -> int:
        """Undo the rewrite pass's packing of the model's projection weights (the engine's ``close``;
        :meth:`~hybrid_compile.passes.backend.HybridCompileBackend.release_packed_weights`). A compiled
        runner refuses to run afterwards (its CUDA graphs read the packed buffers, and a recompile
        would pack the weights again). Idempotent; a no-op when nothing was compiled."""
        if self._backend is None:
            return 0
        self._released = True
        return self._backend.release_packed_weights()

    def _refuse_after_release(self) -> None:
        if self._released:
            raise RuntimeError("hybrid_compile: this engine was closed (its compiled forward's packed projection "
                               "weights went back to the model); wrap the model again to serve it")

    # -- compile ------------------------------------------------------------------------------
    def _model_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor, *extra):
        """Packed tokens -> logits ``[B, vocab]`` (the eager path)."""
        if self.step_observer is not None:
            self.step_observer.forward(False, input_ids, extra)
        return self._forward_fn(self.model)(input_ids, positions, logits_indices, *extra)

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

    def _setup_compile(self) -> None:
        from ..passes.backend import HybridCompileBackend

        self._backend = HybridCompileBackend(
            piecewise_graphs=self.piecewise_graphs, rewrites=self._rewrite_passes, skinny_matmuls=self._skinny_matmuls,
            inductor_config=self._inductor_config,
        )
        self._compiled_forward = torch.compile(
            _own_code_copy(self._forward_fn(self.model), f"hybrid_compile_forward_{next(_runner_ids)}"),
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

    def _call_compiled(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor, *extra):
        if self.step_observer is not None:
            self.step_observer.forward(True, input_ids, extra)
        for t in (input_ids, positions, logits_indices, *extra):
            if t.shape[0] >= cg.MIN_GRAPH_SIZE:  # (size 1: the decode graph of one request, a specialised compile)
                torch._dynamo.mark_dynamic(t, 0)
        breaks = _graph_break_count()
        # floats of the model (eps, attention scale) are constants, not graph inputs; no duck sizing,
        # so that equal token count and batch size at compile time do not become a guard
        with torch._dynamo.config.patch(specialize_float=True), torch.fx.experimental._config.patch(use_duck_shape=False):
            logits = self._compiled_forward(input_ids, positions, logits_indices, *extra)
        c = self._compile_counters
        c["graph_breaks"] += _graph_break_count() - breaks
        c["compiled_steps"] += 1
        return logits

    @torch.inference_mode()
    def _warmup(self) -> None:
        """Compile on a padding-only EXTEND batch (2 requests of 1 and 2 tokens whose K/V are not
        stored, attending over the dummy KV slot, Mamba indices -1: the pools are untouched), so the
        one graph is traced with symbolic sizes >= 2 before serving."""
        ids, md = self._padding_step([1, 2])
        self._run_compiled(ids, md, extra=self._extra_zeros(md.num_tokens))

    def _padding_step(self, lens: list[int], num_logits: int | None = None) -> tuple[torch.Tensor, ForwardMetadata]:
        """An EXTEND step of padding requests only (``cg.pad_requests`` on an empty step): running
        it leaves every pool untouched."""
        dev = self.device
        i32 = dict(dtype=torch.int32, device=dev)
        empty = ForwardMetadata(
            mode=ForwardMode.EXTEND,
            positions=torch.zeros(0, dtype=torch.int64, device=dev),
            query_start_loc=torch.zeros(1, **i32),
            seq_lens=torch.zeros(0, **i32),
            prefix_lens=torch.zeros(0, **i32),
            mamba_cache_indices=torch.zeros(0, **i32),
            has_initial_state=torch.zeros(0, dtype=torch.bool, device=dev),
            out_cache_loc=torch.zeros(0, dtype=torch.int64, device=dev),
            kv_indptr=torch.zeros(1, **i32),
            kv_indices=torch.zeros(0, dtype=self.pools.req_to_token.req_to_token.dtype, device=dev),
            logits_indices=torch.zeros(0, dtype=torch.int64, device=dev),
            prompt_lens=torch.zeros(0, **i32),
        )
        return cg.pad_requests(torch.zeros(0, dtype=torch.int64, device=dev), empty, lens,
                               self.pools.kv.PADDING_SLOT, num_logits)

    def _run_compiled(self, input_ids: torch.Tensor, md: ForwardMetadata, graphs_mode: str | None = None,
                      extra: tuple = ()):
        """The compiled forward over one step under its forward context; ``graphs_mode``: replay or
        capture the pieces' CUDA graphs (``cg.PiecewiseGraphs`` modes)."""
        extra = self._pad_extra(extra, input_ids.shape[0])
        with forward_context(ForwardContext(md, self.kv_caches, self.mamba_caches)):
            if graphs_mode is None:
                return self._call_compiled(input_ids, md.positions, md.logits_indices, *extra)
            with self.piecewise_graphs.active(graphs_mode):
                return self._call_compiled(input_ids, md.positions, md.logits_indices, *extra)

    def _logits_rows(self, num_tokens: int) -> int:
        return cg.logits_rows_for_tokens(num_tokens, self._max_running_requests)

    @torch.inference_mode()
    def _capture_piecewise(self) -> None:
        """Warm up and capture every piece for every token bucket, largest first (one padding
        request holding all the bucket's tokens)."""
        pw = self.piecewise_graphs
        t0 = time.perf_counter()
        for n in sorted(self._token_buckets, reverse=True):
            step = self._padding_step([n], self._logits_rows(n))
            extra = self._extra_zeros(n)
            self._run_compiled(*step, extra=extra)  # warm-up outside the capture
            torch.cuda.synchronize()
            self._run_compiled(*step, graphs_mode=pw.CAPTURE, extra=extra)
            pw.captured_tokens.append(n)
        torch.cuda.synchronize()
        pw.capture_seconds += time.perf_counter() - t0

    @torch.inference_mode()
    def _capture_full(self, batch_sizes) -> None:
        """Stable buffers + one full graph of the compiled forward per decode bucket, and with
        speculative decoding one per verify bucket (the decode buckets that fit the intermediate
        buffers' rows: a verify batch has at most ``max_running_requests`` requests)."""
        if self._extra_specs:
            raise ValueError("full CUDA graphs of a forward with extra inputs are not supported (their inputs would "
                             "need stable buffers): capture piecewise graphs only")
        req_to_token = self.pools.req_to_token.req_to_token
        sizes = cg.normalize_buckets(batch_sizes, minimum=1)  # 1: a graph specialised to one token (FullGraphRunner)
        verify_sizes: tuple[int, ...] = ()
        if self.draft_len:  # (rows of the intermediate buffers: max_running_requests + 1, engine.py)
            verify_sizes = tuple(s for s in sizes if s <= self.pools.mamba.max_draft_batch)
        buffers = cg.GraphBuffers(sizes[-1], req_to_token.shape[1], self.device, req_to_token.dtype,
                                  self.pools.kv.PADDING_SLOT, max_tokens_per_request=max(1, self.draft_len))
        self.full_graphs = cg.FullGraphRunner(self._call_compiled, buffers, sizes, self.kv_caches, self.mamba_caches,
                                              self._graph_pool, verify_batch_sizes=verify_sizes,
                                              draft_len=self.draft_len, intermediate_caches=self.intermediate_caches)
        self.full_graphs.capture_all()

    def _one_token_graphs(self) -> int:
        """1 when a full decode graph of batch 1 was captured (its compile is specialised to one token)."""
        return int(self.full_graphs is not None and 1 in self.full_graphs.batch_sizes)

    def compile_stats(self) -> dict:
        """What ``engine.stats()["compile"]`` reports: ``enabled``; with compile on also
        ``compile_seconds`` (split + Inductor, every graph), ``warmup_seconds`` (the compile at
        construction: Dynamo trace + backend + one run), ``graphs`` (Dynamo compiles of the forward),
        ``recompiles`` (graphs beyond the first and the one-token specialisation of a decode graph of
        batch 1, see ``cuda_graphs.FullGraphRunner``), ``pieces`` (Inductor-compiled pieces), ``splitting_op_calls`` and
        ``split_ops_seen`` (layer ops left eager between them), ``graph_breaks``, ``compiled_steps``
        (calls of the compiled forward outside graph replays: warm-ups and captures included),
        ``padded_steps`` (steps of one request padded to two), and the CUDA graphs: ``cuda_graphs``
        (``{"full": bool, "piecewise": bool}``), ``capture_seconds``, ``decode_batch_sizes`` and
        ``token_buckets`` (captured buckets), ``full_graphs`` / ``piecewise_graphs`` (CUDA graphs
        captured, verify graphs included), ``verify_batch_sizes`` (captured TARGET_VERIFY buckets),
        ``cuda_graph_replays`` (full decode graphs), ``verify_graph_replays`` (full verify graphs),
        ``piecewise_replays`` (steps),
        ``piecewise_copied_bytes`` (inputs copied into the pieces' captured inputs) and
        ``eager_fallbacks`` (steps with graphs on that no graph fitted, verify steps included: the
        compiled path ran)."""
        if not self.compiled:
            return {"enabled": False}
        s = self._backend.stats
        c = self._compile_counters
        full, pw = self.full_graphs, self.piecewise_graphs
        return {
            "enabled": True,
            "compile_seconds": s.backend_seconds,
            "warmup_seconds": c["warmup_seconds"],
            "graphs": s.graphs,
            "recompiles": max(0, s.graphs - 1 - self._one_token_graphs()),
            "one_token_graph": bool(self._one_token_graphs()),
            "pieces": s.pieces,
            "splitting_op_calls": s.splitting_op_calls,
            "split_ops_seen": dict(s.split_ops_seen),
            "inductor_config": dict(self._inductor_config),
            "rewrites": dict(s.rewrites),  # post-grad rewrite pass: packed weights, fused matmuls (passes/rewrite.py)
            "graph_breaks": c["graph_breaks"],
            "compiled_steps": c["compiled_steps"],
            "padded_steps": c["padded_steps"],
            "cuda_graphs": {"full": full is not None, "piecewise": pw is not None},
            "capture_seconds": (full.capture_seconds if full else 0.0) + (pw.capture_seconds if pw else 0.0),
            "decode_batch_sizes": [k.batch_size for k in full.graphs if k.mode is ForwardMode.DECODE] if full else [],
            "verify_batch_sizes": [k.batch_size for k in full.graphs if k.mode is ForwardMode.TARGET_VERIFY]
            if full else [],
            "token_buckets": sorted(pw.captured_tokens) if pw else [],
            "full_graphs": len(full.graphs) if full else 0,
            "piecewise_graphs": pw.num_graphs if pw else 0,
            "cuda_graph_replays": full.replays if full else 0,
            "verify_graph_replays": full.verify_replays if full else 0,
            "piecewise_replays": pw.replays if pw else 0,
            "piecewise_copied_bytes": pw.copied_bytes if pw else 0,
            "eager_fallbacks": c["eager_fallbacks"],
        }

    def build_metadata(
        self, batch: ScheduledBatch, input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ForwardMetadata]:
        """(packed input ids, metadata) of one step, on the device. A DECODE step's input ids
        already on the device (``input_ids``, else ``batch.input_ids`` when set: the tokens the
        previous step sampled, engine overlap) are used as they are."""
        device_ids = input_ids if input_ids is not None else batch.input_ids
        if batch.mode is ForwardMode.DECODE and batch.track_slots is None:
            return self._build_decode_metadata(batch, device_ids)
        if device_ids is not None:
            raise ValueError(f"build_metadata: device input ids are for DECODE steps, got a {batch.mode.value} step")
        return self._build_extend_metadata(batch)

    def _build_decode_metadata(
        self, batch: ScheduledBatch, device_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ForwardMetadata]:
        """:meth:`build_metadata` of a DECODE step (one new token per request, the common case),
        the same tensors as :meth:`_build_extend_metadata` with less host work
        (:meth:`_build_uniform_metadata`); built straight into the full graph's buffers when one
        fits the step."""
        if device_ids is not None:
            b = len(batch.requests)
            if device_ids.shape != (b,) or device_ids.dtype != torch.int64:
                raise ValueError(f"build_metadata: device input ids must be [{b}] int64, got "
                                 f"{tuple(device_ids.shape)} {device_ids.dtype}")
        return self._build_uniform_metadata(batch, ForwardMode.DECODE, 1, None, device_ids, self._graph_for(batch, 1))

    def build_verify_metadata(
        self, batch: ScheduledBatch, drafts: list[list[int]]
    ) -> tuple[torch.Tensor, ForwardMetadata]:
        """(packed input ids, metadata) of a TARGET_VERIFY step (``batch`` from
        ``Scheduler.schedule_verify``: ``L = draft_len`` new tokens per request, its pending token
        then ``drafts[i]``; logits of every token), the verify counterpart of
        :meth:`_build_decode_metadata` (:meth:`_build_uniform_metadata`)."""
        b = len(batch.requests)
        steps = self.draft_len
        if batch.mode is not ForwardMode.TARGET_VERIFY or any(n != steps for n in batch.extend_lens) \
                or len(drafts) != b or any(len(row) != steps - 1 for row in drafts):
            raise ValueError(f"build_verify_metadata: a TARGET_VERIFY step of {steps} tokens per request "
                             f"(pending token + {steps - 1} drafts), got {batch.mode.value} with extend lengths "
                             f"{batch.extend_lens[:8]}")
        return self._build_uniform_metadata(batch, ForwardMode.TARGET_VERIFY, steps, drafts, None,
                                            self._graph_for(batch, steps))

    def _graph_for(self, batch: ScheduledBatch, steps: int) -> "cg.GraphKey | None":
        """The full CUDA graph a uniform step replays (its metadata is then built into the
        graph's buffers), or None."""
        if self.full_graphs is None or self._released:
            return None
        return self.full_graphs.key_for(batch.mode, len(batch.requests), steps)

    def _build_uniform_metadata(
        self, batch: ScheduledBatch, mode: ForwardMode, steps: int, drafts: list[list[int]] | None,
        device_ids: torch.Tensor | None, graph: "cg.GraphKey | None" = None, buffers: "cg.GraphBuffers | None" = None,
    ) -> tuple[torch.Tensor, ForwardMetadata]:
        """Metadata of a step in which every request adds ``steps`` tokens (DECODE: 1, its pending
        token; TARGET_VERIFY: its pending token then ``drafts[i]``), logits of every token: one
        staged row per request (``ops.metadata``) from Python lists, one host->device copy, then
        the ``uniform_step_metadata`` op writes the new ``req_to_token`` entries and every tensor.
        ``device_ids``: the step's input ids, already on the device. With ``graph`` the tensors
        are written into the full graph's stable buffers (``buffers``, by default the runner's),
        the rows past the step's requests up to the bucket as padding requests; the returned
        metadata are views of its first rows, with ``graph_key`` set."""
        reqs = batch.requests
        b = len(reqs)
        n = b * steps
        if graph is not None and (b > graph.batch_size or graph.tokens_per_request != steps or graph.mode is not mode):
            raise ValueError(f"build metadata: a {mode.value} step of {b} requests of {steps} tokens does not fit the "
                             f"full graph {graph}")
        prefix = batch.prefix_lens
        req_slots = [r.req_slot for r in reqs]
        out_cache_loc = batch.out_cache_loc.tolist()
        r2t = self.pools.req_to_token
        for j in range(steps):  # checks and the host mirror; the op writes the device map
            r2t.set_decode_tokens(req_slots, [p + j for p in prefix], out_cache_loc[j::steps], write_device=False)
        rows, start = [], 0
        for i, (r, p) in enumerate(zip(reqs, prefix)):
            if device_ids is not None:
                ids = [0] * steps
            else:
                ids = r.token_ids(p, p + 1) + (list(drafts[i]) if drafts is not None else [])
            rows.append(md_ops.staged_row(r.req_slot, p, start, r.mamba_slot, len(r.prompt),
                                          out_cache_loc[i * steps: (i + 1) * steps], ids))
            start += p + steps
        seq = [p + steps for p in prefix]
        total = start
        if graph is not None:
            buffers = buffers if buffers is not None else self.full_graphs.buffers
            rows += md_ops.padding_rows(start, graph.batch_size - b, steps)
            outputs = buffers.outputs(graph)
        else:
            outputs = self._uniform_outputs(b, steps, total)
        host = torch.tensor(rows, dtype=torch.int64)
        if self.device.type == "cuda":
            host = host.pin_memory()
        torch.ops.hybrid_compile.uniform_step_metadata(
            host.to(self.device, non_blocking=True), device_ids, steps, self.pools.kv.PADDING_SLOT, r2t.req_to_token,
            *outputs)
        input_ids, positions, out_cache_loc_d, logits_indices, qsl, seq_d, prefix_d, prompt_d, mamba_d, initial, \
            kv_indptr, kv_indices = outputs
        md = ForwardMetadata(
            mode=mode,
            positions=positions[:n],
            query_start_loc=qsl[: b + 1],
            seq_lens=seq_d[:b],
            prefix_lens=prefix_d[:b],
            mamba_cache_indices=mamba_d[:b],
            has_initial_state=initial[:b],
            out_cache_loc=out_cache_loc_d[:n],
            kv_indptr=kv_indptr[: b + 1],
            kv_indices=kv_indices[:total],
            logits_indices=logits_indices[:n],
            extend_lens_cpu=[steps] * b,
            seq_lens_cpu=seq,
            draft_len=steps if mode is ForwardMode.TARGET_VERIFY else 0,
            prompt_lens=prompt_d[:b],
            graph_key=graph,
        )
        return input_ids[:n], md

    def _uniform_outputs(self, b: int, steps: int, total: int) -> tuple[torch.Tensor, ...]:
        """Fresh device tensors for the ``uniform_step_metadata`` outputs of ``b`` requests of
        ``steps`` tokens and ``total`` KV entries (each view 16-byte aligned)."""
        dev, n = self.device, b * steps
        tokens = torch.empty(4, _aligned(n, torch.int64), dtype=torch.int64, device=dev)[:, :n]
        per_request = torch.empty(6, _aligned(b + 1, torch.int32), dtype=torch.int32, device=dev)
        qsl, kv_indptr = per_request[:2, : b + 1]
        seq, prefix, prompt, mamba = per_request[2:, :b]
        initial = torch.empty(b, dtype=torch.bool, device=dev)
        kv_indices = torch.empty(total, dtype=self.pools.req_to_token.req_to_token.dtype, device=dev)
        return (*tokens, qsl, seq, prefix, prompt, mamba, initial, kv_indptr, kv_indices)

    def _build_extend_metadata(self, batch: ScheduledBatch) -> tuple[torch.Tensor, ForwardMetadata]:
        """:meth:`build_metadata` of any step (EXTEND, TARGET_VERIFY, DECODE with checkpoints)."""
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
        rows = torch.repeat_interleave(req_slots, seq)
        cols = _segment_arange(seq)
        mamba = torch.tensor([r.mamba_slot for r in batch.requests], dtype=torch.int32)
        prompt_lens = torch.tensor([len(r.prompt) for r in batch.requests], dtype=torch.int32)
        # two host->device copies in all (input ids first: offset 0 of its device tensor)
        input_ids, positions, out_cache_loc, logits_indices, rows, cols = _to_device_packed(
            [torch.tensor(ids, dtype=torch.int64), positions, batch.out_cache_loc, qsl[1:].to(torch.int64) - 1, rows, cols],
            torch.int64, dev,
        )
        qsl_d, kv_indptr_d, seq_d, prefix_d, mamba_d, prompt_d = _to_device_packed(
            [qsl, kv_indptr, seq, prefix, mamba, prompt_lens], torch.int32, dev
        )
        md = ForwardMetadata(
            mode=batch.mode,
            positions=positions,
            query_start_loc=qsl_d,
            seq_lens=seq_d,
            prefix_lens=prefix_d,
            mamba_cache_indices=mamba_d,
            has_initial_state=prefix_d > 0,
            out_cache_loc=out_cache_loc,
            kv_indptr=kv_indptr_d,
            kv_indices=self.pools.req_to_token.req_to_token[rows, cols],
            logits_indices=logits_indices,
            extend_lens_cpu=list(batch.extend_lens),
            seq_lens_cpu=seq.tolist(),
            prompt_lens=prompt_d,
        )
        if batch.track_slots is not None:
            # prefix-cache checkpoints inside the extend (scheduler-chosen; layers/tracking.py)
            md.track_slots = torch.tensor(batch.track_slots, dtype=torch.int32).to(dev)
            md.track_lens = torch.tensor(batch.track_lens, dtype=torch.int32).to(dev)
            md.has_tracking = any(s >= 0 for s in batch.track_slots)
        return input_ids, md

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, input_ids: torch.Tensor | None = None, extra: tuple = ()) -> torch.Tensor:
        """Run one step; returns the logits ``[B, vocab]`` of each request's last new token
        (``input_ids``: see :meth:`build_metadata`; ``extra``: the per-token extra inputs of the
        forward, ``extra_inputs``)."""
        if len(extra) != len(self._extra_specs):
            raise ValueError(f"forward: this runner's model takes {len(self._extra_specs)} extra input(s), got {len(extra)}")
        input_ids, md = self.build_metadata(batch, input_ids)
        n = md.num_tokens
        if not self.compiled:
            with forward_context(ForwardContext(md, self.kv_caches, self.mamba_caches)):
                return self._outputs(self._model_forward(input_ids, md.positions, md.logits_indices, *extra), None, n)
        self._refuse_after_release()
        b = md.batch_size
        if md.graph_key is not None:  # built into the full graph's buffers
            return self._outputs(self.full_graphs.replay(md.graph_key, b), b, n)
        if self.piecewise_graphs is not None and md.mode in (ForwardMode.DECODE, ForwardMode.EXTEND):
            bucket = cg.select_bucket(self._token_buckets, md.num_tokens)
            if bucket is not None and b <= self._logits_rows(bucket):
                pad = bucket - md.num_tokens
                # decode steps stay decode steps: one-token padding requests; else one request of them all
                pad_lens = ([1] * pad if md.mode is ForwardMode.DECODE else [pad]) if pad else []
                padded_ids, padded = cg.pad_requests(input_ids, md, pad_lens, self.pools.kv.PADDING_SLOT,
                                                     self._logits_rows(bucket))
                out = self._run_compiled(padded_ids, padded, graphs_mode=self.piecewise_graphs.REPLAY, extra=extra)
                self.piecewise_graphs.replays += 1
                return self._outputs(out, b, md.num_tokens)
        if self._graph_pool is not None:  # graphs on, but no graph fits this step: the compiled path
            self._compile_counters["eager_fallbacks"] += 1
        if b < _MIN_COMPILED_BATCH:
            input_ids, md = cg.pad_requests(input_ids, md, [1] * (_MIN_COMPILED_BATCH - b), self.pools.kv.PADDING_SLOT)
            self._compile_counters["padded_steps"] += 1
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
            return self._outputs(self.full_graphs.replay(md.graph_key, md.batch_size), n, n)
        if self.compiled:
            if self._graph_pool is not None:  # graphs on, but no verify graph fits this step
                self._compile_counters["eager_fallbacks"] += 1
            if md.batch_size < _MIN_COMPILED_BATCH:  # padding requests of draft_len tokens each
                pad = [md.draft_len] * (_MIN_COMPILED_BATCH - md.batch_size)
                input_ids, md = cg.pad_requests(input_ids, md, pad, self.pools.kv.PADDING_SLOT)
                self._compile_counters["padded_steps"] += 1
        with forward_context(ForwardContext(md, self.kv_caches, self.mamba_caches, self.intermediate_caches)):
            if self.compiled:
                return self._outputs(self._call_compiled(input_ids, md.positions, md.logits_indices), n, n)
            return self._outputs(self._model_forward(input_ids, md.positions, md.logits_indices), n, n)
