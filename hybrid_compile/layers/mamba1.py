"""Mamba1 layer op: the selective-scan core of a Mamba1 mixer (Mamba, FalconMamba, Jamba).

A Mamba1 mixer is ``in_proj`` -> (x, z) -> causal conv + silu over x -> ``x_proj`` -> (dt, B, C)
[-> RMS norms on dt / B / C: FalconMamba, Jamba] -> ``dt_proj`` (weight only) -> selective scan
(``A = -exp(A_log)`` per channel and state, ``D``, ``dt_proj.bias``, softplus, gate ``silu(z)``)
-> ``out_proj``. ``x_proj`` contracts over all channels of the conv output, so the conv and the
scan are two layer ops with the projections between them in a compiled piece: the conv is
``short_conv_layer`` (:mod:`.short_conv`, conv-window pool), the scan is
``hybrid_compile::mamba1_ssm_layer`` here (SSM-state pool ``[S, D_inner, N]``).

By forward mode:

- DECODE: ``mamba1_state_update`` in place (one token per request).
- EXTEND (prefill, chunked prefill, mixed prefill + decode): ``mamba1_selective_scan`` from the
  request's state where it has one; with prefix-cache tracking, the state at the tracked offset
  comes from the scan's chunk states (``layers/tracking.py``; the conv op tracks the window).
- TARGET_VERIFY: every verify request runs ``draft_len`` tokens through ``mamba1_state_update``
  with ``disable_state_update``, the state after every step going to the layer's intermediate
  buffer for the engine's commit; trailing filler tokens are left at zero. A draft tree
  (``verify.parents``) starts each token from its parent's intermediate state.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import ops as _ops  # noqa: F401  (registers the kernel ops)
from ..ops.fp8_cache import MAMBA1_STATE_SCALE_DIM
from .context import ForwardMode, by_mixed_parts, require_forward_context
from .tracking import track_ssm_checkpoints, tracking
from ..ops.registration import kernel_op

_kernels = torch.ops.hybrid_compile


def _check(x, dt, B, C, z):
    if x.dim() != 2 or dt.shape != x.shape or (z is not None and z.shape != x.shape):
        raise ValueError(
            f"mamba1_ssm_layer: x, dt and z must be [tokens, D_inner], got {tuple(x.shape)}, {tuple(dt.shape)}, "
            f"{None if z is None else tuple(z.shape)}"
        )
    if B.dim() != 3 or B.shape != C.shape or B.shape[0] != x.shape[0]:
        raise ValueError(f"mamba1_ssm_layer: B and C must be [tokens, G, N], got {tuple(B.shape)}, {tuple(C.shape)}")


@kernel_op("hybrid_compile::mamba1_ssm_layer", mutates_args=())
def mamba1_ssm_layer(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    z: Optional[torch.Tensor],
    A_log: torch.Tensor,
    D: Optional[torch.Tensor],
    dt_bias: Optional[torch.Tensor],
    layer_id: int,
    chunk_size: int,
    dt_softplus: bool = True,
) -> torch.Tensor:
    """Selective scan of one Mamba1 layer for the step's packed tokens.

    Args:
        x: ``[N_tok, D_inner]`` conv output (after silu). dt: ``[N_tok, D_inner]`` ``dt_proj`` output
            without its bias. B, C: ``[N_tok, G, N]`` (``G`` groups of channels:
            1 for Mamba1, the heads for Zamba). z: ``[N_tok, D_inner]`` gate (``y *= silu(z)``) or None.
        A_log: ``[D_inner, N]``; ``A = -exp(A_log)``. D: ``[D_inner]`` or None. dt_bias: ``[D_inner]``
            (``dt_proj.bias``) or None.
        layer_id: key of ``ForwardContext.mamba_caches``; the SSM pool ``[S, D_inner, N]`` of that
            layer is updated.
        chunk_size: the prefix-cache checkpoint alignment (``ModelLayout.ssm_chunk_size``).
        dt_softplus: ``dt = softplus(dt + dt_bias)`` (Mamba1); False: ``dt + dt_bias`` as given
            (RecurrentGemma's RG-LRU, :mod:`hybrid_compile.models.recurrent_gemma`).

    Returns:
        ``[N_tok, D_inner]`` gated SSM output in x's dtype (zeros for padding rows).
    """
    _check(x, dt, B, C, z)
    split = by_mixed_parts(
        lambda x, dt, B, C, z: mamba1_ssm_layer(x, dt, B, C, z, A_log, D, dt_bias, layer_id, chunk_size, dt_softplus),
        x, dt, B, C, z)
    if split is not None:  # a mixed step: its decode rows through the state update (no scan)
        return split
    ctx = require_forward_context("hybrid_compile::mamba1_ssm_layer")
    md = ctx.metadata
    _, ssm_states, ssm_scales = ctx.mamba_cache(layer_id)  # scales: an FP8 state pool's, else None
    n = x.shape[0]
    if md.mode is ForwardMode.DECODE:
        y = _kernels.mamba1_state_update(
            x.unsqueeze(1), dt.unsqueeze(1), A_log, B.unsqueeze(1), C.unsqueeze(1), D,
            None if z is None else z.unsqueeze(1), dt_bias, dt_softplus, ssm_states, md.mamba_cache_indices, False, None, True,
            ssm_scales, intermediate_scales=None, parent_indices=None,
        )
        return y.squeeze(1)
    if md.mode is ForwardMode.TARGET_VERIFY:
        verify = ctx.verify_batch(layer_id, "mamba1_ssm_layer")
        y = _kernels.mamba1_state_update(
            verify.per_request(x), verify.per_request(dt), A_log, verify.per_request(B), verify.per_request(C), D,
            None if z is None else verify.per_request(z), dt_bias, dt_softplus, ssm_states, verify.cache_indices, True,
            verify.intermediates[1], True, ssm_scales, verify.intermediates[2], verify.parents,
        )
        return verify.pad(y.reshape(verify.num_tokens, -1), n)
    if md.mode is ForwardMode.EXTEND:
        track = tracking(md)
        y, chunk_states = _kernels.mamba1_selective_scan(
            x, dt, A_log, B, C, D, z, dt_bias, dt_softplus, ssm_states, md.query_start_loc, md.mamba_cache_indices,
            md.has_initial_state, chunk_size, track, True, ssm_scales,
        )
        if track:
            track_ssm_checkpoints(md, ssm_states, chunk_states, chunk_size, ssm_scales, MAMBA1_STATE_SCALE_DIM)
        return y
    raise NotImplementedError(f"mamba1_ssm_layer: forward mode {md.mode.value} is not supported")


@mamba1_ssm_layer.register_fake
def _(x, dt, B, C, z, A_log, D, dt_bias, layer_id, chunk_size, dt_softplus=True):
    _check(x, dt, B, C, z)
    return x.new_zeros(x.shape)
