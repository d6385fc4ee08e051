"""The forward context: per-step metadata and pool views that the layer ops read.

The engine builds one :class:`ForwardContext` per model forward and installs it with
:func:`forward_context`; the patched HF layers call layer ops that fetch it with
:func:`get_forward_context`. This side channel is what works for every HF family (kwargs do
not reach the mixers in all of them), and it keeps per-step tensors out of the traced graph's
signature: under torch.compile the layer ops are opaque custom ops, so the context is read
at run time, never traced.

Outside an engine step there is no context and the patched layers run HF's own code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch


class ForwardMode(enum.Enum):
    DECODE = "decode"  # every request adds exactly one generated token (not a prompt token) and has state
    EXTEND = "extend"  # prefill / chunked prefill / mixed prefill + decode
    TARGET_VERIFY = "target_verify"  # speculative verify: a fixed number of draft tokens per request


@dataclass
class ForwardMetadata:
    """Packed-batch metadata of one step (B requests, N new tokens).

    Attributes:
        mode: the forward mode.
        positions: ``[N]`` int64 absolute position of each new token.
        query_start_loc: ``[B+1]`` int32 cumulative new-token counts (cu_seqlens).
        seq_lens: ``[B]`` int32 total tokens of each request after this step.
        prefix_lens: ``[B]`` int32 tokens already cached before this step.
        mamba_cache_indices: ``[B]`` int32 Mamba slot of each request (-1 = padding).
        has_initial_state: ``[B]`` bool, the request's Mamba slot holds state to continue from.
        out_cache_loc: ``[N]`` KV slot each new token's K/V is written to.
        kv_indptr, kv_indices: ``[B+1]`` / ``[sum seq_lens]`` KV slots of every token of every
            request, in position order (token-level paged layout).
        logits_indices: ``[B]`` (or ``[B*L]`` in verify) packed indices whose logits are kept.
        extend_lens_cpu, seq_lens_cpu: host copies of the per-request lengths.
        draft_len: tokens per request in TARGET_VERIFY.
        prompt_lens: ``[B]`` int32 prompt length of each request, or None. Positions below it are
            prompt tokens; layers whose HF code treats prompt and generated tokens differently
            (the Mamba2 mixers clamp ``dt`` only in their prefill path) read it.
        track_slots: ``[B]`` int32 Mamba slot receiving a prefix-cache checkpoint of the
            request's recurrent state inside this EXTEND (-1 = none), or None.
        track_lens: ``[B]`` int32 new tokens of the extend before that checkpoint (a whole
            number of SSM chunks, less than the request's extend length; -1 = none), or None.
        has_tracking: host-side: some request tracks a checkpoint in this step, so the EXTEND
            layer ops ask their chunk kernels for chunk states (skipped otherwise).
        tree_mask: TARGET_VERIFY of draft trees: ``[N]`` int64 ancestor bits of each token among its
            request's verify tokens (``paged_attention_extend``'s ``tree_mask``), else None.
        tree_parents: TARGET_VERIFY of draft trees: ``[rows, draft_len]`` int32 parent of each verify
            token in its row (-1: the root; the recurrent ops' ``parent_indices``), else None.
        graph_key: host-side: the full CUDA graph (``compilation/cuda_graphs.GraphKey``) whose stable
            buffers hold this step's metadata (the tensors here are views of its first rows; the
            rows past them are padding requests): the step replays that graph. None otherwise.
        decode_rows: host-side, EXTEND (a mixed step): requests ``[start, end)`` are decode rows, one
            generated token each with a state to continue from and no checkpoint inside the step, packed
            after the prefill requests (and before any padding request); the layer ops run them through
            their decode path (:meth:`mixed_parts`). None: none.
    """

    mode: ForwardMode
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    mamba_cache_indices: torch.Tensor
    has_initial_state: torch.Tensor
    out_cache_loc: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    logits_indices: torch.Tensor
    extend_lens_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    draft_len: int = 0
    prompt_lens: torch.Tensor | None = None
    track_slots: torch.Tensor | None = None
    track_lens: torch.Tensor | None = None
    has_tracking: bool = False
    tree_mask: torch.Tensor | None = None
    tree_parents: torch.Tensor | None = None
    graph_key: Any = None
    decode_rows: tuple[int, int] | None = None

    @property
    def batch_size(self) -> int:
        return int(self.mamba_cache_indices.shape[0])

    def memo(self, key, build):
        """``build()``, computed once per step: device tensors that every layer op of a kind derives
        alike from this metadata (the prefix-cache tracking rows of ``layers/tracking.py``) are built
        by the first layer that asks, not once per layer. Kept on this object only: a copy with other
        tensors (``dataclasses.replace``, padding) starts without them."""
        memos = self.__dict__.setdefault("_memos", {})
        if key not in memos:
            memos[key] = build()
        return memos[key]

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def mixed_parts(self) -> "MixedParts | None":
        """A mixed step's two parts (``decode_rows``; built once per step, :meth:`memo`): the prefill
        requests as an EXTEND step and the decode rows as a DECODE step, each with metadata of its own
        (fresh tensors, 16-byte aligned: a slice's offset would specialise a Triton kernel anew). None
        for any other step."""
        if self.mode is not ForwardMode.EXTEND or self.decode_rows is None:
            return None
        return self.memo("mixed_parts", self._build_mixed_parts)

    def _build_mixed_parts(self) -> "MixedParts":
        start, end = self.decode_rows
        lens, seqs = self.extend_lens_cpu, self.seq_lens_cpu
        if start <= 0 or any(n != 1 for n in lens[start:end]) or end > len(lens):
            raise ValueError(f"decode_rows {self.decode_rows}: decode rows are one-token requests after at least one "
                             f"prefill request, got extend lengths {lens[:end + 1]}")
        tokens = sum(lens[:start])
        kv_start, kv_end = sum(seqs[:start]), sum(seqs[:end])
        d = end - start

        def rows(t):
            return None if t is None else t[start:end].clone()

        dev = self.positions.device
        extend = dataclasses.replace(
            self, positions=self.positions[:tokens], query_start_loc=self.query_start_loc[: start + 1],
            seq_lens=self.seq_lens[:start], prefix_lens=self.prefix_lens[:start],
            mamba_cache_indices=self.mamba_cache_indices[:start], has_initial_state=self.has_initial_state[:start],
            out_cache_loc=self.out_cache_loc[:tokens], kv_indptr=self.kv_indptr[: start + 1],
            logits_indices=self.logits_indices[:0], extend_lens_cpu=list(lens[:start]), seq_lens_cpu=list(seqs[:start]),
            prompt_lens=None if self.prompt_lens is None else self.prompt_lens[:start],
            track_slots=None if self.track_slots is None else self.track_slots[:start],
            track_lens=None if self.track_lens is None else self.track_lens[:start],
            graph_key=None, decode_rows=None,
        )
        decode = ForwardMetadata(
            mode=ForwardMode.DECODE, positions=self.positions[tokens: tokens + d].clone(),
            query_start_loc=torch.arange(d + 1, dtype=self.query_start_loc.dtype, device=dev),
            seq_lens=rows(self.seq_lens), prefix_lens=rows(self.prefix_lens),
            mamba_cache_indices=rows(self.mamba_cache_indices), has_initial_state=rows(self.has_initial_state),
            out_cache_loc=self.out_cache_loc[tokens: tokens + d].clone(),
            kv_indptr=self.kv_indptr[start: end + 1] - kv_start, kv_indices=self.kv_indices[kv_start:kv_end].clone(),
            logits_indices=self.logits_indices[:0], extend_lens_cpu=[1] * d, seq_lens_cpu=list(seqs[start:end]),
            prompt_lens=rows(self.prompt_lens),
        )
        return MixedParts(extend, decode, tokens, d)

    def verify_rows(self) -> int:
        """TARGET_VERIFY: the leading requests that run ``draft_len`` tokens each (the verify batch,
        padding rows with Mamba index -1 included). Trailing requests of another length (filler of
        a padded token count) are not verify rows: the linear layers leave their tokens at zero."""
        steps = self.draft_len
        if steps <= 0:
            raise ValueError(f"TARGET_VERIFY needs draft_len > 0, got {steps}")
        lens = self.extend_lens_cpu
        if lens:
            rows = 0
            while rows < len(lens) and lens[rows] == steps:
                rows += 1
            return rows
        if self.num_tokens % steps:
            raise ValueError(f"TARGET_VERIFY: {self.num_tokens} tokens are not a whole number of {steps}-token requests")
        return self.num_tokens // steps


@dataclass(frozen=True)
class MixedParts:
    """A mixed EXTEND step split for the layer ops (:meth:`ForwardMetadata.mixed_parts`): the first
    ``extend_tokens`` tokens are the prefill requests' (``extend``, an EXTEND step), the next
    ``decode_tokens`` the decode rows' (``decode``, a DECODE step: one token per request); tokens past
    them belong to padding requests."""

    extend: ForwardMetadata
    decode: ForwardMetadata
    extend_tokens: int
    decode_tokens: int

    def run(self, ctx: "ForwardContext", layer, *per_token: torch.Tensor | None) -> torch.Tensor:
        """``layer(*tokens)`` (a layer op's call, reading the forward context's metadata) over the
        prefill part and over the decode part, each under its own metadata in ``ctx``; the outputs
        concatenated in token order, padding tokens' rows zero (nothing reads them). A per-token
        argument may be None (an absent optional input)."""
        n = per_token[0].shape[0]
        e, d = self.extend_tokens, self.decode_tokens
        whole = ctx.metadata
        outs = []
        try:
            for md, lo, hi in ((self.extend, 0, e), (self.decode, e, e + d)):
                ctx.metadata = md
                outs.append(layer(*(None if t is None else t[lo:hi] for t in per_token)))
        finally:
            ctx.metadata = whole
        if n > e + d:
            outs.append(outs[0].new_zeros(n - e - d, *outs[0].shape[1:]))
        return torch.cat(outs)


@dataclass(frozen=True)
class VerifyBatch:
    """One linear layer's view of a TARGET_VERIFY step: the verify requests, their tokens and buffers.

    The leading ``rows`` requests (padding rows with Mamba index -1 included) run ``steps`` tokens
    each, packed first in the batch; the ``num_tokens = rows * steps`` tokens past them are filler
    of a padded token count, which the linear layer ops leave at zero (:meth:`pad`).

    Attributes:
        rows: verify requests (``ForwardMetadata.verify_rows()``).
        steps: tokens per verify request (``ForwardMetadata.draft_len``).
        cache_indices: ``[rows]`` int32 Mamba slot of each verify request.
        intermediates: the layer's per-draft-step buffers ``(conv_windows, ssm_states, ssm_scales)``
            (``ssm_scales`` None unless the state is FP8).
        parents: ``[rows, steps]`` int32 parent of each verify token (a draft tree; the ops'
            ``parent_indices``), or None for chains.
    """

    rows: int
    steps: int
    cache_indices: torch.Tensor
    intermediates: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
    parents: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.rows * self.steps

    def per_request(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[N, ...]`` packed per-token values -> ``[rows, steps, ...]`` of the verify tokens."""
        return tokens[: self.num_tokens].reshape(self.rows, self.steps, *tokens.shape[1:])

    def pad(self, out: torch.Tensor, n: int) -> torch.Tensor:
        """``[num_tokens, ...]`` output of the verify tokens -> ``[n, ...]``, filler tokens at zero."""
        if out.shape[0] == n:
            return out
        return torch.cat([out, out.new_zeros(n - out.shape[0], *out.shape[1:])])


@dataclass
class ForwardContext:
    """Metadata plus the pool views of every layer for one forward.

    ``kv_caches[layer_id] = (k_cache, v_cache, k_scale, v_scale)`` for full-attention layers;
    ``mamba_caches[layer_id] = (conv_states, ssm_states, ssm_scales)`` for linear layers;
    ``intermediate_caches[layer_id] = (conv_windows, ssm_states, ssm_scales)`` per-draft-step
    buffers (speculative verify only). The scales are the fp32 tensors beside an FP8 pool
    (``hybrid_compile.ops.fp8_cache``), None for a float pool; a tuple without them (``(k, v)``,
    ``(conv, ssm)``) means float pools. Layer ops read them through :meth:`kv_cache`,
    :meth:`mamba_cache` and :meth:`intermediate`, which always return the full tuples.
    """

    metadata: ForwardMetadata
    kv_caches: dict[int, tuple]
    mamba_caches: dict[int, tuple]
    intermediate_caches: dict[int, tuple] = field(default_factory=dict)

    def kv_cache(self, layer_id: int) -> tuple:
        """``(k_cache, v_cache, k_scale, v_scale)`` of a full-attention layer (scales None: float)."""
        return _full(self.kv_caches[layer_id], 4)

    def mamba_cache(self, layer_id: int) -> tuple:
        """``(conv_states, ssm_states, ssm_scales)`` of a linear layer (scales None: float state)."""
        return _full(self.mamba_caches[layer_id], 3)

    def intermediate(self, layer_id: int, op: str) -> tuple:
        """``(conv_windows, ssm_states, ssm_scales)``: the per-draft-step buffers of one linear layer
        (TARGET_VERIFY), or a clear error."""
        if layer_id not in self.intermediate_caches:
            raise RuntimeError(
                f"{op}: TARGET_VERIFY needs the Mamba pool's speculative buffers of layer {layer_id} in the forward "
                "context (an engine built with EngineConfig.speculative provides them)"
            )
        return _full(self.intermediate_caches[layer_id], 3)

    def verify_batch(self, layer_id: int, op: str) -> VerifyBatch:
        """The TARGET_VERIFY view of linear layer ``layer_id`` (``op`` names it in errors)."""
        md = self.metadata
        rows = md.verify_rows()
        parents = None if md.tree_parents is None else md.tree_parents[:rows]
        return VerifyBatch(rows, md.draft_len, md.mamba_cache_indices[:rows], self.intermediate(layer_id, op), parents)


def _full(entry: tuple, n: int) -> tuple:
    """A pool-view tuple padded with None up to ``n`` entries (float pools carry no scales)."""
    entry = tuple(entry)
    return entry + (None,) * (n - len(entry))


_current: ForwardContext | None = None


def get_forward_context() -> ForwardContext | None:
    """The context of the running engine step, or None outside one."""
    return _current


def require_forward_context(what: str) -> ForwardContext:
    if _current is None:
        raise RuntimeError(f"{what} was called outside an engine step (no forward context is set)")
    return _current


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Install ``ctx`` for the duration of one model forward (not re-entrant)."""
    global _current
    if _current is not None:
        raise RuntimeError("a forward context is already active: engine steps cannot nest")
    _current = ctx
    try:
        yield ctx
    finally:
        _current = None


def by_mixed_parts(layer, *per_token: torch.Tensor | None) -> torch.Tensor | None:
    """In a mixed step (``ForwardMetadata.mixed_parts``), a layer op's output over its two parts:
    ``layer(*tokens)`` re-enters the op under the prefill part's metadata, then the decode part's
    (:meth:`MixedParts.run`); None in any other step (or outside a forward), where the op runs
    itself. Each linear or attention layer op calls it first, so that a mixed step's decode rows cost
    what they cost in a decode step: no chunked scan over one-token requests, decode attention."""
    ctx = get_forward_context()
    parts = None if ctx is None else ctx.metadata.mixed_parts()
    return None if parts is None else parts.run(ctx, layer, *per_token)
