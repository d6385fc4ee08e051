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
# the weights' std of the model served in bf16 (:func:`build_minimax` ``init_std``). At INIT_STD (0.2) the
# four layers amplify a relative perturbation about 50x (lightning attention's un-normalised q k^T v and the
# gated experts, each sublayer's output about twice the unit-RMS residual), so bf16 rounding alone moves
# the logits about 15%: HF's own bf16 forward picks tokens whose fp32 logit is up to 75% below the fp32 top
# on the TP GPU test's prompts, and a 2-rank bf16 engine (its other summation order) departs from the
# single-process bf16 engine as far. At 0.05 HF bf16 gives HF fp32's greedy tokens on those prompts.
BF16_INIT_STD = 0.05


def require_minimax() -> None:
    if not hasattr(transformers, "MiniMaxForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no MiniMaxForCausalLM")


def make_config(layer_types=LAYER_TYPES, init_std: float = INIT_STD):
    return transformers.MiniMaxConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=len(layer_types),
        layer_types=list(layer_types), num_attention_heads=HEADS, num_key_value_heads=2, head_dim=HEAD_DIM,
        num_local_experts=4, num_experts_per_tok=2, block_size=32, initializer_range=init_std,
        tie_word_embeddings=False, max_position_embeddings=512, pad_token_id=PAD_TOKEN_ID, bos_token_id=None,
        eos_token_id=None,
    )


@functools.lru_cache(maxsize=None)
def build_minimax(seed: int = 0, layer_types=LAYER_TYPES, init_std: float = INIT_STD):
    """fp32, eval; same arguments -> same weights (and the same object: callers must not mutate it).
    ``init_std``: :data:`BF16_INIT_STD` for a model served in bf16."""
    require_minimax()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.MiniMaxForCausalLM(make_config(layer_types, init_std)).float().eval()
    model.generation_config.do_sample = False
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    return model
