"""Tiny random-weight MiniMax models (``minimax``) for the tests: lightning attention and softmax
attention layers, MoE. :func:`require_minimax` skips a test with the reason where transformers has
no ``MiniMaxForCausalLM``."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

from engine_models import INIT_STD, PAD_TOKEN_ID

VOCAB = 128
HEADS, HEAD_DIM = 4, 16
LAYER_TYPES = ("linear_attention", "full_attention", "linear_attention", "full_attention")


def require_minimax() -> None:
    if not hasattr(transformers, "MiniMaxForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no MiniMaxForCausalLM")


def make_config(layer_types=LAYER_TYPES):
    return transformers.MiniMaxConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=len(layer_types),
        layer_types=list(layer_types), num_attention_heads=HEADS, num_key_value_heads=2, head_dim=HEAD_DIM,
        num_local_experts=4, num_experts_per_tok=2, block_size=32, initializer_range=INIT_STD,
        tie_word_embeddings=False, max_position_embeddings=512, pad_token_id=PAD_TOKEN_ID, bos_token_id=None,
        eos_token_id=None,
    )


@functools.lru_cache(maxsize=None)
def build_minimax(seed: int = 0, layer_types=LAYER_TYPES):
    """fp32, eval; same arguments -> same weights (and the same object: callers must not mutate it)."""
    require_minimax()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.MiniMaxForCausalLM(make_config(layer_types)).float().eval()
    model.generation_config.do_sample = False
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    return model
