"""Mixed steps (prefill chunks + decode rows in one step) against their two halves alone, and the
256-request workload of ``benchmarks/e2e.py``, on the reference model with the default engine.

    python benchmarks/mixed_steps.py                       # reference Qwen3-Next, bf16, CUDA
    python benchmarks/mixed_steps.py --tiny --device cpu   # CPU smoke run

Every timed forward is ``engine.runner.forward`` under ``benchmarks/profiling.py``'s ``StepTrace`` (the device
synchronised before and after it):
``host_ms`` is the time until the forward returned (the host's work, while the GPU runs behind it),
``wall_ms`` until the GPU finished. Per prompt length P (``--prompts``) the best of ``--repeats``
prefills of one P-token prompt alone; per decode batch D (``--decodes``) a decode step of D
requests (prompts of ``--context`` tokens); per (D, P) the mixed step of those D requests decoding
when a P-token prompt arrives, and ``ratio = mixed / (prefill P + decode D)`` (issue goal: <= 1.1); the mixed steps again with the
decode rows inside the extend paths (``mixed_unsplit``: the scheduler's ``split_mixed_steps`` off, as
``EngineConfig.extra["split_mixed_steps"] = False`` sets it), same process.
With ``--cb N``: the continuous-batching workload of ``benchmarks/e2e.py`` (256 requests of random
prompt and output lengths, queued at once; ``max_running_requests`` 64, ``chunked_prefill_size``
8192), N runs in the same process, each with output tok/s, mean TTFT and the engine's step counters
(``mixed_steps``, ``mixed_decode_rows``; ``unpadded_steps`` and ``piecewise_replays`` of the compile
stats), and the seconds its extend and decode steps took (a second pass with the timed forwards).

Output: printed table + JSON (``--out``, default ``benchmarks/results/mixed_steps_<device>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hybrid_compile as hc  # noqa: E402
from hybrid_compile import SamplingParams  # noqa: E402

from benchmarks import e2e  # noqa: E402
from benchmarks.profiling import StepTrace  # noqa: E402
from benchmarks.reference_models import build_qwen3_next_reference, random_token_prompts  # noqa: E402


def _ms(row: dict) -> dict:
    """A :class:`~benchmarks.profiling.StepTrace` row with its times in milliseconds."""
    out = {k: v for k, v in row.items() if k not in ("seconds", "host_seconds")}
    return dict(out, host_ms=1e3 * row["host_seconds"], wall_ms=1e3 * row["seconds"])


def first_forward(engine, mode: str, steps) -> dict:
    """Run ``steps()`` (engine steps) with every forward timed (``StepTrace``) until one of ``mode`` ran:
    that forward's row."""
    with StepTrace(engine) as trace:
        for _ in range(4):
            steps()
            hit = [r for r in trace.rows if r["mode"] == mode]
            if hit:
                return _ms(hit[0])
    raise RuntimeError(f"no {mode} forward in 4 engine steps")


def _finish(engine, rids) -> None:
    """Abort what still runs of ``rids``, step until nothing is left, forget them and the prefix cache."""
    for r in rids:
        engine.abort(r)
    while engine.has_unfinished():
        engine.step()
    for r in rids:
        engine.pop_finished(r)
    engine.clear_prefix_cache()


def prefill(engine, vocab: int, length: int, repeats: int) -> dict:
    best = None
    for i in range(repeats):
        rid = engine.add_request(random_token_prompts(1, length, vocab, 10 + i)[0], SamplingParams(max_new_tokens=1))
        row = first_forward(engine, "extend", engine.step)
        _finish(engine, [rid])
        best = row if best is None or row["wall_ms"] < best["wall_ms"] else best
    return best


def decode_and_mixed(engine, vocab: int, batch: int, lengths: list[int], context: int, repeats: int) -> dict:
    """Per prompt length: the decode step of ``batch`` requests (best of repeats), then the mixed step
    when one prompt of that length arrives (best of repeats)."""
    out = {}
    for length in lengths:
        decodes, mixed = [], []
        for i in range(repeats):
            rids = [engine.add_request(p, SamplingParams(max_new_tokens=32, ignore_eos=True))
                    for p in random_token_prompts(batch, context, vocab, 20 + i)]
            while not all(engine.request(r).output for r in rids):
                engine.step()
            decodes.append(first_forward(engine, "decode", engine.step))
            rids.append(engine.add_request(random_token_prompts(1, length, vocab, 30 + i)[0],
                                           SamplingParams(max_new_tokens=1)))
            mixed.append(first_forward(engine, "extend", engine.step))
            _finish(engine, rids)
        out[length] = (min(decodes, key=lambda r: r["wall_ms"]), min(mixed, key=lambda r: r["wall_ms"]))
    return out


def continuous_batching(engine, vocab: int, tiny: bool, runs: int) -> list[dict]:
    s = e2e.settings_for(tiny, False)
    out = []
    for i in range(runs):
        before = dict(engine.stats())
        before_compile = dict(before.get("compile", {}))
        prompts, outs = e2e.request_list(s, vocab)
        t0, rids, times = e2e.OurSystem(engine, str(engine.device)).run(prompts, outs)
        t_end = max(times[r][-1] for r in rids)
        ttft = [times[r][0] - t0 for r in rids]
        after = engine.stats()
        row = dict(run=i, requests=len(prompts), out_tok_s=sum(outs) / (t_end - t0), seconds=t_end - t0,
                   mean_ttft_s=sum(ttft) / len(ttft))
        for key in ("steps", "extend_steps", "decode_steps", "mixed_steps", "mixed_decode_rows"):
            row[key] = after[key] - before[key]
        for key in ("unpadded_steps", "piecewise_replays", "eager_fallbacks"):
            if key in after.get("compile", {}):
                row[key] = after["compile"][key] - before_compile.get(key, 0)
        engine.clear_prefix_cache()
        out.append(row)
    # the same workload once more with every forward timed: where its steps' time goes
    with StepTrace(engine) as trace:
        prompts, outs = e2e.request_list(s, vocab)
        e2e.OurSystem(engine, str(engine.device)).run(prompts, outs)
    engine.clear_prefix_cache()
    split = {}
    for mode in ("extend", "decode"):
        rows = [r for r in trace.rows if r["mode"] == mode]
        split[mode] = dict(steps=len(rows), wall_s=sum(r["seconds"] for r in rows),
                           host_s=sum(r["host_seconds"] for r in rows))
    out.append(dict(timed_forwards=split))
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="toy-size reference model (CPU smoke runs)")
    ap.add_argument("--prompts", default=None, help="prompt lengths, comma-separated (default 64,256,1024,2048,4096)")
    ap.add_argument("--decodes", default=None, help="decode batch sizes, comma-separated (default 16,63)")
    ap.add_argument("--context", type=int, default=None, help="decode requests' prompt length (default 1500)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cb", type=int, default=0, help="runs of the 256-request workload (0: none)")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda needs a CUDA device (use --device cpu --tiny for a smoke run)", file=sys.stderr)
        raise SystemExit(2)
    tiny = args.tiny
    prompts = [int(x) for x in (args.prompts or ("16,48" if tiny else "64,256,1024,2048,4096")).split(",")]
    decodes = [int(x) for x in (args.decodes or ("3" if tiny else "16,63")).split(",")]
    context = args.context or (24 if tiny else 1500)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model = build_qwen3_next_reference(dtype, args.device, tiny=tiny)
    vocab = model.config.vocab_size
    settings = e2e.settings_for(tiny, False)
    t = time.perf_counter()
    engine = hc.wrap(model, max_running_requests=settings.max_running, chunked_prefill_size=settings.chunked_prefill,
                     max_context_len=max(max(prompts), context + 64, settings.cb_prompt[1] + settings.cb_output[1]) + 64,
                     memory_fraction=0.5)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    result = dict(device=device_name, torch=torch.__version__, date=time.strftime("%Y-%m-%d"), tiny=tiny,
                  wrap_s=time.perf_counter() - t, context=context, prefill={}, mixed={}, mixed_unsplit={})
    engine.generate_batch(random_token_prompts(2, 40, vocab, 1), max_new_tokens=4)  # warm-up
    engine.clear_prefix_cache()
    for length in prompts:
        result["prefill"][length] = prefill(engine, vocab, length, args.repeats)
    for d in decodes:
        for split in (True, False):  # the decode rows as a DECODE part, and (same process) inside the extend paths
            engine.scheduler.split_mixed_steps = split
            for length, (dec, mix) in decode_and_mixed(engine, vocab, d, prompts, context, args.repeats).items():
                pre = result["prefill"][length]
                result["mixed" if split else "mixed_unsplit"][f"D{d}_P{length}"] = dict(
                    decode=dec, mixed=mix, prefill=pre, ratio=mix["wall_ms"] / (pre["wall_ms"] + dec["wall_ms"]))
    engine.scheduler.split_mixed_steps = True
    if args.cb:
        result["continuous_batching"] = continuous_batching(engine, vocab, tiny, args.cb)
    result["compile"] = {k: v for k, v in engine.stats().get("compile", {}).items() if isinstance(v, (int, float, bool))}
    engine.close()
    print(f"mixed steps on {device_name} (decode requests' context {context} tokens); ms wall (host)")
    print(f"{'case':>12} {'prefill':>16} {'decode':>16} {'mixed':>16} {'ratio':>6} {'unsplit':>16} {'ratio':>6}")

    def cell(r):
        return f"{r['wall_ms']:7.1f} ({r['host_ms']:5.1f})"

    for key, m in result["mixed"].items():
        u = result["mixed_unsplit"][key]
        print(f"{key:>12} {cell(m['prefill']):>16} {cell(m['decode']):>16} {cell(m['mixed']):>16} {m['ratio']:6.2f} "
              f"{cell(u['mixed']):>16} {u['ratio']:6.2f}")
    for row in result.get("continuous_batching", []):
        print(json.dumps(row))
    out = args.out or os.path.join("benchmarks", "results", f"mixed_steps_{'cpu' if args.device == 'cpu' else 'cuda'}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
