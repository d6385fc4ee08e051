"""The collectives inside a rank's model: all-reduced partial sums and the vocab-parallel ends.

These are per-instance forward patches of the rank's own (sharded) model, installed once after
its weights are loaded (the model exists only for tensor parallelism, so nothing is undone):

- a row-parallel projection (attention ``o_proj``, a mixer's ``out_proj``) or a whole MLP / MoE
  block computes a partial sum of its output on every rank: its output is all-reduced;
- the embedding holds rows ``[start, stop)`` of the vocabulary: ids outside it embed to zero and
  the all-reduce adds the rank that holds them;
- the LM head holds the same rows of the output projection: the local logits are all-gathered
  along the vocabulary and cut to the real vocabulary size (the last rank's rows may be padding);
  an MTP head's restricted vocabulary takes the map's rows of it on every rank (:class:`VocabParallelRows`);
- an RMSNorm over channels split across every rank (a Mamba2 gated norm over one group that spans
  every rank, ``n_groups == 1``; OLMo-Hybrid's attention ``q_norm`` / ``k_norm``) all-reduces its
  sum of squares and divides by the whole width.

All collectives are functional collectives, so Dynamo traces them with no graph break.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from ..models.base import INNER_FORWARD
from .group import TensorParallelGroup


def _first(output, fn):
    """Apply ``fn`` to a module output that may be a tuple (tensor first)."""
    if isinstance(output, tuple):
        return (fn(output[0]), *output[1:])
    return fn(output)


def reduce_output(module: nn.Module, tp: TensorParallelGroup) -> None:
    """All-reduce ``module``'s output. The forward it reduces is kept as the instance attribute
    :data:`~hybrid_compile.models.base.INNER_FORWARD`: a patch installed later (the engine's, e.g. the
    MoE block's folded shared expert) replaces that one and stays inside the reduction."""
    module.__dict__[INNER_FORWARD] = module.forward

    def reduced_forward(self, *args, **kwargs):
        return _first(getattr(self, INNER_FORWARD)(*args, **kwargs), tp.all_reduce)

    module.forward = types.MethodType(reduced_forward, module)


def vocab_parallel_embedding(module: nn.Embedding, start: int, stop: int, tp: TensorParallelGroup) -> None:
    def embedding_forward(self, input_ids):
        inside = (input_ids >= start) & (input_ids < stop)
        local = torch.where(inside, input_ids - start, torch.zeros_like(input_ids))
        out = nn.functional.embedding(local, self.weight)
        return tp.all_reduce(out * inside.unsqueeze(-1).to(out.dtype))

    module.forward = types.MethodType(embedding_forward, module)


def vocab_parallel_lm_head(module: nn.Linear, vocab_size: int, tp: TensorParallelGroup) -> None:
    def lm_head_forward(self, hidden):
        logits = nn.functional.linear(hidden, self.weight, self.bias)
        return tp.all_gather_last(logits)[..., :vocab_size]

    module.forward = types.MethodType(lm_head_forward, module)
    # an MTP head's draft token map takes its rows this way (models/mtp.py: MTPHead.restrict_vocabulary)
    module.restricted_rows = lambda token_map: VocabParallelRows(module, token_map, tp)


class VocabParallelRows(nn.Module):
    """The rows of a vocab-parallel LM head (:func:`vocab_parallel_lm_head`) at the ids of
    ``token_map``, in the map's order: column ``i`` of its logits is token ``token_map[i]`` (an MTP
    head's restricted vocabulary, ``SpeculativeConfig.draft_token_map``). Each rank keeps the map's
    ids among its own rows (padded with zero rows to the most any rank keeps), the local logits are
    all-gathered and their columns put in the map's order by one ``index_select``."""

    def __init__(self, lm_head: nn.Linear, token_map: torch.Tensor, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp = tp  # (rank r holds rows [r * rows, (r + 1) * rows) of the LM head)
        weight, bias = lm_head.weight, lm_head.bias
        rows = int(weight.shape[0])
        ids = token_map.to(torch.int64).cpu()
        owner = ids // rows  # the rank that holds each id's row
        per_rank = [ids[owner == r] - r * rows for r in range(tp.size)]  # (each in the map's order)
        width = max(int(x.numel()) for x in per_rank)
        local = per_rank[tp.rank].to(weight.device)
        w = torch.zeros(width, weight.shape[1], dtype=weight.dtype, device=weight.device)
        w[: local.numel()] = weight.detach().index_select(0, local)
        self.weight = nn.Parameter(w, requires_grad=False)
        if bias is not None:
            b = torch.zeros(width, dtype=bias.dtype, device=bias.device)
            b[: local.numel()] = bias.detach().index_select(0, local)
            self.bias = nn.Parameter(b, requires_grad=False)
        else:
            self.bias = None
        # map position i -> its gathered column: rank r's block starts at r * width
        rank_of, place = owner.tolist(), [0] * tp.size
        order = []
        for r in rank_of:
            order.append(r * width + place[r])
            place[r] += 1
        self.register_buffer("order", torch.tensor(order, dtype=torch.int64, device=weight.device), persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last(nn.functional.linear(hidden, self.weight, self.bias))
        return logits.index_select(-1, self.order)


def cross_rank_rms_norm(module: nn.Module, width: int, tp: TensorParallelGroup, gated: bool,
                        ranks: int | None = None) -> None:
    """An RMSNorm over ``width`` channels split across ``ranks`` consecutive ranks (default: every
    rank), on this rank's slice: the mean of squares is the sum of squares over ``width``,
    all-reduced across those ranks. Fewer than all (``ranks`` tiles the group): each span of ranks
    has its own column of one all-reduce over the whole group, this rank's sum in its span's column
    and zeros elsewhere, so a span's column sums its ranks alone (the group's all-reduce, the one the
    CUDA graphs already hold, not a communicator of its own).
    ``gated``: transformers' Mamba2 gated RMSNorm (the silu gate, then the norm over one B/C group
    that spans those ranks); else a plain RMSNorm (OLMo-Hybrid's attention ``q_norm`` / ``k_norm``
    over all heads at once)."""
    if (gated and getattr(module, "norm_before_gate", False)) or not hasattr(module, "variance_epsilon"):
        raise ValueError(f"tensor parallelism: the norm {type(module).__name__} (gate after the norm, or no "
                         "variance_epsilon) cannot be reduced across ranks")

    ranks = tp.size if ranks is None else ranks
    if ranks < 1 or tp.size % ranks:
        raise ValueError(f"tensor parallelism: a norm over {ranks} ranks does not tile {tp.size} ranks")
    span = tp.rank // ranks
    if ranks < tp.size:  # this rank's span's column (a buffer: it follows the module to its device)
        columns = torch.zeros(tp.size // ranks, dtype=torch.float32, device=module.weight.device)
        columns[span] = 1.0
        module.register_buffer("tp_norm_column", columns, persistent=False)

    def normalised(self, h: torch.Tensor) -> torch.Tensor:
        squares = h.pow(2).sum(-1, keepdim=True)
        if ranks == tp.size:
            total = tp.all_reduce(squares)
        else:
            total = tp.all_reduce(squares * self.tp_norm_column)[..., span:span + 1]
        return h * torch.rsqrt(total / width + self.variance_epsilon)

    def gated_norm_forward(self, hidden_states, gate=None):
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        if gate is not None:
            h = h * nn.functional.silu(gate.to(torch.float32))
        return self.weight * normalised(self, h).to(dtype)

    def norm_forward(self, hidden_states):
        return (self.weight * normalised(self, hidden_states.to(torch.float32))).to(hidden_states.dtype)

    module.forward = types.MethodType(gated_norm_forward if gated else norm_forward, module)
