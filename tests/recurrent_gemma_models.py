"""Tiny random-weight RecurrentGemma models for the parity tests (fp32, CPU, no download).

Hidden = lru_width 32, four heads (two KV heads), three layers (recurrent, local attention,
recurrent), vocab 128, conv width 3, a 16-token attention window (prompts of 40+ tokens reach past
it). HF's initialisation puts ``a_t`` in [0.9, 0.999]-ish; the builder spreads the recurrent gate's
bias so decays from fast to slow are all exercised. ``pad/bos/eos`` unset: greedy runs full length.
"""

from __future__ import annotations

import torch

from engine_models import PAD_TOKEN_ID, hf_greedy
from mamba2_models import require

VOCAB = 128
WINDOW = 16

__all__ = ["VOCAB", "WINDOW", "build_recurrent_gemma", "hf_greedy_fresh"]


def build_recurrent_gemma(seed: int = 0, window: int = WINDOW):
    config = require("RecurrentGemmaConfig")(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, lru_width=32, attention_window_size=window, conv1d_width=3,
        block_types=["recurrent", "attention", "recurrent"], pad_token_id=PAD_TOKEN_ID, bos_token_id=None,
        eos_token_id=None, tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = require("RecurrentGemmaForCausalLM")(config).float().eval()
        with torch.no_grad():
            for layer in model.model.layers:
                lru = getattr(layer.temporal_block, "rg_lru", None)
                if lru is not None:
                    lru.recurrent_gate_bias.add_(2.0 * torch.randn(lru.recurrent_gate_bias.shape))
    model.generation_config.do_sample = False
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    return model


def hf_greedy_fresh(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF's greedy ``generate`` from a clean module state. HF's recurrent blocks keep their conv
    window between calls and a one-token prompt takes the decode branch, which reads that stale
    window (a longer prompt overwrites it, and the RG-LRU resets at position 0): clear it first."""
    for layer in model.model.layers:
        block = layer.temporal_block
        if hasattr(block, "rg_lru"):
            block.conv1d_state = None
            block.rg_lru.recurrent_states = None
    return hf_greedy(model, prompt, max_new_tokens)
