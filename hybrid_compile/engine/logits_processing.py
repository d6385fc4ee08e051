"""Logits processing of one step's rows, batched on the device, in transformers' order.

Order (transformers' ``_get_logits_processor``, then vLLM's penalties next to the repetition
penalty): sequence bias -> repetition penalty -> presence / frequency penalties -> no-repeat n-gram
-> bad words -> minimum length (stop tokens banned) -> forced BOS / EOS -> inf/nan removal ->
exponential decay length penalty -> suppressed tokens (always / at the first token) -> the user's
processors -> (sampling rows) temperature, top-k, top-p, min-p, typical, epsilon, eta -> log-softmax
renormalisation.

The built-in stages that only need what the host knows without waiting for the device (a row's
parameters, how many tokens it has generated) are batched tensor ops over the rows that use them,
their per-row parameters staged in one pinned host->device copy per step: repetition / presence /
frequency penalties (each request's generated-token counts and prompt-token mask live on the
device, :class:`TokenCounts`, updated with the sampled tokens on the device: no host sync, so the
engine keeps launching decode steps ahead), minimum length, forced tokens, suppression,
temperature, top-k, top-p, min-p, renormalisation. Stages that read a request's token history
(n-gram and bad-word bans, sequence bias, length decay, typical / epsilon / eta, the user's
processors) run transformers' own processor classes on the request's row with its tokens; the
engine never launches such a request's steps ahead (``SamplingParams.needs_history``).
"""

from __future__ import annotations

from typing import Any

import torch

from .forward_batch import to_device_packed

_NEG_INF = float("-inf")


# -- the sampling filters, over rows with per-row parameters (transformers' warpers, min_tokens_to_keep=1)
def top_k_filter(s: torch.Tensor, kth: torch.Tensor, kmax: int) -> torch.Tensor:
    """Keep each row's top-k entries (ties with the k-th kept): ``kth [R]`` int64 = k - 1 (k <= ``kmax``)."""
    value = torch.topk(s, min(kmax, s.shape[1])).values.gather(1, kth[:, None])
    return s.masked_fill(s < value, _NEG_INF)


def top_p_filter(s: torch.Tensor, one_minus_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filter: drop the least likely entries whose cumulative probability stays <= 1 - top_p
    (``one_minus_p [R]`` fp32, computed in double as transformers does); the top entry always stays."""
    sorted_s, order = torch.sort(s, descending=False)
    remove = sorted_s.softmax(-1).cumsum(-1) <= one_minus_p[:, None]
    remove[:, -1] = False
    return s.masked_fill(remove.scatter(1, order, remove), _NEG_INF)


def min_p_filter(s: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop entries whose probability is below ``min_p [R]`` x the row's top probability."""
    probs = s.softmax(-1)
    return s.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), _NEG_INF)


class StepRows:
    """The requests of one sampling step, their parameters and how many tokens each has generated
    (its output plus ``in_flight`` tokens sampled by a step launched ahead, not appended yet)."""

    def __init__(self, requests: list[Any], params: list[Any], in_flight: int = 0) -> None:
        self.requests = requests
        self.params = params
        self.in_flight = in_flight
        self.generated = [len(r.output) + in_flight for r in requests]
        self.count_rows: list[int] = []  # rows with token counts (set by LogitsProcessing)
        self.count_slots: torch.Tensor | None = None
        self.count_index: torch.Tensor | None = None

    def history(self, i: int, device: torch.device) -> torch.Tensor:
        """``[1, L]`` prompt + generated tokens of row ``i`` on ``device``."""
        if self.in_flight:
            raise RuntimeError("a request whose processing reads its tokens was launched ahead of its last token")
        r = self.requests[i]
        return to_device_packed([torch.tensor(r.prompt + r.output, dtype=torch.int64)], torch.int64, device)[0][None]


class TokenCounts:
    """Per-request token counts ``[slots, V]`` (int32, generated tokens) and prompt-token masks
    (bool) on the device; a request gets a slot at its first processed step (seeded from its
    prompt and output so far) and keeps it until released. Grows by doubling when every slot is
    taken (a request that holds one may wait in the queue after a retraction)."""

    def __init__(self, vocab_size: int, device: torch.device, capacity: int) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.capacity = max(1, capacity)
        self.counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None
        self.slot_of: dict[int, int] = {}

    def _grow(self, capacity: int) -> None:
        counts = torch.zeros(capacity, self.vocab_size, dtype=torch.int32, device=self.device)
        mask = torch.zeros(capacity, self.vocab_size, dtype=torch.bool, device=self.device)
        if self.counts is not None:
            counts[: self.counts.shape[0]] = self.counts
            mask[: self.prompt_mask.shape[0]] = self.prompt_mask
        self.counts, self.prompt_mask, self.capacity = counts, mask, capacity

    def slots(self, requests: list[Any]) -> list[int]:
        """Each request's slot; a new one is seeded from its prompt and output (device ops)."""
        if self.counts is None:
            self._grow(self.capacity)
        out = []
        for r in requests:
            slot = self.slot_of.get(r.rid)
            if slot is None:
                used = set(self.slot_of.values())
                slot = next((s for s in range(self.capacity) if s not in used), None)
                if slot is None:
                    slot = self.capacity
                    self._grow(2 * self.capacity)
                self.slot_of[r.rid] = slot
                prompt, output = to_device_packed(
                    [torch.tensor(r.prompt, dtype=torch.int64), torch.tensor(r.output, dtype=torch.int64)],
                    torch.int64, self.device)
                self.counts[slot].zero_()
                self.counts[slot].index_add_(0, output, torch.ones_like(output, dtype=torch.int32))
                self.prompt_mask[slot].zero_()
                self.prompt_mask[slot].index_fill_(0, prompt, True)
            out.append(slot)
        return out

    def release(self, rid: int) -> None:
        self.slot_of.pop(rid, None)


class LogitsProcessing:
    """Applies every row's processors to a step's fp32 logits ``[B, V]`` (module docstring)."""

    def __init__(self, vocab_size: int | None, device: torch.device, max_requests: int) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.token_counts = TokenCounts(vocab_size, device, max_requests) if vocab_size else None
        self._hf: dict[int, dict[str, Any]] = {}  # per request: its transformers processor objects

    def release(self, rid: int) -> None:
        if self.token_counts is not None:
            self.token_counts.release(rid)
        self._hf.pop(rid, None)

    # -- helpers ----------------------------------------------------------------------------------
    def _stage(self, lists: list[list], dtype: torch.dtype) -> list[torch.Tensor]:
        return to_device_packed([torch.tensor(v, dtype=dtype) for v in lists], dtype, self.device)

    def _hf_processors(self, i: int, rows: StepRows, stage: str) -> list[Any]:
        """Row ``i``'s transformers processors of a history stage (``pre``, ``mid``, ``decay``,
        ``warp``), built once per request."""
        from transformers.generation import logits_process as lp

        r, p = rows.requests[i], rows.params[i]
        procs = self._hf.get(r.rid)
        if procs is None:
            eos = list(p.eos_token_ids) or None
            procs = {"pre": [], "mid": [], "decay": [], "warp": []}
            if p.sequence_bias:
                procs["pre"].append(lp.SequenceBiasLogitsProcessor([[list(s), float(b)] for s, b in p.sequence_bias]))
            if p.no_repeat_ngram_size:
                procs["mid"].append(lp.NoRepeatNGramLogitsProcessor(p.no_repeat_ngram_size))
            if p.bad_words_ids:
                procs["mid"].append(lp.NoBadWordsLogitsProcessor([list(w) for w in p.bad_words_ids], eos))
            if p.exponential_decay_length_penalty is not None:
                procs["decay"].append(lp.ExponentialDecayLengthPenalty(
                    tuple(p.exponential_decay_length_penalty), list(p.eos_token_ids), len(r.prompt)))
            if p.do_sample:
                if p.typical_p < 1.0:
                    procs["warp"].append(lp.TypicalLogitsWarper(mass=p.typical_p))
                if 0.0 < p.epsilon_cutoff < 1.0:
                    procs["warp"].append(lp.EpsilonLogitsWarper(epsilon=p.epsilon_cutoff))
                if 0.0 < p.eta_cutoff < 1.0:
                    procs["warp"].append(lp.EtaLogitsWarper(epsilon=p.eta_cutoff, device=self.device))
            self._hf[r.rid] = procs
        return procs[stage]

    def _history_stage(self, x: torch.Tensor, rows: StepRows, get) -> None:
        """Per-row processors that read the row's tokens: ``get(i)`` -> callables."""
        for i in range(len(rows.params)):
            procs = get(i)
            if not procs:
                continue
            ids = rows.history(i, x.device)
            row = x[i : i + 1]
            for proc in procs:
                row = proc(ids, row)
            x[i] = row[0]

    @staticmethod
    def _on_rows(x: torch.Tensor, index: torch.Tensor | None, fn) -> None:
        """``x[index] = fn(x[index])`` (every row when ``index`` is None)."""
        if index is None:
            x.copy_(fn(x))
        else:
            x.index_copy_(0, index, fn(x.index_select(0, index)))

    # -- the pipeline ---------------------------------------------------------------------------
    def __call__(self, x: torch.Tensor, rows: StepRows) -> torch.Tensor:
        """Process ``x`` (fp32 ``[B, V]``, a fresh tensor: changed in place) and return it."""
        params, gen, B = rows.params, rows.generated, len(rows.params)
        # which rows each batched stage touches, and their parameters (host lists, one staging copy)
        counted = [i for i, p in enumerate(params) if p.uses_counts]
        sampled = [i for i, p in enumerate(params) if p.do_sample]
        temp = [i for i in sampled if params[i].temperature != 1.0]
        topk = [i for i in sampled if params[i].top_k != 0]
        topp = [i for i in sampled if params[i].top_p < 1.0]
        minp = [i for i in sampled if params[i].min_p > 0.0]
        infnan = [i for i, p in enumerate(params) if p.remove_invalid_values]
        renorm = [i for i, p in enumerate(params) if p.renormalize_logits]
        min_bans, forced_rows, forced_pairs, suppress = [], [], [], []
        for i, (r, p) in enumerate(zip(rows.requests, params)):
            if gen[i] < p.min_tokens:
                min_bans += [(i, t) for t in sorted(r.stop_ids)]
            if p.forced_bos_token_id is not None and gen[i] == 0 and len(r.prompt) == 1:
                forced_rows.append(i)
                forced_pairs.append((i, p.forced_bos_token_id))
            if p.forced_eos_token_ids and gen[i] == p.max_new_tokens - 1:
                forced_rows.append(i)  # (a later forced token wins, as in transformers' list order)
                forced_pairs += [(i, t) for t in p.forced_eos_token_ids]
            suppress += [(i, t) for t in p.suppress_tokens]
            first = 1 if (p.forced_bos_token_id is not None and len(r.prompt) == 1) else 0
            if p.begin_suppress_tokens and gen[i] == first:
                suppress += [(i, t) for t in p.begin_suppress_tokens]

        def rows_index(sel):
            return sel if len(sel) != B else None

        index_lists = [counted, temp, topk, topp, minp, infnan, renorm, forced_rows,
                       [i for i, _ in min_bans], [t for _, t in min_bans], [i for i, _ in forced_pairs],
                       [t for _, t in forced_pairs], [i for i, _ in suppress], [t for _, t in suppress]]
        slots = self.token_counts.slots([rows.requests[i] for i in counted]) if counted else []
        index_lists.append(slots)
        index_lists.append([min(params[i].top_k, x.shape[1]) - 1 for i in topk])
        (d_counted, d_temp, d_topk, d_topp, d_minp, d_infnan, d_renorm, d_forced, d_min_r, d_min_t, d_fp_r, d_fp_t,
         d_sup_r, d_sup_t, d_slots, d_kidx) = self._stage(index_lists, torch.int64)
        (rep, pres, freq, t_vals, p_vals, mp_vals) = self._stage([
            [float(params[i].repetition_penalty) for i in counted],
            [float(params[i].presence_penalty) for i in counted],
            [float(params[i].frequency_penalty) for i in counted],
            [float(params[i].temperature) for i in temp],
            [1.0 - float(params[i].top_p) for i in topp],  # (transformers' 1 - top_p, in double, then fp32)
            [float(params[i].min_p) for i in minp],
        ], torch.float32)

        self._history_stage(x, rows, lambda i: self._hf_processors(i, rows, "pre")
                            if params[i].sequence_bias else None)
        if counted:
            rows.count_rows, rows.count_slots = counted, d_slots
            rows.count_index = None if len(counted) == B else d_counted
            counts = self.token_counts.counts.index_select(0, d_slots)
            seen = counts > 0
            any_rep = any(params[i].repetition_penalty != 1.0 for i in counted)
            any_fp = any(params[i].presence_penalty or params[i].frequency_penalty for i in counted)

            def penalise(s):
                if any_rep:  # transformers' / vLLM's: tokens of the prompt or the output
                    r = rep[:, None]
                    mask = seen | self.token_counts.prompt_mask.index_select(0, d_slots)
                    s = torch.where(mask, torch.where(s < 0, s * r, s / r), s)
                if any_fp:  # OpenAI's / vLLM's: tokens of the output
                    s = s - (freq[:, None] * counts + pres[:, None] * seen)
                return s

            self._on_rows(x, rows_index(counted) and d_counted, penalise)
        self._history_stage(x, rows, lambda i: self._hf_processors(i, rows, "mid"))
        if min_bans:
            x.index_put_((d_min_r, d_min_t), x.new_full((), _NEG_INF))
        if forced_rows:
            x.index_fill_(0, d_forced, _NEG_INF)
            x.index_put_((d_fp_r, d_fp_t), x.new_zeros(()))
        if infnan:
            def remove_invalid(s):
                big = torch.finfo(s.dtype)
                s2 = torch.where(s != s, 0.0, s)
                s2 = torch.where(s == float("inf"), big.max, s2)
                return torch.where(s == _NEG_INF, big.min, s2)

            self._on_rows(x, rows_index(infnan) and d_infnan, remove_invalid)
        self._history_stage(x, rows, lambda i: self._hf_processors(i, rows, "decay"))
        if suppress:
            x.index_put_((d_sup_r, d_sup_t), x.new_full((), _NEG_INF))
        self._history_stage(x, rows, lambda i: params[i].logits_processors)
        if temp:
            self._on_rows(x, rows_index(temp) and d_temp, lambda s: s / t_vals[:, None])
        if topk:
            kmax = max(params[i].top_k for i in topk)
            self._on_rows(x, rows_index(topk) and d_topk, lambda s: top_k_filter(s, d_kidx, kmax))
        if topp:
            self._on_rows(x, rows_index(topp) and d_topp, lambda s: top_p_filter(s, p_vals))
        if minp:
            self._on_rows(x, rows_index(minp) and d_minp, lambda s: min_p_filter(s, mp_vals))
        self._history_stage(x, rows, lambda i: self._hf_processors(i, rows, "warp") if params[i].do_sample else None)
        if renorm:
            self._on_rows(x, rows_index(renorm) and d_renorm, lambda s: s.log_softmax(-1))
        return x

    def count(self, rows: StepRows, tokens: torch.Tensor) -> None:
        """Add each counted row's sampled token to its request's counts (on the device)."""
        if not rows.count_rows:
            return
        picked = tokens if rows.count_index is None else tokens.index_select(0, rows.count_index)
        self.token_counts.counts.index_put_(
            (rows.count_slots, picked), torch.ones_like(picked, dtype=torch.int32), accumulate=True)
