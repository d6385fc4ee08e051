"""Decode with penalties vs plain decode, in one run (issue 22: penalties batched on the device).

    python benchmarks/sampling_penalties.py                         # reference Qwen3-Next, bf16, CUDA
    python benchmarks/sampling_penalties.py --tiny --device cpu     # CPU smoke run

One engine (default settings: compiled, CUDA graphs on a GPU); ``--batch`` requests (default 16)
of a ``--prompt-len`` token prompt decode ``--new-tokens`` tokens each (no EOS), once per mode:

- ``plain``: greedy, no processing (the argmax fast path);
- ``penalties``: greedy with ``repetition_penalty`` and ``presence_penalty`` (token counts on the
  device, engine/logits_processing.py);
- ``penalties_sampled``: the same penalties plus temperature / top-p sampling.

Per mode, after the prefill: the first half of the decode tokens free-running (no sync between
steps, as serving runs: wall time per decode step, decode tokens/s, and how many steps were
launched ahead: penalties keep the engine launching decode steps ahead, no host sync per step),
the second half with each ``engine.step()`` timed between device syncs (median). Each figure's
ratio to ``plain``'s is printed and saved (``*_vs_plain``); modes are interleaved over
``--repeats`` runs and the best run of each counts. Output: JSON (``--out``, default
``benchmarks/results/sampling_penalties_<device>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hybrid_compile as hc  # noqa: E402
from reference_models import build_qwen3_next_reference, random_token_prompts, sync_device  # noqa: E402

MODES = {
    "plain": dict(),
    "penalties": dict(repetition_penalty=1.2, presence_penalty=0.5),
    "penalties_sampled": dict(repetition_penalty=1.2, presence_penalty=0.5, do_sample=True, temperature=0.8,
                              top_p=0.95, seed=0),
}


def decode_steps(engine, prompts, new_tokens: int, sampling: dict) -> dict:
    """Serve ``prompts``: first until every request has its first token (prefill), then the decode
    phase twice over: free-running (no sync between steps, as serving runs; its wall time per
    decode step) and, for the median, each ``engine.step()`` timed between device syncs."""
    params = hc.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, **sampling)
    rids = [engine.add_request(p, params) for p in prompts]
    emitted = {rid: 0 for rid in rids}

    def step():
        for out in engine.step():
            if out.token is not None:
                emitted[out.rid] += 1

    while min(emitted.values()) < 1:
        step()
    # free-running decode: half of the remaining tokens
    stats0 = engine.stats()
    sync_device(engine.device)
    t0 = time.perf_counter()
    while min(emitted.values()) < new_tokens // 2:
        step()
    sync_device(engine.device)
    wall = time.perf_counter() - t0
    stats1 = engine.stats()
    free_steps = stats1["decode_steps"] - stats0["decode_steps"]
    # the rest, each step timed between syncs
    times = []
    while engine.has_unfinished():
        before = engine.stats()["decode_steps"]
        sync_device(engine.device)
        t0 = time.perf_counter()
        engine.step()
        sync_device(engine.device)
        if engine.stats()["decode_steps"] > before:
            times.append(time.perf_counter() - t0)
    for rid in rids:
        engine.pop_finished(rid)
    return dict(
        free_running_ms_per_step=1e3 * wall / max(1, free_steps), free_running_steps=free_steps,
        median_step_ms=1e3 * statistics.median(times) if times else float("nan"), synced_steps=len(times),
        overlapped_steps=stats1["overlapped_steps"] - stats0["overlapped_steps"],
    )


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="toy-size reference model (CPU smoke run)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="runs per mode (modes interleaved); the best median counts")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: CUDA is not available on this machine (use --device cpu)")
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model = build_qwen3_next_reference(dtype=dtype, device=args.device, tiny=args.tiny)
    vocab = model.config.vocab_size
    prompts = random_token_prompts(args.batch, args.prompt_len, vocab, seed=0)
    config = dict(max_running_requests=max(args.batch, 1), chunked_prefill_size=max(2048, args.prompt_len),
                  max_total_tokens=args.batch * (args.prompt_len + args.new_tokens) + 1024,
                  enable_prefix_cache=False)
    if args.tiny:
        config.update(mamba_cache_size=args.batch + 2)
    results = {mode: [] for mode in MODES}
    with hc.wrap(model, **config) as engine:
        decode_steps(engine, prompts[:2], 3, {})  # warm-up: every kernel variant compiled
        for _ in range(args.repeats):
            for mode, sampling in MODES.items():
                results[mode].append(decode_steps(engine, prompts, args.new_tokens, sampling))
        compile_stats = engine.runner.compile_stats()
    summary = {}
    for mode, runs in results.items():
        best = min(runs, key=lambda r: r["free_running_ms_per_step"])
        summary[mode] = dict(best, decode_tokens_per_s=args.batch * 1e3 / best["free_running_ms_per_step"], runs=runs)
    for mode in summary:
        for key in ("free_running_ms_per_step", "median_step_ms"):
            summary[mode][f"{key}_vs_plain"] = summary[mode][key] / summary["plain"][key]
    out = dict(
        benchmark="sampling_penalties", device=args.device, tiny=args.tiny, batch=args.batch,
        prompt_len=args.prompt_len, new_tokens=args.new_tokens, dtype=str(dtype), modes=summary,
        sampling={m: s for m, s in MODES.items()}, compile=compile_stats,
        gpu=torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        torch=torch.__version__, python=platform.python_version(),
    )
    print(f"batch {args.batch} decode, prompt {args.prompt_len}, {args.new_tokens} new tokens ({args.device}):")
    for mode, r in summary.items():
        print(f"  {mode:18s} {r['free_running_ms_per_step']:8.3f} ms/step free-running "
              f"(x{r['free_running_ms_per_step_vs_plain']:.3f} of plain, {r['decode_tokens_per_s']:.1f} tok/s, "
              f"{r['overlapped_steps']} of {r['free_running_steps']} steps launched ahead); "
              f"{r['median_step_ms']:.3f} ms/step synced median (x{r['median_step_ms_vs_plain']:.3f})")
    path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                    f"sampling_penalties_{args.device.split(':')[0]}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
