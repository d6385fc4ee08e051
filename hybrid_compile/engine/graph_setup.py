"""Compile and CUDA-graph orchestration of a model runner (:mod:`.runner`): what is compiled,
which CUDA graphs are captured, the warm-up and the capture loops, and the compile stats.

With ``EngineConfig.compile`` the model forward runs through ``torch.compile(fullgraph=True)``
with our backend (:mod:`hybrid_compile.compilation`): one Dynamo graph split at the layer ops,
pieces compiled by Inductor. The token count and the batch size are dynamic dimensions; a
step of one request is padded with one padding request (one token whose K/V are not stored,
attending over the dummy KV slot, Mamba index -1; :func:`~.forward_batch.pad_requests`), so every
compiled call sees >= 2 tokens and >= 2 requests and the graph compiled once (at construction, on
a padding-only batch: :meth:`CompiledGraphs.compile`) serves every later step without a recompile
(Dynamo specialises sizes 0 and 1). Per-step metadata never enters the graph: the layer ops read
it from the forward context at run time.

With CUDA graphs (``EngineConfig.cuda_graphs``, :mod:`hybrid_compile.compilation.cuda_graphs`) the
graphs are captured at construction, after the compile (:meth:`CompiledGraphs.capture_cuda_graphs`):
a full graph of the whole forward per decode batch-size bucket (``cuda_graph_batch_sizes``, and
with speculative decoding one per verify bucket), and the pieces' graphs per token bucket
(``piecewise_cuda_graph_tokens``), largest first, each after a warm-up run. Which graph a step
replays is the runner's choice (:meth:`.runner.ModelRunner.forward`); its metadata is built by
:mod:`.forward_batch`.
"""

from __future__ import annotations

import gc
import itertools
import os
import time
import types
from typing import TYPE_CHECKING

import torch
import torch.fx.experimental._config  # noqa: F401  (config patched around compiled calls)
from torch import nn

from ..layers.context import ForwardMode
from ..compilation import cuda_graphs as cg

if TYPE_CHECKING:
    from .config import EngineConfig
    from .startup import Startup

# "ModelRunner" in annotations: the runner (engine/runner.py) owns a CompiledGraphs and passes
# itself in; importing it here, even for type checking, would make the two modules a cycle


def _graph_break_count() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def _recompile_reasons(code_name: str) -> list[str]:
    """The first failed guard of every Dynamo recompile of the code named ``code_name`` (one runner's
    forward, :func:`_own_code_copy`), from Dynamo's compilation metrics (the process's latest 64 compiles)."""
    return [m.recompile_reason for m in torch._dynamo.utils.get_compilation_metrics()
            if m.co_name == code_name and m.recompile_reason]


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def graph_break_reason(error: Exception) -> str:
    """The useful part of a Dynamo graph-break error on one line: its first line, the
    ``Explanation:`` (which names the function Dynamo would not trace) and the innermost frames of
    its "from user code" stack (where the break is, and our call that led there). The rest (hints,
    links, debug context) is left to the chained exception."""
    lines = str(error).splitlines()
    if not lines:
        return type(error).__name__
    parts = [lines[0].strip()]
    parts += [ln.strip() for ln in lines if ln.strip().startswith("Explanation:")]
    frames = [ln.strip() for ln in lines if ln.strip().startswith('File "')]
    ours = [f for f in frames if f.split(",", 1)[0][len('File "'):-1].startswith(_PACKAGE_DIR)]
    for frame in dict.fromkeys(frames[-1:] + ours[-1:]):  # the break, then our innermost call
        parts.append(f"at {frame}")
    return "; ".join(parts)


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
    ``triton.enable_pdl`` where our Triton kernels launch as programmatic dependents, and
    ``shape_padding`` off: its pad-mm pass (bf16 / fp16 matmuls on CUDA) tests the symbolic token
    count of a small unaligned matmul (a tiny Mamba1's ``dt_proj``) and so guards the graph on
    ``2 <= tokens <= 3``, which compiles it again for other token counts (seen on H100 and H200,
    gone with the pass off); a real checkpoint's widths are aligned: nothing for it to pad."""
    import torch._inductor.config as inductor_config

    from ..ops.triton.launch import programmatic_launch_supported

    patches = {"shape_padding": False}
    if hasattr(inductor_config.triton, "enable_pdl") and programmatic_launch_supported(torch.device(device)):
        patches["triton.enable_pdl"] = True
    return patches


def _inductor_caches() -> dict:
    """Inductor's on-disk caches the compiled pieces go through: whether the FX graph cache and the
    AOTAutograd cache are on, and their directory (``TORCHINDUCTOR_CACHE_DIR``)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    off = bool(inductor_config.force_disable_caches)
    return {"fx_graph_cache": bool(inductor_config.fx_graph_cache) and not off,
            "autograd_cache": bool(functorch_config.enable_autograd_cache) and not off, "dir": cache_dir()}


def _device_bytes(model: torch.nn.Module, device: torch.device) -> int:
    """Bytes of ``model``'s parameters and buffers on ``device``, each storage once (packed
    projections share one)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device == device or (t.device.type == device.type and device.index is None):
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


class CompiledGraphs:
    """The compiled forward of one model runner and the CUDA graphs over it.

    Built from the engine config (whether to compile, which graphs, their buckets, the backend's
    settings); :meth:`setup` compiles on a padding-only step and captures the graphs, running
    their steps through the runner (``_run_compiled``, ``_call_compiled``); :meth:`call` is one
    call of the compiled forward; :meth:`stats` is ``engine.stats()["compile"]``.

    ``forward_fn(model)`` builds the function compiled (the runner's)."""

    def __init__(self, model: nn.Module, forward_fn, device: torch.device, config: "EngineConfig | None") -> None:
        self.model = model
        self.forward_fn = forward_fn
        self.device = device
        self.config = config
        self.enabled = config is not None and config.resolved_compile(device)
        self.full, self.piecewise = config.resolved_cuda_graphs(device) if config is not None else (False, False)
        full, piecewise = self.full, self.piecewise
        self.compiled_forward = None
        self.code_name: str | None = None  # the compiled forward's own code name (compile)
        self._code = None  # ... and its code object (Dynamo's compiled entries hang on it)
        self.backend = None
        self.released = False  # release_packed_weights ran: the compiled forward must not run again
        self.counters = dict(warmup_seconds=0.0, graph_breaks=0, compiled_steps=0, padded_steps=0, eager_fallbacks=0,
                             unpadded_steps=0)
        # Dynamo's 0/1 specialisations that graphs of batch 1 outside this object's own ask for (the MTP
        # proposal graphs of one request: a window with one logits row, a chain step of one token), set by
        # their owner: like the one-token decode graph, not counted as recompiles in stats()
        self.batch_one_specialisations = 0
        # CUDA graphs (compilation/cuda_graphs.py): full graphs of decode steps, piecewise graphs of the pieces
        self.graph_pool = cg.GraphPool() if full or piecewise else None
        self.piecewise_graphs = cg.PiecewiseGraphs(self.graph_pool) if piecewise else None
        self.full_graphs: cg.FullGraphRunner | None = None
        self.max_running_requests = config.max_running_requests if config is not None else 1
        # our post-grad rewrite pass (compilation/rewrite.py); EngineConfig.extra["rewrite_passes"]=False turns it off
        self.rewrite_passes = config.rewrite_passes if config is not None else True
        # its routing of matmuls to skinny_mm (ops/linear.py): None = on CUDA; extra["skinny_matmuls"] True/False forces
        self.skinny_matmuls = config.extra.get("skinny_matmuls") if config is not None else None
        # Inductor config patches for every compiled piece (extra["inductor_config"]). Inductor's combo kernels
        # ({"combo_kernels": True}: independent pointwise kernels launched as one) cut a batch-1 decode step of
        # the reference Qwen3-Next from 395 to 311 kernels (H200, 1.76 -> 1.67 ms) but gave wrong tokens with
        # the one-token decode graph on the tiny Qwen3-Next (torch 2.11), so they stay off by default.
        # Inductor's kernels launch as programmatic dependents where ours do (ops/triton/launch.py: only
        # both sides together pay off)
        self.inductor_config = _default_inductor_config(device)
        if config is not None:
            self.inductor_config.update(config.extra.get("inductor_config") or {})
        self.token_buckets: tuple[int, ...] = ()
        # the most padding tokens a step takes to replay a bucket (cg.MAX_PIECEWISE_PADDING)
        self.max_padding = (config.extra.get("piecewise_max_padding") if config is not None else None)
        if self.max_padding is None:
            self.max_padding = cg.MAX_PIECEWISE_PADDING
        if piecewise:
            self.token_buckets = cg.normalize_buckets(
                config.piecewise_cuda_graph_tokens
                or cg.default_token_buckets(config.chunked_prefill_size, config.max_running_requests)
            )

    def setup(self, runner: "ModelRunner", startup: "Startup") -> None:
        """Compile (when enabled), then capture the CUDA graphs (when any), running the warm-up and
        capture steps through ``runner``; ``startup`` times the two phases."""
        capture = self.full or self.piecewise
        startup.plan(*("compile",) * self.enabled, *("capture",) * capture)
        if self.enabled:
            with startup.phase("compile"):
                self.compile(runner)
        if capture:
            with startup.phase("capture"):
                self.capture_cuda_graphs(runner)

    def release_packed_weights(self) -> int:
        """Undo the rewrite pass's packing of the model's projection weights
        (:meth:`~hybrid_compile.compilation.backend.HybridCompileBackend.release_packed_weights`) and
        mark the compiled forward released. Idempotent; a no-op when nothing was compiled."""
        if self.backend is None:
            return 0
        self.released = True
        return self.backend.release_packed_weights()

    # -- compile ------------------------------------------------------------------------------
    def compile(self, runner: "ModelRunner") -> None:
        from ..compilation.backend import HybridCompileBackend

        self.backend = HybridCompileBackend(
            piecewise_graphs=self.piecewise_graphs, rewrites=self.rewrite_passes, skinny_matmuls=self.skinny_matmuls,
            inductor_config=self.inductor_config,
        )
        self.code_name = f"hybrid_compile_forward_{next(_runner_ids)}"
        own = _own_code_copy(self.forward_fn(self.model), self.code_name)
        self._code = own.__code__
        self.compiled_forward = torch.compile(own, backend=self.backend, fullgraph=True, dynamic=True)
        t0 = time.perf_counter()
        try:
            self._warmup(runner)
        except torch._dynamo.exc.Unsupported as e:  # a graph break under fullgraph=True
            raise RuntimeError(
                f"EngineConfig.compile=True: the forward of {type(self.model).__name__} does not trace into one "
                f"graph (torch.compile graph break: {graph_break_reason(e)}); "
                "hybrid_compile needs a single graph to split at the layer ops. Serve this model with compile=False."
            ) from e
        self.counters["warmup_seconds"] = time.perf_counter() - t0

    def call(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor, *extra):
        """One call of the compiled forward (the caller installs the forward context)."""
        for t in (input_ids, positions, logits_indices, *extra):
            if t.shape[0] >= cg.MIN_GRAPH_SIZE:  # (size 1: the decode graph of one request, a specialised compile)
                torch._dynamo.mark_dynamic(t, 0)
        breaks = _graph_break_count()
        # floats of the model (eps, attention scale) are constants, not graph inputs; no duck sizing,
        # so that equal token count and batch size at compile time do not become a guard
        with torch._dynamo.config.patch(specialize_float=True), torch.fx.experimental._config.patch(use_duck_shape=False):
            logits = self.compiled_forward(input_ids, positions, logits_indices, *extra)
        c = self.counters
        c["graph_breaks"] += _graph_break_count() - breaks
        c["compiled_steps"] += 1
        return logits

    @torch.inference_mode()
    def _warmup(self, runner: "ModelRunner") -> None:
        """Compile on a padding-only EXTEND batch (2 requests of 1 and 2 tokens whose K/V are not
        stored, attending over the dummy KV slot, Mamba indices -1: the pools are untouched), so the
        one graph is traced with symbolic sizes >= 2 before serving."""
        ids, md = runner.batch_builder.padding_step([1, 2])
        runner._run_compiled(ids, md, extra=runner._extra_zeros(md.num_tokens))

    # -- CUDA graphs --------------------------------------------------------------------------
    def logits_rows(self, num_tokens: int) -> int:
        """Rows of ``logits_indices`` in a piecewise-graph step of ``num_tokens`` (padded) tokens."""
        return cg.logits_rows_for_tokens(num_tokens, self.max_running_requests)

    def piecewise_bucket(self, num_tokens: int, batch_size: int) -> tuple[int | None, bool]:
        """``(bucket, unpadded)`` of a step of ``num_tokens`` tokens and ``batch_size`` requests: the
        token bucket whose piecewise graphs it replays, or None; ``unpadded``: a bucket fits it, but only
        with more than ``max_padding`` padding tokens, so the compiled forward runs at the step's own
        size instead (counted in ``unpadded_steps``; :func:`~hybrid_compile.compilation.cuda_graphs.replays_bucket`)."""
        bucket = cg.select_bucket(self.token_buckets, num_tokens)
        if bucket is None or batch_size > self.logits_rows(bucket):
            return None, False
        if not cg.replays_bucket(num_tokens, bucket, self.max_padding):
            self.counters["unpadded_steps"] += 1
            return None, True
        return bucket, False

    def capture_cuda_graphs(self, runner: "ModelRunner") -> None:
        config, full, piecewise = self.config, self.full, self.piecewise
        self._capturing = "the full graphs"
        try:
            if full:
                self._capture_full(runner, config.cuda_graph_batch_sizes
                                   or cg.default_decode_batch_sizes(config.max_running_requests))
            if piecewise:
                self._capture_piecewise(runner)
            if piecewise or full:
                # the graphs, their buffers and the compiled code live as long as the engine: keep the
                # cyclic garbage collector from rescanning them every step (SGLang does the same)
                gc.freeze()
                # the warm-ups' blocks, cached for the capture stream, would never serve a step
                torch.cuda.empty_cache()
        except NotImplementedError:
            # the forward itself refuses the configuration (e.g. a MiniMax layer with an FP8 state),
            # graphs or not: its own error
            raise
        except torch.cuda.OutOfMemoryError as e:
            # not a graph-safety problem: the pools left too little memory for the captures' activations
            raise RuntimeError(self._capture_oom_message(e, runner)) from e
        except RuntimeError as e:
            from ..models.fused_experts import unfused_experts

            # transformers' experts forward (the eager loop of an fp32 model) syncs with the host
            hint = (" Its MoE experts run transformers' experts forward: fused_moe=True serves them without host "
                    "syncs." if unfused_experts(self.model) else "")
            raise RuntimeError(
                f"EngineConfig.cuda_graphs={config.cuda_graphs!r}: CUDA graph capture of the "
                f"{type(self.model).__name__} forward failed "
                f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); a graph cannot hold host "
                "syncs or CPU<->GPU copies. Serve this model with cuda_graphs=False (compiled without graphs)."
                + hint
            ) from e

    def _capture_oom_message(self, e: BaseException, runner: "ModelRunner | None" = None) -> str:
        config = self.config
        held = ""
        if self.device.type == "cuda":
            gib = 2**30
            allocated = torch.cuda.memory_allocated(self.device)
            weights = _device_bytes(self.model, self.device)
            pools = runner.pools.nbytes() if runner is not None else 0
            held = (f" while capturing {getattr(self, '_capturing', 'the graphs')} ({allocated / gib:.1f} GiB allocated of "
                    f"{torch.cuda.get_device_properties(self.device).total_memory / gib:.1f} GiB: weights "
                    f"{weights / gib:.1f}, pools {pools / gib:.1f}, the rest {(allocated - weights - pools) / gib:.1f} "
                    "in captured graphs, their buffers and warm-up activations)")
        return (f"EngineConfig.cuda_graphs={config.cuda_graphs!r}: CUDA graph capture of the "
                f"{type(self.model).__name__} forward ran out of device memory{held}: the KV and state pools "
                f"(memory_fraction={config.memory_fraction} of the free memory) leave too "
                "little for the activations of the largest captured step. Lower memory_fraction, "
                f"chunked_prefill_size (now {config.chunked_prefill_size}) or max_running_requests (now "
                f"{config.max_running_requests}). ({str(e).splitlines()[0] if str(e) else type(e).__name__})")

    @torch.inference_mode()
    def _capture_piecewise(self, runner: "ModelRunner") -> None:
        """Warm up and capture every piece for every token bucket, largest first (one padding
        request holding all the bucket's tokens)."""
        pw = self.piecewise_graphs
        t0 = time.perf_counter()
        for n in sorted(self.token_buckets, reverse=True):
            self._capturing = f"the piecewise graphs of {n} tokens"
            step = runner.batch_builder.padding_step([n], self.logits_rows(n))
            extra = runner._extra_zeros(n)
            pw.pool.warm_up(lambda: runner._run_compiled(*step, extra=extra))  # outside the capture
            runner._run_compiled(*step, graphs_mode=pw.CAPTURE, extra=extra)
            pw.captured_tokens.append(n)
        torch.cuda.synchronize()
        pw.capture_seconds += time.perf_counter() - t0

    @torch.inference_mode()
    def _capture_full(self, runner: "ModelRunner", batch_sizes) -> None:
        """Stable buffers + one full graph of the compiled forward per decode bucket, and with
        speculative decoding one per verify bucket (the decode buckets that fit the intermediate
        buffers' rows: a verify batch has at most ``max_running_requests`` requests; draft trees:
        tree verify graphs, ``cuda_graphs.GraphKey.tree``)."""
        if runner._extra_specs:
            raise ValueError("full CUDA graphs of a forward with extra inputs are not supported (their inputs would "
                             "need stable buffers): capture piecewise graphs only")
        pools, draft_len = runner.pools, runner.draft_len
        req_to_token = pools.req_to_token.req_to_token
        sizes = cg.normalize_buckets(batch_sizes, minimum=1)  # 1: a graph specialised to one token (FullGraphRunner)
        verify_sizes: tuple[int, ...] = ()
        spec = self.config.speculative if self.config is not None else None
        # draft trees (top-k > 1): tree verify graphs, their tree mask and parents in the buffers too
        tree = spec is not None and spec.is_tree
        if draft_len:  # (rows: max_running_requests + 1, engine.py)
            # verify buckets start at 2 rows (one of padding), also where one request runs at most
            verify_sizes = tuple(s for s in cg.normalize_buckets(sizes) if s <= pools.mamba.max_draft_batch)
        buffers = cg.GraphBuffers(max(sizes + verify_sizes), req_to_token.shape[1], self.device, req_to_token.dtype,
                                  pools.kv.PADDING_SLOT, max_tokens_per_request=max(1, draft_len))
        self.full_graphs = cg.FullGraphRunner(runner._call_compiled, buffers, sizes, runner.kv_caches,
                                              runner.mamba_caches, self.graph_pool, verify_batch_sizes=verify_sizes,
                                              draft_len=draft_len, intermediate_caches=runner.intermediate_caches,
                                              tree=tree)
        self.full_graphs.capture_all()

    @torch.inference_mode()
    def pools_resized(self, runner: "ModelRunner") -> None:
        """Elastic pools resized the pools: the full graphs (decode, verify) read the old buffers'
        addresses, so they are captured again over the runner's new views. The piecewise graphs
        stay: they hold the compiled pieces only, and the layer ops between them read the pools
        through the forward context at run time. In inference mode, as the first capture: the
        scheduler resizes outside it, and the compiled forward guards on the grad mode (outside it
        Dynamo would compile again, for autograd)."""
        if self.full_graphs is not None:
            self.full_graphs.recapture(runner.kv_caches, runner.mamba_caches)

    def forget_replays(self) -> None:
        """Zero the graphs' replay counters (the engine's kernel warm-up replays graphs too: the
        stats count serving steps only)."""
        if self.full_graphs is not None:
            self.full_graphs.replays = self.full_graphs.verify_replays = 0
        if self.piecewise_graphs is not None:
            self.piecewise_graphs.replays = self.piecewise_graphs.copied_bytes = 0

    def drop_cuda_graphs(self) -> None:
        """Destroy every captured CUDA graph once the last replay has run (waits for the device):
        :meth:`release` at the engine's close. Under tensor parallelism this must happen before the
        NCCL communicator is destroyed (the graphs hold NCCL work of it; ``destroy_process_group``
        hung on the MTP head's). Idempotent; the engine replays nothing afterwards."""
        if self.graph_pool is None:
            return
        torch.cuda.synchronize(self.device)
        if self.full_graphs is not None:
            self.full_graphs.graphs.clear()
        if self.piecewise_graphs is not None:
            for piece in self.piecewise_graphs.pieces:
                piece.graphs.clear()

    def release(self) -> None:
        """Let go of what holds device memory once the engine is closed (after
        :meth:`release_packed_weights`): the captured CUDA graphs (their private pool) and
        Dynamo's compiled entries of this runner's own code object. Dynamo keeps those outside
        Python's garbage collector, and they hold the compiled pieces and what those reach: on the
        GPU a closed engine's memory outlived it (measured: 24 GiB of a 25.7 GiB bf16 model's engine
        still allocated after ``close()``, ``del`` and ``gc.collect()``). Idempotent; the compiled
        forward does not run again."""
        self.drop_cuda_graphs()
        self.released = True
        if self._code is not None:
            torch._C._dynamo.eval_frame.reset_code(self._code)
            self._code = None
        self.compiled_forward = None
        if self.piecewise_graphs is not None:
            self.piecewise_graphs.pieces.clear()
        if self.full_graphs is not None:
            self.full_graphs.forward = None

    def _one_token_graphs(self) -> int:
        """1 when a full decode graph of batch 1 was captured (its compile is specialised to one token),
        plus :attr:`batch_one_specialisations`."""
        return int(self.full_graphs is not None and 1 in self.full_graphs.batch_sizes) + self.batch_one_specialisations

    # -- stats --------------------------------------------------------------------------------
    def stats(self) -> dict:
        """What ``engine.stats()["compile"]`` reports: ``enabled``; with compile on also
        ``compile_seconds`` (split + Inductor, every graph), ``warmup_seconds`` (the compile at
        construction: Dynamo trace + backend + one run), ``graphs`` (Dynamo compiles of the forward),
        ``recompiles`` (graphs beyond the first and the one-token specialisation of a decode graph of
        batch 1, see ``cuda_graphs.FullGraphRunner``, or those of the MTP proposal graphs' batch 1), ``recompile_reasons`` (Dynamo's first failed guard per
        recompile, the one-token graph's included), ``pieces`` (Inductor-compiled pieces), ``distinct_pieces`` (of them, compiled once each: repeated layers share code), ``laid_out_pieces`` (of the
        rest, those whose fake outputs the backend laid out from their key's first piece instead of running
        them under fake mode), ``splitting_op_calls`` and
        ``split_ops_seen`` (layer ops left eager between them), ``caches`` (Inductor's on-disk
        caches: ``fx_graph_cache`` / ``autograd_cache`` on, their ``dir``, and the pieces' lookups:
        ``fx_graph_hits`` / ``_misses`` / ``_bypasses``, ``autograd_hits`` / ...), ``graph_breaks``, ``compiled_steps``
        (calls of the compiled forward outside graph replays: warm-ups and captures included),
        ``padded_steps`` (steps of one request padded to two), and the CUDA graphs: ``cuda_graphs``
        (``{"full": bool, "piecewise": bool}``), ``capture_seconds``, ``decode_batch_sizes`` and
        ``token_buckets`` (captured buckets), ``full_graphs`` / ``piecewise_graphs`` (CUDA graphs
        captured, verify graphs included), ``verify_batch_sizes`` (captured TARGET_VERIFY buckets),
        ``cuda_graph_replays`` (full decode graphs), ``verify_graph_replays`` (full verify graphs),
        ``piecewise_replays`` (steps),
        ``piecewise_copied_bytes`` (inputs copied into the pieces' captured inputs),
        ``full_graph_recaptures`` (full graphs captured again after elastic pools moved memory) and
        ``eager_fallbacks`` (steps with graphs on that no graph fitted, verify steps included: the
        compiled path ran) and ``unpadded_steps`` (steps that fitted a token bucket only with more than
        ``extra["piecewise_max_padding"]`` padding tokens: the compiled path ran at their own size)."""
        if not self.enabled:
            return {"enabled": False}
        s = self.backend.stats
        c = self.counters
        full, pw = self.full_graphs, self.piecewise_graphs
        return {
            "enabled": True,
            "compile_seconds": s.backend_seconds,
            "warmup_seconds": c["warmup_seconds"],
            "graphs": s.graphs,
            "recompiles": max(0, s.graphs - 1 - self._one_token_graphs()),
            "one_token_graph": bool(self._one_token_graphs()),
            "recompile_reasons": _recompile_reasons(self.code_name),  # the one-token graph's included
            "pieces": s.pieces,
            "distinct_pieces": s.distinct_pieces,  # compiled once each, the rest sharing their code (backend.piece_key)
            "laid_out_pieces": s.laid_out_pieces,  # of the rest, fake outputs laid out, not run (backend._output_layout)
            "splitting_op_calls": s.splitting_op_calls,
            "split_ops_seen": dict(s.split_ops_seen),
            "inductor_config": dict(self.inductor_config),
            "rewrites": dict(s.rewrites),  # post-grad rewrite pass: packed weights, fused matmuls (compilation/rewrite.py)
            "caches": {**_inductor_caches(), **s.caches},  # the pieces' lookups in Inductor's caches (backend.py)
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
            "full_graph_recaptures": full.recaptures if full else 0,
            "eager_fallbacks": c["eager_fallbacks"],
            "unpadded_steps": c["unpadded_steps"],
            "piecewise_max_padding": self.max_padding,
        }
