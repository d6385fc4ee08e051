"""Draft sources: what proposes the draft tokens a verify step checks.

- :class:`NgramDraft`: prompt lookup (no extra model): the tokens that followed the latest
  earlier occurrence of the request's last n-gram, longest n first.
- :class:`ReplayDraft`: a known continuation per prompt, each token replaced by a random other
  one with probability ``q`` (benchmarks: sets the acceptance rate on random-weight models).
- :class:`EngineDraftModel`: a draft model of a supported hybrid family, run by our own
  machinery (patched layers, a :class:`~hybrid_compile.engine.runner.ModelRunner`) over its own
  pools. It proposes greedily. Its state is kept in sync with the target's accepted tokens
  without a recurrent-state rollback kernel: each proposal first extends the draft-side request
  by the target's tokens it has not seen (the accepted drafts and the bonus token of the last
  verify; one EXTEND that also yields the first draft), snapshots its Mamba slot into a private
  checkpoint slot, runs k - 1 DECODE steps for the other drafts, and then restores the snapshot
  and frees the draft KV slots: the draft side always ends a proposal at exactly the target's
  accepted sequence, so rejected drafts never reach its state. Cost: the forwards a draft model
  needs anyway (1 extend + k - 1 decodes) plus two state copies (snapshot and restore).
- :class:`~.mtp.MTPDraft` (``mtp.py``): the checkpoint's multi-token-prediction head, run as a
  chain over the target's own KV pool.
- :class:`HFDraftModel`: any other HF causal LM (e.g. a small plain transformer), through HF's
  own forward and ``DynamicCache``, one request at a time, the cache cropped back to the
  accepted sequence after every proposal.

:func:`build_draft_source` picks one from a :class:`~.config.SpeculativeConfig`; a source that
needs the target engine reads it as a :class:`~.config.DraftTarget` (public attributes only).
:func:`fill_drafts` cuts / fills a source's proposals to the verify step's width.
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from ...layers.context import ForwardMode
from ...memory import MemoryPools
from ...models import PatchHandle, family_of
from ...models.fused_experts import install_fused_experts, resolve_fused_moe, resolve_fused_routers
from ...models.fused_router import install_fused_routers
from ..config import _as_dtype
from ..request import Request
from ..runner import ModelRunner
from ..scheduler import ScheduledBatch
from .config import DraftSource, DraftTarget, SpeculativeConfig
from .tree import DraftTree, candidate_rows, pick_next, tree_from_topk_chain


class NgramDraft:
    """Prompt-lookup drafts: for n from ``ngram_max`` down to ``ngram_min``, find the latest
    earlier occurrence of the last n tokens of ``prompt + output`` and propose the (up to k)
    tokens that followed it; nothing when no n-gram recurs."""

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1) -> None:
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        size = len(tokens)
        if size < 2:
            return []
        last = tokens[-1]
        # earlier positions of the last token, latest first: where an n-gram match can end
        ends = [i for i in range(size - 2, -1, -1) if tokens[i] == last]
        for n in range(min(self.ngram_max, size - 1), self.ngram_min - 1, -1):
            pattern = tokens[size - n:]
            for end in ends:
                if end >= n - 1 and tokens[end - n + 1:end + 1] == pattern:
                    return tokens[end + 1:end + 1 + k]
        return []

    def propose(self, requests: list[Request], k: int) -> list[list[int]]:
        return [self.lookup(r.prompt + r.output, k) for r in requests]


class ReplayDraft:
    """Drafts replayed from a known continuation of each prompt (e.g. the target's own greedy
    output computed beforehand), each token corrupted with probability ``q`` into a uniformly
    drawn different token of ``[0, vocab_size)``. Requests whose prompt is unknown get none.

    Args:
        continuations: ``{tuple(prompt): continuation token ids}``.
        q: corruption probability (0: every draft right while the request follows the
            continuation; 1: every draft wrong).
        vocab_size: the target's vocabulary size.
        seed: seed of the corruption draws.
    """

    def __init__(self, continuations: dict, q: float, vocab_size: int, seed: int = 0) -> None:
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"ReplayDraft: q must be in [0, 1], got {q}")
        self.continuations = {tuple(p): list(c) for p, c in continuations.items()}
        self.q = q
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.seed = seed

    def _corrupt(self, token: int) -> int:
        if self.rng.random() >= self.q:
            return token
        other = self.rng.randrange(self.vocab_size - 1)
        return other + (other >= token)

    def propose(self, requests: list[Request], k: int) -> list[list[int]]:
        out = []
        for r in requests:
            cont = self.continuations.get(tuple(r.prompt), [])
            pos = len(r.output)
            out.append([self._corrupt(t) for t in cont[pos:pos + k]])
        return out

    def propose_tree(self, requests: list[Request], depth: int, topk: int, budget: int) -> list[DraftTree]:
        """Draft trees of a draft whose candidates, in rank order, are each the continuation's
        token with probability ``1 - q`` (so rank ``r`` holds it with probability
        ``q ** (r - 1) * (1 - q)``; ``topk = 1`` is :meth:`propose`'s chain): the ``budget`` nodes
        of the full ``topk``-ary tree of ``depth`` with the best rank scores
        (``tree_from_ranks``); the continuation's path through it holds its tokens, every other
        node a random other token. Deterministic given the request (its prompt and output length):
        a seeded sampled request is reproducible."""
        out = []
        for r in requests:
            cont = self.continuations.get(tuple(r.prompt), [])
            pos = len(r.output)
            true = cont[pos:pos + depth]
            rng = random.Random(f"{self.seed}:{r.prompt}:{pos}")
            ranks = []  # the rank the continuation's token takes at each depth (topk: not among them)
            for _ in true:
                rank = 0
                while rank < topk and rng.random() < self.q:
                    rank += 1
                ranks.append(rank)
            out.append(self._tree(true, ranks, depth, topk, budget, rng))
        return out

    def _tree(self, true: list[int], ranks: list[int], depth: int, topk: int, budget: int,
              rng: random.Random) -> DraftTree:
        score = math.log(max(self.q, 1e-6))  # (a rank's log-probability, up to a constant)
        best = sorted((sum(rank_path) * score * -1, len(rank_path), rank_path)
                      for rank_path in _rank_paths(depth, topk))[:budget]
        best = sorted(best, key=lambda b: (b[1], b[2]))
        index = {}
        tokens, parents = [], []
        for _, d, rank_path in best:
            on_path = d <= len(true) and list(rank_path) == ranks[:d]
            token = true[d - 1] if on_path else self._other(true[d - 1] if d <= len(true) else -1, rng)
            tokens.append(token)
            parents.append(index[rank_path[:-1]] if d > 1 else 0)
            index[rank_path] = len(tokens)
        return DraftTree(tokens, parents)

    def _other(self, token: int, rng: random.Random) -> int:
        other = rng.randrange(self.vocab_size - 1)
        return other + (0 <= token <= other)


def _rank_paths(depth: int, topk: int):
    """Every node of the full ``topk``-ary tree of ``depth`` as its tuple of child ranks."""
    frontier = [()]
    for _ in range(depth):
        frontier = [p + (r,) for p in frontier for r in range(topk)]
        yield from frontier


class EngineDraftModel:
    """A hybrid draft model served by our machinery over its own pools (module docstring).

    Args:
        model: the draft HF model (a supported family). When it is the target model itself its
            patches are shared; otherwise it is patched here and unpatched by :meth:`close`.
        target: the target engine (device, dtype, capacities, vocabulary).
        k: drafts per request per proposal.
    """

    def __init__(self, model: torch.nn.Module, target: DraftTarget, k: int) -> None:
        family = family_of(model)
        cfg = target.config
        dtype = next(model.parameters()).dtype
        self.model = model
        self.device = target.device
        self.layout = family.layout(model, kv_dtype=cfg.resolved_kv_cache_dtype(dtype), conv_dtype=dtype,
                                    ssm_dtype=_as_dtype(cfg.ssm_state_dtype))
        self.vocab_size = min(self.layout.vocab_size, target.layout.vocab_size)
        running = cfg.max_running_requests
        # positions up to the target's longest request + the k - 1 draft positions past it
        max_context = target.max_context_len + k
        # the draft side holds at most the target's running requests' tokens (+ k drafts each)
        kv_tokens = min(running * max_context, target.pools.kv.total() + running * (k + 1))
        self.pools = MemoryPools.from_specs(
            self.layout.attention, self.layout.mamba, device=self.device, max_running_requests=running,
            max_context_len=max_context, page_size=1, max_total_tokens=max(kv_tokens, max_context),
            mamba_cache_size=2 * running,  # each request's slot + its snapshot slot
        )
        self.patch = PatchHandle()
        if model is not target.model:
            family.patch(model, self.patch)
        try:
            if model is not target.model:  # EngineConfig.fused_moe on the draft model's experts too
                fused = resolve_fused_moe(model, cfg.fused_moe, self.device)
                install_fused_experts(model, self.patch, fused, required=False)
                routers = resolve_fused_routers(model, cfg.fused_moe, self.device, fused)
                install_fused_routers(model, self.patch, routers)
            self.runner = ModelRunner(model, self.pools, self.device, cfg)
            self.patch.restores.append(self.runner.release_packed_weights)  # packed projection weights: on close()
        except BaseException:
            self.patch.undo()
            raise
        self._reqs: dict[int, tuple[Request, int]] = {}  # target rid -> (draft-side request, snapshot slot)

    def _draft_request(self, r: Request) -> Request:
        entry = self._reqs.get(r.rid)
        if entry is None:
            req_slots = self.pools.req_to_token.alloc(1)
            snapshot = self.pools.mamba.alloc(1)
            if req_slots is None or snapshot is None:
                raise RuntimeError("draft model: out of request / Mamba slots (more requests than max_running_requests)")
            d = Request(rid=r.rid, prompt=r.prompt, params=r.params)
            d.req_slot = int(req_slots[0])
            d.mamba_slot = int(self.pools.req_to_token.mamba_slots(req_slots)[0])
            entry = self._reqs[r.rid] = (d, int(snapshot[0]))
        d = entry[0]
        d.output = list(r.output)
        return d

    def _forward(self, reqs: list[Request]) -> torch.Tensor:
        """Run every draft request's pending tokens; returns each request's logits of its next token."""
        lens = [d.pending for d in reqs]
        prefix = [d.num_computed for d in reqs]
        last = torch.tensor([int(d.kv_slots[-1]) if d.kv_slots.numel() else -1 for d in reqs], dtype=torch.int64)
        slots = self.pools.kv.allocator.alloc_extend(prefix, lens, last)
        if slots is None:
            raise RuntimeError("draft model: its KV pool is exhausted (sized for the target's running requests)")
        offset = 0
        for d, n in zip(reqs, lens):
            d.kv_slots = torch.cat([d.kv_slots, slots[offset:offset + n]])
            offset += n
        decode = all(d.decoding for d in reqs)
        batch = ScheduledBatch(reqs, prefix, lens, slots, ForwardMode.DECODE if decode else ForwardMode.EXTEND)
        logits = self.runner.forward(batch)
        for d, n in zip(reqs, lens):
            d.num_computed += n
        return logits[:, : self.vocab_size]

    def propose(self, requests: list[Request], k: int) -> list[list[int]]:
        return self._chain(requests, k, 1)[0]

    def propose_tree(self, requests: list[Request], depth: int, topk: int, budget: int) -> list[DraftTree]:
        """The greedy chain with its top-k alternatives at every depth (``tree_from_topk_chain``)."""
        steps = self._chain(requests, depth, topk)[1]
        return [tree_from_topk_chain(row, budget) for row in candidate_rows(steps)] if requests else []

    def _chain(self, requests: list[Request], k: int, topk: int) -> tuple[list[list[int]], list]:
        """The greedy chain of k drafts per request, and with ``topk > 1`` each step's top-k
        (``pick_next``)."""
        live = {r.rid for r in requests}
        for rid in [rid for rid in self._reqs if rid not in live]:
            self.release(rid)  # finished or retracted: its slots go back (recomputed if it returns)
        if not requests:
            return [], []
        reqs = [self._draft_request(r) for r in requests]
        next_tokens, cands = pick_next(self._forward(reqs), topk)
        steps = [cands] if cands is not None else []
        tokens = next_tokens.tolist()
        drafts = [[t] for t in tokens]
        if k > 1:
            mamba = self.pools.mamba
            snapshots = [self._reqs[r.rid][1] for r in requests]
            accepted = [d.num_computed for d in reqs]
            mamba.copy_slots([d.mamba_slot for d in reqs], snapshots)
            for _ in range(k - 1):
                for d, t in zip(reqs, tokens):
                    d.output.append(t)
                next_tokens, cands = pick_next(self._forward(reqs), topk)  # one pending token each: the last draft
                steps += [cands] if cands is not None else []
                tokens = next_tokens.tolist()
                for row, t in zip(drafts, tokens):
                    row.append(t)
            # back to the accepted sequence: state from the snapshot, draft KV slots freed
            mamba.copy_slots(snapshots, [d.mamba_slot for d in reqs])
            for d, n in zip(reqs, accepted):
                self.pools.kv.allocator.free(d.kv_slots[n:])
                d.kv_slots = d.kv_slots[:n]
                d.num_computed = n
        return drafts, steps

    def release(self, rid: int) -> None:
        entry = self._reqs.pop(rid, None)
        if entry is None:
            return
        d, snapshot = entry
        self.pools.kv.allocator.free(d.kv_slots)
        self.pools.req_to_token.free([d.req_slot])
        self.pools.mamba.free([snapshot])

    def close(self) -> None:
        for rid in list(self._reqs):
            self.release(rid)
        self.patch.undo()


def _crop(cache: Any, keep: int) -> None:
    """Crop an HF cache to its first ``keep`` tokens. A negative argument removes that many
    tokens in every transformers 5.x release (``crop``'s positive argument changed meaning)."""
    remove = cache.get_seq_length() - keep
    if remove > 0:
        cache.crop(-remove)


class HFDraftModel:
    """A draft model of a family the engine does not serve (a plain HF causal LM whose cache HF
    can crop, e.g. a small Llama/Qwen3): HF's own forward over a per-request ``DynamicCache``,
    one request at a time, greedy; after each proposal the cache is cropped back to the
    request's accepted sequence."""

    def __init__(self, model: torch.nn.Module, target: DraftTarget) -> None:
        from transformers import DynamicCache

        self.model = model
        self.device = target.device
        vocab = model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") else model.config.vocab_size
        self.vocab_size = min(int(vocab), target.layout.vocab_size)
        self._cache_class = DynamicCache
        self._caches: dict[int, tuple[Any, int]] = {}  # rid -> (cache, tokens in it)

    @torch.inference_mode()
    def _next(self, cache: Any, tokens: list[int], start: int, topk: int = 1):
        """(the greedy next token, its step's ``pick_next`` top-k or None)."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        pos = torch.arange(start, start + len(tokens), device=self.device)[None]
        out = self.model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1:, : self.vocab_size]
        if topk == 1:
            return int(logits[0].argmax()), None
        token, cands = pick_next(logits, topk)
        return int(token[0]), cands

    def propose(self, requests: list[Request], k: int) -> list[list[int]]:
        return [[t for t, _ in row] for row in self._chains(requests, k, 1)]

    def propose_tree(self, requests: list[Request], depth: int, topk: int, budget: int) -> list[DraftTree]:
        """The greedy chain with its top-k alternatives at every depth (``tree_from_topk_chain``)."""
        out = []
        for row in self._chains(requests, depth, topk):
            steps = [cands for _, cands in row]
            out.append(tree_from_topk_chain(candidate_rows(steps)[0], budget))
        return out

    def _chains(self, requests: list[Request], k: int, topk: int) -> list[list[tuple]]:
        """Per request its k greedy steps ``(token, top-k or None)``."""
        live = {r.rid for r in requests}
        for rid in [rid for rid in self._caches if rid not in live]:
            self.release(rid)
        drafts = []
        for r in requests:
            cache, n = self._caches.get(r.rid) or (self._cache_class(config=self.model.config), 0)
            tokens = r.prompt + r.output
            row = [self._next(cache, tokens[n:], n, topk)]
            for i in range(k - 1):
                row.append(self._next(cache, [row[-1][0]], len(tokens) + i, topk))
            _crop(cache, len(tokens))
            self._caches[r.rid] = (cache, len(tokens))
            drafts.append(row)
        return drafts

    def release(self, rid: int) -> None:
        self._caches.pop(rid, None)

    def close(self) -> None:
        self._caches.clear()


def build_draft_source(config: SpeculativeConfig, target: DraftTarget) -> DraftSource:
    """The draft source a :class:`SpeculativeConfig` asks for."""
    if config.method == "ngram":
        return NgramDraft(config.ngram_max, config.ngram_min)
    if config.method == "custom":
        return config.draft_source
    if config.method == "mtp":
        from .mtp import MTPDraft

        if getattr(target, "mtp_head", None) is None:
            raise ValueError("speculative method 'mtp' needs the engine's MTP head (HybridEngine loads it from the checkpoint)")
        return MTPDraft(target.mtp_head, target)
    model = config.draft_model
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"SpeculativeConfig.draft_model must be an HF causal LM (nn.Module), got {type(model).__name__}")
    devices = {p.device for p in model.parameters()}
    if devices != {target.device} and not (len(devices) == 1 and next(iter(devices)).type == target.device.type):
        raise ValueError(f"the draft model's weights are on {sorted(map(str, devices))}, the target's on {target.device}")
    try:
        family_of(model)
    except ValueError:
        return HFDraftModel(model, target)
    return EngineDraftModel(model, target, config.num_draft_tokens)


def check_draft_tokens(rows: list[list[int]], vocab_size: int) -> list[list[int]]:
    """The rows as ints; a token outside the vocabulary raises."""
    out = []
    for row in rows:
        row = [int(t) for t in row]
        bad = [t for t in row if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"draft source proposed token id(s) outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        out.append(row)
    return out


def fill_drafts(proposals: list[list[int]], requests: list[Request], k: int, vocab_size: int) -> list[list[int]]:
    """Each request's proposals cut / filled to exactly k (fill: its last proposed token, or
    its pending token when none was proposed). A token outside the vocabulary raises."""
    if len(proposals) != len(requests):
        raise ValueError(f"draft source returned {len(proposals)} proposals for {len(requests)} requests")
    rows = []
    for r, row in zip(requests, check_draft_tokens([row[:k] for row in proposals], vocab_size)):
        fill = row[-1] if row else r.token_ids(r.num_computed, r.num_computed + 1)[0]
        rows.append(row + [fill] * (k - len(row)))
    return rows
