"""Speculative decoding settings (:class:`SpeculativeConfig`), the draft-source protocol
(:class:`DraftSource`) that every way of proposing draft tokens implements, and what a draft
source may read of the target engine (:class:`DraftTarget`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .token_map import read_token_map

METHODS = ("draft_model", "ngram", "custom", "mtp")
#: Methods whose draft source gives k candidates per step (``propose_tree``): draft trees (top-k > 1).
TREE_METHODS = ("draft_model", "mtp", "custom")
#: Verify tokens per request a draft tree may have (root + nodes): one int64 of ancestor bits each.
MAX_TREE_TOKENS = 64


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

    Draft trees (``SpeculativeConfig.topk > 1``) need ``propose_tree(requests, depth, topk,
    budget)`` instead: one :class:`~.tree.DraftTree` per request of at most ``budget`` nodes, at
    most ``depth`` deep, at most ``topk`` children per node (deterministic given the request, as
    ``propose``'s tokens).
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
            tokens per request and emits 1 to k + 1 of them. With ``topk > 1``: the draft tree's
            depth (a verify step emits 1 to depth + 1 tokens).
        topk: candidates per draft position. 1: a chain of ``num_draft_tokens`` drafts. ``> 1``: a
            draft TREE (``draft_model``, ``mtp``, or a ``custom`` source with ``propose_tree``;
            n-gram drafts stay chains and raise): the draft's greedy chain with its top-k
            alternatives at every depth (``tree.tree_from_topk_chain``), verified in one forward
            with a tree attention mask and one recurrent state per node; the longest accepted
            path (greedy) or tree rejection sampling (exact) picks the emitted tokens.
        num_tree_nodes: ``topk > 1``: the tree's draft nodes per request (the verify step runs
            ``num_tree_nodes + 1`` tokens per request), the nodes of highest draft probability.
            None: ``num_draft_tokens * topk`` (every candidate). At least ``num_draft_tokens``, at
            most the nodes the source can give (the full ``topk``-ary tree for ``custom``,
            ``num_draft_tokens * topk`` for ``draft_model`` / ``mtp``) and 63.
        draft_model: an HF causal LM with the target's vocabulary. A supported hybrid family is
            served by our own engine machinery with its own pools (``drafts.EngineDraftModel``);
            any other model runs through HF's own forward with its KV cache, one request at a
            time (``drafts.HFDraftModel``). ``hc.from_pretrained`` also takes a checkpoint
            directory here, which it reads onto the model's device and dtype.
        ngram_max, ngram_min: longest / shortest n-gram the lookup tries (longest first).
        draft_source: the :class:`DraftSource` of ``method="custom"`` (e.g. a replay draft).
        mtp_checkpoint: ``method="mtp"``: the checkpoint directory whose safetensors hold the
            ``mtp.*`` tensors. None: the directory the model was loaded from
            (``config._name_or_path``, set by ``from_pretrained``; a Hub id is looked up in the
            local Hub cache). A directory without ``mtp.*`` tensors is one clear error.
        draft_token_map: ``method="mtp"``: the token ids the head drafts from (EAGLE's hot
            vocabulary, SGLang's ``--speculative-token-map``): a path to a ``.pt`` / ``.pth`` /
            ``.npy`` / ``.json`` file, a list of ids or a 1-D integer tensor of distinct ids of the
            vocabulary (``token_map.read_token_map``). The head's LM head becomes those rows of the
            target's (its own small linear; the target's is untouched), so a head forward reads N
            rows instead of the vocabulary's; drafts are always ids of the map, outputs are
            unchanged (the target verifies them). None: the whole vocabulary. With tensor
            parallelism each rank takes the map's rows of its vocab-parallel LM head.
    """

    method: str = "ngram"
    num_draft_tokens: int = 3
    topk: int = 1
    num_tree_nodes: Any = None
    draft_model: Any = None
    ngram_max: int = 4
    ngram_min: int = 1
    draft_source: Any = None
    mtp_checkpoint: Any = None
    draft_token_map: Any = None

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

    @property
    def is_tree(self) -> bool:
        return self.topk > 1

    @property
    def draft_nodes(self) -> int:
        """Draft tokens per request of a verify step (a chain's k, a tree's nodes); the step runs
        one more (the pending token)."""
        if not self.is_tree:
            return self.num_draft_tokens
        return self.num_tree_nodes if self.num_tree_nodes is not None else self.num_draft_tokens * self.topk

    def max_tree_nodes(self) -> int:
        """The most draft nodes the method's tree can hold (``num_tree_nodes``' upper bound)."""
        depth, k = self.num_draft_tokens, self.topk
        full = sum(k ** d for d in range(1, depth + 1)) if self.method == "custom" else depth * k
        return min(full, MAX_TREE_TOKENS - 1)

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"SpeculativeConfig.method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 1:
            raise ValueError(f"SpeculativeConfig.num_draft_tokens must be a positive integer, got {self.num_draft_tokens!r}")
        if not isinstance(self.topk, int) or isinstance(self.topk, bool) or self.topk < 1:
            raise ValueError(f"SpeculativeConfig.topk must be a positive integer, got {self.topk!r}")
        if self.topk > 1 and self.method not in TREE_METHODS:
            raise ValueError(f"SpeculativeConfig.topk={self.topk} (a draft tree) needs a draft source that gives "
                             f"top-k candidates ({', '.join(TREE_METHODS)}); method {self.method!r} proposes a chain: "
                             "use topk=1")
        if self.num_tree_nodes is not None:
            if self.topk == 1:
                raise ValueError("SpeculativeConfig.num_tree_nodes is the node budget of a draft tree: it needs topk > 1")
            most = self.max_tree_nodes()
            if not isinstance(self.num_tree_nodes, int) or not self.num_draft_tokens <= self.num_tree_nodes <= most:
                raise ValueError(
                    f"SpeculativeConfig.num_tree_nodes must be an integer in [num_draft_tokens, {most}] (the most "
                    f"nodes a {self.method!r} tree of depth {self.num_draft_tokens} and topk {self.topk} holds), "
                    f"got {self.num_tree_nodes!r}")
        elif self.topk > 1 and self.draft_nodes > MAX_TREE_TOKENS - 1:
            raise ValueError(f"SpeculativeConfig: a draft tree of num_draft_tokens * topk = {self.draft_nodes} nodes is "
                             f"over the {MAX_TREE_TOKENS - 1} a verify step holds: set num_tree_nodes")
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
        if self.draft_token_map is not None:
            if self.method != "mtp":
                raise ValueError(f"SpeculativeConfig: draft_token_map is only used with method='mtp', not {self.method!r}")
            read_token_map(self.draft_token_map)  # (its contents' errors now; the vocabulary's range at build)
        if self.method == "custom":
            if self.draft_source is None or not callable(getattr(self.draft_source, "propose", None)):
                raise ValueError("SpeculativeConfig: method='custom' needs draft_source, an object with propose(requests, k)")
        elif self.draft_source is not None:
            raise ValueError(f"SpeculativeConfig: draft_source is only used with method='custom', not {self.method!r}")
