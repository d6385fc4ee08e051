"""Reference models of the benchmarks: random-weight Hugging Face hybrid models of ~1.9 B parameters.

- :func:`build_qwen3_next_reference`: the reference ``Qwen3NextForCausalLM`` of the compile issue
  (vocab 151936, hidden 2048, 24 layers ``[linear_attention x3, full_attention] x6``, dense MLP
  5632 in every layer, attention 16 q / 2 kv heads of dim 256, GDN 16 key / 32 value heads of
  dim 128, conv kernel 4, tied embeddings: 1.912 B parameters).
- :func:`build_nemotron_h_reference`: a NemotronH of similar size (hidden 2048, pattern
  ``M-M-M-*-`` x6 with relu2 MLPs of 8192, Mamba2 64 heads x 64, state 128, 8 groups, chunk 128,
  attention 16 q / 2 kv heads of dim 128, vocab 131072, tied embeddings: 1.930 B parameters).

Weights are drawn by transformers' own initialisation under ``torch.manual_seed(seed)`` (same
seed, dtype and device -> same weights), directly on ``device`` in ``dtype``. ``tiny=True``
keeps every structural feature (layer pattern, GQA on both layer kinds, tied embeddings) at toy
sizes for CPU smoke runs. No generation defaults leak in: no EOS, greedy.

Also the small helpers every benchmark shares: :func:`sync_device`, :func:`random_token_prompts`.
"""

from __future__ import annotations

import torch
import transformers

QWEN3_NEXT_PARAMS = 1.912e9
NEMOTRON_H_PARAMS = 1.930e9


def qwen3_next_reference_config(tiny: bool = False) -> "transformers.Qwen3NextConfig":
    repeats = 1 if tiny else 6
    n_layers = 4 * repeats
    sizes = (
        dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=16)
        if tiny else
        dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
             num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
             linear_key_head_dim=128, linear_value_head_dim=128)
    )
    return transformers.Qwen3NextConfig(
        **sizes,
        num_hidden_layers=n_layers,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * repeats,
        num_experts=0,
        mlp_only_layers=list(range(n_layers)),
        linear_conv_kernel_dim=4,
        tie_word_embeddings=True,
        max_position_embeddings=65536 if not tiny else 8192,
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )


def nemotron_h_reference_config(tiny: bool = False) -> "transformers.NemotronHConfig":
    sizes = (
        dict(vocab_size=512, hidden_size=64, intermediate_size=128, mamba_num_heads=8, mamba_head_dim=16,
             ssm_state_size=16, n_groups=2, chunk_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        if tiny else
        dict(vocab_size=131072, hidden_size=2048, intermediate_size=8192, mamba_num_heads=64, mamba_head_dim=64,
             ssm_state_size=128, n_groups=8, chunk_size=128, num_attention_heads=16, num_key_value_heads=2,
             head_dim=128)
    )
    return transformers.NemotronHConfig(
        **sizes,
        # "M" Mamba2, "-" MLP, "*" attention (converted to layers_block_type by newer transformers)
        hybrid_override_pattern="M-M-M-*-" * (1 if tiny else 6),
        conv_kernel=4,
        tie_word_embeddings=True,
        max_position_embeddings=65536 if not tiny else 8192,
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )


def _build(model_class, config, dtype: torch.dtype, device, seed: int):
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device(device):
            model = model_class._from_config(config, dtype=dtype)
    model = model.eval()
    model.generation_config.do_sample = False
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


def _check_params(model, expected: float, name: str) -> None:
    n = sum(p.numel() for p in model.parameters())
    if abs(n - expected) > 0.005 * expected:
        raise AssertionError(f"{name}: {n / 1e9:.3f} B parameters, expected {expected / 1e9:.3f} B")


def build_qwen3_next_reference(dtype: torch.dtype = torch.bfloat16, device="cuda", seed: int = 0, tiny: bool = False):
    """The reference random-weight Qwen3NextForCausalLM (1.912 B parameters; toy sizes with ``tiny``)."""
    model = _build(transformers.Qwen3NextForCausalLM, qwen3_next_reference_config(tiny), dtype, device, seed)
    if not tiny:
        _check_params(model, QWEN3_NEXT_PARAMS, "Qwen3-Next reference")
    return model


def build_nemotron_h_reference(dtype: torch.dtype = torch.bfloat16, device="cuda", seed: int = 0, tiny: bool = False):
    """The random-weight NemotronHForCausalLM of similar size (1.930 B parameters; toy sizes with ``tiny``)."""
    model = _build(transformers.NemotronHForCausalLM, nemotron_h_reference_config(tiny), dtype, device, seed)
    if not tiny:
        _check_params(model, NEMOTRON_H_PARAMS, "NemotronH reference")
    return model


def save_random_mtp_head(model, path: str, seed: int = 0, std: float = 0.02) -> str:
    """Write random ``mtp.*`` tensors for a Qwen3-Next / Qwen3.5 ``model`` into
    ``path/mtp.safetensors`` (the layout of the releases' MTP head: ``fc``, the three norms and
    ``layers.0``, a full-attention decoder layer of the family built by transformers, its experts
    fused as transformers holds them); returns ``path`` (``SpeculativeConfig.mtp_checkpoint``)."""
    import copy
    import os

    from safetensors.torch import save_file

    cfg = copy.deepcopy(model.config.get_text_config())
    n = cfg.num_hidden_layers
    cfg.layer_types = list(cfg.layer_types[:n]) + ["full_attention"]
    h = cfg.hidden_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layer = type(model.model.layers[0])(cfg, n)
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=std) if p.dim() > 1 else torch.nn.init.zeros_(p)
        tensors = {f"mtp.layers.0.{k}": v for k, v in layer.state_dict().items()}
        tensors["mtp.fc.weight"] = torch.randn(h, 2 * h) * std
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            tensors[f"mtp.{name}.weight"] = torch.zeros(h)  # (1 + w) norms: the identity scale
    dtype = next(model.parameters()).dtype
    os.makedirs(path, exist_ok=True)
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, os.path.join(path, "mtp.safetensors"),
              metadata={"format": "pt"})
    return path


REFERENCE_BUILDERS = {
    "qwen3_next": build_qwen3_next_reference,
    "nemotron_h": build_nemotron_h_reference,
}


def sync_device(device) -> None:
    """Wait for the device's queued work (a no-op on CPU): timing boundaries of the benchmarks."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def random_token_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` random token ids in [1, vocab) (0 is often the pad token)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (length,), generator=g).tolist() for _ in range(n)]
