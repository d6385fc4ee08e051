"""The forward batch of a step: a scheduled batch (``ScheduledBatch``, :mod:`.scheduler`) turned
into what the model forward reads, on the device: the packed input ids and the
:class:`~hybrid_compile.layers.context.ForwardMetadata` the layer ops read from the forward
context (:data:`ForwardBatch`). Every kind of step's metadata is built here
(:class:`ForwardBatchBuilder`), and so is the padding of a step with padding requests
(:func:`pad_requests`: for the compiled forward and the CUDA graphs of
:mod:`hybrid_compile.compilation.cuda_graphs`). The model runner (:mod:`.runner`) runs the result.

Three paths, all giving the same tensors:

- a DECODE step (the common case) takes a fast path (:meth:`ForwardBatchBuilder.build_decode`:
  one staged row per request from Python lists, one host->device copy, then one op,
  ``uniform_step_metadata`` (:mod:`hybrid_compile.ops.metadata`), writes the new ``req_to_token``
  entries and every tensor, into fresh tensors or into a full graph's stable buffers); its input
  ids may already be on the device (the engine's overlap feeds a step's sampled tokens straight
  into the next step launched ahead);
- a TARGET_VERIFY step (speculative decoding: ``draft_len = k + 1`` tokens per request) takes the
  same path (:meth:`ForwardBatchBuilder.build_verify`); a draft tree's (top-k > 1) then has its
  positions (``prefix + depth``), ``tree_mask`` and ``tree_parents`` from one more host->device copy;
- every other step (EXTEND, DECODE with prefix-cache checkpoints) takes the general path
  (:meth:`ForwardBatchBuilder.build_extend`: two host->device copies, KV indices gathered on the
  device from ``req_to_token``).

A DECODE or TARGET_VERIFY step that fits a full CUDA graph (:attr:`ForwardBatchBuilder.full_graphs`,
set once the graphs are captured) is built straight into that graph's buffers, the rows past the
step's requests up to the bucket as padding requests (``ForwardMetadata.graph_key`` says which
graph; a draft tree's tree metadata go into the graph's tree buffers, padding rows a chain); the
model runner then replays the graph.

Metadata tensors start at 16-byte aligned addresses (:func:`to_device_packed`): Triton
specialises a kernel on the alignment of each pointer.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

import torch

from ..layers.context import ForwardMetadata, ForwardMode
from ..memory.allocator import repeat_counts, segment_arange
from ..ops import metadata as md_ops
from .transfer import aligned as _aligned, to_device_packed

if TYPE_CHECKING:
    from ..memory import MemoryPools
    from ..compilation.cuda_graphs import FullGraphRunner, GraphBuffers, GraphKey
    from .scheduler import ScheduledBatch

#: The forward batch of one step: (packed input ids ``[N]``, its forward metadata).
ForwardBatch = tuple[torch.Tensor, ForwardMetadata]


def pad_requests(
    input_ids: torch.Tensor,
    md: ForwardMetadata,
    pad_lens: Sequence[int],
    padding_slot: int,
    num_logits: int | None = None,
) -> ForwardBatch:
    """Append padding requests of ``pad_lens`` tokens each: token id 0 at positions
    ``0 .. len-1``, K/V not stored (``out_cache_loc`` -1), attending over ``len`` copies of the
    KV padding slot, Mamba index -1 (every kernel op skips it), no initial state, no prefix-cache
    tracking. ``logits_indices`` gets one row per padding request (its last token), or, with
    ``num_logits``, is padded with index 0 up to ``num_logits`` rows. No host sync."""
    pad_lens = [int(n) for n in pad_lens]
    if any(n <= 0 for n in pad_lens):
        raise ValueError(f"pad_requests: padding requests need >= 1 token each, got {pad_lens}")
    n = input_ids.shape[0]
    k = sum(pad_lens)
    dev = input_ids.device

    def full(t: torch.Tensor, count: int, value) -> torch.Tensor:
        return torch.cat([t, torch.full((count,), value, dtype=t.dtype, device=dev)])

    ends = torch.tensor(pad_lens, dtype=torch.int64).cumsum(0)
    local_positions = torch.cat([torch.arange(p, dtype=torch.int64) for p in pad_lens]) if pad_lens else ends
    lens = torch.tensor(pad_lens, dtype=torch.int64)
    # the padding requests' values go over in one copy per dtype from pinned memory (a copy from pageable
    # memory would make the host wait for the GPU's work so far)
    positions, logits = to_device_packed([local_positions, n + ends - 1], md.positions.dtype, dev)
    qsl, seq, kv_ends, prompt = to_device_packed([n + ends, lens, ends, lens], md.query_start_loc.dtype, dev)
    p = len(pad_lens)
    padded = dataclasses.replace(
        md,
        positions=torch.cat([md.positions, positions]),
        query_start_loc=torch.cat([md.query_start_loc, qsl]),
        seq_lens=torch.cat([md.seq_lens, seq.to(md.seq_lens.dtype)]),
        prefix_lens=full(md.prefix_lens, p, 0),
        mamba_cache_indices=full(md.mamba_cache_indices, p, -1),
        has_initial_state=full(md.has_initial_state, p, False),
        out_cache_loc=full(md.out_cache_loc, k, -1),
        kv_indptr=torch.cat([md.kv_indptr, md.kv_indptr[-1:] + kv_ends.to(md.kv_indptr.dtype)]),
        kv_indices=full(md.kv_indices, k, padding_slot),
        logits_indices=torch.cat([md.logits_indices, logits.to(md.logits_indices.dtype)]),
        extend_lens_cpu=list(md.extend_lens_cpu) + pad_lens,
        seq_lens_cpu=list(md.seq_lens_cpu) + pad_lens,
        prompt_lens=None if md.prompt_lens is None else torch.cat([md.prompt_lens, prompt.to(md.prompt_lens.dtype)]),
        graph_key=None,
    )
    if md.tree_mask is not None:  # a draft tree's verify: padding tokens see everything (their KV is padding)
        padded.tree_mask = full(md.tree_mask, k, -1)
        steps = md.draft_len
        verify_pads = next((i for i, n in enumerate(pad_lens) if n != steps), len(pad_lens))
        chain, = to_device_packed([torch.tensor(md_ops.padding_tree(steps)[0])], md.tree_parents.dtype, dev)
        padded.tree_parents = torch.cat([md.tree_parents, chain.expand(verify_pads, steps)])
    for name in ("track_slots", "track_lens"):  # prefix-cache checkpoints (layers/tracking.py)
        t = getattr(md, name, None)
        if t is not None:
            setattr(padded, name, full(t, p, -1))
    if num_logits is not None:
        rows = padded.logits_indices[: md.logits_indices.shape[0]]
        if rows.shape[0] > num_logits:
            raise ValueError(f"pad_requests: {rows.shape[0]} logits rows do not fit in num_logits={num_logits}")
        padded.logits_indices = full(rows, num_logits - rows.shape[0], 0)
    return full(input_ids, k, 0), padded


def _staged_rows(reqs, prefix: list[int], slots: list[int], ids: list[list[int]], steps: int,
                 pad_to: int | None) -> tuple[list[list[int]], int]:
    """The staged rows (``ops.metadata.staged_row``) of requests ``reqs`` of ``steps`` new tokens at
    ``prefix``, in KV slots ``slots`` (request-major) with ids ``ids[i]``, then padding rows up to
    ``pad_to`` requests; returns (rows, the ``kv_indices`` entry after the requests)."""
    rows, start = [], 0
    for i, (r, p) in enumerate(zip(reqs, prefix)):
        rows.append(md_ops.staged_row(r.req_slot, p, start, r.mamba_slot, len(r.prompt),
                                      slots[i * steps: (i + 1) * steps], ids[i]))
        start += p + steps
    if pad_to is not None:
        rows += md_ops.padding_rows(start, pad_to - len(reqs), steps)
    return rows, start


class ForwardBatchBuilder:
    """Builds the forward batch of each step of one model runner: its pools (the step's new
    ``req_to_token`` entries are written on the way), its device, and, once captured, the full
    CUDA graphs whose buffers uniform steps are built into."""

    def __init__(self, pools: MemoryPools, device: torch.device, draft_len: int = 0) -> None:
        self.pools = pools
        self.device = device
        # speculative verify steps: tokens per request (k + 1; 0 without speculative decoding)
        self.draft_len = draft_len
        # the runner's full CUDA graphs (graph_setup.py), set once captured and cleared when the
        # compiled forward is released: a DECODE / TARGET_VERIFY step that fits one is built
        # into its buffers
        self.full_graphs: FullGraphRunner | None = None

    def build(self, batch: ScheduledBatch, input_ids: torch.Tensor | None = None) -> ForwardBatch:
        """(packed input ids, metadata) of one step, on the device. A DECODE step's input ids
        already on the device (``input_ids``, else ``batch.input_ids`` when set: the tokens the
        previous step sampled, engine overlap) are used as they are."""
        device_ids = input_ids if input_ids is not None else batch.input_ids
        if batch.mode is ForwardMode.DECODE and batch.track_slots is None:
            return self.build_decode(batch, device_ids)
        if device_ids is not None:
            raise ValueError(f"build_metadata: device input ids are for DECODE steps, got a {batch.mode.value} step")
        return self.build_extend(batch)

    def build_decode(self, batch: ScheduledBatch, device_ids: torch.Tensor | None = None) -> ForwardBatch:
        """:meth:`build` of a DECODE step (one new token per request, the common case), the same
        tensors as :meth:`build_extend` with less host work (:meth:`build_uniform`); built straight
        into the full graph's buffers when one fits the step."""
        if device_ids is not None:
            b = len(batch.requests)
            if device_ids.shape != (b,) or device_ids.dtype != torch.int64:
                raise ValueError(f"build_metadata: device input ids must be [{b}] int64, got "
                                 f"{tuple(device_ids.shape)} {device_ids.dtype}")
        return self.build_uniform(batch, ForwardMode.DECODE, 1, None, device_ids, self._graph_for(batch, 1))

    def build_verify(self, batch: ScheduledBatch, drafts: list[list[int]] | torch.Tensor,
                     tree: tuple | None = None) -> ForwardBatch:
        """(packed input ids, metadata) of a TARGET_VERIFY step (``batch`` from
        ``Scheduler.schedule_verify``: ``L = draft_len`` new tokens per request, its pending token
        then ``drafts[i]``; logits of every token), the verify counterpart of
        :meth:`build_decode` (:meth:`build_uniform`). ``tree``: draft trees (``drafts[i]`` their
        tokens), ``(parents, depths, ancestor bits)`` of every verify token per request
        (``speculative.tree.tree_metadata``): positions ``prefix + depth``, ``tree_mask`` and
        ``tree_parents`` are set (:meth:`build_tree_verify`); a step that fits a draft-tree verify
        graph is built into its buffers. ``drafts`` may be a device tensor ``[b, L - 1]`` (int64,
        a chain): staged as zeros, then copied into the input ids on the device (no host sync)."""
        b = len(batch.requests)
        steps = self.draft_len
        on_device = isinstance(drafts, torch.Tensor)
        shape_ok = tuple(drafts.shape) == (b, steps - 1) and drafts.dtype == torch.int64 and tree is None \
            if on_device else len(drafts) == b and all(len(row) == steps - 1 for row in drafts)
        if batch.mode is not ForwardMode.TARGET_VERIFY or any(n != steps for n in batch.extend_lens) or not shape_ok:
            raise ValueError(f"build_verify_metadata: a TARGET_VERIFY step of {steps} tokens per request "
                             f"(pending token + {steps - 1} drafts{', a chain of int64 device drafts' if on_device else ''}),"
                             f" got {batch.mode.value} with extend lengths {batch.extend_lens[:8]}")
        graph = self._graph_for(batch, steps, tree=tree is not None)
        if tree is not None:
            return self.build_tree_verify(batch, drafts, tree, graph)
        if not on_device:
            return self.build_uniform(batch, ForwardMode.TARGET_VERIFY, steps, drafts, None, graph)
        input_ids, md = self.build_uniform(batch, ForwardMode.TARGET_VERIFY, steps, [[0] * (steps - 1)] * b, None, graph)
        input_ids.view(b, steps)[:, 1:].copy_(drafts)
        return input_ids, md

    def build_tree_verify(self, batch: ScheduledBatch, drafts: list[list[int]], tree: tuple,
                          graph: GraphKey | None = None, buffers: GraphBuffers | None = None) -> ForwardBatch:
        """:meth:`build_verify` of draft trees: :meth:`build_uniform`, then the tree's positions
        (``prefix + depth``), ``tree_mask`` and ``tree_parents`` (int32 ``[b, L]``) from one
        host->device copy. With ``graph`` (a draft-tree verify graph) everything goes into its
        stable buffers (``buffers``, by default those of :attr:`full_graphs`): the positions of the
        step's tokens, the tree metadata of every row up to the bucket (padding rows a chain,
        ``GraphBuffers.tree_rows``); the returned metadata are views of the first rows."""
        b, steps = len(batch.requests), self.draft_len
        if graph is not None and not graph.tree:
            raise ValueError(f"build metadata: a draft-tree verify step does not fit the chain verify graph {graph}")
        input_ids, md = self.build_uniform(batch, ForwardMode.TARGET_VERIFY, steps, drafts, None, graph, buffers)
        parents, depth_rows, bit_rows = tree
        positions = [p + d for p, row in zip(batch.prefix_lens, depth_rows) for d in row]
        if graph is None:
            flat_parents, bits = [x for row in parents for x in row], [x for row in bit_rows for x in row]
        else:
            buffers = buffers if buffers is not None else self.full_graphs.buffers
            flat_parents, bits = buffers.tree_rows(graph, parents, bit_rows)
        positions_d, mask_d, parents_d = to_device_packed(
            [torch.tensor(positions, dtype=torch.int64), torch.tensor(bits, dtype=torch.int64),
             torch.tensor(flat_parents, dtype=torch.int64)], torch.int64, self.device)
        if graph is None:
            md.positions, md.tree_mask = positions_d, mask_d
            md.tree_parents = parents_d.to(torch.int32).view(b, steps)
            return input_ids, md
        # into the graph's buffers (md.positions is a view of them: the op wrote prefix + j there)
        mask_buf, parents_buf = buffers.tree_outputs(graph)
        md.positions.copy_(positions_d)
        mask_buf.copy_(mask_d)
        parents_buf.view(-1).copy_(parents_d)
        md.tree_mask, md.tree_parents = mask_buf[: b * steps], parents_buf[:b]
        return input_ids, md

    def _graph_for(self, batch: ScheduledBatch, steps: int, tree: bool = False) -> GraphKey | None:
        """The full CUDA graph a uniform step (``tree``: a verify step of draft trees) replays (its
        metadata is then built into the graph's buffers), or None."""
        if self.full_graphs is None:
            return None
        return self.full_graphs.key_for(batch.mode, len(batch.requests), steps, tree)

    def build_uniform(
        self, batch: ScheduledBatch, mode: ForwardMode, steps: int, drafts: list[list[int]] | None,
        device_ids: torch.Tensor | None, graph: GraphKey | None = None, buffers: GraphBuffers | None = None,
    ) -> ForwardBatch:
        """Metadata of a step in which every request adds ``steps`` tokens (DECODE: 1, its pending
        token; TARGET_VERIFY: its pending token then ``drafts[i]``), logits of every token: one
        staged row per request (``ops.metadata``) from Python lists, one host->device copy, then
        the ``uniform_step_metadata`` op writes the new ``req_to_token`` entries and every tensor.
        ``device_ids``: the step's input ids, already on the device. With ``graph`` the tensors
        are written into the full graph's stable buffers (``buffers``, by default those of
        :attr:`full_graphs`), the rows past the step's requests up to the bucket as padding
        requests; the returned metadata are views of its first rows, with ``graph_key`` set."""
        reqs = batch.requests
        b = len(reqs)
        n = b * steps
        if graph is not None and (b > graph.batch_size or graph.tokens_per_request != steps or graph.mode is not mode):
            raise ValueError(f"build metadata: a {mode.value} step of {b} requests of {steps} tokens does not fit the "
                             f"full graph {graph}")
        rows, total = self.stage_uniform(batch, steps, drafts, device_ids is not None,
                                         graph.batch_size if graph is not None else None)
        if graph is not None:
            buffers = buffers if buffers is not None else self.full_graphs.buffers
            outputs = buffers.outputs(graph)
        else:
            outputs = self._uniform_outputs(b, steps, total)
        host = torch.tensor(rows, dtype=torch.int64)
        if self.device.type == "cuda":
            host = host.pin_memory()
        torch.ops.hybrid_compile.uniform_step_metadata(
            host.to(self.device, non_blocking=True), device_ids, steps, self.pools.kv.PADDING_SLOT,
            self.pools.req_to_token.req_to_token, *outputs)
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
            seq_lens_cpu=[p + steps for p in batch.prefix_lens],
            draft_len=steps if mode is ForwardMode.TARGET_VERIFY else 0,
            prompt_lens=prompt_d[:b],
            graph_key=graph,
        )
        return input_ids[:n], md

    def stage_uniform(self, batch: ScheduledBatch, steps: int, drafts: list[list[int]] | None, device_ids: bool,
                      pad_to: int | None = None) -> tuple[list[list[int]], int]:
        """The staged rows (``ops.metadata``) of a uniform step of ``batch`` (:meth:`build_uniform`;
        ``device_ids``: its ids come from the device, staged as 0), padding rows up to ``pad_to``
        requests; the host mirror of the step's
        ``req_to_token`` entries is written (the op writes the device map). Returns (rows, the
        ``kv_indices`` entry after the step's requests)."""
        reqs = batch.requests
        b = len(reqs)
        prefix = batch.prefix_lens
        req_slots = [r.req_slot for r in reqs]
        out_cache_loc = batch.out_cache_loc.tolist()
        r2t = self.pools.req_to_token
        if min(out_cache_loc, default=0) < 0:  # masked tokens (an MTP head's window): the padding slot
            pad = self.pools.kv.PADDING_SLOT
            entries = [pad if s < 0 else s for s in out_cache_loc]
        else:
            entries = out_cache_loc
        # checks and the host mirror; the op writes the device map
        r2t.set_decode_tokens(req_slots, prefix, entries, write_device=False, steps=steps)
        if device_ids:
            ids = [[0] * steps] * b
        else:
            ids = [r.token_ids(p, p + 1) + (list(drafts[i]) if drafts is not None else [])
                   for i, (r, p) in enumerate(zip(reqs, prefix))]
        return _staged_rows(reqs, prefix, out_cache_loc, ids, steps, pad_to)

    def stage_chain(self, batch: ScheduledBatch, steps: int, pad_to: int) -> list[list[list[int]]]:
        """The staged rows of ``steps`` one-token DECODE steps of ``batch``'s requests, one after the
        other (an MTP proposal's chain, its ids from the device): step ``j`` of request ``i`` at
        position ``batch.prefix_lens[i] + j`` in KV slot ``batch.out_cache_loc[i * steps + j]``
        (request-major), each step padded to ``pad_to`` requests; the same rows as :meth:`stage_uniform`
        of each step, with one host-mirror write of the ``req_to_token`` entries of all of them."""
        reqs = batch.requests
        prefix = batch.prefix_lens
        slots = batch.out_cache_loc.tolist()
        self.pools.req_to_token.set_decode_tokens([r.req_slot for r in reqs], prefix, slots, write_device=False,
                                                  steps=steps)
        ids = [[0]] * len(reqs)
        return [_staged_rows(reqs, [p + j for p in prefix], slots[j::steps], ids, 1, pad_to)[0] for j in range(steps)]

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

    def build_extend(self, batch: ScheduledBatch) -> ForwardBatch:
        """:meth:`build` of any step (EXTEND, TARGET_VERIFY, DECODE with checkpoints)."""
        dev = self.device
        prefix = torch.tensor(batch.prefix_lens, dtype=torch.int64)
        extend = torch.tensor(batch.extend_lens, dtype=torch.int64)
        seq = prefix + extend
        ids: list[int] = []
        for r, p, n in zip(batch.requests, batch.prefix_lens, batch.extend_lens):
            ids.extend(r.token_ids(p, p + n))
        positions = repeat_counts(prefix, extend) + segment_arange(extend)
        req_slots = torch.tensor([r.req_slot for r in batch.requests], dtype=torch.int64)
        self.pools.req_to_token.set_tokens_batch(req_slots, prefix, extend, batch.out_cache_loc)

        qsl = torch.zeros(len(batch.requests) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(extend, 0)
        kv_indptr = torch.zeros_like(qsl)
        kv_indptr[1:] = torch.cumsum(seq, 0)
        mamba = torch.tensor([r.mamba_slot for r in batch.requests], dtype=torch.int32)
        prompt_lens = torch.tensor([len(r.prompt) for r in batch.requests], dtype=torch.int32)
        # two host->device copies in all (input ids first: offset 0 of its device tensor)
        input_ids, positions, out_cache_loc, logits_indices, req_slots_d = to_device_packed(
            [torch.tensor(ids, dtype=torch.int64), positions, batch.out_cache_loc, qsl[1:].to(torch.int64) - 1, req_slots],
            torch.int64, dev,
        )
        tracked = batch.track_slots is not None
        track = [torch.tensor(batch.track_slots), torch.tensor(batch.track_lens)] if tracked else []
        qsl_d, kv_indptr_d, seq_d, prefix_d, mamba_d, prompt_d, *track_d = to_device_packed(
            [qsl, kv_indptr, seq, prefix, mamba, prompt_lens, *track], torch.int32, dev
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
            # KV slots of every token of every request, gathered on the device from req_to_token (host
            # work per new token only: the requests' contexts can be far longer than the step)
            kv_indices=md_ops.request_token_slots(self.pools.req_to_token.req_to_token, req_slots_d, seq_d,
                                                  kv_indptr_d, int(kv_indptr[-1])),
            logits_indices=logits_indices,
            extend_lens_cpu=list(batch.extend_lens),
            seq_lens_cpu=seq.tolist(),
            prompt_lens=prompt_d,
            decode_rows=batch.decode_rows if batch.mode is ForwardMode.EXTEND else None,
        )
        if tracked:
            # prefix-cache checkpoints inside the extend (scheduler-chosen; layers/tracking.py), in the
            # same copy as the other int32 tensors (a copy of its own from pageable memory would wait
            # for the GPU's work so far)
            md.track_slots, md.track_lens = track_d
            md.has_tracking = any(s >= 0 for s in batch.track_slots)
        return input_ids, md

    def padding_step(self, lens: list[int], num_logits: int | None = None) -> ForwardBatch:
        """An EXTEND step of padding requests only (:func:`pad_requests` on an empty step): running
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
        return pad_requests(torch.zeros(0, dtype=torch.int64, device=dev), empty, lens,
                            self.pools.kv.PADDING_SLOT, num_logits)
