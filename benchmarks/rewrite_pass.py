"""Rewrite-pass benchmark: decode-step time of the compiled reference model with our post-grad
rewrite pass (``hybrid_compile.compilation.rewrite``: projections sharing an input fused into one
matmul over weights packed once) on vs off.

    python benchmarks/rewrite_pass.py                              # reference Qwen3-Next, bf16, CUDA
    python benchmarks/rewrite_pass.py --tiny --device cpu --batch-sizes 1,2 --iters 5   # CPU smoke

Per setting (one engine each, ``compile=True``, the engine's own CUDA graphs off; "off" first,
on the unpacked weights): for each batch size, B prompts of ``--prompt`` tokens are prefilled and
the first pure-decode step's compiled forward call (the runner's ``_run_compiled``: input ids and
metadata, batch 1 padded to 2 as the runner does) is recorded. That call is then timed

- ``graph_ms``: captured in a plain ``torch.cuda.graph`` and replayed (``benchmarks/kernels.py``'s
  ``replay_ms``: CUDA events, median of ``--rounds`` x ``--iters`` replays): the decode step as
  full CUDA graphs run it;
- ``launch_ms``: called directly (wall time per call after a sync, same rounds): eager launches
  of the compiled pieces and the layer ops;
- ``kernels``: CUDA kernels launched by one call (torch.profiler).

Also: the greedy tokens of one prompt (``--check-tokens`` new tokens) with the pass on vs off, the
max |logit| difference of the recorded decode step, and the engine's rewrite counters. Output:
printed table + JSON (``--out``, default ``benchmarks/results/rewrite_pass_<device>.json``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hybrid_compile as hc  # noqa: E402
from benchmarks.reference_models import (  # noqa: E402
    build_qwen3_next_reference, random_token_prompts as _prompts, sync_device as _sync,
)
from benchmarks.kernels import capture_graph, replay_ms  # noqa: E402  (one timing method)
from hybrid_compile.layers.context import ForwardMode  # noqa: E402


def record_decode_call(engine, prompts):
    """Prefill ``prompts`` and return (input ids, metadata, logits) of the first decode step in
    which all of them decode together, as the runner passed them to its compiled forward."""
    runner = engine.runner
    recorded = []
    original = runner._run_compiled

    def run_compiled(input_ids, md, *args, **kwargs):
        out = original(input_ids, md, *args, **kwargs)
        if not recorded and md.mode is ForwardMode.DECODE and md.batch_size >= len(prompts):
            recorded.append((input_ids, md, out.float().cpu()))
        return out

    runner._run_compiled = run_compiled
    try:
        rids = [engine.add_request(p, hc.SamplingParams(max_new_tokens=3, ignore_eos=True)) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        for rid in rids:
            engine.pop_finished(rid)
    finally:
        runner._run_compiled = original
    if not recorded:
        raise RuntimeError(f"no pure decode step of batch {len(prompts)} was run")
    return recorded[0]


def time_launches(fn, device, iters, rounds):
    times = []
    for _ in range(rounds):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(device)
        times.append((time.perf_counter() - t0) / iters * 1e3)
    return statistics.median(times)


def time_graph(fn, iters, rounds):
    """Median milliseconds of one replay of fn() captured in a CUDA graph (``iters * rounds``
    replays; two warm-up calls before the capture)."""
    return replay_ms(capture_graph(fn, warmup=2), iters * rounds)


def count_kernels(fn, device):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        _sync(device)
    if device.type != "cuda":
        return None
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def run_setting(model, rewrites, args, device, vocab):
    torch.compiler.reset()
    t0 = time.perf_counter()
    engine = hc.wrap(
        model, compile=True, cuda_graphs=False, enable_prefix_cache=False, max_running_requests=max(args.batch_sizes),
        max_total_tokens=max(args.batch_sizes) * (args.prompt + 8) + args.check_tokens + args.prompt + 64,
        chunked_prefill_size=args.chunked_prefill, extra={"rewrite_passes": rewrites},
    )
    build_seconds = time.perf_counter() - t0
    out = {"rewrites": rewrites, "build_seconds": build_seconds, "compile": engine.stats()["compile"], "batches": {}}
    try:
        (check,) = _prompts(1, args.prompt, vocab, seed=1)
        generated = engine.generate(torch.tensor([check], device=device), max_new_tokens=args.check_tokens)
        out["tokens"] = generated[0, args.prompt:].tolist()
        with torch.inference_mode():
            for b in args.batch_sizes:
                input_ids, md, logits = record_decode_call(engine, _prompts(b, args.prompt, vocab, seed=100 + b))

                def step():
                    return engine.runner._run_compiled(input_ids, md)

                row = {"tokens_in_call": int(input_ids.shape[0]), "logits": logits}
                row["kernels"] = count_kernels(step, device)
                row["launch_ms"] = time_launches(step, device, args.iters, args.rounds)
                if device.type == "cuda":
                    row["graph_ms"] = time_graph(step, args.iters, args.rounds)
                out["batches"][b] = row
                print(f"  rewrites={rewrites} batch {b}: {row.get('graph_ms', float('nan')):.3f} ms graph, "
                      f"{row['launch_ms']:.3f} ms launches, {row['kernels']} kernels", flush=True)
    finally:
        engine.close()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="toy sizes of the reference model (CPU smoke)")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--chunked-prefill", type=int, default=8192)
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

    model = build_qwen3_next_reference(dtype, device, seed=0, tiny=args.tiny)
    vocab = model.config.vocab_size
    # "off" first: it runs on the weights as loaded; "on" packs them (same values, views of packed buffers)
    off = run_setting(model, False, args, device, vocab)
    on = run_setting(model, True, args, device, vocab)

    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "model": "qwen3_next reference" + (" (tiny)" if args.tiny else ""),
        "dtype": str(dtype),
        "prompt": args.prompt,
        "rewrite_counters": on["compile"].get("rewrites"),
        "build_seconds": {"off": off["build_seconds"], "on": on["build_seconds"]},
        "greedy_tokens_equal": on["tokens"] == off["tokens"],
        "first_token_divergence": next((i for i, (a, b) in enumerate(zip(on["tokens"], off["tokens"])) if a != b),
                                       None),
        "batches": {},
    }
    print(f"\n{result['device']}, torch {torch.__version__}; rewrite counters: {result['rewrite_counters']}")
    print(f"greedy tokens on == off ({args.check_tokens} new): {result['greedy_tokens_equal']}")
    print(f"{'batch':>5} {'graph off':>10} {'graph on':>9} {'ratio':>6} {'launch off':>11} {'launch on':>10} "
          f"{'ratio':>6} {'kernels off/on':>15} {'max|dlogit|':>11}")
    for b in args.batch_sizes:
        r_off, r_on = off["batches"][b], on["batches"][b]
        row = {
            "tokens_in_call": r_on["tokens_in_call"],
            "launch_ms": {"off": r_off["launch_ms"], "on": r_on["launch_ms"],
                          "speedup": r_off["launch_ms"] / r_on["launch_ms"]},
            "kernels": {"off": r_off["kernels"], "on": r_on["kernels"]},
            "max_abs_logit_diff": float((r_on["logits"] - r_off["logits"]).abs().max()),
        }
        if "graph_ms" in r_on:
            row["graph_ms"] = {"off": r_off["graph_ms"], "on": r_on["graph_ms"],
                               "speedup": r_off["graph_ms"] / r_on["graph_ms"]}
        result["batches"][str(b)] = row
        g = row.get("graph_ms", {"off": float("nan"), "on": float("nan"), "speedup": float("nan")})
        print(f"{b:>5} {g['off']:>10.3f} {g['on']:>9.3f} {g['speedup']:>6.3f} {row['launch_ms']['off']:>11.3f} "
              f"{row['launch_ms']['on']:>10.3f} {row['launch_ms']['speedup']:>6.3f} "
              f"{str(row['kernels']['off']) + '/' + str(row['kernels']['on']):>15} {row['max_abs_logit_diff']:>11.4f}")

    path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                    f"rewrite_pass_{device.type}{'_tiny' if args.tiny else ''}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
