"""The softmax top-k MoE router as one op: ``moe_topk_softmax(logits, top_k, renormalize)``.

transformers' softmax routers (Qwen3-Next, Qwen3.5-MoE, Jamba, MiniMax, Granite-4) run, after the
router linear, a float softmax, ``torch.topk``, an optional renormalising sum + divide and a cast: a
few small kernels per MoE layer. This op does them in one (the Triton kernel of
:mod:`.triton.moe_router` on CUDA; plain torch on the CPU, the reference).

Semantics: ``p = softmax(logits.float(), -1)``; the ``top_k`` largest ``p`` of each row in descending
order; ties go to the lower expert index (a stable descending sort: deterministic and the same on the
CPU and the GPU; ``torch.topk`` does not promise an order among equal values, and on the CPU it
does not give the lower index first); with ``renormalize`` the weights are divided by their sum.
"""

from __future__ import annotations

import torch

from ._validation import FLOAT_DTYPES, check_tensor
from .registration import kernel_op

__all__ = ["moe_topk_softmax", "reference_moe_topk_softmax"]


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
