"""A generation request and its progress through the engine, and the per-token output of a step."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """One prompt being generated.

    ``num_computed`` tokens of ``prompt + output`` have their KV and recurrent state in the
    pools; the rest (``pending``) are fed in the next steps: the remaining prompt in chunks,
    then one sampled token per decode step. A retracted request returns to ``num_computed = 0``
    and recomputes its tokens later (its output so far is kept).
    """

    rid: int
    prompt: list[int]
    params: SamplingParams
    arrival: int = 0
    output: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    req_slot: int | None = None
    mamba_slot: int | None = None
    kv_slots: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    num_computed: int = 0
    num_retractions: int = 0
    # prefix cache: the tree node the request locked, and how many of its first KV slots are
    # the tree's (the matched prefix; the request must not free them)
    last_node: Any = None
    cached_len: int = 0
    # prompt tokens the prefix cache served at the request's (latest) admission
    num_cached_tokens: int = 0
    # where the tree's KV match left its hybrid hit (MatchResult.branching_len): a checkpoint there
    # makes the shared KV-only part reusable
    branching_len: int | None = None
    stop_ids: frozenset[int] = frozenset()
    # n > 1: the sequences of one prompt share a group (the first sequence's rid) and are told
    # apart by index; the others wait in ``forks`` of the first until its prompt is prefilled,
    # then start from copies of its KV and recurrent state (HybridEngine._fork)
    group: int = -1
    index: int = 0
    forks: list["Request"] = field(default_factory=list)
    # timings (time.perf_counter seconds): arrival, first generated token, finish
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    stop_criteria: list = field(default_factory=list)  # (stop string, its transformers StopStringCriteria)
    stop_str: str | None = None  # the stop string (SamplingParams.stop) that finished the request
    # SamplingParams.logprobs: per generated token (its logprob, [(id, logprob)] of the top ones)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # SamplingParams.output_scores / output_logits: a [V] fp32 row per generated token (device)
    scores: list[torch.Tensor] = field(default_factory=list)
    raw_logits: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.stop_ids = self.params.stop_ids()
        if self.group < 0:
            self.group = self.rid
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def seq_len(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def pending(self) -> int:
        return self.seq_len - self.num_computed

    @property
    def decoding(self) -> bool:
        """Its one pending token is a generated one: the request takes a DECODE step. (A lone
        last prompt token, left by a chunk boundary or a cached prefix, is prefilled instead:
        DECODE steps hold generated tokens only, which the Mamba2 layer op relies on.)"""
        return self.pending == 1 and self.num_computed >= len(self.prompt)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens at positions ``start:end`` of ``prompt + output``."""
        n = len(self.prompt)
        if end <= n:
            return self.prompt[start:end]
        if start >= n:
            return self.output[start - n : end - n]
        return self.prompt[start:] + self.output[: end - n]

    def append_token(self, token: int) -> None:
        self.output.append(token)
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif len(self.output) >= self.params.max_new_tokens:
            self.finish_reason = "length"

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def timings(self) -> dict[str, float | None]:
        """Arrival, first-token and finish times (seconds, ``time.perf_counter``), time to first
        token and mean time per output token after the first (None until known)."""
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival_time
        tpot = None
        if self.finish_time is not None and self.first_token_time is not None and len(self.output) > 1:
            tpot = (self.finish_time - self.first_token_time) / (len(self.output) - 1)
        return dict(arrival=self.arrival_time, first_token=self.first_token_time, finish=self.finish_time,
                    ttft=ttft, tpot=tpot)


@dataclass
class StepOutput:
    """One event of one request in a step: a generated token (or, while a prompt is prefilled in
    chunks, none) and whether the request finished."""

    rid: int
    token: int | None  # None while a prompt is still being prefilled in chunks
    finished: bool
    finish_reason: str | None  # "stop", "length", "time" (SamplingParams.max_time), "abort" or None
    # n > 1: the sequences of one prompt: the group's first rid and this sequence's index in it
    group: int = -1
    index: int = 0
    # SamplingParams.logprobs: (the token's logprob, [(id, logprob)] of the top ones)
    logprobs: tuple[float, list[tuple[int, float]]] | None = None
