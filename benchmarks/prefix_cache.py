"""Prefix-cache benchmark: SGLang's generated-shared-prefix workload on our engine, with the
cache off, the LRU policy and the Marconi policy.

    python benchmarks/prefix_cache.py --tiny                # CPU smoke run (toy model, ~10-chunk prompts)
    python benchmarks/prefix_cache.py                       # CUDA: reference Qwen3-Next (1.9 B, bf16)
    python benchmarks/prefix_cache.py --system-len 10000 --groups 8 --prompts-per-group 8
    python benchmarks/prefix_cache.py --chat --no-shared-prefix --no-pressure --systems no_cache lru lru_host

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
``EngineConfig.prefix_cache_host_tier``, ``--host-bytes`` of pinned host memory: 4 GiB, 8 GiB with
``--chat``): under memory pressure the device evicts to the host and hits load back, so its
pressure and chat phases against ``lru`` show the hit rate and TTFT the tier buys. After its
shared-prefix phase it measures the load-back rate (:meth:`HostPool.load_kv` of a whole KV range,
GB/s) next to a plain pinned host -> device copy of the same bytes (the copy engine's rate).

Multi-turn chat (``--chat``; with ``--no-shared-prefix --no-pressure`` it runs alone):
``chat_conversations`` conversations, each a first message of ``chat_first_len`` random tokens
and then ``chat_turns - 1`` more turns whose prompt is the previous prompt + the engine's own
(greedy) answer + a user message of ``chat_user_len`` +-50 % tokens, so every turn's prefix is the
previous turn's whole sequence. Each round (turn) takes the conversations in a new seeded random
order, in waves of ``chat_wave``. The device pools are cut down (:class:`Ballast`) to a KV pool
that the prefix set -- what the turns after the first can hit (the previous prompt + answer), summed
over the conversations and averaged over the rounds -- is ``chat_cache_ratio`` (4) times, and
Mamba slots for the wave plus ``1 / chat_cache_ratio`` of the conversations' states, so between
two turns of a conversation the others evict it from the device. Per system: token hit rate, host
hit tokens, TTFT (mean / p50 / p99) of the turns after the first, throughput; with the host tier
the bytes, device seconds and GB/s of its load backs (:class:`LoadBackTimer`) beside the plain
pinned copy rate; the mean TTFT ratio lru / lru_host; and whether every system answered the same
tokens (``outputs_equal``: bf16 near-ties may flip on a GPU; fp32 on the CPU must not).

Elastic pools (``--elastic``): a workload that flips from ``flip_chats`` short chats at once
(state-bound) to ``flip_docs`` long documents (KV-bound), on pools sized for the chats, with the
fixed split and with ``EngineConfig.elastic_pools``: retractions, steps, seconds and the moves.

Prints a table and saves JSON under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
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


def _token_source(seed: int, vocab: int):
    """``tokens(n)``: ``n`` random token ids in [0, vocab) from one generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()


def shared_prefix_prompts(groups: int, per_group: int, system_len: int, question_len: int, vocab: int, seed: int):
    """``prompts[g][k]``: system prompt ``g`` + question ``k`` (length question_len +-50 %)."""
    tokens = _token_source(seed, vocab)
    rng = random.Random(seed)
    systems = [tokens(system_len) for _ in range(groups)]
    lo, hi = max(1, question_len // 2), max(1, question_len * 3 // 2)
    return [[systems[i] + tokens(rng.randint(lo, hi)) for _ in range(per_group)] for i in range(groups)]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def run_waves(engine, waves, output_len: int, *, outputs: list | None = None, ttft_skip: int = 0) -> dict:
    """Submit each wave when the previous one is done; per-request TTFT split into queue wait
    (``add_request`` to the start of the step that admits it) and prefill (from there to the end
    of the step that samples its first token), and the run's throughput.

    ``waves`` may be a generator: the next wave is drawn only once the previous one is done, and
    ``outputs`` (when given) has every request's output tokens appended in submission order by
    then (the chat phase builds its next prompts from them). The TTFT statistics leave out the
    first ``ttft_skip`` requests (the chat's first turns); throughput counts every request."""
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
        finished: dict[int, list[int]] = {}
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
                    finished[out.rid] = engine.pop_finished(out.rid).output
                    out_tokens += len(finished[out.rid])
        ttfts += [first[rid] - t for rid, t in added.items()]
        queue += [admitted[rid] - t for rid, t in added.items()]
        if outputs is not None:
            outputs += [list(finished[rid]) for rid in added]
    seconds = time.perf_counter() - t_start
    requests = len(ttfts)
    ttfts, queue = ttfts[ttft_skip:], queue[ttft_skip:]
    prefill = [t - q for t, q in zip(ttfts, queue)]
    return {
        "requests": requests,
        "ttft_requests": len(ttfts),
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


def phase(engine, waves, output_len: int, **run_kw) -> dict:
    """One measured run on an empty prefix cache; cache and engine counters are this run's (deltas:
    ``forward_seconds`` vs the run's ``seconds`` shows the host's share). ``run_kw``: of
    :func:`run_waves`."""
    engine.clear_prefix_cache()
    before = cache_counters(engine)
    engine_before = engine.stats()
    r = run_waves(engine, waves, output_len, **run_kw)
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


class ChatWorkload:
    """The chat phase: ``first[c]`` opens conversation ``c`` and ``users[c][t]`` is its user message
    of turn ``t + 2``; ``order[t]`` is the conversations' order in round ``t + 1``, cut into waves
    of ``wave``; ``capacity`` sizes the device pools (:class:`Ballast`); ``info`` goes to the JSON.
    (A plain class: the tests load this script without registering it in ``sys.modules``, which
    ``dataclasses`` needs.)"""

    def __init__(self, first: list[list[int]], users: list[list[list[int]]], order: list[list[int]], wave: int,
                 capacity: dict, info: dict) -> None:
        self.first, self.users, self.order, self.wave, self.capacity, self.info = \
            first, users, order, wave, capacity, info

    def waves(self, outputs: list[list[int]]):
        """The waves, round after round. After the first turn a conversation's prompt is its
        previous prompt + its answer (read from ``outputs``, which :func:`run_waves` fills in
        submission order before it draws the next wave) + its next user message."""
        prompts = [list(f) for f in self.first]
        answers: list[list[int]] = [[] for _ in self.first]
        for turn, order in enumerate(self.order):
            for i in range(0, len(order), self.wave):
                convs = order[i: i + self.wave]
                if turn:
                    for c in convs:
                        prompts[c] = prompts[c] + answers[c] + self.users[c][turn - 1]
                yield [prompts[c] for c in convs]
                for c, answer in zip(convs, outputs[-len(convs):]):
                    answers[c] = answer


def chat_workload(args, vocab: int) -> ChatWorkload:
    """``chat_conversations`` conversations of ``chat_turns`` turns (a first message of
    ``chat_first_len`` random tokens, then user messages of ``chat_user_len`` +-50 %), each round
    in a new random order, and the device pools that make the prefix set ``chat_cache_ratio`` x
    the KV pool (the ratio it gets is in ``info``)."""
    n, turns, wave, out = args.chat_conversations, args.chat_turns, args.chat_wave, args.output_len
    if turns < 2:
        raise ValueError(f"--chat-turns must be >= 2 (a first turn has nothing to hit), got {turns}")
    if not 1 <= wave <= n:
        raise ValueError(f"--chat-wave ({wave}) must lie in [1, --chat-conversations ({n})]")
    if args.chat_cache_ratio <= 0:
        raise ValueError(f"--chat-cache-ratio must be > 0, got {args.chat_cache_ratio}")
    tokens = _token_source(args.seed + 3, vocab)
    rng = random.Random(args.seed + 3)
    lo, hi = max(1, args.chat_user_len // 2), max(1, args.chat_user_len * 3 // 2)
    first = [tokens(args.chat_first_len) for _ in range(n)]
    users = [[tokens(rng.randint(lo, hi)) for _ in range(turns - 1)] for _ in range(n)]
    order = [rng.sample(range(n), n) for _ in range(turns)]
    # greedy with ignore_eos: every answer has output_len tokens, so every prompt's length is known
    lens = [list(itertools.accumulate([len(f)] + [len(u) + out for u in us])) for f, us in zip(first, users)]
    # what turn t + 1 can hit: turn t's prompt + answer but its last token (sampled, never computed)
    prefix_sets = [sum(ls[t] + out - 1 for ls in lens) for t in range(turns - 1)]
    kv = max(1, round(_mean(prefix_sets) / args.chat_cache_ratio))
    wave_tokens = sum(sorted((ls[-1] + out for ls in lens), reverse=True)[:wave])
    if kv < wave_tokens:
        raise ValueError(
            f"chat: a device KV pool of {kv} tokens (the prefix set, {_mean(prefix_sets):.0f} tokens, / "
            f"--chat-cache-ratio {args.chat_cache_ratio}) cannot hold a wave of {wave} conversations at their last "
            f"turn ({wave_tokens} tokens): raise --chat-conversations or lower --chat-wave / --chat-cache-ratio")
    # the running wave's states plus the same share of the conversations' states as of their KV
    mamba = wave + math.ceil(n / args.chat_cache_ratio)
    info = dict(conversations=n, turns=turns, wave=wave, requests=n * turns, kv_tokens=kv, mamba_slots=mamba,
                wave_tokens=wave_tokens, prefix_set_tokens=prefix_sets, cache_ratio=_mean(prefix_sets) / kv,
                cache_ratio_last_turn=prefix_sets[-1] / kv, state_ratio=n / (mamba - wave))
    return ChatWorkload(first, users, order, wave, dict(kv_tokens=kv, mamba_slots=mamba), info)


class LoadBackTimer:
    """``with LoadBackTimer(host_pool) as t:`` times every host-tier load back of the block
    (:meth:`HostPool.load_kv` / :meth:`~HostPool.load_mamba`): on CUDA with events on the compute
    stream around each load, after the waits for writes in flight that the load makes anyway (so
    only its copies are timed, with no host sync in the timed run); on the CPU by wall time.
    :meth:`result`: the loads, bytes (the pool's counter), seconds and GB/s."""

    METHODS = ("load_kv", "load_mamba")

    def __init__(self, host) -> None:
        self.host, self.events, self.cpu_seconds = host, [], 0.0

    def __enter__(self) -> "LoadBackTimer":
        self.before = dict(self.host.counters)
        for name in self.METHODS:
            setattr(self.host, name, self._timed(getattr(self.host, name)))
        return self

    def __exit__(self, *exc) -> None:
        for name in self.METHODS:
            delattr(self.host, name)

    def _timed(self, inner):
        host = self.host

        def timed(*args):
            if not host.cuda:
                t0 = time.perf_counter()
                inner(*args)
                self.cpu_seconds += time.perf_counter() - t0
                return
            stream = torch.cuda.current_stream(host.device)
            host.wait_for_writes(stream)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            inner(*args)
            end.record(stream)
            self.events.append((start, end))

        return timed

    def result(self) -> dict:
        if self.events:
            self.events[-1][1].synchronize()
        seconds = self.cpu_seconds + sum(s.elapsed_time(e) for s, e in self.events) / 1e3
        nbytes = self.host.counters["load_bytes"] - self.before["load_bytes"]
        return {"loads": self.host.counters["loads"] - self.before["loads"], "bytes": nbytes, "seconds": seconds,
                "gb_s": nbytes / seconds / 1e9 if seconds else 0.0}


def chat_phase(engine, chat: ChatWorkload, output_len: int) -> tuple[dict, list[list[int]]]:
    """The chat phase on the pools cut down to ``chat.capacity``: :func:`phase`'s figures (TTFT of
    the turns after the first) plus, with a host tier, its capacity and the load backs' bytes,
    device seconds and GB/s; and every answer, in submission order."""
    engine.clear_prefix_cache()
    ballast = Ballast(engine, **chat.capacity)
    host = engine.host_pool
    timer = LoadBackTimer(host) if host is not None else contextlib.nullcontext()
    outputs: list[list[int]] = []
    try:
        with timer:
            r = phase(engine, chat.waves(outputs), output_len, outputs=outputs, ttft_skip=len(chat.first))
    finally:
        engine.clear_prefix_cache()
        ballast.release()
    if host is not None:
        r["load_back"] = timer.result()
        r["host_capacity"] = {"kv_tokens": host.kv_capacity(), "mamba_slots": host.mamba_capacity()}
    return r, outputs


def engine_capacity(args, vocab: int) -> dict:
    """Pools with room for every phase run (the pressure and chat phases cut them down with a
    :class:`Ballast`)."""
    caps = []
    if args.shared_prefix or args.pressure:
        caps.append(workloads(args, vocab)[2])
    if args.chat:
        c = chat_workload(args, vocab).capacity
        caps.append(dict(max_total_tokens=c["kv_tokens"], mamba_cache_size=c["mamba_slots"]))
    return {k: max(c[k] for c in caps) for k in caps[0]}


def run_system(model, system: str, args, vocab: int) -> dict:
    """One engine for the system: warm-up, the shared-prefix phase, then (cache on) the
    memory-pressure phase, then the chat phase, these two with the pools cut down by a
    :class:`Ballast`."""
    main, pressure, _, pressure_capacity = workloads(args, vocab)
    capacity = engine_capacity(args, vocab)
    t0 = time.perf_counter()
    engine = hc.wrap(model, **engine_config(system, args, capacity))
    out = {"engine_build_s": time.perf_counter() - t0}
    try:
        t0 = time.perf_counter()
        # (two of them at once fit the smallest pools a phase asks for)
        warm = [p[: min(args.warmup_len, capacity["max_total_tokens"] // 4)] for p in main[0][:2]]
        run_waves(engine, [warm, warm[:1]], 2)  # compile / allocator warm-up, then an empty cache
        out["warmup_s"] = time.perf_counter() - t0
        if args.profile:
            out["profile_steps"] = profile_phase(engine, main, args.output_len, args.profile, system)
        if args.shared_prefix:
            out["shared_prefix"] = r = phase(engine, main, args.output_len)
            print(f"  {system:9s} mean TTFT {r['mean_ttft_s'] * 1e3:9.1f} ms (queue {r['mean_queue_s'] * 1e3:8.1f} + "
                  f"prefill {r['mean_prefill_s'] * 1e3:8.1f})  p99 {r['p99_ttft_s'] * 1e3:9.1f} ms  "
                  f"{r['output_tokens_per_s']:8.1f} out tok/s  hit rate "
                  f"{r.get('cache', {}).get('token_hit_rate', 0):.3f}", flush=True)
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
        if args.chat:
            chat = chat_workload(args, vocab)
            out["chat"], out["chat_outputs"] = r, _ = chat_phase(engine, chat, args.output_len)
            c = r.get("cache", {})
            print(f"  {system:9s} chat: token hit rate {c.get('token_hit_rate', 0):.3f}  mean TTFT (turns >= 2) "
                  f"{r['mean_ttft_s'] * 1e3:9.1f} ms  p99 {r['p99_ttft_s'] * 1e3:9.1f} ms  "
                  f"{r['output_tokens_per_s']:8.1f} out tok/s  (host hit tokens {c.get('host_hit_tokens', 0)})",
                  flush=True)
            held = r.get("host_capacity")
            if held and (held["kv_tokens"] < chat.info["prefix_set_tokens"][-1]
                         or held["mamba_slots"] < chat.info["conversations"]):
                print(f"  WARNING: the host tier ({held['kv_tokens']} KV tokens, {held['mamba_slots']} states) is "
                      f"smaller than the chat's prefix set ({chat.info['prefix_set_tokens'][-1]} tokens, "
                      f"{chat.info['conversations']} states): host evictions cut its hits (raise --host-bytes)",
                      flush=True)
    finally:
        engine.close()
    return out


def flip_workload(args, vocab: int):
    """(phases, engine kwargs) of the elastic-pools comparison: chats, then documents. The start-up
    split is the one sized for the chats: a Mamba slot per chat (plus the two a pool keeps spare) and
    the KV of the chats at once, so the chats are state-bound and the documents, which need more KV
    than that, KV-bound."""
    tokens = _token_source(args.seed + 2, vocab)
    chats = [tokens(args.flip_chat_len) for _ in range(args.flip_chats)]
    docs = [tokens(args.flip_doc_len + 2 * i) for i in range(args.flip_docs)]
    phases = [(chats, args.flip_chat_output), (docs, args.flip_doc_output)]
    kv = args.flip_chats * (args.flip_chat_len + args.flip_chat_output)
    engine = dict(max_running_requests=args.flip_chats, max_total_tokens=kv, mamba_cache_size=args.flip_chats + 2,
                  chunked_prefill_size=args.chunked_prefill_size or 2048, cuda_graphs=False)
    return phases, engine


def fixed_split_slots(startup_slots: int) -> list[int]:
    """Mamba slot counts of the other fixed splits of the start-up split's bytes: fewer slots (more
    KV: fewer chats at once) and more (less KV: fewer documents at once), never under 3 (a running
    request and the two spare)."""
    fractions = (0.25, 0.5, 0.75, 1.5)
    return sorted({max(3, round(startup_slots * f)) for f in fractions} - {startup_slots}, reverse=True)


def _triton_cache_entries() -> int:
    """Entries of Triton's on-disk kernel cache (``TRITON_CACHE_DIR``, default ``~/.triton/cache``)."""
    path = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    return len(os.listdir(path)) if os.path.isdir(path) else 0


def run_elastic_comparison(model, args, vocab: int) -> dict:
    """The flip workload with the start-up split and with elastic pools (same outputs asserted in
    fp32 on the CPU, compared and reported on a GPU), then with other fixed splits of the same bytes
    (``fixed_splits``: Mamba slots traded for KV tokens and back, :func:`fixed_split_slots`), so
    that elastic pools are compared with fixed splits on both sides of the start-up one. A split
    with fewer slots than the chats runs fewer chats at once (its ``max_running_requests``: the
    slots less the two spare)."""
    phases, kw = flip_workload(args, vocab)
    if args.eager:
        kw["compile"] = False
    out, outputs = {}, {}

    def run(name: str, elastic: bool, **sizes) -> dict:
        engine = hc.wrap(model, elastic_pools=elastic, **{**kw, **sizes})
        try:
            built = _triton_cache_entries()
            t0 = time.perf_counter()
            outputs[name] = [engine.generate_batch(p, max_new_tokens=n) for p, n in phases]
            st = engine.stats()
            bytes_per = (engine.pools.kv.bytes_per_token, engine.pools.mamba.bytes_per_slot)
            r = {"seconds": time.perf_counter() - t0, "retractions": st["retractions"], "steps": st["steps"],
                 "pools": st["memory"]["capacity"], "moves": st["memory"]["moves"],
                 # (a compiled forward built again after a move would cost its compile time)
                 "recompiles": st.get("compile", {}).get("recompiles", 0),
                 # Triton kernels built during the run (new entries of Triton's on-disk cache): a kernel
                 # specialised on a pool size builds again after a move
                 "triton_kernels_built": _triton_cache_entries() - built,
                 # the scheduler's asks for a move and the host time they took (elastic pools only)
                 "elastic_asks": st.get("elastic_pools", {}).get("asks"),
                 "elastic_ask_seconds": st.get("elastic_pools", {}).get("ask_seconds", 0.0)}
        finally:
            engine.close()
        print(f"  {name:8s} retractions {r['retractions']:3d}  steps {r['steps']:5d}  {r['seconds']:7.2f} s  "
              f"KV {r['pools']['kv_tokens']} tokens / Mamba {r['pools']['mamba_slots']} slots at the end  "
              f"moves {r['moves']['to_kv']} to KV, {r['moves']['to_mamba']} to Mamba  recompiles {r['recompiles']}  "
              f"Triton kernels built {r['triton_kernels_built']}"
              + (f"  asks {r['elastic_asks']} ({r['elastic_ask_seconds']:.3f} s)" if r["elastic_asks"] else ""),
              flush=True)
        return r, bytes_per

    out["fixed"], (per_token, per_slot) = run("fixed", False)
    out["elastic"], _ = run("elastic", True)
    budget = kw["max_total_tokens"] * per_token + kw["mamba_cache_size"] * per_slot
    out["fixed_splits"] = []
    for slots in (args.flip_splits if args.flip_splits is not None else fixed_split_slots(kw["mamba_cache_size"])):
        kv_tokens = (budget - slots * per_slot) // per_token
        if kv_tokens < args.flip_doc_len + 2 * (args.flip_docs - 1) + args.flip_doc_output:
            continue  # the longest document would not fit at all
        running = min(kw["max_running_requests"], slots - 2)
        r, _ = run(f"fixed/{slots}", False, mamba_cache_size=slots, max_running_requests=running,
                   max_total_tokens=kv_tokens)
        out["fixed_splits"].append(dict(r, mamba_slots=slots, max_running_requests=running))
    fixed_all = [out["fixed"]] + out["fixed_splits"]
    out["fewest_fixed_retractions"] = min(r["retractions"] for r in fixed_all)
    out["fewest_fixed_steps"] = min(r["steps"] for r in fixed_all)
    out["fastest_fixed_seconds"] = min(r["seconds"] for r in fixed_all)
    print(f"  elastic: {out['elastic']['steps']} steps against {out['fewest_fixed_steps']} for the best fixed split, "
          f"{out['elastic']['retractions']} retractions against {out['fewest_fixed_retractions']}", flush=True)
    equal = [a == b for a, b in zip(sum(outputs["fixed"], []), sum(outputs["elastic"], []))]
    out["outputs_equal"], out["requests_equal"] = all(equal), f"{sum(equal)}/{len(equal)}"
    if not all(equal):
        if args.tiny:  # fp32 on the CPU: the split never changes a token
            raise AssertionError("elastic pools changed the greedy outputs of the flip workload")
        print(f"  WARNING: {len(equal) - sum(equal)} of {len(equal)} greedy outputs differ between the splits (other "
              f"batch compositions round differently in bf16 and near-ties flip on a GPU)", flush=True)
    out["settings"] = kw
    return out


def main_results(per_system: dict) -> tuple[dict, dict]:
    shared = {s: r["shared_prefix"] for s, r in per_system.items() if "shared_prefix" in r}
    base = shared.get("no_cache")
    if base:
        for r in shared.values():
            r["ttft_speedup_vs_no_cache"] = base["mean_ttft_s"] / r["mean_ttft_s"]
            r["throughput_ratio_vs_no_cache"] = r["output_tokens_per_s"] / base["output_tokens_per_s"]
    pressure = {s: r["pressure"] for s, r in per_system.items() if "pressure" in r}
    return shared, pressure


def chat_results(per_system: dict, info: dict) -> dict:
    """The chat phase of every system: the workload's sizes, whether all systems answered the same
    tokens, the TTFT ratios and, beside each load-back rate, the plain pinned copy rate."""
    systems = {s: r["chat"] for s, r in per_system.items() if "chat" in r}
    outputs = [r["chat_outputs"] for r in per_system.values() if "chat_outputs" in r]
    res = {"workload": info, "systems": systems, "outputs_equal": all(o == outputs[0] for o in outputs)}
    base = systems.get("no_cache")
    for s, r in systems.items():
        if base:
            r["ttft_speedup_vs_no_cache"] = base["mean_ttft_s"] / r["mean_ttft_s"]
        if "load_back" in r and "load_back" in per_system[s]:
            r["load_back"]["host_to_device_copy_gb_s"] = per_system[s]["load_back"]["host_to_device_copy_gb_s"]
    if "lru" in systems and "lru_host" in systems:
        res["ttft_ratio_lru_over_lru_host"] = systems["lru"]["mean_ttft_s"] / systems["lru_host"]["mean_ttft_s"]
    return res


def print_chat(chat: dict) -> None:
    w = chat["workload"]
    print(f"multi-turn chat ({w['conversations']} conversations x {w['turns']} turns, waves of {w['wave']}; prefix "
          f"set {w['cache_ratio']:.2f} x the device KV pool of {w['kv_tokens']} tokens, {w['mamba_slots']} Mamba "
          "slots); TTFT of turns >= 2:")
    for s, r in chat["systems"].items():
        c = r.get("cache", {})
        line = (f"  {s:9s} hit rate {c.get('token_hit_rate', 0):.3f}  host hit tokens "
                f"{c.get('host_hit_tokens', 0):7d}  TTFT mean {r['mean_ttft_s'] * 1e3:8.1f} p50 {r['p50_ttft_s'] * 1e3:8.1f} p99 "
                f"{r['p99_ttft_s'] * 1e3:8.1f} ms  {r['output_tokens_per_s']:8.1f} out tok/s")
        if "load_back" in r:
            lb = r["load_back"]
            line += (f"  load back {lb['bytes'] / 2**20:.1f} MiB at {lb['gb_s']:.2f} GB/s (pinned copy "
                     f"{lb.get('host_to_device_copy_gb_s', float('nan')):.2f} GB/s)")
        print(line)
    if "ttft_ratio_lru_over_lru_host" in chat:
        print(f"  mean TTFT lru / lru_host: x{chat['ttft_ratio_lru_over_lru_host']:.2f}")
    if not chat["outputs_equal"]:
        print("  WARNING: the systems' greedy chat answers differ (bf16 near-ties can flip on a GPU; never on the "
              "CPU in fp32)")


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
    p.add_argument("--no-shared-prefix", dest="shared_prefix", action="store_false",
                   help="skip the shared-prefix phase")
    p.add_argument("--chat", action="store_true", help="add the multi-turn chat phase")
    p.add_argument("--chat-conversations", type=int, default=None)
    p.add_argument("--chat-turns", type=int, default=None, help="turns per conversation (>= 2)")
    p.add_argument("--chat-wave", type=int, default=None, help="conversations per wave")
    p.add_argument("--chat-first-len", type=int, default=None, help="tokens of a conversation's first message")
    p.add_argument("--chat-user-len", type=int, default=None, help="tokens of a later user message (+-50 %%)")
    p.add_argument("--chat-cache-ratio", type=float, default=4.0,
                   help="the conversations' prefix set / the device KV pool (sizes the pool)")
    p.add_argument("--systems", nargs="+", default=None, choices=list(SYSTEMS),
                   help=f"default: {' '.join(DEFAULT_SYSTEMS)} (+ lru_host with --host-tier)")
    p.add_argument("--host-tier", action="store_true", help="add the system lru_host (prefix cache with a host tier)")
    p.add_argument("--host-bytes", type=int, default=None,
                   help="host tier size of lru_host (default: 4 GiB, 8 GiB with --chat; --tiny: 16 MiB)")
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
    p.add_argument("--flip-splits", type=int, nargs="*", default=None, metavar="SLOTS",
                   help="Mamba slot counts of the other fixed splits of the flip (default: a quarter, half, three "
                        "quarters and 1.5 times the start-up split's)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.flip_splits is not None and any(n < 3 for n in args.flip_splits):
        p.error(f"--flip-splits: every split needs at least 3 Mamba slots (a running request and the two a pool "
                f"keeps spare), got {args.flip_splits}")
    defaults = (dict(groups=4, prompts_per_group=4, system_len=660, question_len=96, output_len=8,
                     chunked_prefill_size=256, pressure_wave=8, pressure_mamba_slots=4, warmup_len=300)
                if args.tiny else
                dict(groups=8, prompts_per_group=8, system_len=10000, question_len=128, output_len=32,
                     pressure_wave=16, pressure_mamba_slots=8, warmup_len=3000))
    defaults["host_bytes"] = 16 << 20 if args.tiny else 8 << 30 if args.chat else 4 << 30
    defaults.update(dict(chat_conversations=16, chat_turns=3, chat_wave=2, chat_first_len=128, chat_user_len=32)
                    if args.tiny else
                    dict(chat_conversations=48, chat_turns=4, chat_wave=8, chat_first_len=4096, chat_user_len=256))
    defaults.update(dict(flip_chats=8, flip_chat_len=12, flip_chat_output=3, flip_docs=3, flip_doc_len=40,
                         flip_doc_output=28) if args.tiny else
                    dict(flip_chats=64, flip_chat_len=256, flip_chat_output=32, flip_docs=4, flip_doc_len=8000,
                         flip_doc_output=512))
    defaults["systems"] = DEFAULT_SYSTEMS + (["lru_host"] if args.host_tier else [])
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if not (args.shared_prefix or args.pressure or args.chat or args.elastic):
        p.error("nothing to run: --no-shared-prefix and --no-pressure without --chat or --elastic")
    if args.profile and not args.shared_prefix:
        p.error("--profile traces the shared-prefix phase: drop --no-shared-prefix")
    if args.max_running_requests is None:  # the largest wave of the phases run
        args.max_running_requests = max(
            ([args.groups * (args.prompts_per_group - 1), args.groups] if args.shared_prefix else [])
            + ([args.pressure_wave] if args.pressure else []) + ([args.chat_wave] if args.chat else []), default=1)
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
    phases = [name for name, on in (("shared-prefix", args.shared_prefix), ("pressure", args.pressure),
                                     ("chat", args.chat)) if on]
    print(f"prefix cache benchmark on {device_name} ({', '.join(phases)}): {args.groups} groups x "
          f"{args.prompts_per_group} prompts, system {args.system_len}, question ~{args.question_len}, output "
          f"{args.output_len}, max running {args.max_running_requests}", flush=True)
    if args.chat:
        print(f"chat: {args.chat_conversations} conversations x {args.chat_turns} turns in waves of {args.chat_wave}, "
              f"first message {args.chat_first_len}, user messages ~{args.chat_user_len}", flush=True)
    run = {
        "device": device_name,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "model": "qwen3_next_reference" + ("_tiny" if args.tiny else ""),
    }
    per_system = {}
    for system in args.systems if phases else []:  # (--elastic alone: only the flip below)
        per_system[system] = run_system(model, system, args, vocab)
    run["engines"] = {s: {k: v for k, v in r.items() if k.endswith("_s")} for s, r in per_system.items()}
    run["shared_prefix"], run["pressure"] = main_results(per_system)
    if phases:
        run["capacity"], run["pressure_capacity"] = engine_capacity(args, vocab), workloads(args, vocab)[3]
    if run["shared_prefix"]:
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
    if args.chat:
        run["chat"] = chat_results(per_system, chat_workload(args, vocab).info)
        print_chat(run["chat"])
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
