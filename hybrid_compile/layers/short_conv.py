"""Short-conv layer op: a depthwise causal conv over the layer's conv-window pool — the whole
recurrent core of an LFM2 ``ShortConv`` mixer, and the conv half of a Mamba1 mixer.

``hybrid_compile::short_conv_layer`` takes the conv input (packed tokens) and returns the causal
conv of it (with an optional activation), reading the layer's conv-window pool from the forward
context. LFM2: the input is the gated ``B * x``, no activation, and the layer has no recurrent
state besides the window (its Mamba-pool spec is conv-only, ``state_shape == ()``). Mamba1: the
input is ``in_proj``'s x half, activation silu; ``x_proj`` / ``dt_proj`` run on the conv output
in the compiled piece after this op, then the scan in ``mamba1_ssm_layer`` (:mod:`.mamba1`).
Projections and gating products stay outside, in the compiled pieces (a layer op holds only
what touches pools and per-step metadata).

By forward mode (same dispatch as ``layers/gdn.py``):
- DECODE: ``causal_conv1d_update`` in place.
- EXTEND (prefill, chunked prefill, mixed prefill + decode): ``causal_conv1d_fn`` continuing from
  the request's window where it has one; prefix-cache checkpoints inside the extend when the step
  asks for them (``layers/tracking.py``: only the conv window, there is no chunk state).
- TARGET_VERIFY (speculative verify): ``causal_conv1d_update`` over each request's ``draft_len``
  tokens with ``disable_state_update``, writing the window after every step into the layer's
  intermediate buffer (``ForwardContext.intermediate_caches``) for the engine's commit; trailing
  requests of another length (bucket filler) are left at zero.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import ops as _ops  # noqa: F401  (registers the kernel ops)
from .context import ForwardMode, by_mixed_parts, require_forward_context
from .tracking import track_conv_checkpoints, tracking
from ..ops.registration import kernel_op

_kernels = torch.ops.hybrid_compile


def _check(x: torch.Tensor, conv_weight: torch.Tensor) -> None:
    if x.dim() != 2 or conv_weight.dim() != 2 or x.shape[1] != conv_weight.shape[0]:
        raise ValueError(
            f"short_conv_layer: x must be [tokens, D] and conv_weight [D, W] with the same D, got "
            f"{tuple(x.shape)} and {tuple(conv_weight.shape)}"
        )


@kernel_op("hybrid_compile::short_conv_layer", mutates_args=())
def short_conv_layer(
    x: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: Optional[torch.Tensor],
    layer_id: int,
    activation: Optional[str] = None,
) -> torch.Tensor:
    """Depthwise causal conv of one conv layer for the step's packed tokens.

    Args:
        x: ``[N, D]`` conv input (LFM2: ``B * x`` of the input projection).
        conv_weight: ``[D, W]`` depthwise conv weight (HF's ``conv.weight.squeeze(1)``).
        conv_bias: ``[D]`` or None.
        layer_id: HF layer index (key of ``ForwardContext.mamba_caches``); the conv window pool
            ``[S, W-1, D]`` of that layer is updated.
        activation: None (LFM2) or "silu" (Mamba1), applied to the conv output.

    Returns:
        ``[N, D]`` conv output in x's dtype (zeros for padding rows).
    """
    _check(x, conv_weight)
    split = by_mixed_parts(lambda x: short_conv_layer(x, conv_weight, conv_bias, layer_id, activation), x)
    if split is not None:  # a mixed step: its decode rows through the conv update
        return split
    ctx = require_forward_context("hybrid_compile::short_conv_layer")
    md = ctx.metadata
    conv_states = ctx.mamba_cache(layer_id)[0]

    if md.mode is ForwardMode.DECODE:
        return _kernels.causal_conv1d_update(
            x.unsqueeze(1), conv_states, conv_weight, conv_bias, activation, md.mamba_cache_indices, False, None,
        ).squeeze(1)
    if md.mode is ForwardMode.EXTEND:
        if tracking(md):  # prefix-cache checkpoint: the window at the tracked offset, before the conv
            track_conv_checkpoints(md, conv_states, x)
        return _kernels.causal_conv1d_fn(
            x, conv_weight, conv_bias, conv_states, md.query_start_loc, md.mamba_cache_indices,
            md.has_initial_state, activation,
        )
    if md.mode is ForwardMode.TARGET_VERIFY:
        verify = ctx.verify_batch(layer_id, "short_conv_layer")
        out = _kernels.causal_conv1d_update(
            verify.per_request(x), conv_states, conv_weight, conv_bias, activation, verify.cache_indices, True,
            verify.intermediates[0], verify.parents,
        )
        return verify.pad(out.reshape(verify.num_tokens, -1), x.shape[0])
    raise NotImplementedError(f"short_conv_layer: forward mode {md.mode.value} is not supported")


@short_conv_layer.register_fake
def _(x, conv_weight, conv_bias, layer_id, activation=None):
    _check(x, conv_weight)
    return x.new_zeros(x.shape)
