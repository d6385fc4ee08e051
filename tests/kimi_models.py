"""Tiny random-weight Kimi-Linear models (``kimi_linear``) for the tests: KDA and MLA layers, MoE.

transformers has ``KimiLinearForCausalLM`` since 5.17; :func:`require_kimi_linear` skips a test
with the reason where it is missing.
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

from engine_models import INIT_STD, PAD_TOKEN_ID

VOCAB = 128
KV_RANK, ROPE, NOPE, V_DIM, HEADS = 16, 8, 16, 16, 4
LAYER_TYPES = ("linear_attention", "full_attention", "linear_attention", "full_attention")


def require_kimi_linear() -> None:
    if not hasattr(transformers, "KimiLinearForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no KimiLinearForCausalLM (added in 5.17)")


def make_config(q_lora_rank=None, layer_types=LAYER_TYPES, mla_dims=(KV_RANK, ROPE), moe=True):
    """``mla_dims``: (kv_lora_rank, qk_rope_head_dim); (512, 64) are Kimi-Linear-48B's. ``moe``:
    MoE blocks after the first layer (as the checkpoint), else dense MLPs only."""
    n = len(layer_types)
    return transformers.KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=n, layer_types=list(layer_types), mlp_layer_types=["dense"] + ["sparse" if moe else "dense"] * (n - 1),
        num_attention_heads=HEADS, num_key_value_heads=HEADS, num_local_experts=4, num_experts_per_tok=2,
        num_shared_experts=1, n_group=1, topk_group=1, q_lora_rank=q_lora_rank, kv_lora_rank=mla_dims[0],
        qk_rope_head_dim=mla_dims[1], qk_nope_head_dim=NOPE, v_head_dim=V_DIM, linear_head_dim=16, linear_num_heads=2,
        linear_conv_kernel_dim=4, initializer_range=INIT_STD, tie_word_embeddings=False,
        max_position_embeddings=512, pad_token_id=PAD_TOKEN_ID, bos_token_id=None, eos_token_id=None,
    )


@functools.lru_cache(maxsize=None)
def build_kimi_linear(seed: int = 0, q_lora_rank=None, layer_types=LAYER_TYPES, mla_dims=(KV_RANK, ROPE), moe=True):
    """fp32, eval; same arguments -> same weights (and the same object: callers must not mutate it)."""
    require_kimi_linear()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.KimiLinearForCausalLM(make_config(q_lora_rank, layer_types, mla_dims, moe)).float().eval()
    model.generation_config.do_sample = False
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    return model
