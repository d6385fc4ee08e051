"""Prefix-cache benchmark: SGLang's generated-shared-prefix workload on our engine, with the
cache off, the LRU policy and the Marconi policy.

    python benchmarks/prefix_cache.py --tiny                # CPU smoke run (toy model, ~10-chunk prompts)
    python benchmarks/prefix_cache.py                       # CUDA: reference Qwen3-Next (1.9 B, bf16)
    python benchmarks/prefix_cache.py --system-len 10000 --groups 8 --prompts-per-group 8

Workload (seed 004 / SGLang ``bench_serving --dataset-name generated-shared-prefix``): ``groups``
system prompts of ``system_len`` random tokens; each group has ``prompts_per_group`` prompts =
its system prompt + a question of about ``question_len`` tokens (varied +-50 %); every request
generates ``output_len`` tokens greedily (no EOS). Arrival: wave 1 is the first prompt of every
group, submitted together; when it is done the rest is submitted together (in group-interleaved
order). TTFT = time from ``add_request`` to the end of the step that samples the request's first
token, split into queue wait (to the start of the step that admits it) and prefill (the rest).
Throughput = generated tokens (and all tokens) per second over the whole run.

Engine: as SGLang's benchmark runs the server in its best mode with every request admitted, each
system gets the engine defaults (on CUDA: compile + full and piecewise CUDA graphs; ``--eager``
turns compile off) with ``max_running_requests`` = the largest wave, so TTFT measures prefill,
not queueing behind other requests' decode. One engine per system (one compile + capture): a
warm-up, then the measured phases, each on an emptied cache (counters are per phase).

Memory-pressure phase (``--no-pressure`` skips it), cache on only: the same engine with its pools
cut down by held slots (:class:`Ballast`) so the KV pool fits the running wave plus
``pressure_kv_groups`` system prompts and the Mamba pool ``pressure_mamba_slots`` states beyond
the running requests; the prompts come in random group order in waves of ``pressure_wave``. It
reports the token hit rate (prefix tokens served from the cache / tokens of the admitted
requests) of LRU and Marconi.

Host tier (``--host-tier``): adds the system ``lru_host`` (LRU with
``EngineConfig.prefix_cache_host_tier``, ``--host-bytes`` of pinned host memory): under memory
pressure the device evicts to the host and hits load back, so its pressure phase against ``lru``
shows the hit rate and TTFT the tier buys. After its phases it measures the load-back rate
(:meth:`HostPool.load_kv` of a whole KV range, GB/s) next to a plain pinned host -> device copy
of the same bytes (the copy engine's rate).

Elastic pools (``--elastic``): a workload that flips from ``flip_chats`` short chats at once
(state-bound) to ``flip_docs`` long documents (KV-bound), on pools sized for the chats, with the
fixed split and with ``EngineConfig.elastic_pools``: retractions, steps, seconds and the moves.

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
from benchmarks.profiling import StepTrace, kernel_profile  # noqa: E402
from benchmarks.reference_models import build_qwen3_next_reference  # noqa: E402

SYSTEMS = {
    "no_cache": dict(enable_prefix_cache=False),
    "lru": dict(enable_prefix_cache=True, prefix_cache_policy="lru"),
    "marconi": dict(enable_prefix_cache=True, prefix_cache_policy="marconi"),
    "lru_host": dict(enable_prefix_cache=True, prefix_cache_policy="lru", prefix_cache_host_tier=True),
}
DEFAULT_SYSTEMS = ["no_cache", "lru", "marconi"]
CACHE_COUNTERS = ("admitted_hit_tokens", "admitted_tokens", "mamba_hits", "kv_evicted_tokens", "mamba_evicted",
                  "checkpoints_tracked", "checkpoints_forked", "checkpoints_skipped", "admissions_held",
                  "host_hits", "host_hit_tokens", "host_loaded_tokens", "host_written_tokens", "host_evicted_tokens")
ENGINE_COUNTERS = ("steps", "extend_steps", "decode_steps", "prefill_tokens", "decode_tokens", "forward_seconds",
                   "retractions")


def shared_prefix_prompts(groups: int, per_group: int, system_len: int, question_len: int, vocab: int, seed: int):
    """``prompts[g][k]``: system prompt ``g`` + question ``k`` (length question_len +-50 %)."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)

    def tokens(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    systems = [tokens(system_len) for _ in range(groups)]
    lo, hi = max(1, question_len // 2), max(1, question_len * 3 // 2)
    return [[systems[i] + tokens(rng.randint(lo, hi)) for _ in range(per_group)] for i in range(groups)]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def run_waves(engine, waves: list[list[list[int]]], output_len: int) -> dict:
    """Submit each wave when the previous one is done; per-request TTFT split into queue wait
    (``add_request`` to the start of the step that admits it) and prefill (from there to the end
    of the step that samples its first token), and the run's throughput."""
    params = hc.SamplingParams(max_new_tokens=output_len, ignore_eos=True)
    ttfts: list[float] = []
    queue: list[float] = []
    out_tokens = prompt_tokens = 0
    t_start = time.perf_counter()
    for wave in waves:
        added = {}
        for prompt in wave:
            added[engine.add_request(prompt, params)] = time.perf_counter()
            prompt_tokens += len(prompt)
        first: dict[int, float] = {}
        admitted: dict[int, float] = {}
        pending = set(added)
        while pending:
            t_step = time.perf_counter()
            outs = engine.step()
            t_done = time.perf_counter()
            for r in engine.scheduler.running:
                admitted.setdefault(r.rid, t_step)
            for out in outs:
                admitted.setdefault(out.rid, t_step)
                if out.token is not None and out.rid not in first:
                    first[out.rid] = t_done
                if out.finished and out.rid in pending:
                    pending.discard(out.rid)
                    out_tokens += len(engine.pop_finished(out.rid).output)
        ttfts += [first[rid] - t for rid, t in added.items()]
        queue += [admitted[rid] - t for rid, t in added.items()]
    seconds = time.perf_counter() - t_start
    prefill = [t - q for t, q in zip(ttfts, queue)]
    return {
        "requests": len(ttfts),
        "mean_ttft_s": _mean(ttfts),
        "p50_ttft_s": sorted(ttfts)[len(ttfts) // 2],
        "p99_ttft_s": _p99(ttfts),
        "mean_queue_s": _mean(queue),
        "mean_prefill_s": _mean(prefill),
        "p99_prefill_s": _p99(prefill),
        "seconds": seconds,
        "output_tokens_per_s": out_tokens / seconds,
        "total_tokens_per_s": (out_tokens + prompt_tokens) / seconds,
    }


def cache_counters(engine) -> dict:
    s = engine.stats().get("prefix_cache")
    return {} if s is None else {k: s.get(k, 0) for k in CACHE_COUNTERS}


def phase(engine, waves, output_len: int) -> dict:
    """One measured run on an empty prefix cache; cache and engine counters are this run's (deltas:
    ``forward_seconds`` vs the run's ``seconds`` shows the host's share)."""
    engine.clear_prefix_cache()
    before = cache_counters(engine)
    engine_before = engine.stats()
    r = run_waves(engine, waves, output_len)
    engine_after = engine.stats()
    r["engine"] = {k: engine_after[k] - engine_before[k] for k in ENGINE_COUNTERS}
    after = cache_counters(engine)
    if after:
        c = {k: after[k] - before[k] for k in after}
        c["token_hit_rate"] = c["admitted_hit_tokens"] / max(c["admitted_tokens"], 1)
        s = engine.stats()["prefix_cache"]
        c["tombstones"], c["memory_bytes"] = s["tombstones"], s["memory_bytes"]
        r["cache"] = c
    return r


def profile_phase(engine, waves, output_len: int, folder: str, system: str) -> list[dict]:
    """A diagnostic (untimed) run of the phase: per-step forward times by shape and the top
    kernels, written to ``folder/prefix_cache_<system>_{steps,kernels}.txt``; returns the step
    summary."""
    os.makedirs(folder, exist_ok=True)
    engine.clear_prefix_cache()
    with StepTrace(engine) as trace, kernel_profile(os.path.join(folder, f"prefix_cache_{system}_kernels.txt"),
                                                    engine.device):
        run_waves(engine, waves, output_len)
    with open(os.path.join(folder, f"prefix_cache_{system}_steps.txt"), "w") as f:
        f.write(trace.format() + "\n")
    print(trace.format(), flush=True)
    return trace.summary()


class Ballast:
    """Holds KV and Mamba slots of an engine's pools so that only ``kv_tokens`` / ``mamba_slots``
    stay free: the memory-pressure phase on the same engine (no second compile + capture)."""

    def __init__(self, engine, kv_tokens: int, mamba_slots: int) -> None:
        pools = engine.pools
        self.pools = pools
        kv_hold = pools.kv.allocator.available() - kv_tokens
        kv_hold -= kv_hold % pools.kv.allocator.page_size
        mamba_hold = pools.mamba.available() - mamba_slots
        if kv_hold < 0 or mamba_hold < 0:
            raise ValueError(f"pressure capacity (KV {kv_tokens}, Mamba {mamba_slots}) exceeds the engine's free pools "
                             f"(KV {pools.kv.allocator.available()}, Mamba {pools.mamba.available()})")
        self.kv = pools.kv.allocator.alloc(kv_hold)
        self.mamba = pools.mamba.alloc(mamba_hold)

    def release(self) -> None:
        self.pools.kv.allocator.free(self.kv)
        self.pools.mamba.free(self.mamba)


def engine_config(system: str, args, capacity: dict) -> dict:
    """Engine defaults (on CUDA: compile + full/piecewise CUDA graphs) with room for a whole wave."""
    kw = dict(max_running_requests=args.max_running_requests, **capacity, **SYSTEMS[system])
    if args.chunked_prefill_size is not None:
        kw["chunked_prefill_size"] = args.chunked_prefill_size
    if args.eager:
        kw["compile"] = False
    if SYSTEMS[system].get("prefix_cache_host_tier"):
        kw["prefix_cache_host_bytes"] = args.host_bytes
    return kw


def _timed(fn, device, repeat: int = 5) -> float:
    """Best-of-``repeat`` seconds of ``fn()`` (synchronised on CUDA)."""
    best = float("inf")
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def load_back_rate(engine) -> dict:
    """GB/s of a host-tier load back (one host KV range into free device slots) and of a plain
    pinned host -> device copy of the same bytes, on the engine's (empty) pools."""
    engine.clear_prefix_cache()
    host, alloc = engine.host_pool, engine.pools.kv.allocator
    n = min(alloc.available(), host.kv_capacity()) // alloc.page_size * alloc.page_size
    if n == 0:
        raise ValueError("load_back_rate: no free KV slots or no host KV capacity to measure with")
    slots = alloc.alloc(n)
    try:
        start = host.write_kv(slots)
        host.synchronize()
        nbytes = n * host.bytes_per_token
        t_load = _timed(lambda: host.load_kv(start, slots), engine.device)
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=host.pin)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=engine.device)
        t_copy = _timed(lambda: dst.copy_(src, non_blocking=True), engine.device)
        host.free_kv(start, n)
    finally:
        alloc.free(slots)
    return {"tokens": n, "bytes": nbytes, "load_back_gb_s": nbytes / t_load / 1e9,
            "host_to_device_copy_gb_s": nbytes / t_copy / 1e9}


def workloads(args, vocab: int):
    """(main waves, pressure waves, main capacity, pressure capacity)."""
    prompts = shared_prefix_prompts(args.groups, args.prompts_per_group, args.system_len, args.question_len, vocab,
                                    args.seed)
    first = [group[0] for group in prompts]
    rest = [prompts[g][k] for k in range(1, args.prompts_per_group) for g in range(args.groups)]
    main = [first, rest] if rest else [first]
    longest = args.system_len + args.question_len * 3 // 2 + args.output_len
    prompts = shared_prefix_prompts(args.groups, args.prompts_per_group, args.system_len, args.question_len, vocab,
                                    args.seed + 1)
    flat = [p for group in prompts for p in group]
    random.Random(args.seed).shuffle(flat)
    b = args.pressure_wave
    pressure = [flat[i: i + b] for i in range(0, len(flat), b)]
    pressure_capacity = dict(kv_tokens=int(longest * b + args.system_len * args.pressure_kv_groups),
                             mamba_slots=b + args.pressure_mamba_slots)
    # every request of the largest wave running at once plus every group's prefix cached (and room
    # for the pressure phase, which cuts the same pools down)
    main_capacity = dict(
        max_total_tokens=args.kv_tokens or max(longest * (args.max_running_requests + args.groups),
                                               pressure_capacity["kv_tokens"]),
        mamba_cache_size=max(args.max_running_requests * 4, pressure_capacity["mamba_slots"]))
    return main, pressure, main_capacity, pressure_capacity


def run_system(model, system: str, args, vocab: int) -> dict:
    """One engine for the system: warm-up, the shared-prefix phase, then (cache on) the
    memory-pressure phase with the pools cut down by a :class:`Ballast`."""
    main, pressure, capacity, pressure_capacity = workloads(args, vocab)
    t0 = time.perf_counter()
    engine = hc.wrap(model, **engine_config(system, args, capacity))
    out = {"engine_build_s": time.perf_counter() - t0}
    try:
        t0 = time.perf_counter()
        warm = [p[: args.warmup_len] for p in main[0][:2]]
        run_waves(engine, [warm, warm[:1]], 2)  # compile / allocator warm-up, then an empty cache
        out["warmup_s"] = time.perf_counter() - t0
        if args.profile:
            out["profile_steps"] = profile_phase(engine, main, args.output_len, args.profile, system)
        out["shared_prefix"] = r = phase(engine, main, args.output_len)
        print(f"  {system:9s} mean TTFT {r['mean_ttft_s'] * 1e3:9.1f} ms (queue {r['mean_queue_s'] * 1e3:8.1f} + "
              f"prefill {r['mean_prefill_s'] * 1e3:8.1f})  p99 {r['p99_ttft_s'] * 1e3:9.1f} ms  "
              f"{r['output_tokens_per_s']:8.1f} out tok/s  hit rate {r.get('cache', {}).get('token_hit_rate', 0):.3f}",
              flush=True)
        if engine.host_pool is not None:
            out["load_back"] = r = load_back_rate(engine)
            print(f"  {system:9s} load back {r['load_back_gb_s']:.2f} GB/s vs host->device copy "
                  f"{r['host_to_device_copy_gb_s']:.2f} GB/s ({r['bytes'] / 2**20:.1f} MiB)", flush=True)
        if args.pressure and engine.prefix_cache is not None:
            engine.clear_prefix_cache()
            ballast = Ballast(engine, **pressure_capacity)
            try:
                out["pressure"] = r = phase(engine, pressure, args.output_len)
            finally:
                engine.clear_prefix_cache()
                ballast.release()
            c = r["cache"]
            print(f"  {system:9s} pressure: token hit rate {c['token_hit_rate']:.3f}  mean TTFT "
                  f"{r['mean_ttft_s'] * 1e3:9.1f} ms  (KV evicted {c['kv_evicted_tokens']}, Mamba evicted "
                  f"{c['mamba_evicted']}, host hits {c['host_hits']}, host hit tokens {c['host_hit_tokens']})",
                  flush=True)
    finally:
        engine.close()
    return out


def flip_workload(args, vocab: int):
    """(phases, engine kwargs) of the elastic-pools comparison: chats, then documents."""
    g = torch.Generator().manual_seed(args.seed + 2)

    def tokens(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    chats = [tokens(args.flip_chat_len) for _ in range(args.flip_chats)]
    docs = [tokens(args.flip_doc_len + 2 * i) for i in range(args.flip_docs)]
    phases = [(chats, args.flip_chat_output), (docs, args.flip_doc_output)]
    # KV for the chats plus ~1.5 documents; Mamba slots for the chats and their cached states
    kv = args.flip_chats * (args.flip_chat_len + args.flip_chat_output) // 2 + args.flip_doc_len * 3 // 2
    engine = dict(max_running_requests=args.flip_chats, max_total_tokens=kv, mamba_cache_size=4 * args.flip_chats,
                  chunked_prefill_size=args.chunked_prefill_size or 2048, cuda_graphs=False)
    return phases, engine


def run_elastic_comparison(model, args, vocab: int) -> dict:
    """The flip workload with the fixed split and with elastic pools (same outputs asserted)."""
    phases, kw = flip_workload(args, vocab)
    if args.eager:
        kw["compile"] = False
    out, outputs = {}, {}
    for name, elastic in (("fixed", False), ("elastic", True)):
        engine = hc.wrap(model, elastic_pools=elastic, **kw)
        try:
            t0 = time.perf_counter()
            outputs[name] = [engine.generate_batch(p, max_new_tokens=n) for p, n in phases]
            st = engine.stats()
            out[name] = {"seconds": time.perf_counter() - t0, "retractions": st["retractions"], "steps": st["steps"],
                         "pools": st["memory"]["capacity"], "moves": st["memory"]["moves"]}
        finally:
            engine.close()
        r = out[name]
        print(f"  {name:8s} retractions {r['retractions']:3d}  steps {r['steps']:5d}  {r['seconds']:7.2f} s  "
              f"KV {r['pools']['kv_tokens']} tokens / Mamba {r['pools']['mamba_slots']} slots at the end  "
              f"moves {r['moves']['to_kv']} to KV, {r['moves']['to_mamba']} to Mamba", flush=True)
    if outputs["fixed"] != outputs["elastic"]:
        raise AssertionError("elastic pools changed the greedy outputs of the flip workload")
    out["settings"] = kw
    return out


def main_results(per_system: dict) -> tuple[dict, dict]:
    shared = {s: r["shared_prefix"] for s, r in per_system.items()}
    base = shared.get("no_cache")
    if base:
        for r in shared.values():
            r["ttft_speedup_vs_no_cache"] = base["mean_ttft_s"] / r["mean_ttft_s"]
            r["throughput_ratio_vs_no_cache"] = r["output_tokens_per_s"] / base["output_tokens_per_s"]
    pressure = {s: r["pressure"] for s, r in per_system.items() if "pressure" in r}
    return shared, pressure


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="toy model on CPU, short prompts (smoke run)")
    p.add_argument("--groups", type=int, default=None)
    p.add_argument("--prompts-per-group", type=int, default=None)
    p.add_argument("--system-len", type=int, default=None)
    p.add_argument("--question-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=None, help="default: the largest wave")
    p.add_argument("--chunked-prefill-size", type=int, default=None, help="default: the engine's")
    p.add_argument("--kv-tokens", type=int, default=None, help="KV pool size of the main run (default: roomy)")
    p.add_argument("--pressure-wave", type=int, default=None, help="requests per wave of the pressure run")
    p.add_argument("--pressure-kv-groups", type=float, default=2.5, help="KV pool: this many system prompts")
    p.add_argument("--pressure-mamba-slots", type=int, default=None, help="Mamba slots beyond the running requests")
    p.add_argument("--no-pressure", dest="pressure", action="store_false")
    p.add_argument("--systems", nargs="+", default=None, choices=list(SYSTEMS),
                   help=f"default: {' '.join(DEFAULT_SYSTEMS)} (+ lru_host with --host-tier)")
    p.add_argument("--host-tier", action="store_true", help="add the system lru_host (prefix cache with a host tier)")
    p.add_argument("--host-bytes", type=int, default=None,
                   help="host tier size of lru_host (default: 4 GiB; --tiny: 16 MiB)")
    p.add_argument("--eager", action="store_true", help="EngineConfig.compile=False (default: the engine's, "
                   "i.e. compile + CUDA graphs on CUDA)")
    p.add_argument("--warmup-len", type=int, default=None, help="prompt length of the warm-up requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="before the timed shared-prefix phase, a traced run of it: per-step times and top kernels "
                        "written under DIR (benchmarks/profiling.py)")
    p.add_argument("--elastic", action="store_true",
                   help="also run the chats -> documents flip with the fixed split and with elastic pools")
    p.add_argument("--flip-chats", type=int, default=None, help="chats at once in the flip workload")
    p.add_argument("--flip-chat-len", type=int, default=None)
    p.add_argument("--flip-chat-output", type=int, default=None)
    p.add_argument("--flip-docs", type=int, default=None, help="documents of the flip workload")
    p.add_argument("--flip-doc-len", type=int, default=None)
    p.add_argument("--flip-doc-output", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    defaults = (dict(groups=4, prompts_per_group=4, system_len=660, question_len=96, output_len=8,
                     chunked_prefill_size=256, pressure_wave=8, pressure_mamba_slots=4, warmup_len=300)
                if args.tiny else
                dict(groups=8, prompts_per_group=8, system_len=10000, question_len=128, output_len=32,
                     pressure_wave=16, pressure_mamba_slots=8, warmup_len=3000))
    defaults["host_bytes"] = 16 << 20 if args.tiny else 4 << 30
    defaults.update(dict(flip_chats=8, flip_chat_len=12, flip_chat_output=3, flip_docs=3, flip_doc_len=40,
                         flip_doc_output=28) if args.tiny else
                    dict(flip_chats=64, flip_chat_len=256, flip_chat_output=32, flip_docs=4, flip_doc_len=8000,
                         flip_doc_output=512))
    defaults["systems"] = DEFAULT_SYSTEMS + (["lru_host"] if args.host_tier else [])
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.max_running_requests is None:
        args.max_running_requests = max(args.groups * (args.prompts_per_group - 1), args.groups, args.pressure_wave)
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
    t_start = time.perf_counter()
    model = build_qwen3_next_reference(dtype, device, seed=0, tiny=args.tiny)
    vocab = model.config.vocab_size
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"prefix cache benchmark on {device_name}: {args.groups} groups x {args.prompts_per_group} prompts, system "
          f"{args.system_len}, question ~{args.question_len}, output {args.output_len}, max running "
          f"{args.max_running_requests}", flush=True)
    run = {
        "device": device_name,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "model": "qwen3_next_reference" + ("_tiny" if args.tiny else ""),
    }
    per_system = {}
    for system in args.systems:
        per_system[system] = run_system(model, system, args, vocab)
    run["engines"] = {s: {k: v for k, v in r.items() if k.endswith("_s")} for s, r in per_system.items()}
    run["shared_prefix"], run["pressure"] = main_results(per_system)
    _, _, run["capacity"], run["pressure_capacity"] = workloads(args, vocab)
    print("shared-prefix workload (mean TTFT = queue wait + prefill):")
    for s, r in run["shared_prefix"].items():
        print(f"  {s:9s} {r['mean_ttft_s'] * 1e3:9.1f} ms = {r['mean_queue_s'] * 1e3:8.1f} + "
              f"{r['mean_prefill_s'] * 1e3:8.1f}   x{r.get('ttft_speedup_vs_no_cache', float('nan')):.2f} vs no cache  "
              f"hit rate {r.get('cache', {}).get('token_hit_rate', 0):.3f}")
    if run["pressure"]:
        print("memory pressure (token hit rate, mean TTFT):")
        for s, r in run["pressure"].items():
            print(f"  {s:9s} {r['cache']['token_hit_rate']:.3f}  {r['mean_ttft_s'] * 1e3:9.1f} ms")
    run["load_back"] = {s: r["load_back"] for s, r in per_system.items() if "load_back" in r}
    if args.elastic:
        print("chats -> documents flip, fixed split vs elastic pools:")
        run["elastic"] = run_elastic_comparison(model, args, vocab)
    run["total_s"] = time.perf_counter() - t_start
    print(f"total {run['total_s']:.1f} s")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"prefix_cache_{'tiny' if args.tiny else device_name.replace(' ', '_').lower()}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(run, f, indent=2)
    print(f"saved {out}")
    return run


if __name__ == "__main__":
    main()
