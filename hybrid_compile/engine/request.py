"""A generation request and its progress through the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

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

    def __post_init__(self) -> None:
        self.stop_ids = self.params.stop_ids()

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
