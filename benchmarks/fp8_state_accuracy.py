"""Accuracy of the low-precision pools: per-step logit error against the fp32-state engine.

    python benchmarks/fp8_state_accuracy.py [--device cuda] [--tokens 1024] [--out benchmarks/results/fp8_state_accuracy.json]
    python benchmarks/fp8_state_accuracy.py --tiny --device cpu     # CI smoke run (tests/test_benchmarks_fp8.py)
    python benchmarks/fp8_state_accuracy.py --family minimax        # MiniMax's lightning-attention state

Model: a mid-size random Qwen3-Next (GDN + gated attention, dense MLP; ``--tiny``: toy sizes): 8 layers
``[linear_attention x3, full_attention] x2``, hidden 1024, GDN 4 key / 8 value heads of dim 128 (state
``[8, 128, 128]`` per layer), attention 8 q / 2 kv heads of dim 128, vocab 32000, in ``--dtype``
(bf16 on a GPU, fp32 on CPU). Weights are random (scaled like HF's init), so the logits are not a
language model's, but the recurrences, the state magnitudes and the rounding are the real ones.
``--family minimax``: a mid-size random MiniMax instead (the same 8-layer pattern with lightning
attention for GDN: 8 heads of dim 128, state ``[8, 128, 128]`` per layer; attention 8 q / 2 kv heads of
dim 128; MoE of 4 experts, each token routed to all 4: with top-k routing a state rounding can flip an
expert, a jump of the logits that says nothing about the state's precision).

Method: the reference engine (fp32 recurrent state, KV cache in the model dtype) generates
``--tokens`` greedy tokens from a random prompt, recording every step's logits. Each other engine
(bf16 state; fp8 state; fp8 KV cache; both fp8) is then *teacher-forced* on the same tokens (a
logits processor records its logits and forces the reference's token), so step ``i`` of every engine
sees the same prefix and only its pool precision differs; its state errors accumulate over the whole
run, as they would in serving. Per step: ``max|l - l_ref| / max|l_ref|`` (relative max error of the
logits) and whether the argmax agrees. Reported: mean / p50 / p90 / max over steps, per quarter of
the run (drift), top-1 agreement, and the pool bytes per token / per Mamba slot. Prints a table,
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time

import torch
import transformers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import hybrid_compile as hc  # noqa: E402
from reference_models import _build, random_token_prompts  # noqa: E402

#: (name, EngineConfig overrides) of the engines compared with the reference
MODES = [
    ("bf16_state", dict(ssm_state_dtype="bfloat16")),
    ("fp8_state", dict(ssm_state_dtype="fp8")),
    ("fp8_kv_cache", dict(kv_cache_dtype="fp8")),
    ("fp8_state_and_kv_cache", dict(ssm_state_dtype="fp8", kv_cache_dtype="fp8")),
]


def minimax_config(tiny: bool) -> "transformers.MiniMaxConfig":
    h, d, hidden, vocab = (4, 16, 64, 512) if tiny else (8, 128, 1024, 32000)
    n = 4 if tiny else 8
    return transformers.MiniMaxConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=n,
        layer_types=[("full_attention" if i % 4 == 3 else "linear_attention") for i in range(n)],
        num_attention_heads=h, num_key_value_heads=2, head_dim=d, num_local_experts=4, num_experts_per_tok=4,
        block_size=64, tie_word_embeddings=True, max_position_embeddings=8192, pad_token_id=None, bos_token_id=None,
        eos_token_id=None,
    )


#: --family -> (config builder, model class name in transformers, the state shape's config fields)
FAMILIES = {
    "qwen3_next": lambda tiny: (model_config(tiny), "Qwen3NextForCausalLM"),
    "minimax": lambda tiny: (minimax_config(tiny), "MiniMaxForCausalLM"),
}


def state_shape(config) -> list[int]:
    if config.model_type == "minimax":
        return [config.num_attention_heads, config.head_dim, config.head_dim]
    return [config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim]


def model_config(tiny: bool) -> transformers.Qwen3NextConfig:
    sizes = (
        dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=16, num_hidden_layers=4)
        if tiny else
        dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=2,
             head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128,
             linear_value_head_dim=128, num_hidden_layers=8)
    )
    n = sizes["num_hidden_layers"]
    return transformers.Qwen3NextConfig(
        **sizes, layer_types=[("full_attention" if i % 4 == 3 else "linear_attention") for i in range(n)],
        num_experts=0, mlp_only_layers=list(range(n)), linear_conv_kernel_dim=4, tie_word_embeddings=True,
        max_position_embeddings=8192, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )


class TeacherForcing:
    """Logits processor: records each step's logits; with ``tokens``, forces them as the next tokens."""

    def __init__(self, prompt_len: int, tokens: list[int] | None = None) -> None:
        self.prompt_len, self.tokens, self.logits = prompt_len, tokens, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.logits.append(scores[0].detach().float().cpu().clone())
        if self.tokens is None:
            return scores
        step = input_ids.shape[-1] - self.prompt_len
        forced = torch.full_like(scores, float("-inf"))
        forced[..., self.tokens[step]] = 0.0
        return forced


def run(model, prompt: list[int], steps: int, device: str, forced: list[int] | None, **overrides) -> dict:
    kw = dict(max_running_requests=1, max_total_tokens=len(prompt) + steps + 64, mamba_cache_size=2,
              enable_prefix_cache=False, device=device)
    kw.update(overrides)
    t0 = time.perf_counter()
    with hc.wrap(model, **kw) as engine:
        teacher = TeacherForcing(len(prompt), forced)
        params = hc.SamplingParams(max_new_tokens=steps, ignore_eos=True, do_sample=False,
                                   logits_processors=(teacher,))
        (out,) = engine.generate_batch([prompt], params=params)
        mem = engine.stats()["memory"]
    return dict(tokens=out, logits=teacher.logits, seconds=time.perf_counter() - t0,
                bytes=dict(per_token=mem["bytes"]["per_token"], per_mamba_slot=mem["bytes"]["per_mamba_slot"]),
                dtypes=mem["dtypes"])


def _stats(values: list[float]) -> dict:
    v = sorted(values)
    pick = lambda q: v[min(len(v) - 1, int(round(q * (len(v) - 1))))]  # noqa: E731
    return dict(mean=sum(v) / len(v), p50=pick(0.5), p90=pick(0.9), max=v[-1])


def compare(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict:
    errs = [((g - r).abs().max() / r.abs().max()).item() for g, r in zip(got, ref)]
    agree = [int(g.argmax() == r.argmax()) for g, r in zip(got, ref)]
    q = max(1, len(errs) // 4)
    quarters = [_stats(errs[i:i + q])["mean"] for i in range(0, q * 4, q) if errs[i:i + q]]
    return dict(rel_max_error=_stats(errs), rel_max_error_mean_by_quarter=quarters,
                top1_agreement=sum(agree) / len(agree), steps=len(errs))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="toy model and 32 tokens (CPU smoke run)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="model dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--tokens", type=int, default=None, help="generated tokens (default 1024, --tiny 32)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--modes", default=",".join(name for name, _ in MODES),
                   help="comma-separated subset of the compared engines")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--family", choices=sorted(FAMILIES), default="qwen3_next",
                   help="the model's family (module docstring)")
    p.add_argument("--out", default="benchmarks/results/fp8_state_accuracy.json")
    args = p.parse_args(argv)
    steps = args.tokens or (32 if args.tiny else 1024)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device.startswith("cuda")
                                                           else torch.float32)
    config, class_name = FAMILIES[args.family](args.tiny)
    if not hasattr(transformers, class_name):
        p.error(f"--family {args.family}: transformers {transformers.__version__} has no {class_name}")
    model = _build(getattr(transformers, class_name), config, dtype, args.device, args.seed)
    (prompt,) = random_token_prompts(1, args.prompt_len, config.vocab_size, seed=args.seed + 1)

    ref = run(model, prompt, steps, args.device, None, ssm_state_dtype="float32")
    result = dict(
        env=dict(device=str(torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor()
                            or platform.machine()),
                 torch=torch.__version__, transformers=transformers.__version__, tiny=args.tiny,
                 model_dtype=str(dtype).replace("torch.", ""), tokens=steps, prompt_len=args.prompt_len,
                 date=time.strftime("%Y-%m-%d"),
                 model=dict(family=args.family, hidden=config.hidden_size, layers=config.num_hidden_layers,
                            vocab=config.vocab_size, state=state_shape(config))),
        reference=dict(mode="fp32_state", bytes=ref["bytes"], dtypes=ref["dtypes"], seconds=ref["seconds"]),
        modes={},
    )
    print(f"{'mode':<24} {'mean':>9} {'p50':>9} {'p90':>9} {'max':>9} {'top1':>7} {'B/token':>8} {'B/slot':>9}")
    print(f"{'fp32_state (reference)':<24} {'':>9} {'':>9} {'':>9} {'':>9} {'':>7} "
          f"{ref['bytes']['per_token']:>8} {ref['bytes']['per_mamba_slot']:>9}")
    unknown = set(args.modes.split(",")) - {name for name, _ in MODES}
    if unknown:
        p.error(f"unknown mode(s) {sorted(unknown)}; known: {[name for name, _ in MODES]}")
    for name, overrides in MODES:
        if name not in args.modes.split(","):
            continue
        got = run(model, prompt, steps, args.device, ref["tokens"], **overrides)
        assert got["tokens"] == ref["tokens"], f"{name}: teacher forcing did not hold"
        row = compare(ref["logits"], got["logits"])
        row.update(bytes=got["bytes"], dtypes=got["dtypes"], seconds=got["seconds"], config=overrides)
        result["modes"][name] = row
        e = row["rel_max_error"]
        print(f"{name:<24} {e['mean']:>9.2e} {e['p50']:>9.2e} {e['p90']:>9.2e} {e['max']:>9.2e} "
              f"{row['top1_agreement']:>7.3f} {row['bytes']['per_token']:>8} {row['bytes']['per_mamba_slot']:>9}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
