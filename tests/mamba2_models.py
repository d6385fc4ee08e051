"""Tiny random-weight models of the Mamba2 families for the parity tests (fp32, CPU, no download).

Each builder takes a seed and returns an eval-mode HF ``*ForCausalLM``. The configs are small
(hidden 32, 3-6 layers, vocab 128) but keep every structural feature of the family: several
heads per group of B/C, a chunk size that does not divide the chunked-prefill size, attention
layers where the family has them, and the family's extras (Falcon-H1 µP multipliers, NemotronH
MoE blocks and dt clamp, Zamba2 shared attention blocks with adapters). ``pad/bos/eos`` are
unset so greedy generation runs its full length.
"""

from __future__ import annotations

import pytest
import torch
import transformers

VOCAB = 128
# initializer_range 0.1 (HF default 0.02): larger random weights give varied greedy tokens with clear
# argmax margins instead of one repeated token
_TOKENS = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None, initializer_range=0.1)


def require(class_name: str):
    """The transformers class, or skip the test when this transformers version lacks it."""
    cls = getattr(transformers, class_name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {class_name}")
    return cls


def _finish(model, seed: int, dt_bias: float | None = None):
    model = model.eval()
    if dt_bias is not None:  # push some softplus(dt) below time_step_min so the clamp matters
        g = torch.Generator().manual_seed(seed + 1000)
        with torch.no_grad():
            for m in model.modules():
                if hasattr(m, "dt_bias") and hasattr(m, "A_log"):
                    m.dt_bias.copy_(dt_bias + 0.5 * torch.randn(m.dt_bias.shape, generator=g))
    return model


def build_mamba2(seed: int = 0):
    config = require("Mamba2Config")(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_heads=8, head_dim=8, expand=2, n_groups=2,
        state_size=16, conv_kernel=4, chunk_size=16, **_TOKENS,
    )
    torch.manual_seed(seed)
    return _finish(require("Mamba2ForCausalLM")(config), seed)


def build_nemotron_h(seed: int = 0):
    config = require("NemotronHConfig")(
        vocab_size=VOCAB, hidden_size=32,
        layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
        mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
        time_step_min=0.3, max_position_embeddings=512, **_TOKENS,
    )
    torch.manual_seed(seed)
    return _finish(require("NemotronHForCausalLM")(config), seed, dt_bias=-1.5)


def build_falcon_h1(seed: int = 0, rms_norm: bool = False):
    config = require("FalconH1Config")(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16, mamba_rms_norm=rms_norm,
        mamba_norm_before_gate=False, max_position_embeddings=512,
        # µP multipliers (seed 000 "Example: Falcon H1"), all different from 1
        embedding_multiplier=2.0, lm_head_multiplier=0.5, key_multiplier=1.5, attention_in_multiplier=0.8,
        attention_out_multiplier=1.2, ssm_in_multiplier=1.3, ssm_out_multiplier=0.7,
        ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 1.05], mlp_multipliers=[1.1, 0.9], **_TOKENS,
    )
    torch.manual_seed(seed)
    return _finish(require("FalconH1ForCausalLM")(config), seed)


def build_bamba(seed: int = 0):
    config = require("BambaConfig")(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, attn_layer_indices=[1],
        num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, max_position_embeddings=512,
        **_TOKENS,
    )
    torch.manual_seed(seed)
    return _finish(require("BambaForCausalLM")(config), seed)


def build_granitemoehybrid(seed: int = 0):
    config = require("GraniteMoeHybridConfig")(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, num_local_experts=4,
        num_experts_per_tok=2, shared_intermediate_size=32, position_embedding_type="rope",
        embedding_multiplier=2.0, logits_scaling=1.5, residual_multiplier=0.8, attention_multiplier=0.3,
        max_position_embeddings=512, **_TOKENS,
    )
    torch.manual_seed(seed)
    return _finish(require("GraniteMoeHybridForCausalLM")(config), seed)


def build_zamba2(seed: int = 0):
    config = require("Zamba2Config")(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=6,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "mamba", "hybrid"],
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2, n_mamba_heads=8, chunk_size=16,
        num_attention_heads=4, num_key_value_heads=4, intermediate_size=64, num_mem_blocks=2,
        use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True, max_position_embeddings=512,
        **_TOKENS,
    )
    torch.manual_seed(seed)
    return _finish(require("Zamba2ForCausalLM")(config), seed)


BUILDERS = {
    "mamba2": build_mamba2,
    "nemotron_h": build_nemotron_h,
    "falcon_h1": build_falcon_h1,
    "bamba": build_bamba,
    "granitemoehybrid": build_granitemoehybrid,
    "zamba2": build_zamba2,
}
