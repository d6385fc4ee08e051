"""RecurrentGemma (``recurrent_gemma``, Griffin): RG-LRU recurrent blocks and local attention.

Layers follow ``config.layers_block_type``: ``"sliding_attention"`` blocks are HF's attention module
through the registered attention function (its ``sliding_window`` = ``attention_window_size`` goes
to the attention op), ``"linear_attention"`` blocks (``"recurrent"`` in transformers 5.17) are
``RecurrentGemmaRecurrentBlock``::

    y = act(linear_y(h));  x = conv_1d(linear_x(h))                  # depthwise causal conv, bias
    i_t = sigmoid(x W_i + b_i);  r_t = sigmoid(x W_a + b_a)            # block-diagonal gates
    log a_t = -8 r_t softplus(Lambda)
    u_t = x_t i_t * (1 if position == 0 else sqrt(1 - a_t^2))
    h_t = a_t h_{t-1} + u_t;   out = linear_out(h * y)

The patched block keeps HF's projections, gates and products in the compiled pieces; the conv runs
in ``short_conv_layer`` (conv-window pool) and the recurrence ``h_t = a_t h_{t-1} + u_t`` in
``mamba1_ssm_layer`` (SSM pool ``[S, lru_width, 1]``), which is exactly that recurrence for a
Mamba1 scan with one state per channel (``N = 1``): ``dt = r_t`` without softplus,
``A = -8 softplus(Lambda)`` (so ``exp(dt A) = a_t``), ``B = C = 1`` and input ``u_t / r_t``
(``dt * x * B = u_t``). The Mamba1 ops thereby give the RG-LRU their prefill scan with chunk
states, decode and verify updates, Triton kernels and FP8 state, tested against the per-token
recurrence. ``r_t`` is floored at :data:`_MIN_RECURRENT_GATE` before the division: below it
``a_t`` rounds to 1 in fp32 either way and ``u_t / r_t`` stays finite. The reset at position 0
needs no gate: a request's first token always starts from a zero state.

Prefix-cache checkpoints: the scan has a state after every token, so the alignment is free; a
checkpoint is one ``lru_width`` vector (N = 1) plus a conv window per recurrent layer, as cheap as
LFM2's, so the alignment is LFM2's 16 tokens (finer prefix reuse; chunked prefill of any size >= 16
stays on the grid).
Tensor parallelism: ``distributed/plans.py::recurrent_gemma_plan`` (by RG-LRU and attention heads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import mamba1 as _mamba1_layer  # noqa: F401  (registers mamba1_ssm_layer)
from ..layers import short_conv as _short_conv_layer  # noqa: F401  (registers short_conv_layer)
from ..layers.context import get_forward_context
from ..memory import MambaLayerSpec
from ..ops.fp8_cache import MAMBA1_STATE_SCALE_DIM
from .base import ModelLayout, PatchHandle, install_attention, patch_forward
from .mamba2_common import attention_spec, find_attention_modules, max_positions

MODEL_TYPES = ("recurrent_gemma",)
RG_LRU_CHECKPOINT_ALIGN = 16
_MIN_RECURRENT_GATE = 1e-20


def _recurrent_blocks(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """``(RecurrentGemmaRecurrentBlock, HF layer index)``: the block keeps no index itself."""
    layers = model.model.layers
    # transformers >= 5.2x names these layers "linear_attention" in `config.layers_block_type`, 5.17
    # "recurrent": the block's own RG-LRU module says which they are in both
    blocks = [(layer.temporal_block, i) for i, layer in enumerate(layers) if hasattr(layer.temporal_block, "rg_lru")]
    for block, i in blocks:
        if not all(hasattr(block, a) for a in ("linear_x", "linear_y", "linear_out", "conv_1d", "rg_lru", "act_fn")):
            raise ValueError(f"{type(model).__name__}: layer {i} is not an RG-LRU recurrent block")
    return blocks


def _rg_lru_scan_inputs(lru: nn.Module, x: torch.Tensor, positions: torch.Tensor):
    """HF's RG-LRU gates over the packed tokens ``x [T, lru_width]`` -> the Mamba1 scan's
    ``(input u / r, dt = r, A_log)`` with ``exp(dt * -exp(A_log)) = a_t``."""
    T, width = x.shape
    heads = lru.num_attention_heads
    xh = x.reshape(T, heads, -1).transpose(0, 1)  # [heads, T, block_width]: per-head gate matmuls

    def gate(weight, bias):
        return torch.sigmoid(torch.baddbmm(bias[:, None, :], xh, weight).transpose(0, 1).reshape(T, width))

    input_gate = gate(lru.input_gate_weight, lru.input_gate_bias)
    r = gate(lru.recurrent_gate_weight, lru.recurrent_gate_bias)
    softplus = F.softplus(lru.recurrent_param)
    a_square = torch.exp(2 * (-8.0 * r * softplus))  # HF's order of operations: a_t^2 = exp(2 log a_t)
    multiplier = torch.where((positions == 0)[:, None], torch.ones_like(a_square), torch.sqrt(1 - a_square))
    u = (x * input_gate) * multiplier.to(x.dtype)  # HF's normalized_x, in the activations' dtype
    r = r.float().clamp(min=_MIN_RECURRENT_GATE)
    return u.float() / r, r, torch.log(8.0 * softplus.float())[:, None]  # A = -8 softplus(Lambda)


def make_recurrent_block_forward(layer_id: int):
    """The patched ``forward`` of the recurrent block of HF layer ``layer_id`` (its pools' key)."""

    def recurrent_block_forward(self, input_states, position_ids=None, *args, **kwargs):
        if get_forward_context() is None:
            return type(self).forward(self, input_states, position_ids, *args, **kwargs)
        h = input_states[0]  # the packed step is a batch of one row
        y_branch = self.act_fn(self.linear_y(h))
        x = torch.ops.hybrid_compile.short_conv_layer(
            self.linear_x(h), self.conv_1d.weight.squeeze(1), self.conv_1d.bias, layer_id
        )
        u, r, a_log = _rg_lru_scan_inputs(self.rg_lru, x, position_ids[0])
        ones = u.new_ones(u.shape[0], 1, 1)
        states = torch.ops.hybrid_compile.mamba1_ssm_layer(
            u, r, ones, ones, None, a_log, None, None, layer_id, RG_LRU_CHECKPOINT_ALIGN, False
        )
        return self.linear_out((states.to(x.dtype) * y_branch)[None]), None

    return recurrent_block_forward


def layout(model: nn.Module, *, kv_dtype: torch.dtype, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> ModelLayout:
    cfg = model.config
    mamba = []
    for block, i in _recurrent_blocks(model):
        width, kernel = (int(v) for v in (block.conv_1d.weight.shape[0], block.conv_1d.weight.shape[-1]))
        mamba.append(MambaLayerSpec(i, kernel, width, (width, 1), conv_dtype, ssm_dtype,
                                    ssm_scale_dim=MAMBA1_STATE_SCALE_DIM))
    attention = [attention_spec(a, int(a.layer_idx), kv_dtype) for a in find_attention_modules(model)]
    return ModelLayout(attention, mamba, int(cfg.vocab_size), max_positions(cfg), RG_LRU_CHECKPOINT_ALIGN)


def patch(model: nn.Module, handle: PatchHandle) -> None:
    blocks = _recurrent_blocks(model)
    install_attention(model, handle)
    for block, i in blocks:
        patch_forward(block, make_recurrent_block_forward(i), handle)


__all__ = ["MODEL_TYPES", "RG_LRU_CHECKPOINT_ALIGN", "layout", "patch"]
