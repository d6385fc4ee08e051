"""Sampling: per-request parameters (:class:`SamplingParams`) and the batched sampler.

:class:`SamplingParams` holds everything that decides one request's next token and when it stops:
the vLLM-style fields a server speaks (``n``, ``logprobs``, ``presence_penalty``,
``frequency_penalty``, ``repetition_penalty``, ``min_p``, ``min_tokens``, ``stop``, ``seed``) and the
transformers processors ``generate()`` honours (``engine/generation_config.py`` translates a
``GenerationConfig`` into these fields). The logits of a step go through
:mod:`.logits_processing` in transformers' order, then greedy rows take the argmax and sampled rows
draw from the softmax with their own ``torch.Generator`` seeded from ``seed``: a request's draws do
not depend on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .forward_batch import to_device_packed
from .logits_processing import LogitsProcessing, StepRows, top_k_filter, top_p_filter


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request, and when to stop.

    Sampling: ``do_sample`` (False: greedy), ``temperature``, ``top_k`` (0 = off), ``top_p``,
    ``min_p`` (0 = off), ``typical_p``, ``epsilon_cutoff`` / ``eta_cutoff`` (0 = off), ``seed``.
    Penalties: ``repetition_penalty`` (transformers' / vLLM's: on prompt and generated tokens),
    ``presence_penalty`` / ``frequency_penalty`` (vLLM's / OpenAI's: on generated tokens),
    ``no_repeat_ngram_size``, ``bad_words_ids``, ``sequence_bias``, ``suppress_tokens``,
    ``begin_suppress_tokens``. Length: ``max_new_tokens``, ``min_tokens`` (no stop token before
    that many new tokens), ``forced_eos_token_ids`` (the last allowed token is forced to one of
    them), ``exponential_decay_length_penalty``. Stops: ``eos_token_ids`` (off with
    ``ignore_eos``), ``stop_token_ids``, ``stop`` (strings; needs the engine's tokenizer; the token
    that completes one is kept, its string is ``Request.stop_str``), ``stopping_criteria``,
    ``max_time`` (seconds from arrival). Outputs: ``n`` sequences (sharing one prefill of the
    prompt; sequence ``j`` samples with ``seed + j``), ``logprobs`` (the sampled token's and the top-``logprobs`` log-probabilities of the
    model's distribution at each generated token), ``output_scores`` / ``output_logits`` (the
    processed scores / raw logits rows, as transformers' ``generate`` returns them).
    ``logits_processors``: callables ``(input_ids [1, L], scores [1, V]) -> scores`` applied to the
    request's row after the built-in processors (transformers' ``LogitsProcessor`` objects work).
    """

    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # vLLM-style
    n: int = 1
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    # transformers' processors
    typical_p: float = 1.0
    epsilon_cutoff: float = 0.0
    eta_cutoff: float = 0.0
    no_repeat_ngram_size: int = 0
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    sequence_bias: tuple[tuple[tuple[int, ...], float], ...] = ()
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    forced_bos_token_id: int | None = None
    forced_eos_token_ids: tuple[int, ...] = ()
    remove_invalid_values: bool = False
    renormalize_logits: bool = False
    exponential_decay_length_penalty: tuple[int, float] | None = None
    logits_processors: tuple[Callable, ...] = ()
    stopping_criteria: tuple[Callable, ...] = ()
    max_time: float | None = None
    output_scores: bool = False
    output_logits: bool = False
    extra: dict = field(default_factory=dict)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first field with a value out of range."""
        def bad(name, why):
            raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.max_new_tokens) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not is_int(self.n) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            bad("logprobs", "must be None or an integer >= 0 (top log-probabilities per token)")
        if vocab_size is not None and self.logprobs is not None and self.logprobs > vocab_size:
            bad("logprobs", f"exceeds the vocabulary ({vocab_size})")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                bad(name, "must be a number in [-2, 2]")
        if not isinstance(self.repetition_penalty, (int, float)) or not self.repetition_penalty > 0:
            bad("repetition_penalty", "must be > 0 (1 = off)")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a tuple of non-empty strings")
        if not is_int(self.no_repeat_ngram_size) or self.no_repeat_ngram_size < 0:
            bad("no_repeat_ngram_size", "must be an integer >= 0")
        if self.max_time is not None and not self.max_time > 0:
            bad("max_time", "must be > 0 seconds")
        if self.do_sample:
            if not self.temperature > 0:
                raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
            if self.top_k < 0:
                raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
            if not 0.0 < self.top_p <= 1.0:
                raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
            if not 0.0 <= self.min_p <= 1.0:
                bad("min_p", "must be in [0, 1] (0 = off)")
            if not 0.0 < self.typical_p <= 1.0:
                bad("typical_p", "must be in (0, 1] (1 = off)")
            for name in ("epsilon_cutoff", "eta_cutoff"):
                if not 0.0 <= getattr(self, name) < 1.0:
                    bad(name, "must be in [0, 1) (0 = off)")
        if self.exponential_decay_length_penalty is not None:
            start, factor = self.exponential_decay_length_penalty
            if not is_int(start) or start < 0 or not factor >= 1.0:
                bad("exponential_decay_length_penalty", "must be (start index >= 0, decay factor >= 1)")
        if vocab_size is not None:
            ids = [*self.eos_token_ids, *self.stop_token_ids, *self.suppress_tokens, *self.begin_suppress_tokens,
                   *self.forced_eos_token_ids, *(t for w in self.bad_words_ids for t in w),
                   *(t for s, _ in self.sequence_bias for t in s)]
            if self.forced_bos_token_id is not None:
                ids.append(self.forced_bos_token_id)
            out = [t for t in ids if not 0 <= int(t) < vocab_size]
            if out:
                raise ValueError(f"SamplingParams: token id(s) outside the vocabulary [0, {vocab_size}): {out[:5]}")
        if any(len(w) == 0 for w in self.bad_words_ids):
            bad("bad_words_ids", "holds an empty sequence")
        for name in ("logits_processors", "stopping_criteria"):
            if not all(callable(f) for f in getattr(self, name)):
                bad(name, "must hold callables (input_ids, scores) -> ...")

    @property
    def is_greedy(self) -> bool:
        return not self.do_sample or self.top_k == 1

    @property
    def uses_counts(self) -> bool:
        """Needs the per-request token counts on the device (penalties)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def needs_history(self) -> bool:
        """Needs the request's tokens on the host before each step (processors and stop
        conditions that read them): such a request's steps are never launched ahead."""
        return bool(
            self.no_repeat_ngram_size or self.bad_words_ids or self.sequence_bias or self.logits_processors
            or self.stopping_criteria or self.stop or self.exponential_decay_length_penalty is not None
            or (self.do_sample and (self.typical_p < 1.0 or self.epsilon_cutoff > 0.0 or self.eta_cutoff > 0.0))
        )

    @property
    def needs_processing(self) -> bool:
        """Anything between the model's logits and the argmax besides nothing (greedy fast path)."""
        return bool(
            not self.is_greedy or self.uses_counts or self.needs_history or self.min_tokens or self.suppress_tokens
            or self.begin_suppress_tokens or self.forced_eos_token_ids or self.forced_bos_token_id is not None
            or self.remove_invalid_values or self.renormalize_logits or self.logprobs is not None
            or self.output_scores or self.output_logits
        )

    def stop_ids(self) -> frozenset[int]:
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update(self.eos_token_ids)
        return frozenset(ids)


def transform_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Apply temperature, top-k and top-p (nucleus) filtering to one row ``[V]`` of fp32 logits.

    Filtered entries become -inf. Matches transformers' TemperatureLogitsWarper, TopKLogitsWarper
    and TopPLogitsWarper (min_tokens_to_keep=1): the batched filters of :mod:`.logits_processing`
    on one row (speculative acceptance's form).
    """
    x = logits[None] / temperature
    if top_k > 0:
        x = top_k_filter(x, torch.tensor([min(top_k, x.shape[1]) - 1], device=x.device), top_k)
    if top_p < 1.0:
        x = top_p_filter(x, torch.tensor([1 - top_p], dtype=torch.float32, device=x.device))
    return x[0]


@dataclass
class SampleResult:
    """One step's sampled tokens (``[B]`` int64, on the device) and what its rows asked for
    besides: log-probabilities of the rows ``logprob_rows`` (``logprob_values [R, 1 + k]``: the
    sampled token's then the top-k, ``logprob_ids [R, k]``, k the largest ``logprobs`` asked), and
    the processed scores / raw logits rows (``[V]`` fp32, on the device) of rows that keep them."""

    tokens: torch.Tensor
    logprob_rows: list[int] = field(default_factory=list)
    logprob_values: torch.Tensor | None = None
    logprob_ids: torch.Tensor | None = None
    scores: dict[int, torch.Tensor] = field(default_factory=dict)
    raw_logits: dict[int, torch.Tensor] = field(default_factory=dict)


class Sampler:
    """Turns the last-position logits of a batch into next tokens, one row per request."""

    def __init__(self, vocab_size: int | None = None, device: torch.device | str = "cpu",
                 max_requests: int = 16) -> None:
        self._generators: dict[int, torch.Generator] = {}
        self.processing = LogitsProcessing(vocab_size, torch.device(device), max_requests)

    def generator_for(self, request_id: int, seed: int | None, device: torch.device) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
            self._generators[request_id] = gen
        return gen

    def release(self, request_id: int) -> None:
        self._generators.pop(request_id, None)
        self.processing.release(request_id)

    def snapshot(self, requests) -> dict:
        """The generator states of the sampled ``requests`` (None: no generator yet), for
        :meth:`roll_back` when their step is rolled back. Empty (free) when all are greedy."""
        out = {}
        for r in requests:
            if not r.params.is_greedy:
                gen = self._generators.get(r.rid)
                out[r.rid] = None if gen is None else gen.get_state()
        return out

    def roll_back(self, snapshot: dict, request_ids: list[int]) -> None:
        """A step of these requests was rolled back: the generators as :meth:`snapshot` saw them,
        and their token counts forgotten (they counted the step's tokens; re-seeded from the
        requests' prompt and output at their next processed step)."""
        for rid, state in snapshot.items():
            if state is None:
                self._generators.pop(rid, None)
            elif rid in self._generators:
                self._generators[rid].set_state(state)
        for rid in request_ids:
            self.processing.release(rid)

    def sample(self, logits: torch.Tensor, request_ids: list[int], params: list[SamplingParams],
               requests: list[Any] | None = None, in_flight: int = 0) -> torch.Tensor:
        """logits ``[B, V]`` -> next token ids ``[B]`` (int64, on logits' device). See
        :meth:`sample_rows`; ``requests`` (the rows' :class:`~.request.Request` objects) are
        needed when a row's parameters process its logits."""
        return self.sample_rows(logits, request_ids, params, requests, in_flight).tokens

    def sample_rows(self, logits: torch.Tensor, request_ids: list[int], params: list[SamplingParams],
                    requests: list[Any] | None = None, in_flight: int = 0) -> SampleResult:
        """Greedy rows without processing take the argmax in the logits' own dtype (the
        ``argmax_rows`` op); any other row goes through :class:`LogitsProcessing` (fp32, in
        transformers' order), then its argmax or a draw from its softmax with its generator.
        ``in_flight``: tokens each request has sampled that are not in its output yet (a step
        launched ahead: 1)."""
        if not any(p.needs_processing for p in params):
            return SampleResult(torch.ops.hybrid_compile.argmax_rows(logits))
        if requests is None:
            raise ValueError("Sampler.sample: rows with processing need their requests")
        rows = StepRows(requests, params, in_flight)
        raw = logits.float()
        # processed in place: a copy when the raw logits are still needed (or are the caller's)
        keep_raw = raw is logits or any(p.logprobs is not None or p.output_logits for p in params)
        scores = self.processing(raw.clone() if keep_raw else raw, rows)
        next_tokens = torch.ops.hybrid_compile.argmax_rows(scores)
        for row, (rid, p) in enumerate(zip(request_ids, params)):
            if p.is_greedy:
                continue
            probs = scores[row : row + 1].softmax(-1)
            gen = self.generator_for(rid, p.seed, logits.device)
            next_tokens[row] = torch.multinomial(probs, 1, generator=gen)[0, 0]
        self.processing.count(rows, next_tokens)
        result = SampleResult(next_tokens)
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            # log-probabilities of the model's distribution (the raw logits, vLLM's default)
            index = None if len(want) == len(params) else \
                to_device_packed([torch.tensor(want, dtype=torch.int64)], torch.int64, raw.device)[0]
            lp = torch.log_softmax(raw if index is None else raw.index_select(0, index), dim=-1)
            k = max(params[i].logprobs for i in want)
            top = torch.topk(lp, k, dim=-1)
            picked = next_tokens if index is None else next_tokens.index_select(0, index)
            result.logprob_rows = want
            result.logprob_values = torch.cat([lp.gather(1, picked[:, None]), top.values], dim=1)
            result.logprob_ids = top.indices
        for i, p in enumerate(params):
            if p.output_scores or p.stopping_criteria:
                result.scores[i] = scores[i].clone()
            if p.output_logits:
                result.raw_logits[i] = raw[i].clone()
        return result


def logprob_entries(result: SampleResult, values: list[list[float]], ids: list[list[int]],
                    params: list[SamplingParams]) -> dict[int, tuple[float, list[tuple[int, float]]]]:
    """A step's log-probabilities on the host (``values`` / ``ids``: ``result.logprob_values`` /
    ``logprob_ids`` as lists) -> per row ``(sampled token's logprob, [(id, logprob)] of the top
    ``params[row].logprobs``)``."""
    out = {}
    for j, i in enumerate(result.logprob_rows):
        k = params[i].logprobs
        out[i] = (values[j][0], list(zip(ids[j][:k], values[j][1 : 1 + k])))
    return out


__all__ = ["SamplingParams", "Sampler", "SampleResult", "transform_logits", "logprob_entries"]
