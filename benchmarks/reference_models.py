"""Reference models of the benchmarks: random-weight Hugging Face hybrid models (``REFERENCE_BUILDERS``).

Two dense models of ~1.9 B parameters (the e2e benchmark's default pair):

- :func:`build_qwen3_next_reference`: the reference ``Qwen3NextForCausalLM`` of the compile issue
  (vocab 151936, hidden 2048, 24 layers ``[linear_attention x3, full_attention] x6``, dense MLP
  5632 in every layer, attention 16 q / 2 kv heads of dim 256, GDN 16 key / 32 value heads of
  dim 128, conv kernel 4, tied embeddings: 1.912 B parameters).
- :func:`build_nemotron_h_reference`: a NemotronH of similar size (hidden 2048, pattern
  ``M-M-M-*-`` x6 with relu2 MLPs of 8192, Mamba2 64 heads x 64, state 128, 8 groups, chunk 128,
  attention 16 q / 2 kv heads of dim 128, vocab 131072, tied embeddings: 1.930 B parameters).

Two MoE models with the per-layer shapes of real releases, cut in layers only (every width, head
count, expert count and top-k as released) so that the bf16 weights (~27 GB) fit one 80 GB GPU
beside our engine's pools and build in seconds there:

- :func:`build_jamba_reference`: Jamba-v0.1 / Jamba-Mini-1.6 (same shape: vocab 65536, hidden
  4096, 32 layers, attention every 8th layer from layer 4 (32 q / 8 kv heads of dim 128), the
  other layers Mamba1 (d_state 16, d_conv 4, expand 2, dt_rank 256), MoE of 16 experts (top 2,
  width 14336) every 2nd layer from layer 1, dense MLP 14336 in the others, untied embeddings:
  51.57 B parameters, 12.11 B active). Cut: 32 -> 8 layers, one period of both patterns
  (7 Mamba1 + 1 attention at layer 4; 4 MoE + 4 dense): 13.295 B parameters, 3.430 B active.
- :func:`build_kimi_linear_reference`: Kimi-Linear-48B-A3B (transformers' ``KimiLinearConfig``
  defaults are that checkpoint's: vocab 163840, hidden 2304, 27 layers, Kimi Delta Attention 32
  heads x 128 with conv 4, MLA full attention in layers 4, 8, ..., 24 and 27 (1-indexed; 32 heads,
  kv_lora_rank 512, q without LoRA, nope 128 + rope 64, v 128), layer 1 a dense MLP of 9216, the
  others MoE of 256 experts (top 8, width 1024, sigmoid router, routed scaling 2.446) + 1 shared
  expert, untied embeddings: 49.13 B parameters, 3.49 B active). Cut: 27 -> 8 layers
  ``[KDA x3, MLA] x2``, the first dense, 7 MoE: 13.851 B parameters, 1.564 B active.

Active parameters (:func:`active_params`): every parameter, with the routed experts counted at
``top_k / num_experts`` (what one token reads; shared experts and routers whole).

Weights are drawn by transformers' own initialisation under ``torch.manual_seed(seed)`` (same
seed, dtype and device -> same weights), directly on ``device`` in ``dtype``. ``tiny=True``
keeps every structural feature (layer pattern, GQA on both layer kinds, tied or untied embeddings,
dense / MoE layers with top-k routing and shared experts) at toy sizes for CPU smoke runs. No generation defaults leak in: no EOS, greedy.

Also the small helpers every benchmark shares: :func:`sync_device`, :func:`random_token_prompts`.
"""

from __future__ import annotations

import torch
import transformers

QWEN3_NEXT_PARAMS = 1.912e9
NEMOTRON_H_PARAMS = 1.930e9
JAMBA_PARAMS, JAMBA_ACTIVE_PARAMS = 13.295e9, 3.430e9
KIMI_LINEAR_PARAMS, KIMI_LINEAR_ACTIVE_PARAMS = 13.851e9, 1.564e9


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


def jamba_reference_config(tiny: bool = False) -> "transformers.JambaConfig":
    sizes = (
        dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_dt_rank=8)
        if tiny else
        dict(vocab_size=65536, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
             num_key_value_heads=8, num_experts=16, num_experts_per_tok=2, mamba_d_state=16, mamba_dt_rank=256)
    )
    return _require("JambaConfig")(
        **sizes,
        num_hidden_layers=8,  # one period of both patterns (the release has 32)
        attn_layer_period=8, attn_layer_offset=4, expert_layer_period=2, expert_layer_offset=1,
        mamba_d_conv=4, mamba_expand=2, mamba_conv_bias=True, mamba_proj_bias=False,
        tie_word_embeddings=False,
        max_position_embeddings=65536 if not tiny else 8192,
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )


def kimi_linear_reference_config(tiny: bool = False) -> "transformers.KimiLinearConfig":
    sizes = (
        dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
             num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
             num_local_experts=8, num_experts_per_tok=2, linear_num_heads=2, linear_head_dim=16)
        if tiny else
        dict(vocab_size=163840, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024,
             num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=512, qk_rope_head_dim=64,
             qk_nope_head_dim=128, v_head_dim=128, num_local_experts=256, num_experts_per_tok=8,
             linear_num_heads=32, linear_head_dim=128)
    )
    n_layers = 8  # [KDA x3, MLA] x2 (the release: 27 layers)
    # the keywords both transformers 5.17 and 5.24 take (their KimiLinearConfig fields are the same)
    return _require("KimiLinearConfig")(
        **sizes,
        num_hidden_layers=n_layers,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (n_layers // 4),
        mlp_layer_types=["dense"] + ["sparse"] * (n_layers - 1),
        num_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.446, q_lora_rank=None,
        linear_conv_kernel_dim=4, tie_word_embeddings=False,
        max_position_embeddings=65536 if not tiny else 8192,
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )


def _build(model_class, config, dtype: torch.dtype, device, seed: int):
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device(device):
            model = model_class._from_config(config, dtype=dtype)
    return as_benchmark_model(model)


def as_benchmark_model(model):
    """``model`` in eval mode with greedy, EOS-free generation defaults (random weights would stop
    at a random EOS)."""
    model = model.eval()
    model.generation_config.do_sample = False
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


def _check_params(model, expected: float, name: str, expected_active: float | None = None) -> None:
    n = sum(p.numel() for p in model.parameters())
    if abs(n - expected) > 0.005 * expected:
        raise AssertionError(f"{name}: {n / 1e9:.3f} B parameters, expected {expected / 1e9:.3f} B")
    if expected_active is not None:
        a = active_params(model)
        if abs(a - expected_active) > 0.005 * expected_active:
            raise AssertionError(f"{name}: {a / 1e9:.3f} B active parameters, expected {expected_active / 1e9:.3f} B")


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


def build_jamba_reference(dtype: torch.dtype = torch.bfloat16, device="cuda", seed: int = 0, tiny: bool = False):
    """A random-weight JambaForCausalLM with Jamba-v0.1's layer shapes in 8 layers (13.295 B
    parameters, 3.430 B active; toy sizes with ``tiny``)."""
    model = _build(_require("JambaForCausalLM"), jamba_reference_config(tiny), dtype, device, seed)
    if not tiny:
        _check_params(model, JAMBA_PARAMS, "Jamba reference", JAMBA_ACTIVE_PARAMS)
    return model


def build_kimi_linear_reference(dtype: torch.dtype = torch.bfloat16, device="cuda", seed: int = 0,
                                tiny: bool = False):
    """A random-weight KimiLinearForCausalLM with Kimi-Linear-48B-A3B's layer shapes in 8 layers
    (13.851 B parameters, 1.564 B active; toy sizes with ``tiny``)."""
    model = _build(_require("KimiLinearForCausalLM"), kimi_linear_reference_config(tiny), dtype, device, seed)
    if not tiny:
        _check_params(model, KIMI_LINEAR_PARAMS, "Kimi-Linear reference", KIMI_LINEAR_ACTIVE_PARAMS)
    return model


def _require(name: str):
    """transformers' class ``name``; a clear error where this transformers lacks it (KimiLinear
    arrived in 5.17)."""
    cls = getattr(transformers, name, None)
    if cls is None:
        raise NotImplementedError(f"transformers {transformers.__version__} has no {name}")
    return cls


def active_params(model, as_bytes: bool = False) -> int:
    """Parameters one token reads (their bytes with ``as_bytes``): all, with each routed-experts
    module's weights counted at ``top_k / num_experts`` (transformers' ``*Experts`` modules: 3-D
    ``[E, ...]`` weights; shared experts and routers are whole)."""
    top_k = getattr(model.config.get_text_config(), "num_experts_per_tok", None)
    total, seen = 0.0, set()
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]  # tied weights once
        seen.update(id(p) for p in own)
        n = sum(p.numel() * (p.element_size() if as_bytes else 1) for p in own)
        if own and top_k and type(module).__name__.endswith("Experts") and all(p.dim() == 3 for p in own):
            n = n * top_k / own[0].shape[0]
        total += n
    return int(round(total))


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
    "jamba": build_jamba_reference,
    "kimi_linear": build_kimi_linear_reference,
}


def sync_device(device) -> None:
    """Wait for the device's queued work (a no-op on CPU): timing boundaries of the benchmarks."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def random_token_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` random token ids in [1, vocab) (0 is often the pad token)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (length,), generator=g).tolist() for _ in range(n)]
