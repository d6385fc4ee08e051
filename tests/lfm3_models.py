"""Tiny random-weight LFM3 models for the parity tests (fp32, CPU, no download).

LFM3 = LFM2's gated short convs + attention layers of two kinds: sliding-window
(``"sliding_attention"``, default RoPE) and full (``"full_attention"``, proportional partial
RoPE), each with q/k norms and a per-head sigmoid output gate, and sandwich norms around every
block. Hidden 32, five layers (conv, sliding, conv, full, conv), vocab 128, conv width 3 and a
16-token window, so prompts of 40+ tokens reach past the window. The builder skips the test on a
transformers without ``Lfm3ForCausalLM`` (5.17 has none).
"""

from __future__ import annotations

import torch

from engine_models import INIT_STD, PAD_TOKEN_ID
from mamba2_models import require

VOCAB = 128
LAYER_TYPES = ("conv", "sliding_attention", "conv", "full_attention", "conv")
SLIDING_WINDOW = 16

__all__ = ["LAYER_TYPES", "SLIDING_WINDOW", "VOCAB", "build_lfm3"]


def build_lfm3(seed: int = 0, sliding_window: int = SLIDING_WINDOW):
    config = require("Lfm3Config")(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=len(LAYER_TYPES),
        layer_types=list(LAYER_TYPES), num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=512, conv_L_cache=3, sliding_window=sliding_window, initializer_range=INIT_STD,
        tie_word_embeddings=False, pad_token_id=PAD_TOKEN_ID, bos_token_id=None, eos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = require("Lfm3ForCausalLM")(config).float().eval()
    model.generation_config.do_sample = False
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    return model
