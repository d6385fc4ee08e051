"""Mamba2 layer op: the conv + SSD core of a Mamba2-style mixer (Mamba2, NemotronH, Falcon-H1,
Bamba, GraniteMoeHybrid, Zamba2).

``hybrid_compile::mamba2_layer`` takes the mixer's projected ``xBC`` channels (before the causal
conv) and raw ``dt``, and returns the SSM output ``y`` (``D`` skip included, gate not applied),
reading the layer's conv window and SSM state pools from the forward context. ``in_proj``, the
gated RMSNorm and ``out_proj`` stay outside as HF's modules, in the compiled (graph-captured)
pieces: the op holds only what touches pools and per-step metadata.

By forward mode:

- DECODE: ``causal_conv1d_update`` + ``selective_state_update`` in place (one token per request).
- EXTEND (prefill, chunked prefill, mixed prefill + decode): ``causal_conv1d_fn`` +
  ``ssd_chunk_scan`` with initial states where the request has them; prefix-cache checkpoints
  inside the extend when the step asks for them (``layers/tracking.py``).
- TARGET_VERIFY (speculative verify): every request runs ``draft_len`` tokens (its last accepted
  token + the drafts) through ``causal_conv1d_update`` + ``selective_state_update`` with
  ``disable_state_update``, the state after every step going to the layer's intermediate
  buffers (``ForwardContext.intermediate_caches``, rows = batch rows); the engine commits the
  state of the last accepted step afterwards (``commit_speculative_state``). Trailing requests
  of another length (filler that pads a step to a token-count bucket) are left at zero.

``dt`` limits: transformers' Mamba2 mixers clamp the discretised ``dt`` to ``time_step_limit``
in their chunked path (the prompt, processed in one forward by ``generate``) and not in their
single-token recurrent path (every generated token). With ``clamp_decode_dt=False`` (what every
HF family does) the op reproduces that per token, whatever the batch mode or chunking: a token
is clamped iff its position is below its request's prompt length (``metadata.prompt_lens``;
without it, tokens of a one-token step on top of cached state count as generated). A DECODE step
holds generated tokens only (``Request.decoding``), so it clamps none, with no per-token mask.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from .. import ops as _ops  # noqa: F401  (registers the kernel ops)
from .context import ForwardMode, by_mixed_parts, require_forward_context
from ..ops.fp8_cache import MAMBA2_STATE_SCALE_DIM
from .tracking import track_conv_checkpoints, track_ssm_checkpoints, tracking
from ..ops.registration import kernel_op

_kernels = torch.ops.hybrid_compile


def _check(xBC, dt, num_heads, head_dim, n_groups, state_size):
    conv_dim = num_heads * head_dim + 2 * n_groups * state_size
    if xBC.dim() != 2 or xBC.shape[1] != conv_dim:
        raise ValueError(
            f"mamba2_layer: xBC must be [tokens, {conv_dim}] (x, B, C channels), got {tuple(xBC.shape)}"
        )
    if dt.dim() != 2 or dt.shape[0] != xBC.shape[0] or dt.shape[1] != num_heads:
        raise ValueError(f"mamba2_layer: dt must be [tokens, {num_heads}], got {tuple(dt.shape)}")
    if n_groups <= 0 or num_heads % n_groups != 0:
        raise ValueError(f"mamba2_layer: num_heads ({num_heads}) must be a multiple of n_groups ({n_groups})")


def _limits_trivial(dt_min: float, dt_max: float) -> bool:
    """softplus(dt) >= 0, so a clamp to [<= 0, inf] changes nothing."""
    return dt_min <= 0.0 and math.isinf(dt_max) and dt_max > 0


def _prompt_token_mask(md, n: int) -> torch.Tensor:
    """``[N]`` bool: the token is a prompt token (HF processes it in the clamping chunked path)."""
    qsl = md.query_start_loc.to(torch.int64)
    lens = qsl[1:] - qsl[:-1]
    if md.prompt_lens is not None:
        limit = torch.repeat_interleave(md.prompt_lens.to(torch.int64), lens, output_size=n)
        return md.positions.to(torch.int64) < limit
    generated = (lens == 1) & md.has_initial_state
    return ~torch.repeat_interleave(generated, lens, output_size=n)


def _discretize_dt(dt, dt_bias, dt_min, dt_max, clamp):
    """softplus(dt + dt_bias), clamped to [dt_min, dt_max] where ``clamp`` (fp32)."""
    d = dt.float()
    if dt_bias is not None:
        d = d + dt_bias.float()
    d = F.softplus(d)
    return torch.where(clamp[:, None], torch.clamp(d, min=dt_min, max=dt_max), d)


@kernel_op("hybrid_compile::mamba2_layer", mutates_args=())
def mamba2_layer(
    xBC: torch.Tensor,
    dt: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: Optional[torch.Tensor],
    A_log: torch.Tensor,
    D: Optional[torch.Tensor],
    dt_bias: Optional[torch.Tensor],
    layer_id: int,
    num_heads: int,
    head_dim: int,
    n_groups: int,
    state_size: int,
    activation: str,
    chunk_size: int,
    dt_min: float,
    dt_max: float,
    clamp_decode_dt: bool,
) -> torch.Tensor:
    """Causal conv + selective scan of one Mamba2 layer for the step's packed tokens.

    Args:
        xBC: ``[N, H*P + 2*G*S]`` projected x, B, C channels before the causal conv.
        dt: ``[N, H]`` raw time steps (before ``dt_bias``, softplus and the clamp).
        conv_weight: ``[conv_dim, W]`` depthwise conv weight (HF's ``conv1d.weight.squeeze(1)``).
        conv_bias: ``[conv_dim]`` or None.
        A_log: ``[H]``; ``A = -exp(A_log)``.
        D: ``[H]`` skip coefficient or None. dt_bias: ``[H]`` or None.
        layer_id: key of ``ForwardContext.mamba_caches``; the conv window pool
            ``[S, W-1, conv_dim]`` and SSM pool ``[S, H, P, S_state]`` of that layer are updated.
        num_heads, head_dim, n_groups, state_size: H, P, G, N of the mixer.
        activation: the conv activation ("silu" or "identity"/"none").
        chunk_size: SSD chunk length (the model's ``chunk_size``).
        dt_min, dt_max: the chunked path's ``time_step_limit``.
        clamp_decode_dt: also clamp ``dt`` of generated tokens (HF's mixers do not; see the
            module docstring).

    Returns:
        ``[N, H, P]`` SSM output in xBC's dtype (zeros for padding rows).
    """
    _check(xBC, dt, num_heads, head_dim, n_groups, state_size)
    split = by_mixed_parts(
        lambda x, t: mamba2_layer(x, t, conv_weight, conv_bias, A_log, D, dt_bias, layer_id, num_heads, head_dim, n_groups,
                                  state_size, activation, chunk_size, dt_min, dt_max, clamp_decode_dt), xBC, dt)
    if split is not None:  # a mixed step: its decode rows through the decode path (no chunked scan)
        return split
    ctx = require_forward_context("hybrid_compile::mamba2_layer")
    md = ctx.metadata
    conv_states, ssm_states, ssm_scales = ctx.mamba_cache(layer_id)
    n = xBC.shape[0]
    x_dim = num_heads * head_dim
    bc_dim = n_groups * state_size
    if md.mode not in (ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY):
        raise NotImplementedError(f"mamba2_layer: forward mode {md.mode.value} is not supported")

    # dt arguments of the scan: raw dt + bias + softplus + one clamp for all tokens, or (when HF
    # would clamp only some of them) dt discretised here per token. DECODE steps hold generated
    # tokens only (the scheduler prefills a lone last prompt token), so none of them is clamped.
    bias, softplus, lo, hi = dt_bias, True, dt_min, dt_max
    if md.mode is ForwardMode.DECODE and not clamp_decode_dt:
        lo, hi = 0.0, math.inf
    elif not clamp_decode_dt and not _limits_trivial(dt_min, dt_max):
        dt = _discretize_dt(dt, dt_bias, dt_min, dt_max, _prompt_token_mask(md, n))
        bias, softplus, lo, hi = None, False, 0.0, math.inf

    if md.mode is ForwardMode.DECODE:
        conv = _kernels.causal_conv1d_update(
            xBC.unsqueeze(1), conv_states, conv_weight, conv_bias, activation, md.mamba_cache_indices, False, None,
        )  # [N, 1, conv_dim]
        x, B, C = torch.split(conv, [x_dim, bc_dim, bc_dim], dim=-1)
        y = _kernels.selective_state_update(  # A = -exp(A_log) in the kernel (A_is_log): no glue kernels
            x.reshape(n, 1, num_heads, head_dim), dt.unsqueeze(1), A_log,
            B.reshape(n, 1, n_groups, state_size), C.reshape(n, 1, n_groups, state_size),
            D, None, bias, softplus, lo, hi, ssm_states, md.mamba_cache_indices, False, None, True, ssm_scales, intermediate_scales=None, parent_indices=None,
        )
        return y.reshape(n, num_heads, head_dim)

    if md.mode is ForwardMode.TARGET_VERIFY:
        verify = ctx.verify_batch(layer_id, "mamba2_layer")
        rows, steps = verify.rows, verify.steps
        inter_conv, inter_ssm, inter_scales = verify.intermediates
        conv = _kernels.causal_conv1d_update(
            verify.per_request(xBC), conv_states, conv_weight, conv_bias, activation, verify.cache_indices, True,
            inter_conv, verify.parents,
        )  # [B, L, conv_dim]
        x, B, C = torch.split(conv, [x_dim, bc_dim, bc_dim], dim=-1)
        y = _kernels.selective_state_update(
            x.reshape(rows, steps, num_heads, head_dim), verify.per_request(dt), A_log,
            B.reshape(rows, steps, n_groups, state_size), C.reshape(rows, steps, n_groups, state_size),
            D, None, bias, softplus, lo, hi, ssm_states, verify.cache_indices, True, inter_ssm, True,
            ssm_scales, inter_scales, verify.parents,
        )
        return verify.pad(y.reshape(verify.num_tokens, num_heads, head_dim), n)

    track = tracking(md)  # prefix-cache checkpoints inside the extend (layers/tracking.py)
    if track:
        track_conv_checkpoints(md, conv_states, xBC)
    A = -torch.exp(A_log.float())
    conv = _kernels.causal_conv1d_fn(
        xBC, conv_weight, conv_bias, conv_states, md.query_start_loc, md.mamba_cache_indices,
        md.has_initial_state, activation,
    )
    x, B, C = torch.split(conv, [x_dim, bc_dim, bc_dim], dim=-1)
    y, chunk_states = _kernels.ssd_chunk_scan(
        x.reshape(n, num_heads, head_dim), dt, A,
        B.reshape(n, n_groups, state_size), C.reshape(n, n_groups, state_size),
        D, None, bias, softplus, lo, hi, ssm_states, md.query_start_loc, md.mamba_cache_indices,
        md.has_initial_state, chunk_size, track, ssm_scales,
    )
    if track:
        track_ssm_checkpoints(md, ssm_states, chunk_states, chunk_size, ssm_scales, MAMBA2_STATE_SCALE_DIM)
    return y


@mamba2_layer.register_fake
def _(xBC, dt, conv_weight, conv_bias, A_log, D, dt_bias, layer_id, num_heads, head_dim, n_groups, state_size,
      activation, chunk_size, dt_min, dt_max, clamp_decode_dt):
    _check(xBC, dt, num_heads, head_dim, n_groups, state_size)
    return xBC.new_zeros(xBC.shape[0], num_heads, head_dim)
