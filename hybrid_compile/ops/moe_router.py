"""The MoE routers as one op each: ``moe_topk_softmax(logits, top_k, renormalize)`` and
``moe_topk_sigmoid_grouped(logits, bias, top_k, num_groups, topk_groups, renormalize, scaling)``.

transformers' softmax routers (Qwen3-Next, Qwen3.5-MoE, Jamba, MiniMax, Granite-4) run, after the
router linear, a float softmax, ``torch.topk``, an optional renormalising sum + divide and a cast: a
few small kernels per MoE layer. This op does them in one (the Triton kernel of
:mod:`.triton.moe_router` on CUDA; plain torch on the CPU, the reference).

Semantics: ``p = softmax(logits.float(), -1)``; the ``top_k`` largest ``p`` of each row in descending
order; ties go to the lower expert index (a stable descending sort: deterministic and the same on the
CPU and the GPU; ``torch.topk`` does not promise an order among equal values, and on the CPU it
does not give the lower index first); with ``renormalize`` the weights are divided by their sum.

The sigmoid group-limited router (DeepSeek-V3's, as transformers' Kimi-Linear and NemotronH routers
run it after their fp32 router linear; about ten small kernels a MoE layer there): ``s =
sigmoid(logits)``, ``c = s + bias`` (the expert-bias correction, used for the choice only); each of
``num_groups`` equal groups of experts scores the sum of its two largest ``c``; the ``topk_groups``
best groups stay; the ``top_k`` largest ``c`` among their experts are chosen (descending, ties to the
lower index, as above), weighted by their ``s``, divided by ``sum + 1e-20`` with ``renormalize``, and
multiplied by ``scaling``.
"""

from __future__ import annotations

import torch

from ._validation import FLOAT_DTYPES, check_tensor
from .registration import kernel_op

__all__ = ["moe_topk_sigmoid_grouped", "moe_topk_softmax", "reference_moe_topk_sigmoid_grouped",
           "reference_moe_topk_softmax"]


def _check_router(logits: torch.Tensor, top_k: int) -> None:
    op = "moe_topk_softmax"
    check_tensor(op, "logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"{op}: `top_k` must lie in [1, {logits.shape[1]}] (the number of experts), got {top_k}")


@kernel_op("hybrid_compile::moe_topk_softmax", mutates_args=())
def moe_topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts, then the top-k experts of each token (see the module docstring).

    Args:
        logits: ``[T, E]`` router logits, fp32/bf16/fp16 (any strides).
        top_k: experts per token, ``1 <= top_k <= E``.
        renormalize: divide the ``top_k`` weights of a token by their sum.

    Returns:
        ``(weights [T, top_k] fp32, indices [T, top_k] int64)``, each row's weights descending.
    """
    _check_router(logits, top_k)
    return reference_moe_topk_softmax(logits, top_k, renormalize)


def reference_moe_topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool):
    """The CPU implementation in plain torch: softmax in fp32, a stable descending sort, the first ``top_k``."""
    probs = torch.softmax(logits.float(), dim=-1)
    values, indices = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, indices = values[:, :top_k].contiguous(), indices[:, :top_k].contiguous()
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, indices


@moe_topk_softmax.register_fake
def _(logits, top_k, renormalize):
    _check_router(logits, top_k)
    shape = (logits.shape[0], top_k)
    return (logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int64))


def _check_grouped_router(logits: torch.Tensor, bias: torch.Tensor, top_k: int, num_groups: int,
                          topk_groups: int) -> None:
    op = "moe_topk_sigmoid_grouped"
    check_tensor(op, "logits", logits, ndim=2, dtypes=(torch.float32,))
    experts = logits.shape[1]
    check_tensor(op, "bias", bias, ndim=1, dtypes=(torch.float32,))
    if bias.device != logits.device:
        raise ValueError(f"{op}: `bias` is on {bias.device}, `logits` on {logits.device}")
    if bias.shape[0] != experts:
        raise ValueError(f"{op}: `bias` must have one value per expert ({experts}), got {bias.shape[0]}")
    if num_groups < 1 or experts % num_groups or not 1 <= topk_groups <= num_groups:
        raise ValueError(f"{op}: `num_groups` must divide the {experts} experts and `topk_groups` lie in "
                         f"[1, num_groups]; got num_groups={num_groups}, topk_groups={topk_groups}")
    per_group = experts // num_groups
    if num_groups > 1 and per_group < 2:
        raise ValueError(f"{op}: a group scores its two best experts: groups of {per_group} are too small")
    if not 1 <= top_k <= topk_groups * per_group:
        raise ValueError(f"{op}: `top_k` must lie in [1, {topk_groups * per_group}] (the experts of the kept "
                         f"groups), got {top_k}")


@kernel_op("hybrid_compile::moe_topk_sigmoid_grouped", mutates_args=())
def moe_topk_sigmoid_grouped(logits: torch.Tensor, bias: torch.Tensor, top_k: int, num_groups: int,
                             topk_groups: int, renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid scores, bias-corrected group-limited top-k (see the module docstring).

    Args:
        logits: ``[T, E]`` fp32 router logits (any strides).
        bias: ``[E]`` fp32 expert-bias correction (added for the choice only).
        top_k, num_groups, topk_groups: experts per token, expert groups, groups kept per token.
        renormalize, scaling: divide the weights by their sum (+ 1e-20), then multiply by ``scaling``.

    Returns:
        ``(weights [T, top_k] fp32, indices [T, top_k] int64)``, by descending corrected score.
    """
    _check_grouped_router(logits, bias, top_k, num_groups, topk_groups)
    return reference_moe_topk_sigmoid_grouped(logits, bias, top_k, num_groups, topk_groups, renormalize, scaling)


def reference_moe_topk_sigmoid_grouped(logits, bias, top_k, num_groups, topk_groups, renormalize, scaling):
    """The CPU implementation in plain torch (stable descending sorts for every choice)."""
    scores = torch.sigmoid(logits.float())
    choice = scores + bias
    t, experts = choice.shape
    if num_groups > 1:
        per_group = choice.view(t, num_groups, experts // num_groups)
        group_scores = torch.sort(per_group, dim=-1, descending=True, stable=True)[0][..., :2].sum(-1)
        kept = torch.sort(group_scores, dim=-1, descending=True, stable=True)[1][:, :topk_groups]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(~mask.repeat_interleave(experts // num_groups, dim=1), float("-inf"))
    indices = torch.sort(choice, dim=-1, descending=True, stable=True)[1][:, :top_k].contiguous()
    weights = scores.gather(1, indices)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return (weights * scaling).contiguous(), indices


@moe_topk_sigmoid_grouped.register_fake
def _(logits, bias, top_k, num_groups, topk_groups, renormalize, scaling):
    _check_grouped_router(logits, bias, top_k, num_groups, topk_groups)
    shape = (logits.shape[0], top_k)
    return (logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int64))
