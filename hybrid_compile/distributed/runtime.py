"""Starting a tensor-parallel engine: processes, per-rank engines, the leader and its shutdown.

:func:`launch` (``hc.from_pretrained(dir, tensor_parallel_size=N)``) runs in one of two ways:

- **spawned** (a plain ``python`` process): this process is rank 0; it starts ranks 1..N-1 with
  ``torch.multiprocessing`` (start method ``spawn``), all meeting through a ``TCPStore`` it hosts.
  It returns rank 0's engine; ``engine.close()`` stops and joins the other processes.
- **torchrun** (``torchrun --nproc-per-node N script.py``, every rank runs the script): rank 0
  returns its engine; every other rank follows rank 0's steps inside the call and returns
  ``None`` once rank 0's engine is closed.

``hc.wrap(model, tensor_parallel_size=N)`` (a model in memory) saves the model for the ranks first:
in the spawned way before they start, under torchrun once the group is up (:func:`shared_checkpoint`).
The prefix cache's host tier gets an even share of its size per rank (:func:`_host_tier_share`), and
elastic pools resize every rank's pools in step (:meth:`TensorParallelEngine.pools_resized`).

Every rank loads only its shard (``distributed/loading.py``; with speculative method "mtp" also
its shard of the MTP head; with method "draft_model" the draft model is rank 0's alone:
:func:`follower_config`; with ``quantization="fp8"`` it quantizes that shard before anything else
patches its modules), installs the collectives (``distributed/layers.py``) and builds a
:class:`~hybrid_compile.engine.HybridEngine` over it with the same configuration and pool sizes.
Rank 0's engine (:class:`TensorParallelEngine`) broadcasts every step (``distributed/step.py``); a
failure on any rank ends every rank with that error (``distributed/group.py``), and the user's
process raises it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from ..engine import EngineConfig, HybridEngine
from ..engine.speculative import SpeculativeConfig
from ..engine.speculative.mtp_graphs import resolve_option as resolve_mtp_graphs
from ..engine.startup import Startup
from ..models.mtp import check_mtp_checkpoint
from . import group as _group
from . import one_shot
from .group import DEFAULT_TIMEOUT_SECONDS, TensorParallelError, TensorParallelGroup
from .layers import cross_rank_rms_norm, reduce_output, vocab_parallel_embedding, vocab_parallel_lm_head
from .loading import LoadReport, load_mtp_shard, load_shard
from .plans import ShardPlan, plan_for
from .step import StepBroadcaster, follow, mtp_runner

_JOIN_SECONDS = 30.0


class TensorParallelEngine(HybridEngine):
    """Rank 0's engine: a :class:`HybridEngine` whose every step the other ranks run too.

    Its API is the plain engine's. Any exception inside a step ends the whole group (the ranks'
    collectives would no longer pair up): this engine then raises that error, or the failing
    rank's as :class:`TensorParallelError`, and every later call raises it too."""

    def __init__(self, model, config: EngineConfig, tp: TensorParallelGroup, *, tokenizer=None,
                 processes: list | None = None, startup: Startup | None = None, mtp_head=None) -> None:
        super().__init__(model, dataclasses.replace(config, warmup_kernels=False), tokenizer=tokenizer,
                         startup=startup, mtp_head=mtp_head)
        self.config = config
        self.tp = tp
        self.load_reports: list[LoadReport] = []
        # seconds hc.wrap(model, tensor_parallel_size=N) spent saving the model for the ranks to load (None:
        # from_pretrained, the ranks read the user's checkpoint)
        self.saved_checkpoint_seconds: float | None = None
        self._processes = list(processes or [])
        self._failure: BaseException | None = None
        self._broadcaster = StepBroadcaster(tp)
        self._broadcast(True)

    def _broadcast(self, on: bool) -> None:
        """Whether rank 0's model calls (the target's and the MTP head's) and its pool moves (KV, Mamba,
        the prefix cache's host tier: every rank moves its shard's slots) are sent to the other ranks."""
        b = self._broadcaster if on else None
        self.runner.step_observer = b
        head = mtp_runner(self)
        if head is not None:
            head.step_observer = b.head_observer() if on else None
        self.pools.mamba.observer = b
        self.pools.kv.observer = b
        if self.host_pool is not None:
            self.host_pool.observer = b

    def warm_up_with_followers(self) -> None:
        """The kernels' warm-up (``EngineConfig.warmup_kernels``; default on CUDA), its steps run by
        every rank: call it once the other ranks follow (:func:`follow`), after the start-up
        collectives of :func:`build_rank_engine` (a step broadcast before then would meet a rank
        still inside one of those collectives)."""
        warm = self.config.warmup_kernels
        if warm if warm is not None else self.tp.device.type == "cuda":
            self.startup.plan("warmup")
            with self.startup.phase("warmup"):
                self._guarded(self._warm_up_kernels)
            self.startup.finish()  # total_s with the warm-up

    def _guarded(self, fn, *args):
        if self._failure is not None:
            raise TensorParallelError(f"this tensor-parallel engine failed earlier: {self._failure}")
        try:
            return fn(*args)
        except BaseException as e:
            if self._rank0_only(e):  # the other ranks saw nothing of it: the group serves on
                raise
            err = self.tp.fail(e)
            self._failure = err if err is not None else e
            self._reap(terminate_after=5.0)
            if err is None:
                raise
            raise err from e

    def _rank0_only(self, e: BaseException) -> bool:
        """Whether ``e`` came from a step's draft phase with a draft source that runs on rank 0 alone
        (a draft model, n-gram, custom: everything but the MTP head, whose forwards every rank runs).
        The draft phase comes before anything of the step reaches the other ranks, and the decoder
        leaves every request and pool as it was (``SpeculativeDecoder.step``), so the engine serves on
        as one process does; any other failure may leave a rank inside a collective: it ends the group."""
        spec = self.speculative
        return spec is not None and spec.draft_failure == id(e) and mtp_runner(self) is None

    def step(self):
        return self._guarded(super().step)

    def pools_resized(self) -> None:
        """Elastic pools moved memory (rank 0's pools already have their new sizes): the other ranks
        take the same sizes (``RESIZE``), then every rank refreshes its views and captures its full
        graphs again, by itself (the captures' runs are not broadcast), in the same order."""
        self._broadcaster.resize(self.pools.kv.allocator.num_pages, self.pools.mamba.total())
        # each rank captures by itself (the same graphs in the same order, their all-reduces pairing up):
        # a capture's warm-up run broadcast from here would meet a follower inside its own capture
        self._broadcast(False)
        try:
            super().pools_resized()
        finally:
            self._broadcast(True)

    def close(self) -> None:
        """Close the engine on every rank and end the group (joins the spawned processes)."""
        if self.tp.closed:
            if self.patch.restores:
                HybridEngine.close(self)
            self._reap()
            return
        try:
            # (close drops the target's and the MTP head's CUDA graphs: they hold NCCL work of the
            # group destroyed below, and destroy_process_group hangs on it)
            self._guarded(HybridEngine.close, self)
            self._broadcaster.stop()
            self.tp.shutdown(together=True)
        finally:
            self.tp.shutdown()
            _group.set_current_group(None)
            self._reap()

    def _reap(self, terminate_after: float = _JOIN_SECONDS) -> None:
        for p in self._processes:
            p.join(terminate_after)
            if p.is_alive():
                p.terminate()
                p.join(5.0)
        self._processes = []

    def stats(self) -> dict:
        s = super().stats()
        s["tensor_parallel"] = {
            "size": self.tp.size,
            "backend": dist.get_backend(self.tp.group) if not self.tp.closed else None,
            "commands_broadcast": self._broadcaster.commands,
            # the model's all-reduces: one_shot.py's kernel up to max bytes, NCCL above; or NCCL (gloo) alone
            "all_reduce": ({"mode": "one_shot", "one_shot_max_bytes": one_shot.MAX_BYTES} if self.tp.one_shot
                           else {"mode": dist.get_backend(self.tp.group) if not self.tp.closed else None,
                                 **({"one_shot_unpaired": self.tp.one_shot_unpaired}
                                    if self.tp.one_shot_unpaired else {})}),
            "ranks": [dataclasses.asdict(r) for r in self.load_reports],
            "saved_checkpoint_s": self.saved_checkpoint_seconds,
        }
        return s


def _check_options(config: EngineConfig, size: int, device_type: str) -> EngineConfig:
    spec = config.speculative
    if spec is not None and spec.method == "mtp":
        # the MTP proposal graphs as on one process: an explicit True that cannot run raises here, before launch
        resolve_mtp_graphs(config, torch.device(device_type))
    # an explicit one-shot all-reduce that cannot run (CPU, 3 ranks, no P2P): one error before launch
    # ("auto" never raises: each rank resolves it with the model's dtype, build_rank_engine)
    if config.tensor_parallel_all_reduce == "one_shot":
        one_shot.resolve(config.tensor_parallel_all_reduce, torch.device(device_type), size, None)
    # CUDA graphs as without tensor parallelism (an explicit mode on CPU or without compile raises here,
    # before any process starts): every rank captures the same graphs, NCCL collectives inside them
    full, piecewise = config.resolved_cuda_graphs(torch.device(device_type))
    if (full or piecewise) and os.environ.get("TORCH_NCCL_BLOCKING_WAIT", "0").lower() in ("1", "true"):
        raise ValueError(
            "CUDA graphs with tensor_parallel_size > 1 capture the NCCL collectives, and TORCH_NCCL_BLOCKING_WAIT=1 "
            "makes every collective's wait block the host, which a capture cannot hold: unset it or pass "
            "cuda_graphs=False"
        )
    return config


class LeaderDrafts:
    """The draft source of ranks 1..N-1 under speculative method "draft_model": the draft model is
    rank 0's alone (one process, its own pools, no collectives), and its drafts reach the other
    ranks as the verify step's input ids (``distributed/step.py``), so this source never proposes."""

    def propose(self, requests, k):
        raise RuntimeError("tensor parallelism: a follower rank never proposes drafts (rank 0's draft model does)")

    def propose_tree(self, requests, depth, topk, budget):
        self.propose(requests, depth)


def follower_config(config: EngineConfig) -> EngineConfig:
    """The engine configuration of ranks 1..N-1: rank 0's, except with speculative method
    "draft_model", whose draft model runs on rank 0 alone. Their speculative decoder then has rank
    0's shape (drafts per step, a tree's nodes: the verify buffers and graphs are the same on every
    rank) over a :class:`LeaderDrafts` source, and the draft model is not sent to their processes."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model":
        return config
    follower = SpeculativeConfig(method="custom", num_draft_tokens=spec.num_draft_tokens, topk=spec.topk,
                                 num_tree_nodes=spec.draft_nodes if spec.is_tree else None,
                                 draft_source=LeaderDrafts())
    follower.validate()
    return dataclasses.replace(config, speculative=follower)


def _resolve_device(device: Any) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = torch.device(device).type if not isinstance(device, dict) else None
    if kind not in ("cpu", "cuda") or (isinstance(device, (str, torch.device)) and torch.device(device).index is not None):
        raise ValueError(
            f"device={device!r} with tensor parallelism: pass 'cuda' (rank r uses GPU r) or 'cpu', not one device "
            "or a device map"
        )
    return kind


def _memory_budget(tp: TensorParallelGroup, config: EngineConfig) -> int | None:
    """The pools' budget, the same on every rank: the smallest rank's share of its free memory (on
    CPU the ranks share the host's memory, so each takes 1/size of it)."""
    if "memory_budget_bytes" in config.extra:
        return config.extra["memory_budget_bytes"]
    from ..memory.sizing import available_device_memory

    free = available_device_memory(tp.device)
    if tp.device.type == "cpu":
        free //= tp.size
    return tp.all_min([int(free * config.memory_fraction)])[0]


def _normalises_whole_width(norm: torch.nn.Module) -> bool:
    """Whether a Mamba2 gated norm is an RMSNorm (``variance_epsilon``; FalconH1 without
    ``mamba_rms_norm`` has none) that ignores the B/C groups (no ``group_size`` / ``n_groups``): its
    mean of squares then spans every rank's channels (plans.ShardPlan.split_group_norms)."""
    grouped = hasattr(norm, "group_size") or hasattr(norm, "n_groups")
    return hasattr(norm, "variance_epsilon") and not grouped


def _install_layer_collectives(modules, plan: ShardPlan, tp: TensorParallelGroup) -> int:
    """The all-reduces and the cross-rank norms of ``modules`` (``(name, module)`` pairs named as
    the plan's patterns read them); returns the number of reduced modules."""
    reduced = 0
    for name, module in modules:
        if name and plan.is_reduced(name, module):
            reduce_output(module, tp)
            reduced += 1
        for pattern, width, gated, ranks in plan.cross_rank_norms:
            if name and pattern.search(name):
                if gated and ranks is not None and ranks < tp.size and _normalises_whole_width(module):
                    # a B/C group's norm on fewer ranks than all, but the built norm ignores the groups
                    # (transformers 5.17's Bamba / Mamba2 / GraniteMoeHybrid): it spans every rank's channels
                    cross_rank_rms_norm(module, width * (tp.size // ranks), tp, gated)
                else:
                    cross_rank_rms_norm(module, width, tp, gated, ranks)
        for pattern, width in plan.split_group_norms:
            if name and pattern.search(name) and _normalises_whole_width(module):
                cross_rank_rms_norm(module, width, tp, gated=True)
    return reduced


def install_collectives(model, plan: ShardPlan, tp: TensorParallelGroup) -> None:
    """The all-reduces, the cross-rank norms and the vocab-parallel embedding / LM head of a
    rank's model (layers.py)."""
    reduced = _install_layer_collectives(model.named_modules(), plan, tp)
    if not reduced:
        raise RuntimeError(f"tensor parallelism: the {plan.family} plan found no module to all-reduce")
    embed = model.get_input_embeddings()
    vocab = int(plan.config.vocab_size)
    per = embed.weight.shape[0]
    start = min(vocab, tp.rank * per)
    vocab_parallel_embedding(embed, start, min(vocab, start + per), tp)
    head = model.get_output_embeddings()
    vocab_parallel_lm_head(head, vocab, tp)


def install_mtp_collectives(head, plan: ShardPlan, tp: TensorParallelGroup) -> None:
    """The collectives of a rank's MTP head (its modules named ``mtp.*`` as in the checkpoint, so
    the plan's patterns of the model's layers match its decoder layer); its embedding and LM head
    are the model's, vocab-parallel already."""
    modules = [(f"mtp.{name}" + (f".{sub}" if sub else ""), m)
               for name, own in head.own_modules().items() for sub, m in own.named_modules()]
    if not _install_layer_collectives(modules, plan, tp):
        raise RuntimeError(f"tensor parallelism: the {plan.family} plan found no module of the MTP head to all-reduce")


def _weight_bytes(*modules: torch.nn.Module) -> int:
    """Bytes of the modules' parameters (each tensor once)."""
    seen = {id(p): p for m in modules for p in m.parameters()}
    return sum(p.numel() * p.element_size() for p in seen.values())


def build_rank_engine(tp: TensorParallelGroup, path: str, config, engine_config: EngineConfig, dtype,
                      trust_remote_code: bool, tokenizer=None, processes=None,
                      startup: Startup | None = None) -> HybridEngine:
    """Load this rank's shard and build its engine (rank 0: a :class:`TensorParallelEngine`);
    ``startup`` times (and shows) the load and the engine's phases (default: a silent one)."""
    if engine_config.prefix_cache_host_tier:
        engine_config = _host_tier_share(tp, engine_config)
    startup = startup if startup is not None else Startup()
    plan = plan_for(config, tp.size, tp.rank)
    startup.plan("load")
    with startup.phase("load"):
        model, report = load_shard(path, config, plan, dtype, tp.device, trust_remote_code)
        spec = engine_config.speculative
        mtp_head = (load_mtp_shard(model, path, config, plan, spec.mtp_checkpoint)
                    if spec is not None and spec.method == "mtp" else None)
        head_bytes = _weight_bytes(*mtp_head.own_modules().values()) if mtp_head is not None else 0
        report.shard_bytes += head_bytes  # (the checkpoint's bytes count the mtp.* tensors too)
        from ..quantization import has_fp8_layers, quantize_model

        # (an FP8 checkpoint's shard is FP8 as loaded: its float layers stay float, as on one process)
        if engine_config.quantization == "fp8" and not has_fp8_layers(model):
            # each rank quantizes its own shard (block scales over its rows and columns) before the
            # collectives go in: quantize_model swaps the projection modules, the collectives patch the
            # modules' forwards (the other order would drop the row-parallel projections' all-reduces)
            quantize_model(model)
            # the weights as served: the shard's e4m3 weights and scales (the head stays as loaded)
            report.served_bytes = _weight_bytes(model) + head_bytes
        else:
            report.served_bytes = report.shard_bytes
    mode = engine_config.tensor_parallel_all_reduce
    if one_shot.resolve(mode, tp.device, tp.size, getattr(model, "dtype", None)):
        # (every rank gets the same answer: the counts are gathered)
        unpaired = one_shot.unpaired_reason([c[0] for c in tp.gather_ints([one_shot.mappings()])])
        if unpaired is not None and mode == "one_shot":
            raise ValueError(f"EngineConfig.tensor_parallel_all_reduce='one_shot' cannot run here: {unpaired}; pass "
                             "'nccl' or 'auto' (NCCL then), or start this engine in a new process")
        if unpaired is None:
            tp.enable_one_shot()  # (before the engine compiles and captures: its graphs hold the buffer)
        else:
            tp.one_shot_unpaired = unpaired
    install_collectives(model, plan, tp)
    if mtp_head is not None:
        install_mtp_collectives(mtp_head, plan, tp)
    extra = dict(engine_config.extra, memory_budget_bytes=_memory_budget(tp, engine_config))
    # (fused_moe stays as given: each rank's engine resolves it, and the fused routers before FP8 experts, as
    # one process does, on the same layout. The all-reduce mode is the group's now, tp.one_shot; the engine's
    # own check refuses 'one_shot')
    engine_config = dataclasses.replace(engine_config, extra=extra, tensor_parallel_all_reduce="auto")
    if tp.is_leader:
        engine = TensorParallelEngine(model, engine_config, tp, tokenizer=tokenizer, processes=processes,
                                      startup=startup, mtp_head=mtp_head)
    else:
        engine = HybridEngine(model, dataclasses.replace(engine_config, warmup_kernels=False), startup=startup,
                              mtp_head=mtp_head)
    reports = tp.gather_ints([report.shard_bytes, report.full_model_bytes, report.peak_host_bytes,
                              report.peak_device_bytes, report.served_bytes])
    host = engine.host_pool
    capacities = tp.gather_ints([engine.pools.kv.allocator.total(), engine.pools.mamba.total(),
                                 host.kv_capacity() if host is not None else 0, host.mamba_capacity() if host is not None else 0])
    if any(c != capacities[0] for c in capacities):
        raise RuntimeError(f"tensor parallelism: the ranks' pools differ in size ([KV tokens, Mamba slots, host KV "
                           f"tokens, host Mamba slots] per rank: {capacities}); pass max_total_tokens and mamba_cache_size")
    c = engine.runner.compile_stats()
    head = mtp_runner(engine)
    h = head.compile_stats() if head is not None else {}
    proposals = getattr(engine.speculative.source, "graphs", None) if engine.speculative is not None else None
    graphs = tp.gather_ints([c.get("full_graphs", 0), c.get("piecewise_graphs", 0), h.get("piecewise_graphs", 0),
                             -1 if proposals is None else len(proposals.graphs)])
    if any(g != graphs[0] for g in graphs):  # rank 0's every replay pairs with the same graph on every rank
        raise RuntimeError(f"tensor parallelism: the ranks captured different CUDA graphs ([full, piecewise, MTP "
                           f"head piecewise, MTP proposal (-1: none built)] per rank: {graphs})")
    if tp.is_leader:
        engine.load_reports = [LoadReport(*r) for r in reports]
        engine.warm_up_with_followers()
    return engine


def _host_tier_share(tp: TensorParallelGroup, engine_config: EngineConfig) -> EngineConfig:
    """The prefix cache's host tier under tensor parallelism: ``prefix_cache_host_bytes`` (or
    ``prefix_cache_host_fraction`` of the available host memory) is the engine's, split evenly over
    the ranks, which share the host; each rank's share is the smallest any rank computed, so that
    every rank's host pool has the same capacity (rank 0's host allocators choose the positions for
    all of them, ``step.HOST_WRITE``)."""
    from ..memory.host_pool import DEFAULT_HOST_FRACTION
    from ..memory.sizing import available_device_memory

    total = engine_config.prefix_cache_host_bytes
    if total is None:
        fraction = engine_config.prefix_cache_host_fraction
        total = int(available_device_memory("cpu") * (DEFAULT_HOST_FRACTION if fraction is None else fraction))
    (share,) = tp.all_min([total // tp.size])
    return dataclasses.replace(engine_config, prefix_cache_host_bytes=share, prefix_cache_host_fraction=None)


def _serve_follower(tp: TensorParallelGroup, path: str, config, engine_config: EngineConfig, dtype,
                    trust_remote_code: bool) -> None:
    """A follower rank's whole life: its engine follows rank 0's until rank 0 closes (or any rank
    fails: this rank then raises the group's first error, or its own when it was first)."""
    try:
        engine = build_rank_engine(tp, path, config, engine_config, dtype, trust_remote_code)
        follow(engine, tp)
        engine.close()  # (drops the CUDA graphs, which hold NCCL work of the group ended below)
    except BaseException as e:
        err = tp.fail(e)
        raise (err if err is not None else e)
    tp.shutdown(together=True)


def _worker(rank: int, size: int, port: int, device_type: str, timeout: float, threads: int, path: str, config,
            engine_config: EngineConfig, dtype, trust_remote_code: bool) -> None:
    """Entry point of a spawned rank (1..size-1)."""
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=_timedelta(timeout))
    tp = _group.init_group(rank, size, _group.rank_device(device_type, rank), timeout, store=store)
    try:
        _serve_follower(tp, path, config, engine_config, dtype, trust_remote_code)
    except BaseException as e:
        print(f"hybrid_compile tensor-parallel rank {rank}: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


def launch(path, size: int, config, engine_config: EngineConfig, *, dtype, device, tokenizer=None,
           trust_remote_code: bool = False, timeout: float = DEFAULT_TIMEOUT_SECONDS,
           startup: Startup | None = None) -> HybridEngine | None:
    """Serve the checkpoint in ``path`` (its ``config`` already read) over ``size`` ranks (module
    docstring). Everything that can be checked is checked before a process starts or a weight is read.
    ``startup``: rank 0's start-up phases (its load and engine; with progress, its bar): the other
    ranks' are silent. Under torchrun ``path`` may be a function of the rank's group that returns
    the directory once the group is up (:func:`shared_checkpoint`: rank 0 writes it, the others
    wait for its name)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    device_type = _resolve_device(device)
    plan_for(config, size)  # head counts that do not divide: one error, before any weight is read
    engine_config = _check_options(engine_config, size, device_type)
    spec = engine_config.speculative
    if spec is not None and spec.method == "mtp":  # (a family or checkpoint without an MTP head: one error)
        check_mtp_checkpoint(config, os.path.expanduser(os.fspath(spec.mtp_checkpoint or path)))
    if device_type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs, this host has {torch.cuda.device_count()}")
    if _group.current_group() is not None:
        raise RuntimeError("this process already serves a tensor-parallel engine; close it first")
    env = _group.torchrun_env()
    if env is not None:
        rank, world, local_rank = env
        tp = _group.init_group(rank, size, _group.rank_device(device_type, local_rank), timeout)
        _group.set_current_group(tp)
        if callable(path):
            try:
                path = path(tp)
            except BaseException:
                _group.set_current_group(None)
                tp.shutdown()
                raise
        if rank != 0:
            try:
                _serve_follower(tp, path, config, follower_config(engine_config), dtype, trust_remote_code)
            finally:
                _group.set_current_group(None)
            return None
        return _leader(tp, path, config, engine_config, dtype, trust_remote_code, tokenizer, [], startup)

    if callable(path):
        raise TypeError("launch: a checkpoint given as a function is for ranks started by torchrun")
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=_timedelta(timeout), wait_for_workers=False)
    threads = max(1, torch.get_num_threads() // size)
    ctx = torch.multiprocessing.get_context("spawn")
    processes = []
    followers = follower_config(engine_config)
    for rank in range(1, size):
        p = ctx.Process(target=_worker, args=(rank, size, store.port, device_type, timeout, threads, path, config,
                                              followers, dtype, trust_remote_code), daemon=True)
        p.start()
        processes.append(p)
    try:
        tp = _group.init_group(0, size, _group.rank_device(device_type, 0), timeout, store=store)
    except BaseException:
        for p in processes:
            p.terminate()
        raise
    _group.set_current_group(tp)
    return _leader(tp, path, config, engine_config, dtype, trust_remote_code, tokenizer, processes, startup)


_CHECKPOINT_KEY = "hybrid_compile/tp/checkpoint"
_FAILED = "\0"  # the value's first character when rank 0 could not write the checkpoint


def shared_checkpoint(tp: TensorParallelGroup, write) -> str:
    """A checkpoint directory every rank of a torchrun group reads: rank 0 makes a temporary
    directory and calls ``write(directory)``, then publishes its name in the group's store (under
    this engine's key prefix); the other ranks wait for it (as long as the write takes) and raise
    :class:`TensorParallelError` with rank 0's error when the write failed. Rank 0 removes the
    directory once every rank holds its shard (``hc.wrap``)."""
    import datetime
    import tempfile

    if tp.is_leader:
        directory = tempfile.mkdtemp(prefix="hybrid_compile_tp_")
        try:
            write(directory)
        except BaseException as e:
            tp.store.set(_CHECKPOINT_KEY, _FAILED + f"{type(e).__name__}: {e}")
            import shutil

            shutil.rmtree(directory, ignore_errors=True)
            raise
        tp.store.set(_CHECKPOINT_KEY, directory)
        return directory
    tp.store.wait([_CHECKPOINT_KEY], datetime.timedelta(days=1))  # (a large model takes long to write)
    value = tp.store.get(_CHECKPOINT_KEY).decode()
    if value.startswith(_FAILED):
        raise TensorParallelError(f"rank 0 could not save the model for the ranks: {value[1:]}")
    return value


def _leader(tp, path, config, engine_config, dtype, trust_remote_code, tokenizer, processes, startup) -> HybridEngine:
    try:
        return build_rank_engine(tp, path, config, engine_config, dtype, trust_remote_code, tokenizer, processes,
                                 startup)
    except BaseException as e:
        err = tp.fail(e)
        _group.set_current_group(None)
        for p in processes:
            p.join(_JOIN_SECONDS)
            if p.is_alive():
                p.terminate()
        if err is None:
            raise
        raise err from e
