"""Sampling: per-request parameters and the batched sampler (greedy, temperature, top-k, top-p).

Order of the logits transforms is transformers' (temperature, then top-k, then top-p), so a
seeded request samples from the same distribution as ``model.generate(do_sample=True, ...)``.
Each sampled request owns a ``torch.Generator`` seeded from its ``seed``: its draws do not
depend on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """How to pick the next token of one request, and when to stop."""

    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if self.do_sample:
            if not self.temperature > 0:
                raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
            if self.top_k < 0:
                raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
            if not 0.0 < self.top_p <= 1.0:
                raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def is_greedy(self) -> bool:
        return not self.do_sample or self.top_k == 1

    def stop_ids(self) -> frozenset[int]:
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update(self.eos_token_ids)
        return frozenset(ids)


def transform_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Apply temperature, top-k and top-p (nucleus) filtering to one row ``[V]`` of fp32 logits.

    Filtered entries become -inf. Matches transformers' TemperatureLogitsWarper, TopKLogitsWarper
    and TopPLogitsWarper (min_tokens_to_keep=1).
    """
    logits = logits / temperature
    if top_k > 0:
        k = min(top_k, logits.shape[-1])
        kth = torch.topk(logits, k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cum <= (1 - top_p)
        remove_sorted[-1] = False  # always keep the most likely token
        remove = torch.zeros_like(remove_sorted).scatter(0, sorted_idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


class Sampler:
    """Turns the last-position logits of a batch into next tokens, one row per request."""

    def __init__(self) -> None:
        self._generators: dict[int, torch.Generator] = {}

    def generator_for(self, request_id: int, seed: int | None, device: torch.device) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
            self._generators[request_id] = gen
        return gen

    def release(self, request_id: int) -> None:
        self._generators.pop(request_id, None)

    def snapshot(self, requests) -> dict:
        """The generator states of the sampled ``requests`` (None: no generator yet), for
        :meth:`restore` when their step is rolled back. Empty (free) when all are greedy."""
        out = {}
        for r in requests:
            if not r.params.is_greedy:
                gen = self._generators.get(r.rid)
                out[r.rid] = None if gen is None else gen.get_state()
        return out

    def restore(self, snapshot: dict) -> None:
        """Put the generators back as :meth:`snapshot` saw them."""
        for rid, state in snapshot.items():
            if state is None:
                self._generators.pop(rid, None)
            elif rid in self._generators:
                self._generators[rid].set_state(state)

    def sample(self, logits: torch.Tensor, request_ids: list[int], params: list[SamplingParams]) -> torch.Tensor:
        """logits ``[B, V]`` -> next token ids ``[B]`` (int64, on logits' device). Greedy rows take
        the argmax in the logits' own dtype (the ``argmax_rows`` op); sampled rows draw from fp32
        probabilities."""
        next_tokens = torch.ops.hybrid_compile.argmax_rows(logits)
        if all(p.is_greedy for p in params):
            return next_tokens
        logits = logits.float()
        for row, (rid, p) in enumerate(zip(request_ids, params)):
            if p.is_greedy:
                continue
            filtered = transform_logits(logits[row], p.temperature, p.top_k, p.top_p)
            probs = filtered.softmax(-1)
            gen = self.generator_for(rid, p.seed, logits.device)
            next_tokens[row] = torch.multinomial(probs, 1, generator=gen)[0]
        return next_tokens
