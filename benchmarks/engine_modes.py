"""Engine modes benchmark: eager ops vs compiled vs compiled + CUDA graphs (piecewise, full decode,
both) on the reference model (compile issue).

    python benchmarks/engine_modes.py                    # reference Qwen3-Next, bf16, CUDA
    python benchmarks/engine_modes.py --tiny --device cpu --modes eager,compiled   # CPU smoke

Per mode (one engine each, built after the previous one is closed):
- ``build_seconds`` (wrap: pools, compile, graph capture) and the engine's compile stats
  (``compile_seconds``, ``capture_seconds``, graphs, buckets, replays, fallbacks);
- decode ms/step at batch 1, 16, 64 (prompt 512 tokens, 128 new tokens, no EOS): the median wall
  time of ``engine.step()`` over the pure-decode steps (scheduling, metadata, forward, sampling);
- prefill of one 4k-token prompt (one step, ``chunked_prefill_size`` 4096): tokens/s of the best
  of 3 runs;
- with full graphs: the GPU time of one batch-1 graph replay alone (CUDA events), so the host
  overhead of a step is visible;
- greedy tokens of the batch-1 request (first 32) against eager ops; where they diverge (bf16
  near-ties), the logits of the common prefix are compared: ``max_logit_diff`` and eager's
  top-2 gap at the divergence (a flip is accepted when that gap is below ``--tie-tolerance``).

Also a torch.profiler summary of decode steps at batch 1 with full graphs (kernel time by name).
Output: printed table + JSON (``--out``, default ``benchmarks/results/engine_modes_<device>.json``).
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hybrid_compile as hc  # noqa: E402
from reference_models import build_qwen3_next_reference, random_token_prompts as _prompts, sync_device as _sync  # noqa: E402
from kernels import replay_ms  # noqa: E402  (benchmarks/kernels.py: one timing method)

MODES = {
    "eager": dict(compile=False),
    "compiled": dict(compile=True, cuda_graphs=False),
    "piecewise": dict(compile=True, cuda_graphs="piecewise"),
    "full": dict(compile=True, cuda_graphs="full"),
    "both": dict(compile=True, cuda_graphs=True),
}
CHECK_TOKENS = 32


def run_decode(engine, prompts, new_tokens, record_logits=False):
    """Step an engine over ``prompts`` until done; returns (decode step times in s, the tokens and
    per-step logits rows of request 0)."""
    device = engine.device
    rids = [engine.add_request(p, hc.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)) for p in prompts]
    times, logits_rows = [], []
    original = engine.runner.forward
    if record_logits:
        def forward(batch):
            out = original(batch)
            if batch.requests[0].rid == rids[0] and len(logits_rows) < CHECK_TOKENS:
                logits_rows.append(out[0].float().cpu())
            return out
        engine.runner.forward = forward
    try:
        while engine.has_unfinished():
            before = engine.stats()["decode_steps"]
            _sync(device)
            t0 = time.perf_counter()
            engine.step()
            _sync(device)
            dt = time.perf_counter() - t0
            if engine.stats()["decode_steps"] > before:
                times.append(dt)
    finally:
        engine.runner.forward = original
    tokens = engine.pop_finished(rids[0]).output[:CHECK_TOKENS]
    for rid in rids[1:]:
        engine.pop_finished(rid)
    return times, tokens, logits_rows


def run_prefill(engine, prompt, repeats=3):
    best = float("inf")
    for _ in range(repeats):
        rid = engine.add_request(prompt, hc.SamplingParams(max_new_tokens=1, ignore_eos=True))
        _sync(engine.device)
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        _sync(engine.device)
        best = min(best, time.perf_counter() - t0)
        engine.pop_finished(rid)
    return len(prompt) / best


@torch.inference_mode()
def graph_replay_ms(engine, iters=50):
    """GPU time of one replay of the smallest full decode graph (batch 1 pads to it): median
    milliseconds over ``iters`` replays."""
    fg = engine.runner.full_graphs
    key = min(fg.graphs, key=lambda k: k.batch_size)
    graph, _ = fg.graphs[key]
    fg.buffers.reset(key)
    return replay_ms(graph, iters)


def host_breakdown(engine, prompt, steps=32):
    """Mean host milliseconds per decode step at batch 1 of ``build_metadata`` and of
    ``runner.forward`` (metadata + buffer fill + replay launch; no sync), and of the whole step
    (synchronised)."""
    runner = engine.runner
    acc = {"build_metadata": 0.0, "runner_forward": 0.0, "step": 0.0}
    counted = [0]
    originals = runner.build_metadata, runner.forward

    def timed(name, fn):
        def wrapper(*a):
            t0 = time.perf_counter()
            out = fn(*a)
            acc[name] += time.perf_counter() - t0
            return out
        return wrapper

    rid = engine.add_request(prompt, hc.SamplingParams(max_new_tokens=steps + 4, ignore_eos=True))
    for _ in range(3):
        engine.step()
    runner.build_metadata, runner.forward = timed("build_metadata", originals[0]), timed("runner_forward", originals[1])
    try:
        for _ in range(steps):
            _sync(engine.device)
            t0 = time.perf_counter()
            engine.step()
            _sync(engine.device)
            acc["step"] += time.perf_counter() - t0
            counted[0] += 1
    finally:
        runner.build_metadata, runner.forward = originals
    while engine.has_unfinished():
        engine.step()
    engine.pop_finished(rid)
    return {k: 1e3 * v / counted[0] for k, v in acc.items()}


def profile_decode(engine, prompt, steps=8):
    """Kernel-time summary of ``steps`` decode steps at batch 1 (after the prefill)."""
    rid = engine.add_request(prompt, hc.SamplingParams(max_new_tokens=steps + 4, ignore_eos=True))
    for _ in range(3):  # prefill + warm decode steps
        engine.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished():
        engine.step()
    engine.pop_finished(rid)
    rows = []
    for e in prof.key_averages():
        dev_us = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0))
        if dev_us > 0:
            rows.append({"name": e.key[:90], "calls": e.count, "device_us_per_step": dev_us / steps})
    rows.sort(key=lambda r: -r["device_us_per_step"])
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    return rows[:25], table


def compare_tokens(ref, ref_logits, got, got_logits, tolerance):
    n = min(len(ref), len(got))
    first = next((i for i in range(n) if ref[i] != got[i]), None)
    common = n if first is None else first + 1
    diffs = [float((a - b).abs().max()) for a, b in zip(ref_logits[:common], got_logits[:common])]
    out = {"tokens_equal": first is None and len(ref) == len(got), "first_divergence": first,
           "max_logit_diff": max(diffs) if diffs else None}
    if first is not None and first < len(ref_logits):
        top = torch.topk(ref_logits[first], 2).values
        gap = float(top[0] - top[1])
        out["eager_top2_gap_at_divergence"] = gap
        out["accepted_tie_flip"] = gap <= tolerance
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="toy-size reference model (CPU smoke run)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=4096)
    ap.add_argument("--tie-tolerance", type=float, default=0.125, help="bf16 logit gap below which a flip is a tie")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches = [int(b) for b in args.batches.split(",")]
    if args.tiny:
        args.prompt_len, args.new_tokens, args.prefill_len = min(args.prompt_len, 32), min(args.new_tokens, 8), min(args.prefill_len, 64)
    model = build_qwen3_next_reference(dtype, device, seed=0, tiny=args.tiny)
    vocab = model.config.vocab_size
    max_bs = max(batches)
    engine_kw = dict(
        max_running_requests=max_bs, chunked_prefill_size=max(args.prefill_len, 512),
        max_total_tokens=max_bs * (args.prompt_len + args.new_tokens) + args.prefill_len + 512,
        mamba_cache_size=max_bs + 2, enable_prefix_cache=False,
    )
    prefill_prompt = _prompts(1, args.prefill_len, vocab, seed=1)[0]
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "dtype": str(dtype), "tiny": args.tiny,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "prefill_len": args.prefill_len,
        "engine": {k: v for k, v in engine_kw.items()}, "modes": {},
    }
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"engine_modes_{'tiny_' if args.tiny else ''}{device.type}.json")
    ref_tokens = ref_logits = None
    for mode in args.modes.split(","):
        print(f"== {mode}", flush=True)
        r = result["modes"][mode] = {}
        t0 = time.perf_counter()
        try:
            engine = hc.wrap(model, **MODES[mode], **engine_kw)
        except (ValueError, NotImplementedError) as e:
            r["unsupported"] = str(e)
            print(f"   unsupported: {e}")
            continue
        r["build_seconds"] = time.perf_counter() - t0
        r["decode_ms"] = {}
        for b in batches:
            prompts = _prompts(b, args.prompt_len, vocab, seed=100 + b)
            times, tokens, logits_rows = run_decode(engine, prompts, args.new_tokens, record_logits=(b == 1))
            r["decode_ms"][str(b)] = 1e3 * statistics.median(times)
            print(f"   decode b={b}: {r['decode_ms'][str(b)]:.3f} ms/step ({len(times)} steps)", flush=True)
            if b == 1:
                if ref_tokens is None:
                    ref_tokens, ref_logits = tokens, logits_rows
                    r["check"] = {"reference": True}
                else:
                    r["check"] = compare_tokens(ref_tokens, ref_logits, tokens, logits_rows, args.tie_tolerance)
                print(f"   check vs {args.modes.split(',')[0]}: {r['check']}", flush=True)
        r["prefill_tokens_per_s"] = run_prefill(engine, prefill_prompt)
        print(f"   prefill {args.prefill_len}: {r['prefill_tokens_per_s']:.0f} tok/s", flush=True)
        if engine.runner.full_graphs is not None:
            r["graph_replay_ms_b1"] = graph_replay_ms(engine)
            print(f"   full graph replay alone (b=1): {r['graph_replay_ms_b1']:.3f} ms", flush=True)
            r["host_ms_b1"] = host_breakdown(engine, _prompts(1, args.prompt_len, vocab, seed=8)[0])
            print(f"   host ms per decode step (b=1): {r['host_ms_b1']}", flush=True)
            if not args.no_profile and "profile" not in result:
                rows, table = profile_decode(engine, _prompts(1, args.prompt_len, vocab, seed=7)[0])
                result["profile"] = {"mode": mode, "top_kernels": rows}
                print(table)
        r["compile"] = engine.stats()["compile"]
        _write(result, out)
        print(f"   compile: {json.dumps({k: v for k, v in r['compile'].items() if k != 'split_ops_seen'})}")
        engine.close()
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    eager = result["modes"].get("eager", {})
    print("\nmode        build s   " + "  ".join(f"b={b:<3} ms (x)  " for b in batches) + "  prefill tok/s (x)")
    for mode, r in result["modes"].items():
        if "decode_ms" not in r:
            continue
        cells = []
        for b in batches:
            ms = r["decode_ms"][str(b)]
            base = eager.get("decode_ms", {}).get(str(b))
            cells.append(f"{ms:8.3f} ({base / ms if base else float('nan'):4.2f}x)")
        pf, pbase = r["prefill_tokens_per_s"], eager.get("prefill_tokens_per_s")
        print(f"{mode:10s} {r['build_seconds']:8.1f}   " + "  ".join(cells)
              + f"   {pf:9.0f} ({pf / pbase if pbase else float('nan'):4.2f}x)")
    _write(result, out)
    print(f"wrote {out}")


def _write(result, out):
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
