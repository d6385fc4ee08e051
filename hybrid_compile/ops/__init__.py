"""Kernel ops: torch.library ops under ``torch.ops.hybrid_compile``, each defined with
:func:`.registration.kernel_op` (like ``torch.library.custom_op``, with less host cost per call).

Each op has a schema, a plain-torch implementation (the CPU path), a Triton implementation
registered as its CUDA kernel (:mod:`.triton`), a fake implementation for tracing, argument validation in both, and a docstring
with shapes, dtypes and mutations. :mod:`.reference` holds the independent per-token
references the ops are tested against.

===============================================  ==========================================
op                                               module
===============================================  ==========================================
causal_conv1d_fn / causal_conv1d_update          :mod:`.conv1d` (+ track_conv_window)
gdn_gating / chunk_gated_delta_rule              :mod:`.gdn` (g per head, or per channel: KDA)
fused_sigmoid_gating_delta_rule_update           :mod:`.gdn` (decode)
fused_recurrent_gated_delta_rule_update          :mod:`.gdn` (speculative verify)
chunk_lightning_attention /                      :mod:`.lightning` (MiniMax lightning attention)
recurrent_lightning_attention_update
ssd_chunk_scan / selective_state_update          :mod:`.mamba2`
mamba1_selective_scan / mamba1_state_update      :mod:`.mamba1`
gated_rms_norm                                   :mod:`.norm`
skinny_mm                                        :mod:`.linear`
fp8_quantize_per_token_group / fp8_block_linear  :mod:`.fp8` (block-FP8 weights)
fp8_grouped_linear                               :mod:`.fp8` (MoE experts)
moe_grouped_linear / moe_combine_top_k /         :mod:`.moe` (MoE experts, float weights; the routing sort)
moe_sort_pairs
moe_topk_softmax / moe_topk_sigmoid_grouped      :mod:`.moe_router` (the softmax top-k and the sigmoid
                                                 group-limited MoE routers)
store_kv_cache / paged_attention_extend /        :mod:`.attention`
paged_attention_decode / merge_attention_states
copy_state_slots / commit_speculative_state /    :mod:`.state`
track_chunk_states
uniform_step_metadata                            :mod:`.metadata` (engine step metadata)
argmax_rows                                      :mod:`.sampling` (greedy tokens)
===============================================  ==========================================
"""

from . import (
    attention, conv1d, fp8, gdn, lightning, linear, mamba1, mamba2, metadata, moe, moe_router, norm, sampling, state,
)
from .triton import attention as _triton_attention  # noqa: F401  (registers the CUDA kernels)
from .triton import conv1d as _triton_conv1d  # noqa: F401
from .triton import fp8 as _triton_fp8  # noqa: F401
from .triton import gdn as _triton_gdn  # noqa: F401
from .triton import gdn_gating as _triton_gdn_gating  # noqa: F401
from .triton import lightning as _triton_lightning  # noqa: F401
from .triton import linear as _triton_linear  # noqa: F401
from .triton import mamba1 as _triton_mamba1  # noqa: F401
from .triton import mamba2 as _triton_mamba2  # noqa: F401
from .triton import norm as _triton_norm  # noqa: F401
from .triton import metadata as _triton_metadata  # noqa: F401
from .triton import moe as _triton_moe  # noqa: F401
from .triton import moe_router as _triton_moe_router  # noqa: F401
from .triton import sampling as _triton_sampling  # noqa: F401
from .triton import state as _triton_state  # noqa: F401
from ._validation import debug_checks_enabled, set_debug_checks
from .gdn import GDN_CHUNK_SIZE

#: Every kernel op's name in the ``hybrid_compile`` namespace.
KERNEL_OPS = (
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "track_conv_window",
    "gdn_gating",
    "chunk_gated_delta_rule",
    "fused_sigmoid_gating_delta_rule_update",
    "fused_recurrent_gated_delta_rule_update",
    "chunk_lightning_attention",
    "recurrent_lightning_attention_update",
    "ssd_chunk_scan",
    "selective_state_update",
    "mamba1_selective_scan",
    "mamba1_state_update",
    "gated_rms_norm",
    "skinny_mm",
    "fp8_quantize_per_token_group",
    "fp8_block_linear",
    "fp8_grouped_linear",
    "moe_grouped_linear",
    "moe_combine_top_k",
    "moe_sort_pairs",
    "moe_topk_softmax",
    "moe_topk_sigmoid_grouped",
    "store_kv_cache",
    "paged_attention_extend",
    "paged_attention_decode",
    "merge_attention_states",
    "copy_state_slots",
    "commit_speculative_state",
    "track_chunk_states",
    "uniform_step_metadata",
    "argmax_rows",
)

__all__ = [
    "KERNEL_OPS",
    "GDN_CHUNK_SIZE",
    "attention",
    "conv1d",
    "debug_checks_enabled",
    "fp8",
    "gdn",
    "lightning",
    "linear",
    "mamba1",
    "mamba2",
    "moe",
    "moe_router",
    "norm",
    "set_debug_checks",
    "state",
]
