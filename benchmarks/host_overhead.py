"""Host overhead of a decode step: per-phase host microseconds per pure-decode ``engine.step()``
(issue 5). Runs on CPU (the host cost is Python work, visible with a tiny model) and on CUDA.

    python benchmarks/host_overhead.py --device cpu --tiny                 # eager ops, tiny model
    python benchmarks/host_overhead.py --device cuda --modes full          # reference model, full graphs

Phases of one step (each timed by wrapping the engine's own method on the instance):
- ``schedule``: ``Scheduler.schedule`` or, with overlap, ``Scheduler.schedule_decode_ahead``
  (which requests, KV slot allocation);
- ``build_metadata``: ``ModelRunner.build_metadata`` (packed ids, positions, KV indices, copies);
- ``dispatch``: the rest of ``ModelRunner.forward`` (graph selection, buffer filling, padding,
  forward context), i.e. ``forward`` minus ``build_metadata`` minus ``model``;
- ``model``: the model itself (eager forward, compiled call, or graph replay); on CUDA the wrapper
  synchronises after it, so the GPU time lands here and every other phase is pure host time;
- ``sample``: ``Sampler.sample``;
- ``bookkeeping``: the rest of ``engine.step`` (counters, token host copy, appending tokens,
  finishing requests).
``host`` = step - model: the host work of one step. Medians over the pure-decode steps of a
run of ``--batches`` requests (prompt ``--prompt-len``, ``--new-tokens`` new tokens, no EOS).
Then the same run without timers: ``wall``, the median time of a decode ``engine.step()`` (no
added sync; with overlap on a GPU, the step rate).
Each batch runs with ``--overlap`` off and on (engine ``step`` launching the next decode step
before reading the tokens; on a CPU nothing runs concurrently, so it only moves work).

``--speculative K`` (issue 7): the same for the speculative *verify* steps of an engine with K
draft tokens, the draft a replay of a continuation that is always wrong (acceptance length 1:
every step verifies K + 1 tokens per request and emits one). Phases of a verify step:
``draft`` (the draft source's ``propose``), ``schedule`` (``Scheduler.schedule_verify``),
``build_metadata``, ``dispatch`` (the rest of the verify forward: ids, graph buffers, context),
``model``, ``accept`` (acceptance on the logits; with the one host sync of the step),
``commit`` (``commit_speculative_state``: on CPU its plain-torch implementation, on CUDA its
kernels or one graph replay), ``kv_free`` (freeing the rejected drafts' KV slots), ``bookkeeping``
(the rest: fill_drafts, counters, appending tokens). Output key ``verify_k<K>``.
``--op-dispatch``: instead, the host cost of calling one op (a no-op body on tiny tensors, inference
mode) registered as ours are (``hybrid_compile.ops.registration.kernel_op``) against the same op
through ``torch.library.custom_op``, for 0 / 1 / 4 / 13 mutated arguments (13: the decode metadata
op's count); microseconds per call, medians of ``--repeats`` runs. Output key ``op_dispatch``.
``--op-checks``: instead, the host cost of the argument checks (shapes, dtypes, devices) that the GDN
layer's extend ops and the attention extend op run before their kernels, at a 512-token step of the
Qwen3-Next-80B shapes, on meta tensors (no value checks, as on a GPU); output key ``op_checks``.

Output: printed table + JSON (``--out``, default ``benchmarks/results/host_overhead_<device>.json``).
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
from reference_models import build_qwen3_next_reference  # noqa: E402

MODES = {
    "eager": dict(compile=False),
    "compiled": dict(compile=True, cuda_graphs=False),
    "full": dict(compile=True, cuda_graphs="full"),
}
PHASES = ("schedule", "build_metadata", "dispatch", "model", "sample", "bookkeeping")
VERIFY_PHASES = ("draft", "schedule", "build_metadata", "dispatch", "model", "accept", "commit", "kv_free",
                 "bookkeeping")


class PhaseTimer:
    """Wraps engine methods on their instances; accumulates the seconds of each phase in the
    current step."""

    def __init__(self, engine, sync_model: bool) -> None:
        self.engine = engine
        self.sync_model = sync_model
        self.step: dict[str, float] = {}
        self._undo = []
        runner = engine.runner
        self._wrap(engine.scheduler, "schedule", "schedule")
        if hasattr(engine.scheduler, "schedule_decode_ahead"):  # overlap: the next step planned ahead
            self._wrap(engine.scheduler, "schedule_decode_ahead", "schedule")
        self._wrap(runner, "build_metadata", "build_metadata")
        self._wrap(runner, "forward", "forward")
        self._wrap(engine.sampler, "sample", "sample")
        spec = engine.speculative
        if spec is not None:  # verify steps (the phases of VERIFY_PHASES)
            self._wrap(spec.source, "propose", "draft")
            self._wrap(engine.scheduler, "schedule_verify", "schedule")
            for name in ("build_verify_metadata",):  # the verify fast path, where the runner has one
                if hasattr(runner, name):
                    self._wrap(runner, name, "build_metadata")
            self._wrap(spec, "_forward", "forward")
            self._wrap(spec, "_accept", "accept")
            if hasattr(spec, "_commit"):
                self._wrap(spec, "_commit", "commit")
            self._wrap(engine.pools.kv.allocator, "free", "kv_free")
        # the innermost model call of each path (only the outermost one on the stack counts)
        self._depth = 0
        for name in ("_model_forward", "_run_compiled"):
            self._wrap(runner, name, "model", model=True)
        if runner.full_graphs is not None:
            self._wrap(runner.full_graphs, "replay", "model", model=True)

    def _wrap(self, obj, name: str, phase: str, model: bool = False) -> None:
        original = getattr(obj, name)

        def timed(*args, **kwargs):
            if model:
                self._depth += 1
            t0 = time.perf_counter()
            try:
                out = original(*args, **kwargs)
                if model and self.sync_model and self._depth == 1:
                    torch.cuda.synchronize()
                return out
            finally:
                if not model or self._depth == 1:
                    self.step[phase] = self.step.get(phase, 0.0) + time.perf_counter() - t0
                if model:
                    self._depth -= 1

        setattr(obj, name, timed)
        self._undo.append((obj, name))

    def close(self) -> None:
        for obj, name in self._undo:
            obj.__dict__.pop(name, None)


def _add(engine, prompts, new_tokens) -> list[int]:
    return [engine.add_request(p, hc.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)) for p in prompts]


def _steady(rows: list) -> list:
    """Drop the first decode steps (warm-up of allocators and caches)."""
    return rows[min(4, len(rows) // 4):]


def _measure(engine, prompts, new_tokens, sync_model: bool, phases: tuple[str, ...], counted_steps,
             phase_row, start=lambda: None) -> dict[str, float]:
    """Step the engine over ``prompts`` twice, counting only the steps that advance
    ``counted_steps()``: with the phase timers (median microseconds of each of ``phases``, of
    ``step`` and of ``host`` = step - model; ``phase_row(timer.step, total)`` turns one step's
    timed seconds into its phases), then without them (``wall``: median microseconds of such an
    ``engine.step()`` as it is, no added sync: the step rate, overlap included). ``start()`` runs
    before each pass."""
    start()
    rids = _add(engine, prompts, new_tokens)
    timer = PhaseTimer(engine, sync_model)
    rows: list[dict[str, float]] = []
    try:
        while engine.has_unfinished():
            before = counted_steps()
            timer.step = {}
            t0 = time.perf_counter()
            engine.step()
            total = time.perf_counter() - t0
            if counted_steps() == before:
                continue
            row = phase_row(timer.step, total)
            row["step"] = total
            row["host"] = total - row["model"]
            rows.append(row)
    finally:
        timer.close()
    for rid in rids:
        engine.pop_finished(rid)
    rows = _steady(rows)
    result = {k: 1e6 * statistics.median(r[k] for r in rows) for k in (*phases, "step", "host")}

    start()
    rids = _add(engine, prompts, new_tokens)
    walls = []
    while engine.has_unfinished():
        before = counted_steps()
        t0 = time.perf_counter()
        engine.step()
        if counted_steps() != before:
            walls.append(time.perf_counter() - t0)
    for rid in rids:
        engine.pop_finished(rid)
    result["wall"] = 1e6 * statistics.median(_steady(walls))
    return result | {"steps": len(rows)}


def run(engine, prompts, new_tokens, sync_model: bool) -> dict[str, float]:
    """:func:`_measure` over the decode steps (phases of ``PHASES``)."""

    def decode_row(s: dict[str, float], total: float) -> dict[str, float]:
        row = {k: s.get(k, 0.0) for k in ("schedule", "build_metadata", "model", "sample")}
        row["dispatch"] = s.get("forward", 0.0) - row["build_metadata"] - row["model"]
        row["bookkeeping"] = total - s.get("schedule", 0.0) - s.get("forward", 0.0) - row["sample"]
        return row

    def decode_steps() -> int:
        return engine._counters["decode_steps"]  # (stats() costs more than a step)

    return _measure(engine, prompts, new_tokens, sync_model, PHASES, decode_steps, decode_row)


def run_verify(engine, prompts, new_tokens, vocab: int) -> dict[str, float]:
    """:func:`_measure` over the verify steps of a speculative engine (module docstring; phases
    of ``VERIFY_PHASES``), each pass with a fresh always-wrong draft source."""
    from hybrid_compile.engine.speculative import ReplayDraft

    def use_replay_always_wrong():  # q = 1: every draft differs from the (here irrelevant) continuation
        source = ReplayDraft({tuple(p): [0] * new_tokens for p in prompts}, 1.0, vocab, seed=0)
        engine.speculative.use_source(source, "replay_q1")

    def verify_row(s: dict[str, float], total: float) -> dict[str, float]:
        row = {k: s.get(k, 0.0) for k in ("draft", "schedule", "build_metadata", "model", "accept", "commit", "kv_free")}
        row["commit"] -= row["kv_free"] if "commit" in s else 0.0  # (the free runs inside the commit, where it has one)
        row["dispatch"] = s.get("forward", 0.0) - row["build_metadata"] - row["model"]
        row["bookkeeping"] = total - sum(row.values())
        return row

    def verify_steps() -> int:
        return engine.speculative.counters["verify_steps"]

    return _measure(engine, prompts, new_tokens, engine.device.type == "cuda", VERIFY_PHASES, verify_steps,
                    verify_row, start=use_replay_always_wrong)


OP_DISPATCH_MUTATED = (0, 1, 4, 13)


def _median_call_us(fn, args, calls: int, repeats: int) -> float:
    """Microseconds per ``fn(*args)``: the median of ``repeats`` timings of ``calls`` calls, each
    after ``calls // 10`` warm-up calls."""
    times = []
    for _ in range(repeats):
        for _ in range(calls // 10):
            fn(*args)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def op_dispatch(device: torch.device, calls: int, repeats: int) -> dict:
    """Microseconds per call of a no-op op with ``m`` mutated arguments (``OP_DISPATCH_MUTATED``), as a
    ``kernel_op`` and as a ``torch.library.custom_op`` (``--op-dispatch``, module docstring)."""
    from hybrid_compile.ops.registration import KernelOp

    rows = {}
    for m in OP_DISPATCH_MUTATED:
        names = [f"a{i}" for i in range(m)]
        params = ", ".join(["x: torch.Tensor"] + [f"{n}: torch.Tensor" for n in names])
        scope = {"torch": torch}
        exec(f"def body({params}) -> None:\n    return None", scope)  # (a signature of m tensors)
        body = scope["body"]
        ours = KernelOp(f"hybrid_compile::bench_dispatch_m{m}_{os.getpid()}", body, tuple(names))
        theirs = torch.library.custom_op(f"hybrid_compile_bench::dispatch_m{m}_{os.getpid()}", body,
                                         mutates_args=tuple(names))
        args = [torch.zeros(4, device=device) for _ in range(m + 1)]
        row = {}
        with torch.inference_mode():
            for name, op in (("kernel_op", ours), ("custom_op", theirs)):
                row[name] = _median_call_us(op, args, calls, repeats)
        row["ratio"] = row["custom_op"] / row["kernel_op"]
        rows[str(m)] = row
        print(f"op dispatch, {m:2d} mutated: kernel_op {row['kernel_op']:7.1f} us  custom_op {row['custom_op']:7.1f} us "
              f"({row['ratio']:.1f}x)", flush=True)
    return rows


def op_checks(calls: int, repeats: int) -> dict:
    """Microseconds per call of the argument checks the GDN layer's extend ops and the attention
    extend op run before their kernels (``--op-checks``), at a 512-token, 2-request step of the
    Qwen3-Next-80B shapes, on meta tensors: a device's path, where no check reads values."""
    from hybrid_compile.ops import attention, conv1d, gdn

    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device="meta")

    t, hk, hv, dk, dv, conv_dim, width, slots = 512, 16, 32, 128, 128, 8192, 4, 64
    cu, idx = meta(3, dtype=torch.int32), meta(2, dtype=torch.int32)
    init = meta(2, dtype=torch.bool)
    cases = {
        "gdn_gating": (gdn._check_gdn_gating, (meta(hv, dtype=torch.float32), meta(t, hv), meta(t, hv),
                                               meta(hv, dtype=torch.float32))),
        "causal_conv1d_fn": (conv1d._check_causal_conv1d_fn,
                             (meta(t, conv_dim), meta(conv_dim, width), None, meta(slots, width - 1, conv_dim), cu, idx,
                              init, "silu")),
        "chunk_gated_delta_rule": (gdn._check_chunk, (meta(t, hk, dk), meta(t, hk, dk), meta(t, hv, dv),
                                                      meta(t, hv, dtype=torch.float32), meta(t, hv),
                                                      meta(slots, hv, dk, dv, dtype=torch.float32), cu, idx, init)),
        "paged_attention_extend": (attention._check_extend,
                                   (meta(t, 16, 256), meta(4096, 2, 256), meta(4096, 2, 256), cu, cu,
                                    meta(t, dtype=torch.int32), -1, 0.0)),
    }
    rows = {}
    for name, (check, args) in cases.items():
        rows[name] = _median_call_us(check, args, calls, repeats)
        print(f"argument checks of {name:24s} {rows[name]:6.1f} us", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="toy-size reference model")
    ap.add_argument("--modes", default=None, help="comma list of " + ",".join(MODES) + " (default: eager on CPU, full on CUDA)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--overlap", default="off,on",
                    help="engine overlap settings to run (engine.overlap; an engine without it runs once, as 'n/a')")
    ap.add_argument("--speculative", type=int, default=0, metavar="K",
                    help="measure the verify steps of a speculative engine with K draft tokens instead (module docstring)")
    ap.add_argument("--op-dispatch", action="store_true", help="time one op call, ours against custom_op (module docstring)")
    ap.add_argument("--op-checks", action="store_true",
                    help="time the argument checks of the extend-step ops on meta tensors (module docstring)")
    ap.add_argument("--calls", type=int, default=2000, help="--op-dispatch / --op-checks: calls per timing")
    ap.add_argument("--repeats", type=int, default=5,
                    help="--op-dispatch / --op-checks: timings per row (the median is kept)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.op_dispatch or args.op_checks:
        key = "op_dispatch" if args.op_dispatch else "op_checks"
        rows = op_dispatch(device, args.calls, args.repeats) if args.op_dispatch else op_checks(args.calls, args.repeats)
        on_gpu = args.op_dispatch and device.type == "cuda"  # (the checks run on the host whatever --device)
        result = {"device": torch.cuda.get_device_name(device) if on_gpu else platform.processor() or "cpu",
                  "torch": torch.__version__, "unit": "microseconds per op call", key: rows}
        out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                       f"host_overhead_{key}_{device.type if args.op_dispatch else 'host'}.json")
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {out}")
        return
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    modes = (args.modes or ("full" if device.type == "cuda" else "eager")).split(",")
    batches = [int(b) for b in args.batches.split(",")]
    model = build_qwen3_next_reference(dtype, device, seed=0, tiny=args.tiny)
    vocab = model.config.vocab_size
    max_bs = max(batches)
    engine_kw = dict(
        max_running_requests=max_bs, chunked_prefill_size=max(512, args.prompt_len),
        max_total_tokens=max_bs * (args.prompt_len + args.new_tokens) + 512,
        mamba_cache_size=max_bs + 2, enable_prefix_cache=False,
    )
    if args.speculative:
        engine_kw.update(speculative=hc.SpeculativeConfig(method="ngram", num_draft_tokens=args.speculative),
                         max_total_tokens=max_bs * (args.prompt_len + args.new_tokens + args.speculative + 1) + 512)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "dtype": str(dtype), "tiny": args.tiny, "threads": args.threads,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "unit": f"microseconds per {'verify' if args.speculative else 'decode'} step", "speculative": args.speculative,
        "modes": {},
    }
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"host_overhead_{'verify_' if args.speculative else ''}{'tiny_' if args.tiny else ''}"
                                   f"{device.type}.json")
    g = torch.Generator().manual_seed(0)
    for mode in modes:
        engine = hc.wrap(model, **MODES[mode], **engine_kw)
        result["modes"][mode] = {}
        settings = args.overlap.split(",") if hasattr(engine, "overlap") else ["n/a"]
        for b in batches:
            prompts = [torch.randint(1, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(b)]
            if args.speculative:
                r = result["modes"][mode].setdefault(f"verify_k{args.speculative}", {})[str(b)] = run_verify(
                    engine, prompts, args.new_tokens, vocab)
                print(f"{mode:8s} verify k={args.speculative} b={b:<3d} wall {r['wall']:8.1f} us/step  host "
                      f"{r['host']:8.1f} us  | " + "  ".join(f"{k} {r[k]:.1f}" for k in VERIFY_PHASES), flush=True)
                continue
            for overlap in settings:
                if overlap != "n/a":
                    engine.overlap = overlap == "on"
                r = result["modes"][mode].setdefault(f"overlap_{overlap}", {})[str(b)] = run(
                    engine, prompts, args.new_tokens, device.type == "cuda")
                print(f"{mode:8s} overlap {overlap:3s} b={b:<3d} wall {r['wall']:8.1f} us/step  host {r['host']:8.1f} us  | "
                      + "  ".join(f"{k} {r[k]:.1f}" for k in PHASES), flush=True)
        engine.close()
        del engine
        gc.collect()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
