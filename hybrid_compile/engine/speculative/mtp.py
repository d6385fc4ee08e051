"""MTP drafts: the checkpoint's multi-token-prediction head (:mod:`hybrid_compile.models.mtp`)
proposes the drafts of a verify step, run as a chain of k steps.

The head at position ``i`` reads the target's final hidden state at ``i`` and token ``i + 1``
and predicts token ``i + 2``. Its attention layer is one more layer of the target's KV pool, so
its KV of position ``i`` lives in the KV slot of the target's token ``i`` (a cached prefix brings
it along, rejected drafts free it with the target's) and its forwards reuse the target's
``req_to_token`` map; it runs through its own :class:`~hybrid_compile.engine.runner.ModelRunner`
(compiled as the target is; piecewise CUDA graphs), or, where the engine has full CUDA graphs
and the drafts are a chain (``EngineConfig.extra["mtp_draft_graphs"]``, on by default there),
every proposal as one full CUDA graph (:mod:`.mtp_graphs`).

Per request the draft source keeps ``m`` (positions the head has processed) and the target's
hidden states of the positions after it (:meth:`MTPDraft.observe`, after every target forward;
a verify step's rows past the accepted ones are dropped by the next observation). A position is
processed once the token after it is known:

- after a prefill chunk, every position of it but the last of the prompt (``observe``: one head
  EXTEND over the step's requests);
- at a verify step (:meth:`MTPDraft.propose`): the positions the last verify accepted, up to the
  last computed one ``c - 1`` (token ``c`` is the pending one), whose output gives draft 1; then
  k - 1 DECODE steps at positions ``c .. c + k - 2``, each fed the previous draft and the head's
  own output hidden state on the device, into KV slots taken for the chain and freed after it;
  one device->host copy of the drafts at the end.

Every step of a proposal is a uniform step (the ``uniform_step_metadata`` path of
``engine/forward_batch.py``, one host->device copy each): the first is a WINDOW of ``W = k + 1``
rows per request from its first unprocessed position ``m`` (``a = c - m <= W`` valid rows, as
many as the last verify kept), draft 1 and the next hidden state gathered on the device from row
``a - 1``. Its rows past ``a`` are masked: KV slot -1 (no K/V stored), the KV pool's padding slot
in their ``req_to_token`` entries (positions ``c ..``, which hold no computed token and which the
verify step rewrites before it reads them) and ``kv_indices``; the valid rows never attend to
them (causal). A proposal whose requests do not fit a window (a span not ending at the pending
token, ``a > W``, a row past ``max_context_len``) takes the general EXTEND path
(``window_fallbacks``); so do the prefill chunks' head EXTENDs (``observe``). Draft trees
(``propose_tree``) use the same window and chain steps eagerly.

With ``SpeculativeConfig.draft_token_map`` the head's logits are over the map's ids only (its own
LM head of their rows, ``MTPHead.restrict_vocabulary``): :meth:`MTPDraft.pick` maps each picked
column to its token id on the device, so drafts and the chain's next inputs are token ids on
every path (eager, window, proposal graphs, trees).

Positions the target did not compute for this request (a cached prefix, a forked prompt) keep
the head's KV that their first computation left (for the last cached position, written with the
token that followed it then); that changes drafts, never outputs.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ...layers.context import ForwardMode
from ..request import Request
from ..runner import ModelRunner
from ..scheduler import ScheduledBatch
from ...compilation import cuda_graphs as cg
from .config import DraftTarget
from .mtp_graphs import ProposalGraphs, resolve_option
from .tree import DraftTree, candidate_rows, pick_next, tree_from_topk_chain

if TYPE_CHECKING:
    from ...models.mtp import MTPHead


def mtp_forward(head: "MTPHead"):
    """The runner's forward of an MTP head: ``(input_ids, positions, logits_indices, hidden)`` ->
    ``(draft logits at logits_indices, the head's hidden states of every token)``."""
    def forward(input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor, hidden: torch.Tensor):
        out = head(input_ids[None], positions[None], hidden[None])[0]
        return head.lm_head(out[logits_indices]), out

    return forward


class _Shifted:
    """A target request as the head's batch sees it: position ``i`` feeds token ``i + 1``."""

    __slots__ = ("r",)

    def __init__(self, r: Request) -> None:
        self.r = r

    req_slot = property(lambda self: self.r.req_slot)
    mamba_slot = property(lambda self: self.r.mamba_slot)
    prompt = property(lambda self: self.r.prompt)

    def token_ids(self, start: int, end: int) -> list[int]:
        return self.r.token_ids(start + 1, end + 1)


@dataclasses.dataclass
class _State:
    """The head's progress on one request: positions ``< m`` processed; ``hidden`` holds the
    target's hidden states of positions ``start ..``."""

    m: int = 0
    start: int = 0
    hidden: torch.Tensor | None = None

    def add(self, position: int, rows: torch.Tensor) -> None:
        held = 0 if self.hidden is None else self.hidden.shape[0]
        if self.hidden is not None and self.start <= position <= self.start + held:
            self.hidden = torch.cat([self.hidden[: position - self.start], rows])
        else:  # a gap (cached prefix, fork) or a restart (retraction): from here on
            self.start, self.hidden = position, rows.clone()
        # positions from here are (re)computed; nothing before the rows can be processed
        self.m = max(min(self.m, position), self.start)


class MTPDraft:
    """The draft source of ``SpeculativeConfig(method="mtp")`` (module docstring).

    Args:
        head: the MTP head (``HybridEngine.mtp_head``; its attention layer is in the engine's KV pool).
        target: the target engine.
    """

    def __init__(self, head: "MTPHead", target: DraftTarget) -> None:
        self.head = head
        self.target = target
        self.vocab_size = target.layout.vocab_size
        cfg = target.config
        _, piecewise = cfg.resolved_cuda_graphs(target.device)
        hidden_size = head.hidden_size
        self.runner = ModelRunner(
            head, target.pools, target.device, dataclasses.replace(cfg, cuda_graphs="piecewise" if piecewise else False),
            forward_fn=mtp_forward, extra_inputs=(((hidden_size,), target.dtype),))
        self._states: dict[int, _State] = {}
        self.counters = dict(head_extend_steps=0, head_decode_steps=0, head_tokens=0, chains_cut=0, window_steps=0,
                             window_fallbacks=0, mtp_graph_replays=0, mtp_graph_eager_runs=0, mtp_graph_fallbacks=0)
        # proposals run their first head forward as a uniform window step (module docstring); False:
        # the general EXTEND path for every proposal (the tests compare the two)
        self.use_window = True
        # EngineConfig.extra["mtp_draft_graphs"]: full CUDA graphs of whole chain proposals (mtp_graphs.py)
        self.graphs: ProposalGraphs | None = None
        if resolve_option(cfg, target.device):
            # (True on CUDA only: its full graphs; the body without a capture is what the CPU tests run)
            self.graphs = ProposalGraphs(self, cfg.speculative.num_draft_tokens,
                                         cfg.cuda_graph_batch_sizes or cg.default_decode_batch_sizes(cfg.max_running_requests),
                                         capture=torch.device(target.device).type == "cuda")

    def pick(self, logits: torch.Tensor, topk: int):
        """``tree.pick_next`` of the head's draft logits: over the vocabulary, or over the head's
        draft token map (``SpeculativeConfig.draft_token_map``), its columns mapped to token ids."""
        return pick_next(logits[:, : self.vocab_size], topk, self.head.token_map)

    @property
    def token_map_size(self) -> int | None:
        """The draft token map's ids (``stats()["speculative"]["draft_token_map_size"]``); None: no map."""
        return None if self.head.token_map is None else int(self.head.token_map.numel())

    # -- the target's hidden states ---------------------------------------------------------------
    def observe(self, batch: ScheduledBatch, hidden: torch.Tensor) -> None:
        """Keep the step's hidden states per request, then process every position whose next
        token is known (after a prefill chunk: all but the prompt's last)."""
        offset = 0
        for r, p, n in zip(batch.requests, batch.prefix_lens, batch.extend_lens):
            self._states.setdefault(r.rid, _State()).add(p, hidden[offset: offset + n])
            offset += n
        if batch.mode is not ForwardMode.TARGET_VERIFY:  # (a verify step's tokens are emitted after this)
            self._advance(batch.requests)

    def _span(self, r: Request) -> tuple[int, int]:
        """Positions ``[m, end)`` of ``r`` the head can process now."""
        st = self._states.get(r.rid)
        if st is None or st.hidden is None:
            return 0, 0
        end = min(st.start + st.hidden.shape[0], r.num_computed, r.seq_len - 1)
        return st.m, end

    @torch.inference_mode()
    def _advance(self, requests: list[Request]) -> tuple[list[Request], torch.Tensor, torch.Tensor] | None:
        """One head EXTEND over every processable position of ``requests``; returns the requests
        it ran, their draft logits and the head's hidden states at their last processed position."""
        spans = [(r, *self._span(r)) for r in requests]
        spans = [(r, m, end) for r, m, end in spans if end > m]
        if not spans:
            return None
        reqs = [r for r, _, _ in spans]
        prefix = [m for _, m, _ in spans]
        lens = [end - m for _, m, end in spans]
        hidden = torch.cat([self._states[r.rid].hidden[m - self._states[r.rid].start: end - self._states[r.rid].start]
                            for r, m, end in spans])
        slots = torch.cat([r.kv_slots[m:end] for r, m, end in spans])
        batch = ScheduledBatch([_Shifted(r) for r in reqs], prefix, lens, slots, ForwardMode.EXTEND)
        logits = self.runner.forward(batch, extra=(hidden,))
        last = torch.tensor(lens).cumsum(0) - 1
        out_hidden = self.runner.hidden_states[last.to(self.runner.hidden_states.device)]
        self._processed(spans, lens)
        return reqs, logits, out_hidden

    def _processed(self, spans: list[tuple[Request, int, int]], lens: list[int]) -> None:
        """Positions ``[m, end)`` of each span are processed: the state moves past them."""
        for r, _, end in spans:
            st = self._states[r.rid]
            st.m = end
            keep = max(st.start, end - 1)  # the last processed row stays: a repeated proposal redoes it
            st.hidden, st.start = st.hidden[keep - st.start:], keep
        c = self.counters
        c["head_extend_steps"] += 1
        c["head_tokens"] += sum(lens)

    def _window(self, requests: list[Request], window: int) -> tuple | None:
        """The window step of a proposal (:meth:`_advance_window`) on the host: ``(spans, batch,
        ids after each request's first, hidden-state rows, valid rows per request)``; None unless
        every request's span ends at its pending token (``end = num_computed``: the masked rows'
        positions hold no computed token) and fits the window and its ``req_to_token`` row."""
        spans = [(r, *self._span(r)) for r in requests]
        spans = [(r, m, end) for r, m, end in spans if end > m]
        width = self.target.pools.req_to_token.max_context_len
        if not spans or any(end != r.num_computed or end - m > window or m + window > width for r, m, end in spans):
            return None
        lens = [end - m for _, m, end in spans]
        ids, slots, hidden = [], [], []
        for r, m, end in spans:
            a = end - m
            # token i + 1 feeds position i: the window's ids after its first (build_uniform's "drafts")
            ids.append(r.token_ids(m + 2, end + 1) + [0] * (window - a))
            # masked rows: K/V not stored (slot -1), the padding slot in their req_to_token entries
            # (rewritten by the verify step before any token there is computed): no live slot
            slots += r.kv_slots[m:end].tolist() + [-1] * (window - a)
            st = self._states[r.rid]
            rows = st.hidden[m - st.start: end - st.start]
            hidden += [rows, rows.new_zeros(window - a, rows.shape[1])] if a < window else [rows]
        batch = ScheduledBatch([_Shifted(r) for r, _, _ in spans], [m for _, m, _ in spans], [window] * len(spans),
                               torch.tensor(slots, dtype=torch.int64), ForwardMode.EXTEND)
        return spans, batch, ids, hidden, lens

    @torch.inference_mode()
    def _advance_window(self, requests: list[Request], window: int) -> tuple[list[Request], torch.Tensor, torch.Tensor] | None:
        """:meth:`_advance` of a proposal as a uniform step (module docstring): ``window`` rows per
        request from its first unprocessed position ``m``, the ``a = end - m`` valid ones first and
        the rest masked. None (the caller takes the general path, counted in ``window_fallbacks``)
        where :meth:`_window` has none."""
        step = self._window(requests, window)
        if step is None:
            if any(end > m for m, end in map(self._span, requests)):
                self.counters["window_fallbacks"] += 1
            return None
        spans, batch, ids, hidden, lens = step
        builder = self.runner.batch_builder
        input_ids, md = builder.build_uniform(batch, ForwardMode.EXTEND, window, ids, None)
        # logits and the next hidden state of row a - 1 of each request (the one small extra copy)
        last = torch.tensor([i * window + a - 1 for i, a in enumerate(lens)], dtype=torch.int64)
        md.logits_indices = last.to(builder.device, non_blocking=True)
        logits = self.runner.forward_built(input_ids, md, extra=(torch.cat(hidden),))
        out_hidden = self.runner.hidden_states[md.logits_indices]
        self._processed(spans, lens)
        self.counters["window_steps"] += 1
        return [r for r, _, _ in spans], logits, out_hidden

    @torch.inference_mode()
    def _propose_graph(self, requests: list[Request], k: int) -> tuple[list[Request], torch.Tensor] | None:
        """A chain proposal through the proposal graphs (:mod:`.mtp_graphs`): (the requests it
        drafted for, in ``requests``' order, and their drafts ``[b, k]`` on the device); None where
        the graphs do not fit it (counted in ``mtp_graph_fallbacks``: the eager window path runs it)."""
        graphs = self.graphs
        step = self._window(requests, k + 1) if k == graphs.k else None
        if step is None or graphs.bucket(len(step[0])) is None:
            self.counters["mtp_graph_fallbacks"] += 1
            return None
        spans, batch, ids, hidden, lens = step
        reqs = [r for r, _, _ in spans]
        slots = self._chain_slots(reqs, k - 1) if k > 1 else torch.zeros(0, dtype=torch.int64)
        if slots is None:
            self.counters["mtp_graph_fallbacks"] += 1
            return None
        try:
            chain = ScheduledBatch(batch.requests, [r.num_computed for r in reqs], [k - 1] * len(reqs), slots,
                                   ForwardMode.DECODE) if k > 1 else None
            rows = graphs.propose(batch, ids, hidden, lens, chain)
        finally:
            if slots.numel():
                self.target.pools.kv.allocator.free(slots)
        self._processed(spans, lens)
        c = self.counters
        c["window_steps"] += 1
        c["head_decode_steps"] += k - 1
        c["mtp_graph_replays" if graphs.capture else "mtp_graph_eager_runs"] += 1
        return reqs, rows

    # -- proposals --------------------------------------------------------------------------------
    def propose(self, requests: list[Request], k: int) -> list[list[int]]:
        rows, _ = self._propose(requests, k, 1)
        return rows

    def propose_on_device(self, requests: list[Request], k: int) -> torch.Tensor | list[list[int]]:
        """:meth:`propose`, with the drafts left on the device (``[len(requests), k]`` int64, valid
        until the next proposal) where the proposal graphs drafted for every request: the verify
        step copies them into its input ids on the device and brings them to the host with its
        targets, so no sync stands between the proposal and the verify forward. Elsewhere the
        host rows of :meth:`propose`."""
        rows, _ = self._propose(requests, k, 1, on_device=True)
        return rows

    def propose_tree(self, requests: list[Request], depth: int, topk: int, budget: int) -> list[DraftTree]:
        """The head's greedy chain with its top-k alternatives at every depth
        (``tree_from_topk_chain``); a request the head cannot draft for gets an empty tree."""
        _, by_rid = self._propose(requests, depth, topk)
        return [tree_from_topk_chain(by_rid.get(r.rid, []), budget) for r in requests]

    @torch.inference_mode()
    def _propose(self, requests: list[Request], k: int, topk: int,
                 on_device: bool = False) -> tuple[list[list[int]] | torch.Tensor, dict]:
        """(the chain of k drafts per request, with ``topk > 1`` ``{rid: candidate_rows row}``);
        ``on_device``: the chain as the proposal graphs' device tensor where they drafted for
        every request (:meth:`propose_on_device`)."""
        sched = self.target.scheduler
        live = {r.rid for r in sched.running} | {r.rid for r in sched.waiting}
        for rid in [rid for rid in self._states if rid not in live]:
            del self._states[rid]
        for r in requests:  # draft 1 comes from the last computed position: (re)process it
            st = self._states.get(r.rid)
            if st is not None and st.hidden is not None:
                st.m = max(min(st.m, r.num_computed - 1), st.start)
        if self.graphs is not None and topk == 1 and self.use_window:
            drafted = self._propose_graph(requests, k)
            if drafted is not None:
                reqs, drafts = drafted
                if on_device and len(reqs) == len(requests):  # (the same order: _window keeps it)
                    return drafts, {}
                by_rid = {r.rid: row for r, row in zip(reqs, drafts.tolist())}  # (one device->host copy)
                return [by_rid.get(r.rid, []) for r in requests], {}
        advanced = self._advance_window(requests, k + 1) if self.use_window else None
        if advanced is None:
            advanced = self._advance(requests)
        if advanced is None:
            return [[] for _ in requests], {}
        reqs, logits, hidden = advanced
        tokens, cands = self.pick(logits, topk)
        steps, top = [tokens], [cands] if cands is not None else []
        if k > 1:
            steps += self._chain(reqs, tokens, hidden, k - 1, topk, top)
        rows = torch.stack(steps, dim=1).tolist()  # (the proposal's one device->host copy)
        by_rid = {r.rid: row for r, row in zip(reqs, rows)}
        top_by_rid = {r.rid: row for r, row in zip(reqs, candidate_rows(top))}
        return [by_rid.get(r.rid, []) for r in requests], top_by_rid

    def _chain(self, reqs: list[Request], tokens: torch.Tensor, hidden: torch.Tensor, steps: int, topk: int = 1,
               top: list | None = None) -> list[torch.Tensor]:
        """Drafts 2 .. k: ``steps`` head DECODE steps at positions ``c ..`` (``c``: each request's
        computed tokens), in KV slots taken for the chain and freed after it (none free: the
        proposal stops at draft 1). With ``topk > 1`` each step's top-k is appended to ``top``."""
        allocator = self.target.pools.kv.allocator
        b = len(reqs)
        prefix = [r.num_computed for r in reqs]
        slots = self._chain_slots(reqs, steps)
        if slots is None:
            self.counters["chains_cut"] += 1
            return []
        out = []
        try:
            per_request = slots.view(b, steps)
            views = [_Shifted(r) for r in reqs]
            for j in range(steps):
                batch = ScheduledBatch(views, [p + j for p in prefix], [1] * b, per_request[:, j].contiguous(),
                                       ForwardMode.DECODE)
                logits = self.runner.forward(batch, input_ids=tokens, extra=(hidden,))
                hidden = self.runner.hidden_states
                tokens, cands = self.pick(logits, topk)
                out.append(tokens)
                if cands is not None:
                    top.append(cands)
                self.counters["head_decode_steps"] += 1
        finally:
            allocator.free(slots)
        return out

    def _chain_slots(self, reqs: list[Request], steps: int) -> torch.Tensor | None:
        """KV slots of ``steps`` chain positions per request from its pending token on (request-major),
        or None when the pool has too few."""
        last = torch.tensor([int(r.kv_slots[r.num_computed - 1]) for r in reqs], dtype=torch.int64)
        return self.target.pools.kv.allocator.alloc_extend([r.num_computed for r in reqs], [steps] * len(reqs), last)

    def release(self, rid: int) -> None:
        self._states.pop(rid, None)

    def pools_resized(self) -> None:
        """Elastic pools resized the target's pools, which hold the head's KV: its views again (and
        the proposal graphs over them)."""
        self.runner.refresh_pool_views()
        if self.graphs is not None and self.graphs.capture:
            self.graphs.recapture()

    def close(self) -> None:
        self._states.clear()
        self.graphs = None  # (its graphs read the packed weights released below)
        self.runner.release_packed_weights()
        self.runner.release()
