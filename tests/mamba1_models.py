"""Tiny random-weight models of the Mamba1 families for the parity tests (fp32, CPU, no download).

Each builder takes a seed and returns an eval-mode HF ``*ForCausalLM`` (hidden 32, 3-4 layers,
vocab 128, state 8, conv width 4) keeping the family's features: FalconMamba's dt/B/C norms, Jamba's
attention layer, MoE block and weighted dt/B/C norms, Zamba's multi-head mixers and shared attention. ``pad/bos/eos`` are unset so greedy
generation runs its full length; ``initializer_range`` 0.1 gives varied greedy tokens.
"""

from __future__ import annotations

import torch

from mamba2_models import _TOKENS, VOCAB, require

__all__ = ["BUILDERS", "VOCAB", "build_falcon_mamba", "build_jamba", "build_mamba", "build_zamba"]


def _finish(model, seed: int):
    """Spread A_log and D away from HF's init (A = 1..N for every channel, D = 1) so the per-channel
    decay of the kernels is exercised."""
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "A_log") and (hasattr(m, "x_proj") or hasattr(m, "x_proj_weight")):
                m.A_log.add_(0.5 * torch.randn(m.A_log.shape, generator=g))
                m.D.add_(0.3 * torch.randn(m.D.shape, generator=g))
    return model.eval()


def build_mamba(seed: int = 0):
    config = require("MambaConfig")(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, state_size=8, expand=2, conv_kernel=4,
        time_step_rank=4, tie_word_embeddings=False, **_TOKENS,
    )
    torch.manual_seed(seed)
    return _finish(require("MambaForCausalLM")(config), seed)


def build_falcon_mamba(seed: int = 0):
    config = require("FalconMambaConfig")(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, state_size=8, expand=2, conv_kernel=4,
        time_step_rank=4, mixer_rms_eps=1e-6, tie_word_embeddings=False, **_TOKENS,
    )
    torch.manual_seed(seed)
    return _finish(require("FalconMambaForCausalLM")(config), seed)


def build_jamba(seed: int = 0, moe: bool = True):
    """``moe=False``: every feed-forward block dense (``num_experts=1``), for CUDA-graph tests
    (transformers' fp32 MoE fallback syncs with the host, which graph capture refuses)."""
    config = require("JambaConfig")(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_period=4, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1, num_experts=4 if moe else 1, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4,
        mamba_expand=2, mamba_dt_rank=4, max_position_embeddings=512, **_TOKENS,
    )
    torch.manual_seed(seed)
    return _finish(require("JambaForCausalLM")(config), seed)


def build_zamba(seed: int = 0):
    """Zamba (v1): multi-head Mamba1 layers (2 heads: B/C per head), shared attention at layers 2, 4."""
    config = require("ZambaConfig")(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=4, n_mamba_heads=2, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8,
        mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, max_position_embeddings=512, tie_word_embeddings=False,
        **_TOKENS,
    )
    torch.manual_seed(seed)
    model = require("ZambaForCausalLM")(config)
    g = torch.Generator().manual_seed(seed + 2000)
    with torch.no_grad():  # HF initialises x_proj_weight to zeros: give B, C and dt something to do
        for m in model.modules():
            if hasattr(m, "x_proj_weight"):
                m.x_proj_weight.copy_(0.2 * torch.randn(m.x_proj_weight.shape, generator=g))
    return _finish(model, seed)


BUILDERS = {"mamba": build_mamba, "falcon_mamba": build_falcon_mamba, "jamba": build_jamba, "zamba": build_zamba}
