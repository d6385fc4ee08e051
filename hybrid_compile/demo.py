"""The README's main job: a small built-in random-weight Qwen3-Next served by the engine.

Builds the model from a config (no download), runs several prompts of different lengths
through ``generate_batch`` with continuous batching and chunked prefill, checks every
prompt's tokens against transformers' own greedy ``generate`` on the same weights, and
prints throughput and the engine's counters.
"""

from __future__ import annotations

import time

import torch


def build_demo_model(seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """A ~1.3M-parameter Qwen3-Next (3 Gated DeltaNet layers + 1 attention layer, MoE MLPs)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    config = Qwen3NextConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        max_position_embeddings=2048,
    )
    model = Qwen3NextForCausalLM(config).to(device=device, dtype=dtype).eval()
    return model


def run_demo(
    device: str = "cpu",
    num_prompts: int = 6,
    max_new_tokens: int = 24,
    seed: int = 0,
    check: bool = True,
    out=print,
    tensor_parallel_size: int = 1,
) -> dict:
    """Serve the demo model and check it against transformers. ``tensor_parallel_size`` > 1: the
    model is saved to a temporary directory and served from there over that many processes
    (``hc.from_pretrained(dir, tensor_parallel_size=N)``)."""
    import tempfile

    import hybrid_compile as hc
    from hybrid_compile.distributed.group import is_torchrun_follower

    if is_torchrun_follower(tensor_parallel_size):
        out = lambda *args, **kwargs: None  # noqa: E731  (torchrun: only rank 0 reports)
    model = build_demo_model(seed, device)
    n_params = sum(p.numel() for p in model.parameters())
    out(f"model: random-weight Qwen3-Next, {n_params / 1e6:.1f}M params, layers {model.config.layer_types}, {device}")
    gen = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(1, 300, (num_prompts,), generator=gen)]
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    out(f"prompts: {num_prompts} of lengths {lengths}, {max_new_tokens} new tokens each")

    options = dict(max_running_requests=4, chunked_prefill_size=128, max_total_tokens=4096, mamba_cache_size=16)
    tmp = None
    if tensor_parallel_size != 1:
        tmp = tempfile.TemporaryDirectory(prefix="hybrid_compile_demo_")
        model.save_pretrained(tmp.name)
        engine = hc.from_pretrained(tmp.name, tensor_parallel_size=tensor_parallel_size, device=device, **options)
        if engine is None:  # a torchrun rank other than 0: it followed rank 0's engine until its close
            tmp.cleanup()
            return {"outputs": None, "seconds": None, "stats": None, "matches_hf": None, "follower": True}
        out(f"tensor parallelism: {tensor_parallel_size} ranks")
    else:
        engine = hc.wrap(model, **options)
    t0 = time.perf_counter()
    outputs = engine.generate_batch(prompts, max_new_tokens=max_new_tokens)
    seconds = time.perf_counter() - t0
    stats = engine.stats()
    engine.clear_prefix_cache()  # the prefix cache (on by default) keeps the finished requests' slots
    engine.pools.check_all_free()
    generated = sum(len(o) for o in outputs)
    out(f"engine: {generated} tokens generated in {seconds:.2f} s -> {generated / seconds:.1f} new tokens/s "
        f"({stats['tokens_per_second']:.0f} tokens/s through the model, prefill + decode)")
    for key in ("steps", "extend_steps", "decode_steps", "prefill_tokens", "decode_tokens", "retractions"):
        out(f"  {key:15s} {stats[key]}")
    mem = stats["memory"]
    out(f"  pools: {mem['capacity']['kv_tokens']} KV token slots, {mem['capacity']['mamba_slots']} Mamba slots, "
        f"{mem['bytes']['total'] / 2**20:.1f} MiB; all free again after the run")
    result = {"outputs": outputs, "seconds": seconds, "stats": stats, "matches_hf": None}
    engine.close()
    if tmp is not None:
        tmp.cleanup()
    if check:
        t0 = time.perf_counter()
        matches = 0
        for prompt, tokens in zip(prompts, outputs):
            ids = torch.tensor([prompt], device=device)
            ref = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
            matches += int(ref[0, len(prompt):].tolist() == tokens)
        hf_seconds = time.perf_counter() - t0
        out(f"transformers generate (one prompt at a time): {generated / hf_seconds:.1f} new tokens/s; "
            f"{matches}/{num_prompts} prompts give exactly the engine's tokens")
        out("speeds above: wall-clock new tokens/s of this run, model load and compile excluded. On a CPU with a "
            f"{n_params / 1e6:.1f}M-parameter model the engine's per-step bookkeeping (scheduling, metadata, pools) "
            "costs about as much as the model itself, so it is not expected to beat transformers here; it is built "
            "for GPUs and real model sizes (README, Performance: measured on an H100).")
        result["matches_hf"] = matches == num_prompts
    return result
