"""Speculative decoding settings (:class:`SpeculativeConfig`), the draft-source protocol
(:class:`DraftSource`) that every way of proposing draft tokens implements, and what a draft
source may read of the target engine (:class:`DraftTarget`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

METHODS = ("draft_model", "ngram", "custom", "mtp")


@runtime_checkable
class DraftSource(Protocol):
    """Proposes draft tokens for the requests of a verify step.

    ``propose(requests, k)`` gets the running requests (:class:`~hybrid_compile.engine.request.Request`:
    ``prompt + output`` are their tokens so far, the last one not yet computed by the target) and
    returns one list per request of at most ``k`` proposed next tokens. Fewer than ``k`` (even
    none) is allowed: the engine fills the verify batch's fixed width with copies of the last
    proposed token (a guess like any other; rejected drafts cost nothing but their compute).
    Proposals must be deterministic given the request (the draft distribution is one-hot), which
    is what makes speculative *sampling* exact (see ``acceptance.accept_sampled``).

    ``release(rid)`` (optional) is called once a request finishes, so a source with per-request
    state can drop it; ``close()`` (optional) when the engine closes.
    """

    def propose(self, requests: list, k: int) -> list[list[int]]: ...


class DraftTarget(Protocol):
    """The target engine as a draft source sees it (a :class:`~hybrid_compile.engine.HybridEngine`
    is one): the public attributes the sources of :mod:`.drafts` and :mod:`.mtp` read.

    Attributes:
        config: its ``EngineConfig``.
        model: the target HF model (a draft model that is the target shares its patches).
        device, dtype: where and in which activation dtype it runs.
        layout: the family's model layout (``vocab_size``).
        max_context_len: the longest request it serves.
        pools: its ``MemoryPools`` (the MTP head writes its KV into the target's KV pool).
        scheduler: its ``Scheduler`` (``running`` / ``waiting``: the requests still alive).
        mtp_head: the checkpoint's MTP head (``method="mtp"``), else None.
    """

    config: Any
    model: Any
    device: Any
    dtype: Any
    layout: Any
    max_context_len: int
    pools: Any
    scheduler: Any
    mtp_head: Any


@dataclass
class SpeculativeConfig:
    """Settings of speculative decoding (``EngineConfig.speculative`` takes one, or a dict of
    its fields).

    Attributes:
        method: ``"draft_model"`` (``draft_model`` proposes greedily), ``"ngram"`` (prompt
            lookup: the tokens that followed the latest earlier occurrence of the last n-gram),
            ``"mtp"`` (the multi-token-prediction head the checkpoint ships, ``mtp.*`` tensors,
            run k times per step as a chain: ``mtp.MTPDraft``) or ``"custom"``
            (``draft_source``, any :class:`DraftSource`).
        num_draft_tokens: drafts per request per verify step (k); a verify step runs k + 1
            tokens per request and emits 1 to k + 1 of them.
        draft_model: an HF causal LM with the target's vocabulary. A supported hybrid family is
            served by our own engine machinery with its own pools (``drafts.EngineDraftModel``);
            any other model runs through HF's own forward with its KV cache, one request at a
            time (``drafts.HFDraftModel``).
        ngram_max, ngram_min: longest / shortest n-gram the lookup tries (longest first).
        draft_source: the :class:`DraftSource` of ``method="custom"`` (e.g. a replay draft).
        mtp_checkpoint: ``method="mtp"``: the checkpoint directory whose safetensors hold the
            ``mtp.*`` tensors. None: the directory the model was loaded from
            (``config._name_or_path``, set by ``from_pretrained``; a Hub id is looked up in the
            local Hub cache). A directory without ``mtp.*`` tensors is one clear error.
    """

    method: str = "ngram"
    num_draft_tokens: int = 3
    draft_model: Any = None
    ngram_max: int = 4
    ngram_min: int = 1
    draft_source: Any = None
    mtp_checkpoint: Any = None

    @classmethod
    def coerce(cls, value: "SpeculativeConfig | dict") -> "SpeculativeConfig":
        """A validated SpeculativeConfig from itself or a dict of its fields."""
        if isinstance(value, cls):
            result = dataclasses.replace(value)
        elif isinstance(value, dict):
            names = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - names)
            if unknown:
                raise TypeError(
                    f"unknown SpeculativeConfig field(s): {', '.join(unknown)}; valid fields: {', '.join(sorted(names))}"
                )
            result = cls(**value)
        else:
            raise TypeError(
                f"EngineConfig.speculative must be a SpeculativeConfig, a dict of its fields or None, "
                f"got {type(value).__name__}"
            )
        result.validate()
        return result

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"SpeculativeConfig.method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 1:
            raise ValueError(f"SpeculativeConfig.num_draft_tokens must be a positive integer, got {self.num_draft_tokens!r}")
        if self.method == "draft_model" and self.draft_model is None:
            raise ValueError("SpeculativeConfig: method='draft_model' needs draft_model (an HF causal LM)")
        if self.method != "draft_model" and self.draft_model is not None:
            raise ValueError(f"SpeculativeConfig: draft_model is only used with method='draft_model', not {self.method!r}")
        if self.method == "ngram":
            if not (isinstance(self.ngram_min, int) and isinstance(self.ngram_max, int) and 1 <= self.ngram_min <= self.ngram_max):
                raise ValueError(
                    f"SpeculativeConfig: need 1 <= ngram_min <= ngram_max, got {self.ngram_min!r} and {self.ngram_max!r}"
                )
        if self.mtp_checkpoint is not None and self.method != "mtp":
            raise ValueError(f"SpeculativeConfig: mtp_checkpoint is only used with method='mtp', not {self.method!r}")
        if self.method == "custom":
            if self.draft_source is None or not callable(getattr(self.draft_source, "propose", None)):
                raise ValueError("SpeculativeConfig: method='custom' needs draft_source, an object with propose(requests, k)")
        elif self.draft_source is not None:
            raise ValueError(f"SpeculativeConfig: draft_source is only used with method='custom', not {self.method!r}")
