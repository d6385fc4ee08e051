"""Rank 0 broadcasts every step; the other ranks run it.

Rank 0 (the leader) owns the scheduler, the prefix cache, the sampler and the API. Whatever it
does to the device state of the model reaches the followers as one command, in order:

- ``FORWARD``: a model call (eager or compiled, replaying the pieces' CUDA graphs or not) with its
  packed input ids and forward metadata (``ForwardMetadata``'s tensors packed into one int64
  tensor), inside the same forward context (with the speculative buffers for a verify step). Every
  rank then runs the same forward, whose collectives pair up; the logits are gathered on every rank
  and sampled on rank 0 only. The call is the target's or (speculative method "mtp") the MTP
  head's (``HEAD``): a head step's per-token hidden-state input (the runner's extra inputs: the
  target's hidden states, or the head's own output in a chain) follows the payload, one broadcast
  each in its own dtype, and its drafts are picked on rank 0 only (they reach the other ranks as the
  verify step's input ids).
- ``PROPOSAL``: a proposal of the MTP head's proposal graphs (``EngineConfig.extra["mtp_draft_graphs"]``,
  :mod:`hybrid_compile.engine.speculative.mtp_graphs`): the bucket, the staged step rank 0 copied to
  its device and its requests' ``req_to_token`` entries before the window (one int64 payload: the
  graph's metadata op reads them from the map, which on the other ranks only the proposals' own ops
  write) and the head's hidden-state input rows (one broadcast in their dtype); the other ranks copy
  them into their own proposal buffers and map and replay the same graph (run its body where
  nothing was captured). The drafts are rank 0's: they reach the other ranks as the
  verify step's input ids.
- ``GRAPH``: a replay of a full CUDA graph (decode or verify) with the step rank 0 built into its
  graph buffers (``GraphBuffers.step_tensors``, a draft tree's mask and parents included); the other
  ranks copy it into their own buffers and replay the same graph. Every rank captured the same
  graphs at start-up, in the same order, so the NCCL collectives captured inside them pair up.
- ``ZERO`` / ``COPY``: Mamba-state writes outside a forward (a new slot zeroed, a prefix-cache
  copy-on-write or checkpoint, an ``n > 1`` fork); ``KV_COPY``: K/V copied to a forked sequence;
  ``COMMIT``: a speculative verify's state commit.
- ``HOST_WRITE`` / ``HOST_LOAD``: the prefix cache's host tier (``EngineConfig.prefix_cache_host_tier``)
  moving a node's K/V token slots or Mamba slot to the host or back, with the host positions rank
  0's host allocators chose: every rank copies its own shard's slots to and from its own host pool
  (``HostPool.write_at`` / ``load_at``), so the host tier needs no allocator on the other ranks.
- ``RESIZE``: elastic pools (``EngineConfig.elastic_pools``) moved memory between the KV and Mamba
  pools: the new sizes rank 0's pools took (a move takes free entries off the top only, and the
  other ranks' allocators hold nothing), after which every rank refreshes its views and captures
  its full CUDA graphs again, in the same order (their warm-up runs' collectives pair up).
- ``STOP``: the leader's engine closed.

A command is a small header (``torch.distributed.broadcast`` on the gloo control group, which
followers wait in while rank 0 is idle), the host-side integers a forward's metadata keeps as
lists (``extend_lens_cpu``, ``seq_lens_cpu``: one more broadcast on the gloo group, so a follower
never reads them back from its GPU, which would make it wait for its previous forward before
queueing the next) and, when it has tensors, one int64 payload broadcast on the device group (NCCL
on CUDA). The header's first field is the command, then its fields.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..compilation.cuda_graphs import GraphBuffers, GraphKey
from ..layers.context import ForwardContext, ForwardMetadata, ForwardMode, forward_context, get_forward_context
from .group import TensorParallelGroup

FORWARD, ZERO, COPY, COMMIT, STOP, KV_COPY, GRAPH, HOST_WRITE, HOST_LOAD, RESIZE, PROPOSAL = range(1, 12)
TARGET, HEAD = 0, 1  # a FORWARD's runner: the target model's, the MTP head's
_HEADER = 64
_MODES = (ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY)
_DTYPES = (None, torch.int64, torch.int32, torch.bool, torch.int16, torch.uint8)
# ForwardMetadata's tensor fields, in payload order (after the input ids)
_MD_TENSORS = ("positions", "query_start_loc", "seq_lens", "prefix_lens", "mamba_cache_indices", "has_initial_state",
               "out_cache_loc", "kv_indptr", "kv_indices", "logits_indices", "prompt_lens", "track_slots", "track_lens",
               "tree_mask", "tree_parents")  # (draft trees: tree_parents travels flat, [rows, draft_len] again)
_MD_LISTS = ("extend_lens_cpu", "seq_lens_cpu")


def packed(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A command's payload: its tensors flattened into one int64 tensor on ``device``."""
    return torch.cat([t.reshape(-1).to(device=device, dtype=torch.int64) for t in tensors])


def graph_step(buffers: GraphBuffers, md: ForwardMetadata) -> tuple[list[int], list[torch.Tensor]]:
    """A ``GRAPH`` command's header fields (the graph's key, the step's requests and KV entries) and
    tensors (what the step occupies in the graph buffers) of the step ``md`` built into ``buffers``."""
    key = md.graph_key
    kv_entries = buffers.kv_entries(key, md)
    fields = [_MODES.index(key.mode), key.batch_size, key.tokens_per_request, int(key.tree), md.batch_size, kv_entries]
    return fields, list(buffers.step_tensors(key, kv_entries))


def graph_step_targets(buffers: GraphBuffers, fields: list[int]) -> tuple[GraphKey, int, tuple[torch.Tensor, ...]]:
    """The receiving side of :func:`graph_step`: (graph key, requests, the buffers' tensors that the
    payload fills, in order)."""
    mode, batch_size, tokens_per_request, tree, requests, kv_entries = fields
    key = GraphKey(_MODES[mode], batch_size, tokens_per_request, bool(tree))
    return key, requests, buffers.step_tensors(key, kv_entries)


def unpack_into(targets, flat: torch.Tensor) -> None:
    """Copy a :func:`packed` payload into ``targets`` (each converted to its own dtype)."""
    sizes = [t.numel() for t in targets]
    for t, src in zip(targets, flat.split(sizes)):
        t.copy_(src.view(t.shape))


class StepBroadcaster:
    """Rank 0's side: the runner's ``step_observer`` and the KV and Mamba pools' ``observer``."""

    def __init__(self, tp: TensorParallelGroup) -> None:
        self.tp = tp
        self.commands = 0

    def _send(self, header: list[int], payload: list[torch.Tensor], host: list[int] = ()) -> None:
        h = torch.zeros(_HEADER, dtype=torch.int64)
        h[: len(header)] = torch.tensor(header, dtype=torch.int64)
        dist.broadcast(h, 0, group=self.tp.control)
        if host:  # host-side integers (their count is in the header): on the gloo group, host to host
            dist.broadcast(torch.tensor(host, dtype=torch.int64), 0, group=self.tp.control)
        if payload:
            dist.broadcast(packed(payload, self.tp.device), 0, group=self.tp.group)
        self.commands += 1

    def head_observer(self) -> "_HeadSteps":
        """The step observer of the MTP head's runner (its model calls, ``HEAD``)."""
        return _HeadSteps(self)

    def forward(self, compiled: bool, input_ids: torch.Tensor, extra: tuple = (), piecewise: bool = False,
                runner: int = TARGET) -> None:
        """A model call (``piecewise``: the compiled forward replaying the pieces' CUDA graphs) of
        the target's runner or the MTP head's (``runner``; ``extra``: the head's per-token inputs)."""
        ctx = get_forward_context()
        if ctx is None:
            raise RuntimeError("tensor parallelism: a model call outside a forward context cannot be broadcast")
        if extra and runner != HEAD:
            raise RuntimeError("tensor parallelism: model calls with extra per-token inputs are broadcast for the MTP "
                               "head only (a feature that feeds the target's is not supported with "
                               "tensor_parallel_size > 1)")
        md = ctx.metadata
        if md.graph_key is not None:
            raise RuntimeError("tensor parallelism: a step built into a full CUDA graph's buffers replays the graph "
                               "(StepBroadcaster.replay), not a model call")
        tensors = [input_ids] + [getattr(md, f) for f in _MD_TENSORS]
        lists = [list(getattr(md, f)) for f in _MD_LISTS]
        header = [FORWARD, int(compiled), int(bool(ctx.intermediate_caches)), _MODES.index(md.mode), md.draft_len,
                  int(md.has_tracking), int(piecewise), runner, len(extra), *(e.shape[0] for e in extra)]
        for t in tensors:
            header += [0, -1] if t is None else [_DTYPES.index(t.dtype), t.numel()]
        header += [len(v) for v in lists]
        header += list(md.decode_rows) if md.decode_rows is not None else [-1, -1]  # a mixed step's decode rows
        self._send(header, [t for t in tensors if t is not None], host=[x for v in lists for x in v])
        for e in extra:  # (after the payload: the follower knows its shapes and dtype from its runner)
            dist.broadcast(e.contiguous(), 0, group=self.tp.group)

    def replay(self, buffers: GraphBuffers, md: ForwardMetadata) -> None:
        """A full CUDA graph's replay over the step ``md`` built into ``buffers``."""
        fields, tensors = graph_step(buffers, md)
        self._send([GRAPH, *fields], tensors)

    def proposal(self, bucket: int, staged: torch.Tensor, hidden: torch.Tensor, req_slots: list[int],
                 width: int, req_to_token: torch.Tensor) -> None:
        """An MTP proposal of the proposal graphs' bucket ``bucket``: its staged step (int64, on the
        device), the first ``width`` ``req_to_token`` entries of its requests' rows ``req_slots`` and
        the head's hidden-state input rows."""
        idx = torch.tensor(req_slots, dtype=torch.int64).to(self.tp.device, non_blocking=True)
        rows = req_to_token[:, :width].index_select(0, idx)
        self._send([PROPOSAL, bucket, staged.numel(), hidden.shape[0], len(req_slots), width], [staged, idx, rows])
        dist.broadcast(hidden.contiguous(), 0, group=self.tp.group)

    # -- the Mamba pool's observer -------------------------------------------------------------
    def zero_slots(self, idx: torch.Tensor) -> None:
        self._send([ZERO, idx.numel()], [idx])

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._send([COPY, src.numel()], [src, dst])

    def copy_kv_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._send([KV_COPY, src.numel()], [src, dst])

    def commit(self, slots: torch.Tensor, steps: torch.Tensor) -> None:
        self._send([COMMIT, slots.numel()], [slots, steps])

    # -- the host pool's observer (the prefix cache's host tier) ----------------------------
    def host_write(self, kind: int, dev_idx: torch.Tensor, host_start: int) -> None:
        self._send([HOST_WRITE, kind, host_start, dev_idx.numel()], [dev_idx])

    def host_load(self, kind: int, host_start: int, dev_idx: torch.Tensor) -> None:
        self._send([HOST_LOAD, kind, host_start, dev_idx.numel()], [dev_idx])

    def resize(self, kv_pages: int, mamba_slots: int) -> None:
        """Elastic pools: the KV pool's usable pages and the Mamba pool's slots after a move."""
        self._send([RESIZE, kv_pages, mamba_slots], [])

    def stop(self) -> None:
        self._send([STOP], [])


class _HeadSteps:
    """The MTP head runner's step observer on rank 0: its model calls as ``HEAD`` forwards, the
    proposal graphs' proposals as ``PROPOSAL`` commands. (Its steps are never built into the
    target's full CUDA graph buffers: a whole proposal is one graph of its own.)"""

    def __init__(self, broadcaster: StepBroadcaster) -> None:
        self.broadcaster = broadcaster

    def forward(self, compiled: bool, input_ids: torch.Tensor, extra: tuple = (), piecewise: bool = False) -> None:
        self.broadcaster.forward(compiled, input_ids, extra, piecewise, runner=HEAD)

    def proposal(self, bucket: int, staged: torch.Tensor, hidden: torch.Tensor, req_slots: list[int], width: int,
                 req_to_token: torch.Tensor) -> None:
        self.broadcaster.proposal(bucket, staged, hidden, req_slots, width, req_to_token)

    def replay(self, buffers: GraphBuffers, md: ForwardMetadata) -> None:
        raise RuntimeError("tensor parallelism: the MTP head's steps are not replayed as full CUDA graphs")


def _receive(tp: TensorParallelGroup) -> list[int]:
    h = torch.empty(_HEADER, dtype=torch.int64)
    dist.broadcast(h, 0, group=tp.control)
    return h.tolist()


def _host_ints(tp: TensorParallelGroup, n: int) -> list[int]:
    """The ``host`` integers of a command (:meth:`StepBroadcaster._send`), ``n`` of them."""
    if not n:
        return []
    t = torch.empty(n, dtype=torch.int64)
    dist.broadcast(t, 0, group=tp.control)
    return t.tolist()


def _payload(tp: TensorParallelGroup, n: int) -> torch.Tensor:
    flat = torch.empty(n, dtype=torch.int64, device=tp.device)
    dist.broadcast(flat, 0, group=tp.group)
    return flat


def mtp_runner(engine):
    """The runner of the engine's MTP head (speculative method "mtp"), or None."""
    spec = engine.speculative
    return getattr(spec.source, "runner", None) if spec is not None and engine.mtp_head is not None else None


def _runner(engine, which: int):
    """The runner a ``FORWARD`` names: the target's, or the MTP head's (``HEAD``)."""
    if which == TARGET:
        return engine.runner
    runner = mtp_runner(engine)
    if runner is None:
        raise RuntimeError("tensor parallelism: rank 0 runs an MTP head step, this rank's engine has no MTP head")
    return runner


def _forward(engine, tp: TensorParallelGroup, header: list[int]) -> None:
    compiled, verify, mode, draft_len, has_tracking, piecewise, which, n_extra = header[1:9]
    extra_rows, at = header[9: 9 + n_extra], 9 + n_extra
    n_specs = 1 + len(_MD_TENSORS)
    specs = [(header[at + 2 * i], header[at + 1 + 2 * i]) for i in range(n_specs)]
    list_lens = header[at + 2 * n_specs: at + 2 * n_specs + len(_MD_LISTS)]
    rows_at = at + 2 * n_specs + len(_MD_LISTS)
    decode_rows = tuple(header[rows_at: rows_at + 2]) if header[rows_at] >= 0 else None
    # the host-side lists come over gloo, so this rank never waits for its GPU to read them back
    # (it queues the forward while its previous one still runs, as rank 0 does)
    host = _host_ints(tp, sum(list_lens))
    flat = _payload(tp, sum(n for _, n in specs if n > 0))
    runner = _runner(engine, which)
    extra = []
    for rows, (shape, dtype) in zip(extra_rows, runner.extra_inputs):
        e = torch.empty(rows, *shape, dtype=dtype, device=tp.device)
        dist.broadcast(e, 0, group=tp.group)
        extra.append(e)
    values, offset = [], 0
    for code, n in specs:
        if n < 0:
            values.append(None)
            continue
        values.append(flat[offset: offset + n].to(_DTYPES[code]))
        offset += n
    input_ids, rest = values[0], values[1:]
    fields = dict(zip(_MD_TENSORS, rest))
    lists, start = {}, 0
    for f, n in zip(_MD_LISTS, list_lens):
        lists[f] = host[start: start + n]
        start += n
    if fields["tree_parents"] is not None:
        fields["tree_parents"] = fields["tree_parents"].view(-1, draft_len)
    md = ForwardMetadata(mode=_MODES[mode], draft_len=draft_len, has_tracking=bool(has_tracking), **fields, **lists,
                         decode_rows=decode_rows)
    inter = runner.intermediate_caches if verify else {}
    with forward_context(ForwardContext(md, runner.kv_caches, runner.mamba_caches, inter)):
        if piecewise:
            pw = runner.piecewise_graphs
            if pw is None:
                raise RuntimeError("tensor parallelism: rank 0 replays piecewise CUDA graphs, this rank captured none")
            with pw.active(pw.REPLAY):
                runner._call_compiled(input_ids, md.positions, md.logits_indices, *extra)
            pw.replays += 1
        elif compiled:
            runner._call_compiled(input_ids, md.positions, md.logits_indices, *extra)
        else:
            runner._model_forward(input_ids, md.positions, md.logits_indices, *extra)


def _replay(engine, tp: TensorParallelGroup, header: list[int]) -> None:
    """Rank 0's full-graph step copied into this rank's graph buffers, then the same graph replayed."""
    full = engine.runner.full_graphs
    if full is None:
        raise RuntimeError("tensor parallelism: rank 0 replays full CUDA graphs, this rank captured none")
    key, requests, targets = graph_step_targets(full.buffers, header[1:7])
    if key not in full.graphs:
        raise RuntimeError(f"tensor parallelism: rank 0 replays the full CUDA graph {key}, this rank did not capture it")
    unpack_into(targets, _payload(tp, sum(t.numel() for t in targets)))
    full.replay(key, requests)


def _proposal(engine, tp: TensorParallelGroup, header: list[int]) -> None:
    """Rank 0's MTP proposal copied into this rank's proposal buffers, then the same bucket's graph
    replayed (its body run, where none was captured)."""
    spec = engine.speculative
    graphs = getattr(spec.source, "graphs", None) if spec is not None else None
    if graphs is None:
        raise RuntimeError("tensor parallelism: rank 0 runs an MTP proposal graph, this rank built none")
    bucket, n, rows, b, width = header[1:6]
    if graphs.capture and bucket not in graphs.graphs:
        raise RuntimeError(f"tensor parallelism: rank 0 replays the MTP proposal graph of {bucket} requests, this "
                           "rank did not capture it")
    staged, idx, entries = _payload(tp, n + b + b * width).split([n, b, b * width])
    graphs.staged[:n].copy_(staged)
    r2t = graphs.runner.pools.req_to_token.req_to_token
    r2t[:, :width].index_copy_(0, idx, entries.view(b, width).to(r2t.dtype))
    dist.broadcast(graphs.hidden_in[:rows], 0, group=tp.group)
    graphs.run_staged(bucket)


def _resize(engine, kv_pages: int, mamba_slots: int) -> None:
    """A follower's side of ``RESIZE``: the pools take rank 0's sizes (``MemoryPools.resize_to``, as
    rank 0's move did), then the engine refreshes its views and captures its full graphs again."""
    # outside inference mode, as rank 0's scheduler resizes: the new buffers and the prefix cache's masks
    # are then normal tensors, which the engine's close may update in place
    with torch.inference_mode(False):
        engine.pools.resize_to(kv_pages, mamba_slots)
        engine.pools_resized()


@torch.inference_mode()
def follow(engine, tp: TensorParallelGroup) -> int:
    """A follower rank's loop: run rank 0's commands on this rank's engine until ``STOP``; returns
    the number of forwards run."""
    from ..ops import state as _state_ops  # noqa: F401  (registers the state ops)

    mamba = engine.pools.mamba
    forwards = 0
    while True:
        header = _receive(tp)
        cmd = header[0]
        if cmd == STOP:
            return forwards
        if cmd == FORWARD:
            _forward(engine, tp, header)
            forwards += 1
        elif cmd == GRAPH:
            _replay(engine, tp, header)
            forwards += 1
        elif cmd == PROPOSAL:
            _proposal(engine, tp, header)
            forwards += 1
        elif cmd == ZERO:
            mamba.zero_state(_payload(tp, header[1]))
        elif cmd == COPY:
            src, dst = _payload(tp, 2 * header[1]).split(header[1])
            mamba.copy_state(src, dst)
        elif cmd == KV_COPY:
            src, dst = _payload(tp, 2 * header[1]).split(header[1])
            engine.pools.kv.copy_state(src, dst)
        elif cmd in (HOST_WRITE, HOST_LOAD):
            kind, host_start, n = header[1:4]
            idx = _payload(tp, n)
            if cmd == HOST_WRITE:
                engine.host_pool.write_at(kind, idx, host_start)
            else:
                engine.host_pool.load_at(kind, host_start, idx)
        elif cmd == RESIZE:
            _resize(engine, header[1], header[2])
        elif cmd == COMMIT:
            slots, steps = _payload(tp, 2 * header[1]).to(torch.int32).split(header[1])
            torch.ops.hybrid_compile.commit_speculative_state(
                mamba.state_tensors(), mamba.intermediate_state_tensors(), slots, steps)
        else:
            raise RuntimeError(f"tensor parallelism: unknown step command {cmd} from rank 0")
