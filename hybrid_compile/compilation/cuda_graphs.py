"""CUDA graphs for the engine: full graphs of pure-decode and speculative-verify steps and
piecewise graphs of the compiled pieces.

Two mechanisms, both on top of the compiled forward (:mod:`.backend`). The engine decides
which graphs to capture and captures them (``hybrid_compile.engine.graph_setup``); the model
runner (``hybrid_compile.engine.runner``) picks one per step and counts the steps that use
neither as eager fallbacks (batches larger than the largest bucket, EXTEND batches without
piecewise graphs); a step's metadata, padding included, is built by
``hybrid_compile.engine.forward_batch``.

**Full decode graphs** (:class:`FullGraphRunner`): one CUDA graph per decode batch-size bucket
holding the whole forward, layer ops included. Every per-step tensor the layer ops read lives
in :class:`GraphBuffers`, stable preallocated device buffers; the :class:`ForwardMetadata`
installed while capturing is made of views of them (:meth:`GraphBuffers.metadata`). Before a
replay the engine builds the step's metadata straight into them (the ``uniform_step_metadata``
op, one kernel after one host->device copy), rows ``b .. bs-1`` as padding requests (one token at
position 0, Mamba index -1, ``out_cache_loc`` -1 so no K/V is written, ``seq_len`` 1 attending
over the KV pool's padding slot): exactly what ``forward_batch.pad_requests`` appends, which the
CPU tests check. Graphs are keyed by :class:`GraphKey` (mode, batch size, tokens per request), so TARGET_VERIFY graphs (``L = k + 1`` tokens per
request: the pending token and k drafts) are one more key with its own token layout in the same
buffers: padding requests of ``L`` tokens, ``logits_indices`` every one of the ``bs * L`` tokens,
the host-side values the verify layer ops read (``draft_len``, ``verify_rows()``) fixed per
graph (every row of a bucket is a verify row), the speculative intermediate buffers indexed by
batch row (padding rows come after the real ones). A replay returns ``logits[:b * L]``. Verify
graphs of DRAFT TREES (``GraphKey.tree``: speculative top-k > 1) also read the tree's metadata from
the buffers: ``tree_mask`` (ancestor bits of each token) and ``tree_parents`` (each token's parent
in its row), which the engine writes with the step's positions (``prefix + depth``) before the
replay; their padding rows verify a chain (:func:`~hybrid_compile.ops.metadata.padding_tree`). What
the ops read on the host is the same for every step of a tree graph (tree metadata present,
``verify_rows()``); everything that differs between trees lives in the buffers.

**Piecewise graphs** (:class:`PiecewiseGraphs`): the backend wraps every Inductor-compiled piece
in a :class:`PiecewiseGraphPiece`; while the runner replays a token bucket the piece replays its
graph for that input signature (shapes and int arguments), the layer ops running eagerly
between the pieces. Inputs are made stable by copying: a piece keeps the tensors it was
captured with, and at replay copies an argument into the captured one only when its address
differs (parameters and the outputs of the previous piece's graph have stable addresses and
are never copied; the layer ops' fresh outputs and the runner's inputs are). The outputs a
piece returns are its graph's own output tensors (held, so never reused by a later capture in
the shared pool); they are overwritten by the piece's next replay, which is safe because a
step consumes them before the next step runs. The runner pads a step to the bucket with one
padding request holding the extra tokens (``forward_batch.pad_requests``) and pads
``logits_indices`` to :func:`logits_rows_for_tokens` rows, so a bucket is one input signature.

All graphs share one memory pool (``torch.cuda.graph_pool_handle()``) and are captured largest
bucket first, after a warm-up run at the same size on the capture stream (Triton autotuning and
lazy initialisation happen outside the capture).

Under tensor parallelism (``hybrid_compile.distributed``) every rank captures the same graphs in
the same order, and the model's NCCL all-reduces / all-gathers (functional collectives compiled
by Inductor, inside the pieces) are captured in them: every replay runs them again, paired across
ranks because every rank replays the same graph for the same step (rank 0 sends each step).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from ..layers.context import ForwardContext, ForwardMetadata, ForwardMode, forward_context
from ..ops.metadata import padding_rows, padding_tree

# Dynamo specialises sizes 0 and 1: graphs run with at least this many tokens and logits rows, except
# the full decode graph of one request, captured from a compile specialised to one token (FullGraphRunner)
MIN_GRAPH_SIZE = 2


# --------------------------------------------------------------------------------------------
# buckets
# --------------------------------------------------------------------------------------------


def default_decode_batch_sizes(max_running_requests: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, 24, 32, then every 16 to 256 and every 32 beyond, up to (and including)
    ``max_running_requests``."""
    sizes = [1, 2, 4, 8, 16, 24, 32] + list(range(48, 257, 16)) + list(range(288, max_running_requests + 1, 32))
    return normalize_buckets([s for s in sizes if s <= max_running_requests] + [max_running_requests], minimum=1)


def default_token_buckets(chunked_prefill_size: int, max_running_requests: int) -> tuple[int, ...]:
    """Powers of two up to 512, then 1024, 2048, ... below the largest step (a full prefill
    chunk plus one decode token per running request), and that largest step itself."""
    limit = chunked_prefill_size + max_running_requests
    sizes = [1 << i for i in range(1, 10) if 1 << i < limit]
    big = 1024
    while big < limit:
        sizes.append(big)
        big *= 2
    return normalize_buckets(sizes + [limit])


def normalize_buckets(sizes: Sequence[int], minimum: int = MIN_GRAPH_SIZE) -> tuple[int, ...]:
    """Sorted unique sizes, each at least ``minimum`` (by default :data:`MIN_GRAPH_SIZE`: a bucket
    of 1 is captured and replayed with 2 rows, one of them padding)."""
    return tuple(sorted({max(minimum, int(s)) for s in sizes}))


def select_bucket(buckets: Sequence[int], n: int) -> int | None:
    """The smallest bucket >= n (buckets sorted), or None when n exceeds the largest."""
    for b in buckets:
        if b >= n:
            return b
    return None


#: The most padding tokens a step takes to replay a token bucket's piecewise graphs (the engine's
#: ``extra["piecewise_max_padding"]``): a padding request costs what a prompt of its length costs (its
#: projections, and attention over itself), while the graphs save only the pieces' launches, about
#: 2 ms of host time a step on the reference model. A 4,159-token mixed step padded to the 8,192
#: bucket took 100 ms on an H200 where its 4,096-token prefill alone took 49 (2026-11-30).
MAX_PIECEWISE_PADDING = 1024


def replays_bucket(num_tokens: int, bucket: int, max_padding: int = MAX_PIECEWISE_PADDING) -> bool:
    """Whether a step of ``num_tokens`` replays the piecewise graphs of ``bucket`` (the smallest
    bucket >= it) padded, rather than running the compiled forward at its own size."""
    return bucket - num_tokens <= max_padding


def logits_rows_for_tokens(num_tokens: int, max_running_requests: int) -> int:
    """Rows of ``logits_indices`` in a piecewise-graph step of ``num_tokens`` (padded) tokens:
    enough for every request of any batch that fits, fixed per bucket."""
    return max(MIN_GRAPH_SIZE, min(num_tokens, max_running_requests))


# --------------------------------------------------------------------------------------------
# stable buffers of the full graphs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GraphKey:
    """What a full graph is captured for: the forward mode, the (padded) batch size, the
    new tokens of every request (1 for DECODE; the draft length for TARGET_VERIFY) and, for
    TARGET_VERIFY, whether the drafts are trees (its metadata then carry ``tree_mask`` and
    ``tree_parents``, views of the buffers; a chain's carry None)."""

    mode: ForwardMode
    batch_size: int
    tokens_per_request: int = 1
    tree: bool = False

    @property
    def num_tokens(self) -> int:
        return self.batch_size * self.tokens_per_request


class GraphBuffers:
    """Preallocated device buffers of every per-step tensor the layer ops read, sized for
    ``max_batch`` requests of up to ``max_tokens_per_request`` new tokens and
    ``max_context_len`` tokens each. Graphs capture views of them (:meth:`metadata`); the engine
    (``engine/forward_batch.py``) builds each step's metadata straight into them (:meth:`outputs`,
    the ``uniform_step_metadata`` op), the rows past the step's requests up to the bucket as
    padding requests.

    A graph of ``L`` tokens per request (1: DECODE; the draft length: TARGET_VERIFY) has its
    padding rows laid out as ``forward_batch.pad_requests`` with requests of ``L`` tokens: ids 0,
    positions ``0 .. L-1``, ``out_cache_loc`` -1, ``seq_len`` ``L`` over the KV padding slot, Mamba
    index -1 (the op's padding rows, :func:`~hybrid_compile.ops.metadata.padding_rows`). Every
    buffer is written by every step, so graphs of any ``L`` share them. A draft-tree verify graph
    (``key.tree``) also reads ``tree_mask`` (``[max_batch * max_tokens_per_request]`` int64) and
    ``tree_parents`` (``[max_batch, max_tokens_per_request]`` int32, a graph of ``L`` tokens per
    request reading its first ``bs * L`` entries as ``[bs, L]``); its padding rows are chains
    (:meth:`tree_rows`)."""

    def __init__(
        self, max_batch: int, max_context_len: int, device: torch.device, kv_index_dtype: torch.dtype,
        padding_slot: int, max_tokens_per_request: int = 1,
    ) -> None:
        self.max_batch = max_batch
        self.max_tokens_per_request = max_tokens_per_request
        self.padding_slot = padding_slot
        self.device = device
        t = max_batch * max_tokens_per_request
        i32 = dict(dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        # one allocation each: every buffer starts 16-byte aligned (Triton specialises kernels on it)
        self.input_ids, self.positions, self.out_cache_loc, self.logits_indices = (torch.zeros(t, **i64)
                                                                                 for _ in range(4))
        self.query_start_loc, self.kv_indptr = (torch.zeros(max_batch + 1, **i32) for _ in range(2))
        self.seq_lens, self.prefix_lens, self.prompt_lens, self.mamba_cache_indices = (torch.zeros(max_batch, **i32)
                                                                                     for _ in range(4))
        self.has_initial_state = torch.zeros(max_batch, dtype=torch.bool, device=device)
        self.kv_indices = torch.full((max_batch * max(max_context_len, max_tokens_per_request),), padding_slot,
                                     dtype=kv_index_dtype, device=device)
        self.tree_mask = torch.zeros(t, **i64)
        self.tree_parents = torch.zeros(max_batch, max_tokens_per_request, **i32)

    def _check_key(self, key: GraphKey) -> None:
        if key.mode not in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
            raise NotImplementedError(f"full CUDA graphs: forward mode {key.mode.value} has no graph layout")
        if key.mode is ForwardMode.DECODE and key.tokens_per_request != 1:
            raise ValueError(f"full CUDA graphs: a DECODE graph has 1 token per request, got {key.tokens_per_request}")
        if not 1 <= key.tokens_per_request <= self.max_tokens_per_request:
            raise ValueError(f"GraphBuffers: {key.tokens_per_request} tokens per request, the buffers hold "
                             f"1..{self.max_tokens_per_request}")
        if not 1 <= key.batch_size <= self.max_batch:
            raise ValueError(f"GraphBuffers: a graph of batch size {key.batch_size}, the buffers hold 1..{self.max_batch}")
        if key.tree and key.mode is not ForwardMode.TARGET_VERIFY:
            raise ValueError(f"full CUDA graphs: a draft-tree graph is a TARGET_VERIFY graph, got {key.mode.value}")

    def metadata(self, key: GraphKey) -> ForwardMetadata:
        """The metadata a graph of ``key`` is captured with: views of the buffers. Its host-side
        lists are those of a full bucket (every request ``L`` tokens): what the layer ops read on
        the host (``verify_rows()``, ``draft_len``, whether there is a tree) is fixed per graph."""
        self._check_key(key)
        bs, steps, n = key.batch_size, key.tokens_per_request, key.num_tokens
        tree_mask, tree_parents = self.tree_outputs(key) if key.tree else (None, None)
        return ForwardMetadata(
            mode=key.mode,
            positions=self.positions[:n],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            prefix_lens=self.prefix_lens[:bs],
            mamba_cache_indices=self.mamba_cache_indices[:bs],
            has_initial_state=self.has_initial_state[:bs],
            out_cache_loc=self.out_cache_loc[:n],
            kv_indptr=self.kv_indptr[: bs + 1],
            kv_indices=self.kv_indices,
            logits_indices=self.logits_indices[:n],
            extend_lens_cpu=[steps] * bs,
            seq_lens_cpu=[steps] * bs,
            draft_len=steps if key.mode is ForwardMode.TARGET_VERIFY else 0,
            prompt_lens=self.prompt_lens[:bs],
            tree_mask=tree_mask,
            tree_parents=tree_parents,
        )

    def outputs(self, key: GraphKey) -> tuple[torch.Tensor, ...]:
        """The ``uniform_step_metadata`` outputs of a step of graph ``key`` (``key.batch_size`` rows,
        padding ones included): input_ids, positions, out_cache_loc, logits_indices,
        query_start_loc, seq_lens, prefix_lens, prompt_lens, mamba_cache_indices,
        has_initial_state, kv_indptr, kv_indices."""
        self._check_key(key)
        bs, n = key.batch_size, key.num_tokens
        return (self.input_ids[:n], self.positions[:n], self.out_cache_loc[:n], self.logits_indices[:n],
                self.query_start_loc[: bs + 1], self.seq_lens[:bs], self.prefix_lens[:bs], self.prompt_lens[:bs],
                self.mamba_cache_indices[:bs], self.has_initial_state[:bs], self.kv_indptr[: bs + 1], self.kv_indices)

    def tree_outputs(self, key: GraphKey) -> tuple[torch.Tensor, torch.Tensor]:
        """A draft-tree verify graph's tree metadata: ``tree_mask`` ``[bs * L]`` and ``tree_parents``
        ``[bs, L]`` (contiguous: the first ``bs * L`` entries of the buffer), padding rows included."""
        self._check_key(key)
        if not key.tree:
            raise ValueError(f"GraphBuffers: the graph {key} is not a draft-tree verify graph (no tree buffers)")
        n = key.num_tokens
        return self.tree_mask[:n], self.tree_parents.view(-1)[:n].view(key.batch_size, key.tokens_per_request)

    @staticmethod
    def tree_rows(key: GraphKey, parents: Sequence[Sequence[int]],
                  bits: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
        """The tree metadata of a step of graph ``key`` on the host, flat, padding rows included:
        ``(tree_parents, tree_mask)`` of the step's requests (``parents[i]`` / ``bits[i]``: request
        ``i``'s ``L`` tokens) followed by padding rows verifying a chain
        (:func:`~hybrid_compile.ops.metadata.padding_tree`), so the ops read a valid tree there."""
        steps, rows = key.tokens_per_request, len(parents)
        if rows > key.batch_size or len(bits) != rows or any(len(r) != steps for r in (*parents, *bits)):
            raise ValueError(f"GraphBuffers.tree_rows: the graph {key} takes up to {key.batch_size} rows of {steps} "
                             f"parents and mask bits each, got {[len(r) for r in parents]} / {[len(r) for r in bits]}")
        pad_parents, pad_bits = padding_tree(steps)
        pad = key.batch_size - rows
        return ([p for row in parents for p in row] + pad_parents * pad,
                [b for row in bits for b in row] + pad_bits * pad)

    def step_tensors(self, key: GraphKey, kv_entries: int) -> tuple[torch.Tensor, ...]:
        """What a step of graph ``key`` holds in the buffers: the :meth:`outputs`, ``kv_indices`` cut to
        its first ``kv_entries`` (the requests' then the padding rows': :meth:`kv_entries`), and a
        draft-tree graph's :meth:`tree_outputs`. Tensor parallelism sends them from rank 0 to the
        other ranks, which replay the same graph."""
        *rest, kv_indices = self.outputs(key)
        return (*rest, kv_indices[:kv_entries], *(self.tree_outputs(key) if key.tree else ()))

    @staticmethod
    def kv_entries(key: GraphKey, md: ForwardMetadata) -> int:
        """Entries of ``kv_indices`` a step of graph ``key`` uses: its ``md.batch_size`` requests'
        (``md.kv_indices``) and each padding row's ``key.tokens_per_request`` (the padding slot)."""
        return md.kv_indices.numel() + (key.batch_size - md.batch_size) * key.tokens_per_request

    def reset(self, key: GraphKey) -> None:
        """Every row of ``key`` a padding request (capture and warm-up: no pool is touched)."""
        steps = key.tokens_per_request
        staged = torch.tensor(padding_rows(0, key.batch_size, steps), dtype=torch.int64)
        no_requests = self.kv_indices.new_empty(0, steps)  # the req_to_token of no request: padding rows read none
        torch.ops.hybrid_compile.uniform_step_metadata(staged.to(self.device), None, steps, self.padding_slot,
                                                      no_requests, *self.outputs(key))
        if key.tree:  # every row a padding request's chain
            parents, bits = self.tree_rows(key, [], [])
            mask, tree_parents = self.tree_outputs(key)
            mask.copy_(torch.tensor(bits, dtype=torch.int64))
            tree_parents.view(-1).copy_(torch.tensor(parents, dtype=torch.int32))


def _capture(graph: "torch.cuda.CUDAGraph", pool, stream: "torch.cuda.Stream", fn: Callable[[], Any]) -> Any:
    """Capture ``fn()`` into ``graph`` on ``stream`` with the shared ``pool`` (what
    ``torch.cuda.graph`` does, without its per-capture ``gc.collect`` / ``empty_cache``)."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool)
        try:
            out = fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return out


class GraphPool:
    """The one memory pool and capture stream shared by every graph of a runner."""

    def __init__(self) -> None:
        self.handle = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream()

    def capture(self, graph: "torch.cuda.CUDAGraph", fn: Callable[[], Any]) -> Any:
        return _capture(graph, self.handle, self.stream, fn)

    def warm_up(self, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` once on the capture stream, outside a capture, and wait for it: whatever a
        stream initialises lazily on first use (a cuBLAS workspace, NCCL's events for the stream the
        collectives wait on, Triton's autotuning) happens before the capture, on the stream that
        captures (PyTorch's CUDA-graph notes and vLLM warm up on the capture stream the same way)."""
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------
# full graphs (decode, target verify)
# --------------------------------------------------------------------------------------------


class FullGraphRunner:
    """Full CUDA graphs of the compiled forward, one per batch-size bucket: of DECODE steps, and
    (with ``verify_batch_sizes``) of TARGET_VERIFY steps of ``draft_len`` tokens per request.

    Args:
        forward: ``forward(input_ids, positions, logits_indices) -> logits`` (the compiled
            forward; it runs under the forward context this class installs).
        buffers: the stable buffers (``max_tokens_per_request >= draft_len``).
        batch_sizes: the decode buckets (sorted, unique). A bucket of 1 replays a graph of the
            compiled forward specialised to one token: Dynamo specialises size 1, so its capture
            compiles the forward a second time (once, at capture), and batch 1 then runs one row
            everywhere (the one-row matmul kernel of ``skinny_mm``, no padding request) instead of
            the bucket of 2. Leave 1 out to skip that compile.
        kv_caches, mamba_caches: the pool views of the forward context.
        pool: the shared graph pool.
        verify_batch_sizes: the TARGET_VERIFY buckets (none: no verify graphs). A verify graph's
            request rows are rows of the Mamba pool's intermediate buffers, so a bucket is at most
            their rows; padding rows come after the real ones and never touch the real rows.
        draft_len: tokens per request of the verify graphs (the speculative ``k + 1``).
        intermediate_caches: the verify forward context's per-draft-step buffers
            (``ForwardContext.intermediate_caches``).
        tree: the verify steps are of draft trees (speculative top-k > 1): the verify graphs are
            tree graphs (``GraphKey.tree``), reading the tree's metadata from the buffers.
    """

    def __init__(self, forward: Callable, buffers: GraphBuffers, batch_sizes: Sequence[int], kv_caches, mamba_caches,
                 pool: GraphPool, verify_batch_sizes: Sequence[int] = (), draft_len: int = 0,
                 intermediate_caches: dict | None = None, tree: bool = False) -> None:
        self.forward = forward
        self.buffers = buffers
        self.batch_sizes = normalize_buckets(batch_sizes, minimum=1)
        self.verify_batch_sizes = normalize_buckets(verify_batch_sizes) if verify_batch_sizes else ()
        if self.batch_sizes[-1] > buffers.max_batch or (self.verify_batch_sizes and self.verify_batch_sizes[-1] > buffers.max_batch):
            raise ValueError(f"full-graph bucket {max(self.batch_sizes + self.verify_batch_sizes)} exceeds the "
                             f"buffers' {buffers.max_batch} rows")
        if self.verify_batch_sizes:
            if not 1 <= draft_len <= buffers.max_tokens_per_request:
                raise ValueError(f"verify graphs: draft_len {draft_len} must be in 1..{buffers.max_tokens_per_request} "
                                 "(the buffers' tokens per request)")
            rows = min((inter[0].shape[0] for inter in (intermediate_caches or {}).values()), default=None)
            if rows is not None and self.verify_batch_sizes[-1] > rows:
                raise ValueError(f"verify bucket {self.verify_batch_sizes[-1]} exceeds the {rows} rows of the "
                                 "speculative intermediate buffers")
        self.draft_len = draft_len
        self.tree = bool(tree)
        self.kv_caches, self.mamba_caches = kv_caches, mamba_caches
        self.intermediate_caches = dict(intermediate_caches or {})
        self.pool = pool
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.replays = 0  # DECODE replays
        self.verify_replays = 0  # TARGET_VERIFY replays
        self.recaptures = 0  # capture_all again over new pool views (recapture)

    def keys(self) -> list[GraphKey]:
        """Every graph to capture, largest token count first."""
        keys = [GraphKey(ForwardMode.DECODE, bs) for bs in self.batch_sizes]
        keys += [GraphKey(ForwardMode.TARGET_VERIFY, bs, self.draft_len, self.tree) for bs in self.verify_batch_sizes]
        return sorted(keys, key=lambda k: (k.num_tokens, k.batch_size), reverse=True)

    def key_for(self, mode: ForwardMode, batch_size: int, tokens_per_request: int,
                tree: bool = False) -> GraphKey | None:
        """The graph a step of ``batch_size`` requests adding ``tokens_per_request`` tokens each
        (``tree``: a verify step of draft trees) replays, or None (not a DECODE step nor a
        TARGET_VERIFY step of ``draft_len`` tokens per request whose drafts are trees exactly when
        the verify graphs are, or larger than every bucket)."""
        if mode is ForwardMode.DECODE and tokens_per_request == 1 and not tree:
            bs = select_bucket(self.batch_sizes, batch_size)
            return None if bs is None else GraphKey(ForwardMode.DECODE, bs)
        if (mode is ForwardMode.TARGET_VERIFY and self.verify_batch_sizes and tokens_per_request == self.draft_len
                and bool(tree) == self.tree):
            bs = select_bucket(self.verify_batch_sizes, batch_size)
            return None if bs is None else GraphKey(ForwardMode.TARGET_VERIFY, bs, self.draft_len, self.tree)
        return None

    def _run(self, key: GraphKey) -> torch.Tensor:
        b = self.buffers
        inter = self.intermediate_caches if key.mode is ForwardMode.TARGET_VERIFY else {}
        with forward_context(ForwardContext(b.metadata(key), self.kv_caches, self.mamba_caches, inter)):
            n = key.num_tokens
            return self.forward(b.input_ids[:n], b.positions[:n], b.logits_indices[:n])

    def capture_all(self) -> None:
        """Warm up and capture every bucket, largest first."""
        t0 = time.perf_counter()
        for key in self.keys():
            self.buffers.reset(key)
            self.pool.warm_up(lambda: self._run(key))  # lazy init and autotuning outside the capture
            graph = torch.cuda.CUDAGraph()
            out = self.pool.capture(graph, lambda: self._run(key))
            self.graphs[key] = (graph, out)
        torch.cuda.synchronize()
        self.capture_seconds += time.perf_counter() - t0

    def recapture(self, kv_caches: dict, mamba_caches: dict) -> None:
        """Drop every graph and capture them again over new per-layer pool views (the pools were
        reallocated: a graph replays the addresses it captured). Between steps only."""
        torch.cuda.synchronize()
        self.graphs.clear()
        self.kv_caches, self.mamba_caches = kv_caches, mamba_caches
        self.recaptures += 1
        self.capture_all()

    def replay(self, key: GraphKey, batch_size: int) -> torch.Tensor:
        """Replay the graph of ``key`` over the step the buffers hold (``batch_size`` requests, then
        padding rows); returns the logits of its requests (DECODE: ``[b, V]``; TARGET_VERIFY:
        ``[b * draft_len, V]``, every verify position), a view of the graph's output, valid until
        the next replay (a ``(logits, hidden)`` output: views of both)."""
        graph, out = self.graphs[key]
        graph.replay()
        if key.mode is ForwardMode.TARGET_VERIFY:
            self.verify_replays += 1
        else:
            self.replays += 1
        rows = batch_size * key.tokens_per_request
        # (a forward that also returns hidden states: one row per token in both outputs)
        return tuple(o[:rows] for o in out) if isinstance(out, tuple) else out[:rows]


# --------------------------------------------------------------------------------------------
# piecewise graphs
# --------------------------------------------------------------------------------------------


def _signature(args: Sequence[Any]) -> tuple:
    """What a piece's graph depends on besides tensor contents: tensor shapes/dtypes and every
    non-tensor argument (the symbolic sizes Inductor passes as ints)."""
    return tuple(
        (tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else (type(a).__name__, a) for a in args
    )


class PiecewiseGraphs:
    """Piecewise-graph state shared by the pieces of one compiled forward: the mode the runner
    sets for a step (off: the pieces run their compiled code; ``replay``; ``capture``), the
    shared pool and counters."""

    OFF, REPLAY, CAPTURE = "off", "replay", "capture"

    def __init__(self, pool: GraphPool) -> None:
        self.pool = pool
        self.mode = self.OFF
        self.pieces: list["PiecewiseGraphPiece"] = []
        self.captured_tokens: list[int] = []
        self.capture_seconds = 0.0
        self.replays = 0  # steps
        self.copied_bytes = 0  # inputs copied into captured ones at replay (layer-op outputs, step inputs)

    @contextlib.contextmanager
    def active(self, mode: str) -> Iterator[None]:
        if mode not in (self.REPLAY, self.CAPTURE):
            raise ValueError(f"PiecewiseGraphs.active: mode must be 'replay' or 'capture', got {mode!r}")
        if self.mode != self.OFF:
            raise RuntimeError("PiecewiseGraphs: steps cannot nest")
        self.mode = mode
        try:
            yield
        finally:
            self.mode = self.OFF

    def wrap(self, name: str, fn: Callable) -> "PiecewiseGraphPiece":
        piece = PiecewiseGraphPiece(name, fn, self)
        self.pieces.append(piece)
        return piece

    @property
    def num_graphs(self) -> int:
        return sum(len(p.graphs) for p in self.pieces)


@dataclass
class _PieceGraph:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: list[Any]  # the arguments captured with (tensors kept alive: stable addresses)
    output: Any


class PiecewiseGraphPiece:
    """One Inductor-compiled piece with its CUDA graphs, one per input signature (token bucket).
    Called like the piece; what it does depends on :attr:`PiecewiseGraphs.mode`."""

    def __init__(self, name: str, fn: Callable, owner: PiecewiseGraphs) -> None:
        self.name = name
        self.fn = fn
        self.owner = owner
        self.graphs: dict[tuple, _PieceGraph] = {}

    def __call__(self, *args):
        mode = self.owner.mode
        if mode == PiecewiseGraphs.OFF:
            return self.fn(*args)
        sig = _signature(args)
        entry = self.graphs.get(sig)
        if entry is None:
            if mode != PiecewiseGraphs.CAPTURE:
                raise RuntimeError(
                    f"piecewise CUDA graphs: piece {self.name} has no graph for inputs {sig} (the runner replays "
                    "only captured token buckets)"
                )
            inputs = list(args)
            graph = torch.cuda.CUDAGraph()
            output = self.owner.pool.capture(graph, lambda: self.fn(*inputs))
            entry = self.graphs[sig] = _PieceGraph(graph, inputs, output)
        else:
            copied = 0
            for a, s in zip(args, entry.inputs):
                if isinstance(a, torch.Tensor) and a.data_ptr() != s.data_ptr():
                    s.copy_(a)
                    copied += a.numel() * a.element_size()
            self.owner.copied_bytes += copied
        entry.graph.replay()
        return entry.output
