"""Prefix-cache benchmark: SGLang's generated-shared-prefix workload on our engine, with the
cache off, the LRU policy and the Marconi policy.

    python benchmarks/prefix_cache.py --tiny                # CPU smoke run (toy model, short prompts)
    python benchmarks/prefix_cache.py                       # CUDA: reference Qwen3-Next (1.9 B, bf16)
    python benchmarks/prefix_cache.py --system-len 10000 --groups 8 --prompts-per-group 8

Workload (seed 004 / SGLang ``bench_serving --dataset-name generated-shared-prefix``): ``groups``
system prompts of ``system_len`` random tokens; each group has ``prompts_per_group`` prompts =
its system prompt + a question of about ``question_len`` tokens (varied +-50 %); every request
generates ``output_len`` tokens greedily (no EOS). Arrival: wave 1 is the first prompt of every
group, submitted together; when it is done the rest is submitted together (in group-interleaved
order). TTFT = time from ``add_request`` to the step that samples the request's first token;
throughput = generated tokens (and all tokens) per second over the whole run.

Memory-pressure variant (``--pressure``, on by default): the same workload on an engine whose KV
pool holds only ``pressure_kv_groups`` system prompts and whose Mamba pool is small, with the
prompts submitted in random group order in waves of ``max_running_requests``; it reports the
token hit rate (prefix tokens served from the cache / tokens of the admitted requests) of LRU and Marconi.

Prints a table and saves JSON under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hybrid_compile as hc  # noqa: E402
from benchmarks.reference_models import build_qwen3_next_reference  # noqa: E402

SYSTEMS = {
    "no_cache": dict(enable_prefix_cache=False),
    "lru": dict(enable_prefix_cache=True, prefix_cache_policy="lru"),
    "marconi": dict(enable_prefix_cache=True, prefix_cache_policy="marconi"),
}


def shared_prefix_prompts(groups: int, per_group: int, system_len: int, question_len: int, vocab: int, seed: int):
    """``prompts[g][k]``: system prompt ``g`` + question ``k`` (length question_len +-50 %)."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)

    def tokens(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    systems = [tokens(system_len) for _ in range(groups)]
    lo, hi = max(1, question_len // 2), max(1, question_len * 3 // 2)
    return [[systems[i] + tokens(rng.randint(lo, hi)) for _ in range(per_group)] for i in range(groups)]


def run_waves(engine, waves: list[list[list[int]]], output_len: int) -> dict:
    """Submit each wave when the previous one is done; per-request TTFT and the run's throughput."""
    params = hc.SamplingParams(max_new_tokens=output_len, ignore_eos=True)
    ttfts: list[float] = []
    out_tokens = prompt_tokens = 0
    t_start = time.perf_counter()
    for wave in waves:
        added = {}
        for prompt in wave:
            added[engine.add_request(prompt, params)] = time.perf_counter()
            prompt_tokens += len(prompt)
        first: dict[int, float] = {}
        pending = set(added)
        while pending:
            for out in engine.step():
                if out.token is not None and out.rid not in first:
                    first[out.rid] = time.perf_counter()
                if out.finished and out.rid in pending:
                    pending.discard(out.rid)
                    out_tokens += len(engine.pop_finished(out.rid).output)
        ttfts += [first[rid] - t for rid, t in added.items()]
    seconds = time.perf_counter() - t_start
    ttfts.sort()
    return {
        "requests": len(ttfts),
        "mean_ttft_s": sum(ttfts) / len(ttfts),
        "p50_ttft_s": ttfts[len(ttfts) // 2],
        "p99_ttft_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "seconds": seconds,
        "output_tokens_per_s": out_tokens / seconds,
        "total_tokens_per_s": (out_tokens + prompt_tokens) / seconds,
    }


def cache_summary(engine) -> dict:
    s = engine.stats().get("prefix_cache")
    if s is None:
        return {}
    keys = ("token_hit_rate", "admitted_hit_tokens", "admitted_tokens", "mamba_hits", "tombstones", "kv_evicted_tokens",
            "mamba_evicted", "checkpoints_tracked", "checkpoints_forked", "checkpoints_skipped", "memory_bytes")
    return {k: s[k] for k in keys}


def make_engine(model, system: str, args, **capacity):
    kw = dict(max_running_requests=args.max_running_requests, chunked_prefill_size=args.chunked_prefill_size)
    if args.compile:
        kw["compile"] = True
    kw.update(capacity)
    kw.update(SYSTEMS[system])
    return hc.wrap(model, **kw)


def main_workload(model, args, vocab: int) -> dict:
    prompts = shared_prefix_prompts(args.groups, args.prompts_per_group, args.system_len, args.question_len, vocab,
                                    args.seed)
    first = [group[0] for group in prompts]
    rest = [prompts[g][k] for k in range(1, args.prompts_per_group) for g in range(args.groups)]
    waves = [first, rest] if rest else [first]
    per_request = args.system_len * 3 // 2 + args.question_len * 2 + args.output_len
    capacity = dict(max_total_tokens=args.kv_tokens or per_request * (args.groups + args.max_running_requests) * 2,
                    mamba_cache_size=args.max_running_requests * 8)
    results = {}
    for system in args.systems:
        engine = make_engine(model, system, args, **capacity)
        try:
            run_waves(engine, [[first[0]]], 2)  # warm-up (allocator, kernels), then an empty cache
            engine.clear_prefix_cache()
            r = run_waves(engine, waves, args.output_len)
            r["cache"] = cache_summary(engine)
        finally:
            engine.close()
        results[system] = r
        print(f"  {system:9s} mean TTFT {r['mean_ttft_s'] * 1e3:9.1f} ms  p99 {r['p99_ttft_s'] * 1e3:9.1f} ms  "
              f"{r['output_tokens_per_s']:9.1f} out tok/s  hit rate {r['cache'].get('token_hit_rate', 0):.3f}",
              flush=True)
    base = results.get("no_cache")
    if base:
        for r in results.values():
            r["ttft_speedup_vs_no_cache"] = base["mean_ttft_s"] / r["mean_ttft_s"]
            r["throughput_ratio_vs_no_cache"] = r["output_tokens_per_s"] / base["output_tokens_per_s"]
    return results


def pressure_workload(model, args, vocab: int) -> dict:
    """Random group order, a KV pool for ``pressure_kv_groups`` system prompts, few Mamba slots."""
    prompts = shared_prefix_prompts(args.groups, args.prompts_per_group, args.system_len, args.question_len, vocab,
                                    args.seed + 1)
    flat = [p for group in prompts for p in group]
    random.Random(args.seed).shuffle(flat)
    b = args.max_running_requests
    waves = [flat[i: i + b] for i in range(0, len(flat), b)]
    longest = max(len(p) for p in flat) + args.output_len
    capacity = dict(max_total_tokens=int(longest * b + args.system_len * args.pressure_kv_groups),
                    mamba_cache_size=b + args.pressure_mamba_slots)
    results = {}
    for system in [s for s in args.systems if s != "no_cache"]:
        engine = make_engine(model, system, args, **capacity)
        try:
            r = run_waves(engine, waves, args.output_len)
            r["cache"] = cache_summary(engine)
        finally:
            engine.close()
        results[system] = r
        print(f"  {system:9s} token hit rate {r['cache']['token_hit_rate']:.3f}  mean TTFT "
              f"{r['mean_ttft_s'] * 1e3:9.1f} ms  (KV evicted {r['cache']['kv_evicted_tokens']}, Mamba evicted "
              f"{r['cache']['mamba_evicted']})", flush=True)
    return {"capacity": capacity, **results}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="toy model on CPU, short prompts (smoke run)")
    p.add_argument("--groups", type=int, default=None)
    p.add_argument("--prompts-per-group", type=int, default=None)
    p.add_argument("--system-len", type=int, default=None)
    p.add_argument("--question-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--kv-tokens", type=int, default=None, help="KV pool size of the main run (default: roomy)")
    p.add_argument("--pressure-kv-groups", type=float, default=2.5, help="KV pool: this many system prompts")
    p.add_argument("--pressure-mamba-slots", type=int, default=None, help="Mamba slots beyond the running requests")
    p.add_argument("--no-pressure", dest="pressure", action="store_false")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    p.add_argument("--compile", action="store_true", help="EngineConfig.compile=True")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    defaults = (dict(groups=3, prompts_per_group=4, system_len=300, question_len=24, output_len=8,
                     max_running_requests=4, chunked_prefill_size=128, pressure_mamba_slots=4)
                if args.tiny else
                dict(groups=8, prompts_per_group=8, system_len=10000, question_len=128, output_len=32,
                     max_running_requests=16, chunked_prefill_size=4096, pressure_mamba_slots=8))
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.tiny:
        device, dtype = "cpu", torch.float32
        torch.set_num_threads(1)  # toy sizes: intra-op threads only add overhead
    else:
        if not torch.cuda.is_available():
            raise SystemExit("the full benchmark needs a CUDA device (use --tiny on CPU)")
        device, dtype = "cuda", torch.bfloat16
    model = build_qwen3_next_reference(dtype, device, seed=0, tiny=args.tiny)
    vocab = model.config.vocab_size
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"prefix cache benchmark on {device_name}: {args.groups} groups x {args.prompts_per_group} prompts, system "
          f"{args.system_len}, question ~{args.question_len}, output {args.output_len}", flush=True)
    run = {
        "device": device_name,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "model": "qwen3_next_reference" + ("_tiny" if args.tiny else ""),
    }
    print("shared-prefix workload:")
    run["shared_prefix"] = main_workload(model, args, vocab)
    if args.pressure:
        print("memory pressure:")
        run["pressure"] = pressure_workload(model, args, vocab)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"prefix_cache_{'tiny' if args.tiny else device_name.replace(' ', '_').lower()}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(run, f, indent=2)
    print(f"saved {out}")
    return run


if __name__ == "__main__":
    main()
