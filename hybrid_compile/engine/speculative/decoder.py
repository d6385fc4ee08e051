"""The speculative decoder: one draft + verify + commit step of the engine's decoding requests.

A step (:meth:`SpeculativeDecoder.step`) takes every decoding running request, asks the draft
source for k tokens each, and runs ONE target forward in ``TARGET_VERIFY`` mode over
``L = k + 1`` tokens per request (its pending token + the drafts), through
``ModelRunner.forward_verify`` (with CUDA graphs on: a full TARGET_VERIFY graph of the
batch-size bucket when one fits). The linear layers leave their main state untouched and
write the state after every step into the Mamba pool's intermediate buffers (rows = batch
rows); attention layers write the K/V of all L tokens and attend causally over prefix + drafts.
Then, per request:

1. acceptance on the logits of all L positions (:mod:`.acceptance`): greedy keeps the longest
   prefix of drafts equal to the target's argmax plus the target's token after it; sampling
   uses speculative rejection sampling, exact for the target's distribution after the
   request's temperature / top-k / top-p (the Sampler's ``transform_logits``);
2. truncation at a stop token / ``max_new_tokens`` (the emitted run is cut after it);
3. commit: ``commit_speculative_state`` copies the state after the last kept step (conv window
   and SSM state) into the request's slot (with full CUDA graphs: one graph replay for all the
   layers, :class:`CommitGraphs`); ``num_computed`` grows by the kept tokens, the KV
   slots of the rest are freed (``req_to_token`` entries past ``num_computed`` are never read:
   the next step overwrites them);
4. the tokens are emitted through the engine's emit callback, which appends them and hands
   finished requests to the scheduler (with a prefix cache: exactly their ``num_computed``
   tokens' KV and the committed state).

Draft trees (``SpeculativeConfig.topk > 1``, :mod:`.tree`): the source proposes one tree per
request (``propose_tree``), the verify row holds its ``num_tree_nodes + 1`` tokens (each at
``prefix + depth``, attending to the prefix and its ancestors, its recurrent state started from
its parent's), acceptance walks the tree, and the commit first copies the K/V of the accepted
path's nodes into the positions they take (node ``path[d]`` -> verify token ``d``, all layers:
so every request keeps whole pages of position-ordered KV, page size > 1 and the prefix cache
included), then commits the state of the path's last node.

The decoder never sees the engine: it gets the parts it drives (scheduler, runner, sampler,
pools, the draft source) and four callbacks into the engine (check a request's host-side stop
conditions, emit a token, roll a failed step back, count a step) explicitly.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ...memory import MemoryPools
from ...compilation import cuda_graphs as cg
from ..request import Request
from ..runner import ModelRunner
from ..sampling import Sampler
from ..scheduler import ScheduledBatch, Scheduler
from .acceptance import accept_greedy, accept_sampled, target_probs, truncate_at_stop
from .config import DraftSource, SpeculativeConfig
from .drafts import check_draft_tokens, fill_drafts
from .tree import DraftTree, accept_tree_greedy, accept_tree_sampled, fill_tree, tree_metadata

_kernels = torch.ops.hybrid_compile

#: The parts of a verify step timed on the host (``stats()["phase_seconds"]``): the draft source's
#: proposal, scheduling the verify batch, its metadata, the forward's launch (a graph replay), the
#: acceptance (the step's one device->host copy: where it waits for the GPU) and stop checks,
#: the commit (a tree's K/V moves, the state commit, freeing the rest), the draft source's
#: ``observe`` and emitting the tokens.
PHASES = ("draft", "schedule", "metadata", "forward", "accept", "commit", "observe", "emit")


# -- the commit as CUDA graphs ------------------------------------------------------------------


class CommitGraphs:
    """``commit_speculative_state`` over every state tensor of the pool as one CUDA graph per
    verify bucket: one replay instead of one kernel launch per state tensor (two per linear
    layer) from the host. A step of ``b`` requests copies its slots and step counts into stable
    buffers (one host->device copy; rows ``b ..`` get slot -1, which the op skips) and replays
    the graph of the smallest bucket ``>= b``.

    Args:
        states, intermediates: the op's pool tensors and intermediate buffers (stable: the pools
            live as long as the engine).
        batch_sizes: the buckets (the runner's verify graph buckets).
    """

    def __init__(self, states: list[torch.Tensor], intermediates: list[torch.Tensor], batch_sizes) -> None:
        self.batch_sizes = cg.normalize_buckets(batch_sizes)
        self._select = cg.select_bucket
        self.max_batch = self.batch_sizes[-1]
        device = states[0].device
        # [slots (max_batch), accepted steps (max_batch)]: slot -1 = a skipped row
        self._buffer = torch.full((2 * self.max_batch,), -1, dtype=torch.int32, device=device)
        slots, steps = self._buffer[: self.max_batch], self._buffer[self.max_batch:]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0
        pool = cg.GraphPool()  # (its own: the op allocates nothing, so the graphs hold no memory)
        for bs in sorted(self.batch_sizes, reverse=True):
            def commit(bs=bs):
                _kernels.commit_speculative_state(states, intermediates, slots[:bs], steps[:bs])

            commit()  # warm-up outside the capture (Triton compiles); every row is skipped
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            pool.capture(graph, commit)
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def fits(self, batch: int) -> bool:
        return batch <= self.max_batch

    def commit(self, slots: list[int], steps: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The op for ``len(slots) <= max_batch`` requests (``fits``), by one graph replay; returns
        the device slots and step counts it committed (views of the stable buffer)."""
        b = len(slots)
        bs = self._select(self.batch_sizes, b)
        pad = self.max_batch - b
        host = torch.tensor(slots + [-1] * pad + steps + [0] * pad, dtype=torch.int32).pin_memory()
        self._buffer.copy_(host, non_blocking=True)
        self.graphs[bs].replay()
        self.replays += 1
        return self._buffer[:b], self._buffer[self.max_batch: self.max_batch + b]


# -- the verify forward -------------------------------------------------------------------------


class SpeculativeDecoder:
    """Runs the speculative decode steps of one engine (module docstring).

    The engine calls :meth:`step` first on every step; it returns None when this step should be
    a normal one: no request is decoding, or others wait for a prefill and the previous step
    was a verify (verify steps and prefill steps alternate then, as in SGLang; the engine's
    normal steps leave decoding requests out, so every generated token after a request's first
    comes from a verify step and a seeded request draws the same random numbers whatever
    else runs). ``step(force=True)`` verifies whenever a request decodes (the engine's
    prefill turn found nothing to run).

    Args:
        config: the settings (``num_draft_tokens``, ``method``).
        source: a callable that builds the draft source (called last, once the decoder's own
            setup succeeded; the decoder owns the source: :meth:`close` closes it).
        scheduler, runner, sampler, pools: the target engine's (the runner verifies
            ``num_draft_tokens + 1`` tokens per request; the pools hold the intermediate buffers).
        emit: ``emit(request, token, stop) -> output``: the engine appends a kept token to the
            request (``stop``: the result of ``host_stop`` for its last kept token, else None;
            handing a finished request to the scheduler) and returns the step output for it.
        host_stop: ``host_stop(request, tokens, scores)``: the engine's host-side stop checks
            (stop strings, user stopping criteria, ``max_time``) as if ``tokens`` were appended;
            they run before anything is committed, since a user's check may raise.
        roll_back: ``roll_back(requests, generators)``: the engine recomputes ``requests`` (and
            restores the generator states ``generators``, ``Sampler.snapshot``) after a commit
            that raised half-way.
        count_step: ``count_step(tokens, seconds)``: the engine counts a verify step that kept
            ``tokens`` tokens in ``seconds`` of forward time.
        vocab_size: the target's vocabulary size (drafts outside it are refused).
        commit_graphs: with full CUDA graphs, commit verify batches within the verify buckets as
            one graph replay (:class:`CommitGraphs`); False: one op launch per state tensor.
    """

    def __init__(
        self,
        config: SpeculativeConfig,
        source: Callable[[], DraftSource],
        *,
        scheduler: Scheduler,
        runner: ModelRunner,
        sampler: Sampler,
        pools: MemoryPools,
        emit: Callable[[Request, int, Any], Any],
        host_stop: Callable[[Request, list[int], Any], Any],
        roll_back: Callable[[list[Request], dict], None],
        count_step: Callable[[int, float], None],
        vocab_size: int,
        commit_graphs: bool = True,
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.pools = pools
        self._emit = emit
        self._host_stop = host_stop
        self._roll_back = roll_back
        self._count_step = count_step
        self.vocab_size = vocab_size
        self.k = config.num_draft_tokens  # (a tree's depth)
        self.tree = config.is_tree
        self.draft_len = config.draft_nodes + 1
        mamba = pools.mamba
        if runner.draft_len != self.draft_len:
            raise ValueError(f"speculative: the runner verifies {runner.draft_len} tokens per request, the "
                             f"config {self.draft_len}")
        self._states = mamba.state_tensors() if mamba.layer_ids else []
        self._intermediates = mamba.intermediate_state_tensors() if mamba.layer_ids else []
        # with full CUDA graphs: the commit of a verify batch within the verify buckets as one graph
        full = runner.full_graphs
        self.commit_graphs = (
            CommitGraphs(self._states, self._intermediates, full.verify_batch_sizes)
            if commit_graphs and self._states and full is not None and full.verify_batch_sizes else None
        )
        self.source = source()
        if self.tree and not callable(getattr(self.source, "propose_tree", None)):
            self.close()
            raise ValueError(f"SpeculativeConfig.topk={config.topk} (a draft tree) needs a draft source with "
                             f"propose_tree(requests, depth, topk, budget); {type(self.source).__name__} has none")
        self.method = config.method
        self._last_was_verify = False
        # id() of the exception the latest failed draft phase raised (before any verify work: tensor
        # parallelism tells by it a rank-0-only fault, TensorParallelEngine)
        self.draft_failure: int | None = None
        self.counters = dict(verify_steps=0, verified_requests=0, drafted=0, accepted=0, emitted=0,
                             tree_kv_moves=0, device_draft_steps=0)
        # host seconds of each part of the verify steps (stats()["phase_seconds"], PHASES)
        self.phase_seconds = dict.fromkeys(PHASES, 0.0)
        # tokens a request kept per verify step (accepted drafts + 1, less at a stop) -> count
        self.acceptance_histogram: dict[int, int] = {}

    def pools_resized(self) -> None:
        """Elastic pools resized the target's pools: the slot-indexed state views again (the
        intermediate buffers, by batch row, stay) and the commit graphs over them, and the draft
        source's views where it runs on the target's pools (an MTP head's attention KV)."""
        if self._states:
            mamba = self.pools.mamba
            self._states, self._intermediates = mamba.state_tensors(), mamba.intermediate_state_tensors()
            old = self.commit_graphs
            if old is not None:  # (captured over the old state tensors)
                self.commit_graphs = CommitGraphs(self._states, self._intermediates, old.batch_sizes)
                self.commit_graphs.replays = old.replays
        refresh = getattr(self.source, "pools_resized", None)
        if refresh is not None:
            refresh()

    def close(self) -> None:
        close = getattr(self.source, "close", None)
        if close is not None:
            close()

    def use_source(self, source, name: str = "custom", close_previous: bool = True) -> None:
        """Switch to another :class:`DraftSource` (the old one is closed unless ``close_previous``
        is False: a source that wraps it) keeping the engine, its pools and compiled graphs:
        benchmarks compare sources at one ``num_draft_tokens``."""
        if not callable(getattr(source, "propose", None)):
            raise TypeError(f"a draft source needs propose(requests, k), got {type(source).__name__}")
        if self.tree and not callable(getattr(source, "propose_tree", None)):
            raise TypeError(f"a draft tree (topk > 1) needs a source with propose_tree, got {type(source).__name__}")
        if close_previous:
            self.close()
        self.source = source
        self.method = name

    def release(self, rid: int) -> None:
        release = getattr(self.source, "release", None)
        if release is not None:
            release(rid)

    def observe(self, batch: ScheduledBatch, paths: list[list[int]] | None = None) -> None:
        """After a target forward of ``batch`` (its requests' ``num_computed`` already advanced): a
        draft source with ``observe(batch, hidden_states)`` (the MTP head) gets the target's final
        hidden states of every token of the step (a tree verify's ``paths``: each request's accepted
        path first, in position order, :meth:`_path_rows`; their row order reaches the device in one
        pinned copy, only for a source that observes)."""
        observe = getattr(self.source, "observe", None)
        if observe is None:
            return
        hidden = self.runner.hidden_states
        if paths is None:
            observe(batch, hidden)
            return
        rows = self._path_rows(paths)
        if hidden.device.type == "cuda":
            rows = rows.pin_memory()
        observe(batch, hidden[rows.to(hidden.device, non_blocking=True)])

    def stats(self) -> dict:
        """``engine.stats()["speculative"]``: ``verify_steps``; ``verified_requests`` (request rows
        over all verify steps); ``drafted`` (k per row) and ``accepted`` drafts; ``emitted`` tokens
        kept; ``mean_acceptance_length`` (emitted per row: accepted drafts + 1, the bonus or
        correction token); ``acceptance_rate`` (accepted / drafted); ``acceptance_histogram``;
        ``draft_seconds`` (host time in the draft source: drafts left on the device are not waited
        for); ``phase_seconds``: host wall seconds of each part of the verify steps (:data:`PHASES`:
        the GPU's time shows in the part that waits for it, ``accept``'s one copy to the host, or in
        the next step's parts when the host runs ahead); ``device_draft_steps`` (verify steps whose drafts stayed on the device until the
        verify step's one sync, ``propose_on_device``); ``commit_graph_replays`` (commits replayed as
        one CUDA graph, :class:`CommitGraphs`); draft trees: ``topk``, ``draft_nodes`` (nodes per
        tree: ``drafted`` counts them) and ``tree_kv_moves`` (kept tokens whose node is not the
        verify token of their position, so their K/V moved there); MTP drafts:
        ``draft_token_map_size`` (the ids of ``SpeculativeConfig.draft_token_map``; None: the whole
        vocabulary)."""
        c = dict(self.counters)
        c["draft_seconds"] = self.phase_seconds["draft"]
        c["phase_seconds"] = dict(self.phase_seconds)
        c["num_draft_tokens"] = self.k
        c["topk"] = self.config.topk
        c["draft_nodes"] = self.draft_len - 1
        c["method"] = self.method
        c["mean_acceptance_length"] = c["emitted"] / c["verified_requests"] if c["verified_requests"] else 0.0
        c["acceptance_rate"] = c["accepted"] / c["drafted"] if c["drafted"] else 0.0
        c["acceptance_histogram"] = dict(sorted(self.acceptance_histogram.items()))
        c["commit_graph_replays"] = self.commit_graphs.replays if self.commit_graphs is not None else 0
        if isinstance(getattr(self.source, "counters", None), dict):  # (the MTP head's forwards)
            c["draft_source"] = dict(self.source.counters)
        if hasattr(self.source, "token_map_size"):  # (MTP drafts)
            c["draft_token_map_size"] = self.source.token_map_size
        return c

    def _propose_chain(self, decoding: list[Request]) -> list[list[int]] | torch.Tensor:
        """k drafts per request: host rows (:func:`fill_drafts`), or a device tensor
        ``[len(decoding), k]`` from a source's ``propose_on_device`` (the MTP head's proposal
        graphs), which stays on the device until the verify step's one sync."""
        on_device = getattr(self.source, "propose_on_device", None)
        rows = on_device(decoding, self.k) if on_device is not None else self.source.propose(decoding, self.k)
        if not isinstance(rows, torch.Tensor):
            return fill_drafts(rows, decoding, self.k, self.vocab_size)
        if tuple(rows.shape) != (len(decoding), self.k) or rows.dtype != torch.int64:
            raise ValueError(f"draft source proposed a device tensor of shape {tuple(rows.shape)} {rows.dtype} for "
                             f"{len(decoding)} requests of {self.k} drafts (needs [{len(decoding)}, {self.k}] int64)")
        return rows

    def _wants_verify(self, force: bool) -> bool:
        sched = self.scheduler
        decoding = sum(1 for r in sched.running if r.decoding)
        if not decoding or force:
            return bool(decoding)
        prefilling = decoding < len(sched.running) or (
            bool(sched.waiting) and len(sched.running) < sched.max_running_requests
        )
        return not (prefilling and self._last_was_verify)

    @torch.inference_mode()
    def _forward(self, batch: ScheduledBatch, drafts: list[list[int]] | torch.Tensor,
                 trees: list[DraftTree] | None) -> torch.Tensor:
        """The TARGET_VERIFY forward -> logits ``[B * L, V]`` of every verify position (through the
        runner's dispatch: a full verify CUDA graph when one fits, ``ModelRunner.forward_verify``)."""
        runner = self.runner
        t = time.perf_counter()
        if trees is None:
            step = runner.build_verify_metadata(batch, drafts)
        else:
            step = runner.build_verify_metadata(batch, drafts, tree_metadata(trees))
        t = self._lap("metadata", t)
        logits = runner.forward_verify(*step)
        self._lap("forward", t)
        return logits

    def _accept(self, batch: ScheduledBatch, drafts: list[list[int]] | torch.Tensor, logits: torch.Tensor,
                trees: list[DraftTree] | None) -> tuple[list[list[int]], list[list[int]]]:
        """(emitted tokens, accepted path: the verify node of each) per request; ``drafts`` on the
        device come to the host in the same copy as the greedy targets."""
        reqs = batch.requests
        steps = self.draft_len
        logits = logits.reshape(len(reqs), steps, -1)
        emitted: list[list[int] | None] = [None] * len(reqs)
        paths: list[list[int] | None] = [None] * len(reqs)
        greedy = [i for i, r in enumerate(reqs) if r.params.is_greedy]
        if greedy:
            # the argmax of every row on the device, one copy to the host (the step's one sync)
            targets = torch.ops.hybrid_compile.argmax_rows(logits.flatten(0, 1)).view(len(reqs), -1)
            if isinstance(drafts, torch.Tensor):
                rows = torch.cat([targets, drafts], dim=1).tolist()
                targets, drafts = [row[:steps] for row in rows], [row[steps:] for row in rows]
            else:
                targets = targets.tolist()
            if trees is None:
                for i, tokens in zip(greedy, accept_greedy([targets[i] for i in greedy], [drafts[i] for i in greedy])):
                    emitted[i] = tokens
            else:
                for i in greedy:
                    emitted[i], paths[i] = accept_tree_greedy(targets[i], trees[i])
        elif isinstance(drafts, torch.Tensor):
            drafts = drafts.tolist()
        sampler = self.sampler
        for i, r in enumerate(reqs):
            if emitted[i] is None:
                gen = sampler.generator_for(r.rid, r.params.seed, logits.device)
                probs = target_probs(logits[i], r.params)
                if trees is None:
                    emitted[i] = accept_sampled(probs, drafts[i], gen)
                else:
                    emitted[i], paths[i] = accept_tree_sampled(probs, trees[i], gen)
        if trees is None:  # a chain's path is its first tokens
            paths = [list(range(len(e))) for e in emitted]
        return emitted, paths

    def _move_path_kv(self, batch: ScheduledBatch, paths: list[list[int]]) -> None:
        """Tree verify: the K/V of each kept path node ``path[d]`` into verify token ``d``'s slot
        (position ``prefix + d``), in every layer (one gather, then one scatter per buffer)."""
        loc = batch.out_cache_loc.tolist()
        src, dst = [], []
        for i, path in enumerate(paths):
            base = i * self.draft_len
            for d, node in enumerate(path):
                if node != d:
                    src.append(loc[base + node])
                    dst.append(loc[base + d])
        if src:
            self.pools.kv.copy_slots(torch.tensor(src), torch.tensor(dst))
            self.counters["tree_kv_moves"] += len(src)

    def _path_rows(self, paths: list[list[int]]) -> torch.Tensor:
        """Every verify token's row, each request's accepted path first (position order)."""
        rows = []
        for i, path in enumerate(paths):
            base = i * self.draft_len
            rest = sorted(set(range(self.draft_len)) - set(path))
            rows.extend(base + j for j in list(path) + rest)
        return torch.tensor(rows, dtype=torch.int64)

    def _commit(self, reqs: list[Request], kept: list[list[int]], paths: list[list[int]]) -> None:
        """State after each request's last kept node (one host->device copy of the slots and
        step counts, then the op; with :class:`CommitGraphs` one graph replay), ``num_computed``
        past the kept tokens, and the KV slots of the rest freed (one free for the batch)."""
        steps = [path[len(t) - 1] + 1 for t, path in zip(kept, paths)]  # (a chain: len(t))
        graphs = self.commit_graphs
        committed = None
        if graphs is not None and graphs.fits(len(reqs)):
            committed = graphs.commit([r.mamba_slot for r in reqs], steps)
        elif self._states:
            host = torch.tensor([r.mamba_slot for r in reqs] + steps, dtype=torch.int32)
            device = self.pools.device
            if device.type == "cuda":
                host = host.pin_memory()
            committed = host.to(device, non_blocking=True).split(len(reqs))
            _kernels.commit_speculative_state(self._states, self._intermediates, *committed)
        observer = self.pools.mamba.observer
        if observer is not None and committed is not None:  # tensor parallelism: every rank commits its heads' states
            observer.commit(*committed)
        for r, tokens in zip(reqs, kept):
            r.num_computed += len(tokens)
        self.scheduler.free_uncomputed_kv(reqs)

    def _lap(self, phase: str, since: float) -> float:
        """Adds the host seconds since ``since`` to ``phase``; returns now."""
        now = time.perf_counter()
        self.phase_seconds[phase] += now - since
        return now

    def step(self, force: bool = False) -> list | None:
        """One draft + verify + commit step (class docstring): the outputs of the emitted tokens
        (``emit``'s), or None when this step should be a normal one."""
        if not self._wants_verify(force):
            self._last_was_verify = False
            return None
        # drafts first: a failing draft source leaves every request and pool as it was
        t0 = time.perf_counter()
        decoding = [r for r in self.scheduler.running if r.decoding]
        try:
            if self.tree:
                nodes = self.draft_len - 1
                proposed = self.source.propose_tree(decoding, self.k, self.config.topk, nodes)
                if len(proposed) != len(decoding):
                    raise ValueError(f"draft source returned {len(proposed)} trees for {len(decoding)} requests")
                trees_of = [fill_tree(t, nodes, r.token_ids(r.num_computed, r.num_computed + 1)[0])
                            for t, r in zip(proposed, decoding)]
                proposals = check_draft_tokens([t.tokens for t in trees_of], self.vocab_size)
            else:
                proposals = self._propose_chain(decoding)
        except BaseException as e:
            # a draft model stopped half-way may hold a half-updated state: it forgets these
            # requests (and recomputes them from the target's tokens when next asked)
            for r in decoding:
                self.release(r.rid)
            self.draft_failure = id(e)
            raise
        t1 = self._lap("draft", t0)
        batch = self.scheduler.schedule_verify(self.draft_len)  # (may retract some of them)
        if batch is None:
            self._last_was_verify = False
            return None
        self._last_was_verify = True
        reqs = batch.requests
        if isinstance(proposals, torch.Tensor):  # (the rows of the requests still scheduled)
            self.counters["device_draft_steps"] += 1
            row_of = {r.rid: i for i, r in enumerate(decoding)}
            rows = [row_of[r.rid] for r in reqs]
            drafts = proposals if rows == list(range(len(decoding))) else \
                proposals[torch.tensor(rows, dtype=torch.int64).to(proposals.device, non_blocking=True)]
        else:
            by_rid = {r.rid: row for r, row in zip(decoding, proposals)}
            drafts = [by_rid[r.rid] for r in reqs]
        trees = None
        if self.tree:
            tree_of = {r.rid: t for r, t in zip(decoding, trees_of)}
            trees = [tree_of[r.rid] for r in reqs]
        generators = self.sampler.snapshot(reqs)
        self._lap("schedule", t1)
        try:
            logits = self._forward(batch, drafts, trees)
            t = time.perf_counter()
            emitted, paths = self._accept(batch, drafts, logits, trees)
            kept = [truncate_at_stop(r, tokens) for r, tokens in zip(reqs, emitted)]
            # the host-side stop checks before anything is committed (HybridEngine._finish), once
            # per request after its last kept token
            stops = [self._host_stop(r, tokens, None) for r, tokens in zip(reqs, kept)]
            t = self._lap("accept", t)
        except BaseException:
            # the verify forward leaves the requests' states as they were (it writes the
            # intermediate buffers only): the drafts' KV slots are all there is to undo
            self.sampler.roll_back(generators, [r.rid for r in reqs])
            self.scheduler.free_uncomputed_kv(reqs)
            raise
        try:
            if self.tree:
                self._move_path_kv(batch, paths)
            self._commit(reqs, kept, paths)
        except BaseException:  # states half-committed: the requests recompute
            self._roll_back(reqs, generators)
            raise
        t = self._lap("commit", t)
        self.observe(batch, paths if self.tree else None)
        t2 = self._lap("observe", t)

        c = self.counters
        c["verify_steps"] += 1
        c["verified_requests"] += len(reqs)
        c["drafted"] += (self.draft_len - 1) * len(reqs)
        outputs = []
        for r, tokens, full, stop in zip(reqs, kept, emitted, stops):
            c["accepted"] += len(full) - 1
            c["emitted"] += len(tokens)
            self.acceptance_histogram[len(tokens)] = self.acceptance_histogram.get(len(tokens), 0) + 1
            for j, tok in enumerate(tokens):
                outputs.append(self._emit(r, tok, stop if j == len(tokens) - 1 else None))
        self._count_step(sum(len(t) for t in kept), t2 - t1)
        self._lap("emit", t2)
        return outputs
