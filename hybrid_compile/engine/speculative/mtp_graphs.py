"""Full CUDA graphs of whole MTP proposals (``EngineConfig.extra["mtp_draft_graphs"]``): the
head's window step, its ``k - 1`` chain steps and their argmaxes as one graph per batch-size
bucket, replayed once per verify step (:class:`ProposalGraphs`; the proposal itself:
:mod:`.mtp`).

Every step of a proposal is a uniform step (``ops.metadata``), and everything but the drafts is
known on the host before the proposal: the window's rows (``k + 1`` per request, the masked ones
with KV slot -1), each chain step's position and temporary KV slot. So all of them are staged
at once (:meth:`~hybrid_compile.engine.forward_batch.ForwardBatchBuilder.stage_uniform`, padding
rows up to the bucket) and copied to the device in one host->device copy, with the logits row of
each request's last valid window row; the head's hidden-state input rows are copied into a
stable buffer. The graph then runs, on the device only: the ``uniform_step_metadata`` op of the
window into the stable :class:`~hybrid_compile.compilation.cuda_graphs.GraphBuffers` (a
TARGET_VERIFY layout of ``k + 1`` tokens per request: the head's attention treats it as the
EXTEND of the eager path, the same ``paged_attention_extend``), the head's compiled forward,
the argmax (mapped to token ids by the head's draft token map, if any) and the gather of the
next hidden state; then per chain step the op of a DECODE layout
(its input ids the previous argmax, ``ids_src``), the forward and the argmax; every draft lands
in one ``[bucket, k]`` buffer, read back with one device->host copy.

The same body runs without a capture (``capture=False``): what the CPU tests check against the
general path; on CUDA it is captured at start-up, after the target's graphs, in the target's
graph pool. Under tensor parallelism every rank captures the same graphs at start-up (the head's
collectives inside them pair up) and rank 0's head runner's step observer sends each proposal's
staged step and hidden-state rows to the other ranks (``PROPOSAL``, :mod:`hybrid_compile.distributed.step`),
which copy them into their own buffers and replay the same graph; the body's model calls are not
broadcast one by one. On by default wherever it can run (:func:`resolve_option`): on an H100 it cut the
head's cost per forward from 2.2-2.9 ms (eager steps) to 0.5 ms (``benchmarks/speculative.py``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import torch

from ...compilation import cuda_graphs as cg
from ...layers.context import ForwardContext, ForwardMode, forward_context
from ...ops import metadata as md_ops
from ..scheduler import ScheduledBatch

#: ``EngineConfig.extra`` key of the proposal graphs (None: on where they can run; True; False).
OPTION = "mtp_draft_graphs"


def resolve_option(config, device: torch.device) -> bool:
    """``EngineConfig.extra["mtp_draft_graphs"]``: None (default: on where it can run, i.e. the
    engine's full CUDA graphs, compile on a CUDA device with ``cuda_graphs`` None or full, and a
    chain of drafts, ``topk`` 1), True (the same, and a ValueError naming the option where they
    cannot run) or False (any other value: ``EngineConfig.validate`` refuses it)."""
    value = config.extra.get(OPTION)
    if value is False:
        return False
    full, _ = config.resolved_cuda_graphs(device)
    spec = config.speculative
    chain = spec is not None and spec.method == "mtp" and not spec.is_tree
    if value is None:
        return full and chain
    if not full:
        raise ValueError(f"EngineConfig.extra[{OPTION!r}]=True needs the engine's full CUDA graphs (compile on a CUDA "
                         f"device, cuda_graphs None or full); this engine runs on {device} with "
                         f"compile={config.compile!r}, cuda_graphs={config.cuda_graphs!r}")
    if not chain:
        raise ValueError(f"EngineConfig.extra[{OPTION!r}]=True graphs chains of MTP drafts: it needs "
                         "speculative method 'mtp' with topk 1 (draft trees propose through the eager path)")
    return True


class ProposalGraphs:
    """The proposal of ``k`` drafts per request for every bucket of ``batch_sizes`` (module
    docstring) of ``source``, the :class:`.mtp.MTPDraft` (its head runner, states and target).
    ``capture``: capture CUDA graphs (CUDA only); else each proposal runs the body."""

    def __init__(self, source, k: int, batch_sizes: Sequence[int], capture: bool) -> None:
        runner = source.runner
        self.source, self.runner, self.k, self.window = source, runner, k, k + 1
        self.sizes = cg.normalize_buckets(batch_sizes, minimum=1)
        pools = runner.pools
        r2t = pools.req_to_token.req_to_token
        self.padding_slot = pools.kv.PADDING_SLOT
        dev, most = runner.device, self.sizes[-1]
        # inference tensors, as the head's own outputs that the chain steps feed it: a compiled forward
        # guards on its inputs' dispatch keys, and a normal tensor here recompiled it twice per proposal shape
        with torch.inference_mode():
            self.buffers = cg.GraphBuffers(most, r2t.shape[1], dev, r2t.dtype, self.padding_slot,
                                           max_tokens_per_request=self.window)
            # staged rows of the window and of each chain step, then the window's logits rows, per bucket
            # laid out from offset 0 (one host->device copy)
            self.staged = torch.zeros(self._staged_size(most), dtype=torch.int64, device=dev)
            self.hidden_in = torch.zeros(most * self.window, source.head.hidden_size, dtype=source.target.dtype,
                                         device=dev)
            self.drafts = torch.zeros(most, k, dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture = capture
        self.capture_seconds = 0.0
        if 1 in self.sizes:  # (one logits row in the window; one token a chain step: Dynamo specialises both)
            runner.graphs.batch_one_specialisations = 1 + (k > 1)
        if capture:
            # the head runner's pool (none: the head runs without piecewise graphs)
            self.pool = runner.graphs.graph_pool or cg.GraphPool()
            try:
                self.capture_all()
            except RuntimeError as e:
                raise RuntimeError(
                    f"EngineConfig.extra[{OPTION!r}]=True: CUDA graph capture of the MTP proposal failed "
                    f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); serve without the option") from e

    def _staged_size(self, bs: int) -> int:
        return bs * (md_ops.staged_width(self.window) + (self.k - 1) * md_ops.staged_width(1) + 1)

    def _staged_views(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(window rows ``[bs, width]``, chain rows ``[k - 1, bs, width]``, logits rows ``[bs]``)."""
        win, one = md_ops.staged_width(self.window), md_ops.staged_width(1)
        a, b = bs * win, bs * win + (self.k - 1) * bs * one
        return (self.staged[:a].view(bs, win), self.staged[a:b].view(self.k - 1, bs, one),
                self.staged[b: b + bs])

    def bucket(self, batch_size: int) -> int | None:
        return cg.select_bucket(self.sizes, batch_size)

    # -- the body (captured, or run as it is) ---------------------------------------------------
    def _forward(self, md, input_ids: torch.Tensor, hidden: torch.Tensor):
        # (unobserved: under tensor parallelism every rank runs the whole body, from the staged step)
        runner = self.runner
        with forward_context(ForwardContext(md, runner.kv_caches, runner.mamba_caches)):
            return runner.call_unobserved(input_ids, md.positions, md.logits_indices, hidden)

    def _run(self, bs: int) -> None:
        """The proposal of a bucket over the staged step: drafts into :attr:`drafts` ``[:bs]``."""
        window, buffers = self.window, self.buffers
        op, r2t = torch.ops.hybrid_compile.uniform_step_metadata, self.runner.pools.req_to_token.req_to_token
        pick = self.source.pick  # (the argmax; with a draft token map, its columns' token ids)
        win_rows, chain_rows, last = self._staged_views(bs)
        key = cg.GraphKey(ForwardMode.TARGET_VERIFY, bs, window)
        op(win_rows, None, window, self.padding_slot, r2t, *buffers.outputs(key))
        md = dataclasses.replace(buffers.metadata(key), logits_indices=last)
        logits, hidden = self._forward(md, buffers.input_ids[: bs * window], self.hidden_in[: bs * window])
        tokens = pick(logits, 1)[0]
        hidden = hidden[last]
        self.drafts[:bs, 0] = tokens
        key = cg.GraphKey(ForwardMode.DECODE, bs)
        for j in range(self.k - 1):
            op(chain_rows[j], tokens, 1, self.padding_slot, r2t, *buffers.outputs(key))
            md = buffers.metadata(key)
            logits, hidden = self._forward(md, buffers.input_ids[:bs], hidden)
            tokens = pick(logits, 1)[0]
            self.drafts[:bs, j + 1] = tokens

    def _stage_padding(self, bs: int) -> None:
        """Every row of bucket ``bs`` a padding request (capture and warm-up: no pool is touched)."""
        win_rows, chain_rows, last = self._staged_views(bs)
        win_rows.copy_(torch.tensor(md_ops.padding_rows(0, bs, self.window), dtype=torch.int64))
        chain_rows.copy_(torch.tensor(md_ops.padding_rows(0, bs, 1), dtype=torch.int64).expand_as(chain_rows))
        last.copy_(torch.arange(bs) * self.window + self.window - 1)
        self.hidden_in.zero_()

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Warm up and capture every bucket, largest first, in the head runner's graph pool."""
        pool = self.pool
        t0 = time.perf_counter()
        for bs in sorted(self.sizes, reverse=True):
            self._stage_padding(bs)
            pool.warm_up(lambda: self._run(bs))
            graph = torch.cuda.CUDAGraph()
            pool.capture(graph, lambda: self._run(bs))
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        self.capture_seconds += time.perf_counter() - t0

    @torch.inference_mode()
    def recapture(self) -> None:
        """The head's KV views changed (elastic pools): every graph again over the runner's new views."""
        torch.cuda.synchronize()
        self.graphs.clear()
        self.capture_all()

    # -- one proposal ---------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, window_batch: ScheduledBatch, ids: list[list[int]], hidden_rows: list[torch.Tensor],
                lens: list[int], chain: ScheduledBatch | None) -> torch.Tensor:
        """The drafts ``[b, k]`` (int64, on the device: a view of :attr:`drafts`, valid until the
        next proposal) of a proposal: ``window_batch`` / ``ids`` / ``hidden_rows`` / ``lens``
        the window step (:meth:`.mtp.MTPDraft._window`), ``chain`` its ``k - 1`` one-token steps
        (:meth:`~hybrid_compile.engine.forward_batch.ForwardBatchBuilder.stage_chain`: prefix lengths
        at the first, KV slots taken, request-major; None when ``k`` is 1); the batch fits a bucket
        (:meth:`bucket`)."""
        b = len(window_batch.requests)
        bs = self.bucket(b)
        steps = 0 if chain is None else chain.out_cache_loc.numel() // max(1, len(chain.requests))
        if bs is None or steps != self.k - 1:
            raise ValueError(f"ProposalGraphs.propose: {b} requests and {steps} chain steps, the graphs hold "
                             f"up to {self.sizes[-1]} requests and {self.k - 1} chain steps")
        builder, window = self.runner.batch_builder, self.window
        staged, _ = builder.stage_uniform(window_batch, window, ids, False, pad_to=bs)
        flat = [x for row in staged for x in row]
        if chain is not None:
            for rows in builder.stage_chain(chain, steps, bs):
                flat += [x for row in rows for x in row]
        flat += [i * window + a - 1 for i, a in enumerate(lens)] + [i * window + window - 1 for i in range(b, bs)]
        host = torch.tensor(flat, dtype=torch.int64)
        if self.staged.is_cuda:
            host = host.pin_memory()
        n = host.shape[0]
        self.staged[:n].copy_(host, non_blocking=True)
        hidden = torch.cat(hidden_rows)
        self.hidden_in[: hidden.shape[0]].copy_(hidden)
        self.hidden_in[hidden.shape[0]: bs * window].zero_()
        observer = self.runner.step_observer
        if observer is not None:  # tensor parallelism: every rank runs this proposal (distributed/step.py)
            # (with the requests' req_to_token entries before the window, which the head attends to: the other
            # ranks' maps are written only by the ops of the proposals they run)
            observer.proposal(bs, self.staged[:n], self.hidden_in[: bs * window],
                              [r.req_slot for r in window_batch.requests], max(window_batch.prefix_lens),
                              self.runner.pools.req_to_token.req_to_token)
        self.run_staged(bs)
        return self.drafts[:b]

    def run_staged(self, bs: int) -> None:
        """The proposal of bucket ``bs`` over what :attr:`staged` and :attr:`hidden_in` hold: the
        captured graph's replay, or the body (``capture`` False)."""
        if self.capture:
            self.graphs[bs].replay()
        else:
            self._run(bs)
