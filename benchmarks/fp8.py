"""FP8 benchmark: our engine in bf16 vs block FP8 on one model, and our FP8 GEMMs vs torch._scaled_mm.

    python benchmarks/fp8.py [--layers 8] [--out benchmarks/results/fp8.json]
    python benchmarks/fp8.py --no-engines              # only the kernel table
    python benchmarks/fp8.py --modes fp8               # only the FP8 engine (the model quantized first)
    python benchmarks/fp8.py --modes bf16_hf_experts,bf16 --no-kernels   # bf16: transformers' experts vs ours
    python benchmarks/fp8.py --tiny --device cpu      # CPU smoke run (toy sizes, tests/test_benchmarks_fp8.py)
    python benchmarks/fp8.py --sweep [--out benchmarks/results/fp8_sweep.json]   # decode kernel sweep (CUDA)
    python benchmarks/fp8.py --sweep --prefill           # the tensor-core GEMM's tiles at prefill sizes
    python benchmarks/fp8.py --sweep --tp 2 --sweep-only experts --sweep-rows 1 16 64   # a TP 2 rank's experts
    python benchmarks/fp8.py --layers 48 --modes fp8 --build-quantized --no-kernels   # the whole 80B shape, one H200
    TRITON_INTERPRET=1 python benchmarks/fp8.py --sweep --tiny --device cpu       # its smoke run

Model: the Qwen3-Next-80B-A3B layer shape on ``--layers`` of its 48 layers (default 8: pattern
``[linear_attention x3, full_attention] x2``; hidden 2048, vocab 151936, attention 16 q / 2 kv heads
of dim 256 with the output gate, GDN 16 key / 32 value heads of dim 128, 512 experts top-10 of
intermediate 512 plus a shared expert of 512; 13.8 B parameters, 1.16 B active per token), random
bf16 weights built on the GPU. The bf16 engine is measured first; then the same model is quantized
in place (``quantize_model``: projections and experts to e4m3 with 128 x 128 block scales; embeddings,
LM head, norms, routers and ``in_proj_ba`` stay bf16) and the FP8 engine measured with the same
settings. ``bf16_hf_experts``: the bf16 engine on transformers' experts path (``fused_moe=False``)
instead of ours (the default on CUDA), first; every later mode is compared with the first. Workloads: greedy decode at batch 1 / 16 / 64 (ms per step from the difference of two
generate lengths, so prefill cancels; the median of :data:`DECODE_REPEATS` runs) and prefill of one
4k / 32k prompt (one generated token; the median of :data:`REPEATS` runs), every timed run on an
emptied prefix cache (a repeated prompt would otherwise be served from it); then
a few batch-1 decode steps and the 4k prefill once more under ``torch.profiler`` (``decode_profile``,
``prefill_profile`` in the JSON: wall and GPU-busy ms per engine step and the 20 kernels with the
most GPU time), to compare the modes kernel by kernel.

Kernel table: ``fp8_block_linear`` (activation quantization included) and ``fp8_grouped_linear`` at
the model's shapes against ``torch._scaled_mm`` with row-wise scales on pre-quantized e4m3 inputs
(quantization not included: the strongest baseline torch offers on every supported version) and
bf16 ``torch.mm``; ``path`` says what the op ran (``gemv``, ``cublas``: cuBLAS's block-scaled GEMM
on Hopper, ``triton``: our tensor-core kernel), and where it ran cuBLAS, ``triton ms`` times our
kernel on the same call. Each time is the median of CUDA-graph replays. Prints tables, writes JSON
after each part (an out-of-memory kernel table is recorded as such; ``--no-engines`` runs only the
kernel table, in a process of its own). ``memory_gib``: what the caching allocator holds (allocated /
reserved) after the build, the quantization and each engine's close (Dynamo's code cache is reset
after each close), the memory the next engine's budget sees.

``--sweep``: the decode kernels at the model's shapes, to pick the defaults in one GPU run (a few
minutes, most of it Triton compiling the grid). Dense projections (:data:`LINEAR_SHAPES`) at 1, 2,
4, 8, 16, 32, 64 rows, and the experts (:data:`EXPERT_SHAPES`, random top-10 distinct routing) at
as many tokens; per case: ``tc_old`` (the tensor-core GEMM as it was: the activation quantized in
every column program, up to 64 rows), ``tc`` (the same GEMM on an activation quantized once),
``gemv`` (the CUDA-core GEMV, default config) and the GEMV under :data:`GEMV_GRID` (dense, up to 16
rows) / :data:`GEMV_GRID_GROUPED` (one row of an expert per program; at the default config also
``gemv_1row`` and ``gemv_2rows``, a row pair per program; for gate_up also ``routed``: the call as
the experts forward makes it, rows gathered and silu_and_mul fused, FP8 beside bf16); the bf16
equivalents on the same (dequantized) weight: ``skinny_mm`` (1-2 rows), ``torch.mm``, our bf16
``moe_grouped_linear`` (``bf16_grouped``: its default kernel, the GEMV at decode, else the tensor
cores) and ``torch._grouped_mm``; and ``torch._scaled_mm`` (dense,
pre-quantized e4m3, unit row-wise scales). Every output is checked against its CPU-semantics
reference (``reference_block_linear`` / ``reference_grouped_linear``; bf16: the fp32 product of
the same bf16 values) before it is timed; a wrong one is reported and the run exits 1. Times:
median of CUDA-graph replays; GB/s from the weight bytes the call streams (the experts hit). At
decode sizes a dense case's graph calls the candidate once per copy of its weight, copies adding up
to :data:`DECODE_SWEEP_BYTES` (``weight_copies``; time per call): one call per replay measured the
replay's own fixed cost (~17 µs on an H200, whatever the tile) instead of the kernel. The experts'
cases are one call per replay (their ~20 MB of experts hit stay in the L2).
Printed per case: the current default (what the op dispatches to), the best FP8 candidate and
its config and speedup over the default, the best bf16 time and FP8-best / bf16-best.

``--sweep --tp N``: the shapes of one rank's shard (:func:`tp_slices`); ``--sweep-only dense|experts``
and ``--sweep-rows`` narrow the cases.

``--sweep --prefill``: the same cases at prefill sizes (:data:`PREFILL_ROWS` dense rows; as many
tokens of top-10 experts, 10x the rows) with the tensor-core GEMM under :data:`TC_GRID` (``tc[BM,
BN, warps, stages, GROUP_M]``) beside its default ``tc``, ``torch._scaled_mm``, ``torch.mm`` and the
bf16 experts kernels (no GEMV).
"""


from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import pathlib
import statistics
import sys
import time

import torch
import transformers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import hybrid_compile as hc  # noqa: E402
from hybrid_compile.ops import fp8 as fp8_ops  # noqa: E402
from hybrid_compile.quantization import fp8_weight_bytes, quantize_model  # noqa: E402
from benchmarks.profiling import decode_profile, prefill_profile  # noqa: E402
from reference_models import _build, as_benchmark_model, random_token_prompts, sync_device  # noqa: E402

# (name, N, K) of the 80B model's projections; experts: (name, E, N, K)
LINEAR_SHAPES = [("gdn in_proj_qkvz", 12288, 2048), ("gdn out_proj", 2048, 4096), ("attn q_proj", 8192, 2048),
                 ("attn o_proj", 2048, 4096), ("shared expert gate_up", 1024, 2048), ("shared expert down", 2048, 512)]
EXPERT_SHAPES = [("experts gate_up", 512, 1024, 2048), ("experts down", 512, 2048, 512)]
# the sweep's extra dense shape: attention k_proj / v_proj (2 kv heads of 256)
SWEEP_LINEAR_SHAPES = LINEAR_SHAPES + [("attn k/v_proj", 512, 2048)]
SWEEP_ROWS = (1, 2, 4, 8, 16, 32, 64)
#: (BLOCK_N, BLOCK_K, warps, stages) of the GEMV tried in the sweep (those whose fp32 accumulators
#: and weight tile would take more than 160 registers a thread are left out: they spill), up to
#: GEMV_SWEEP_MAX_ROWS rows
GEMV_GRID = dict(block_n=(2, 4, 8, 16), block_k=(512, 1024, 2048), warps=(4, 8), stages=(2,))
GEMV_GRID_GROUPED = dict(block_n=(4, 8, 16, 32), block_k=(128, 256, 512), warps=(4, 8), stages=(2,))
#: --sweep --tp N: the projections split over N ranks as tensor parallelism splits them (the others
#: split their output rows): these split their input columns (row-parallel), and the experts' down_proj
ROW_PARALLEL = ("gdn out_proj", "attn o_proj", "shared expert down")
GEMV_SWEEP_MAX_ROWS = 16
#: decode sizes of --sweep: the dense cases' weight copies add up to at least this many bytes (past the L2)
DECODE_SWEEP_BYTES = 400 << 20
#: the engines --modes picks from, in the order they run, with the EngineConfig fields each sets
#: (fp8 quantizes the model in place, so it runs last)
MODES = {"bf16_hf_experts": {"fused_moe": False}, "bf16": {}, "fp8": {}}
TINY_SWEEP = dict(linear=[("tiny", 40, 300)], experts=[("tiny experts gate_up", 4, 16, 160)], rows=(1, 5),
                  top_k=2,
                  grid=dict(block_n=(8,), block_k=(128,), warps=(4,), stages=(1,)))
TINY_SWEEP["grid_grouped"] = TINY_SWEEP["grid"]
TINY_SWEEP["copy_bytes"] = 20_000  # two copies of the tiny weight (the copy cycle exercised)
#: ``--sweep --prefill``: dense rows (a 4k prompt, an 8k prefill chunk) and expert tokens (x top-10 rows)
PREFILL_ROWS = (4096, 8192)
#: the tensor-core GEMM's tiles tried there: (BM, BN, warps, stages, GROUP_M)
TC_GRID = dict(bm=(64, 128), bn=(64, 128, 256), warps=(4, 8), stages=(3, 4), group_m=(1, 8))
TINY_PREFILL = dict(rows=(20,), tc_grid=dict(bm=(16,), bn=(16,), warps=(4,), stages=(1,), group_m=(1, 2)))


def qwen3_next_80b_config(layers: int = 8, tiny: bool = False) -> transformers.Qwen3NextConfig:
    lin, full = "linear_attention", "full_attention"
    sizes = (
        dict(vocab_size=512, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
             num_experts=8, moe_intermediate_size=128, shared_expert_intermediate_size=128, intermediate_size=128)
        if tiny else
        dict(vocab_size=151936, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
             linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
             num_experts=512, moe_intermediate_size=512, shared_expert_intermediate_size=512, intermediate_size=5120)
    )
    return transformers.Qwen3NextConfig(
        **sizes, num_hidden_layers=layers, layer_types=[full if i % 4 == 3 else lin for i in range(layers)],
        num_experts_per_tok=2 if tiny else 10, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        linear_conv_kernel_dim=4, tie_word_embeddings=False, max_position_embeddings=65536,
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )


#: timed runs per prefill length; the median is reported (one run is at the mercy of
#: whatever else the host is doing: a decode step of ~1 ms and a prefill's host work move with it)
REPEATS = 3
#: Timed decode runs per batch size (the median is reported)
DECODE_REPEATS = 5


def build_quantized(config, device, seed: int = 0) -> torch.nn.Module:
    """The Qwen3-Next model of ``config`` with random weights, each decoder layer drawn on ``device`` in
    bf16 and quantized to FP8 before the next exists (the whole model never exists in bf16: the 48-layer
    80B shape is ~160 GB in bf16, ~80 GB in FP8). Built on the meta device, then per part: storage on
    ``device``, the model's own weight init (``_init_weights``), :func:`quantize_model`; the rotary
    embedding (buffers only) is rebuilt on ``device``."""
    with torch.device("meta"):
        model = transformers.Qwen3NextForCausalLM._from_config(config, dtype=torch.bfloat16)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        torch.manual_seed(seed)
        for part in (model.model.embed_tokens, model.model.norm, model.lm_head, *model.model.layers):
            part.to_empty(device=device)
            for module in part.modules():
                model._init_weights(module)
            if part in model.model.layers:
                quantize_model(part)
        with torch.device(device):
            model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    return as_benchmark_model(model)


def _timed(fn, device) -> float:
    sync_device(device)
    t = time.perf_counter()
    fn()
    sync_device(device)
    return time.perf_counter() - t


def measure_engine(engine, vocab: int, decode_batches, decode_steps: int, prefill_lens, device) -> dict:
    out = {"decode": {}, "prefill": {}}
    for b in decode_batches:
        prompts = random_token_prompts(b, 32, vocab, seed=b)
        engine.generate_batch(prompts, max_new_tokens=4, do_sample=False)  # warm (graphs, kernels)
        diffs = []
        for _ in range(DECODE_REPEATS):
            engine.clear_prefix_cache()
            short = _timed(lambda: engine.generate_batch(prompts, max_new_tokens=2, do_sample=False), device)
            engine.clear_prefix_cache()
            long = _timed(lambda: engine.generate_batch(prompts, max_new_tokens=2 + decode_steps, do_sample=False),
                          device)
            diffs.append(long - short)
        ms = 1e3 * statistics.median(diffs) / decode_steps
        out["decode"][str(b)] = {"ms_per_step": ms, "tokens_per_s": b * 1e3 / ms}
        print(f"  decode batch {b:3d}: {ms:8.3f} ms/step  {b * 1e3 / ms:9.1f} tok/s", flush=True)
    for n in prefill_lens:
        prompt = random_token_prompts(1, n, vocab, seed=n)[0]
        def run_cold() -> float:  # the prefix cache emptied first: a repeated prompt would be a cache hit
            engine.clear_prefix_cache()
            return _timed(lambda: engine.generate_batch([prompt], max_new_tokens=1, do_sample=False), device)

        run_cold()
        s = statistics.median(run_cold() for _ in range(REPEATS))
        out["prefill"][str(n)] = {"seconds": s, "tokens_per_s": n / s}
        print(f"  prefill {n:6d}: {s * 1e3:9.1f} ms  {n / s:9.0f} tok/s", flush=True)
    # where the smallest decode's and the shortest prefill's time go (kernels by GPU time), to compare the
    # modes kernel by kernel
    engine.clear_prefix_cache()
    out["decode_profile"] = decode_profile(engine, min(decode_batches), vocab, kernels_shown=20)
    out["prefill_profile"] = prefill_profile(engine, min(prefill_lens), vocab, kernels_shown=20)
    for what, prof in (("decode batch %d" % min(decode_batches), out["decode_profile"]),
                       ("prefill %d" % min(prefill_lens), out["prefill_profile"])):
        if "top_kernels" in prof:
            print(f"  {what} profiled: wall {prof['wall_ms_per_step']:.2f} ms/step, GPU busy "
                  f"{prof['gpu_busy_ms_per_step']:.2f} ms/step; top kernels (ms/step):", flush=True)
            for k in prof["top_kernels"]:
                print(f"    {k['ms_per_step']:8.3f}  x{k['calls_per_step']:<6.1f} {k['name'][:90]}", flush=True)
    return out


def kernel_table(rows_list) -> list[dict]:
    from kernels import bench
    from hybrid_compile.ops.triton import fp8 as tfp8

    ops = torch.ops.hybrid_compile
    dev = "cuda"
    table = []
    for name, n, k in LINEAR_SHAPES:
        q, s = fp8_ops.quantize_weight_blocks(torch.randn(n, k, device=dev) / k ** 0.5)
        wb = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        for m in rows_list:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            xq = x.to(fp8_ops.FP8_DTYPE)
            sa = torch.ones(m, 1, device=dev)
            sb = torch.ones(1, n, device=dev)
            ours = bench(lambda: ops.fp8_block_linear(x, q, s))
            try:
                scaled = bench(lambda: torch._scaled_mm(xq, q.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
            except Exception as e:  # noqa: BLE001 - e.g. a shape cuBLASLt refuses (m not a multiple of 16)
                scaled = None
                print(f"  torch._scaled_mm {name} m={m}: {type(e).__name__}: {str(e)[:80]}")
            bf16 = bench(lambda: torch.mm(x, wb.t()))
            row = _row(name, m, n, k, ours, scaled, bf16, 1)
            # what the op dispatches to, and our tensor-core kernel beside it where that is cuBLAS
            row["path"] = ("gemv" if tfp8.use_gemv(m, weight_shape=(n, k)) else "cublas" if tfp8.use_cublas(x, q)
                           else "triton")
            if row["path"] == "cublas":
                row["triton_ms"] = float(bench(lambda: tfp8.fp8_block_linear_triton(x, q, s)))
            table.append(row)
    for name, e, n, k in EXPERT_SHAPES:
        q, s = fp8_ops.quantize_weight_blocks(torch.randn(e, n, k, device=dev) / k ** 0.5)
        for tokens in rows_list:
            ids = torch.stack([torch.randperm(e, device=dev)[:10] for _ in range(tokens)]).flatten()
            off = torch.zeros(e + 1, dtype=torch.int64, device=dev)
            off[1:] = torch.bincount(ids, minlength=e).cumsum(0)
            x = torch.randn(ids.numel(), k, device=dev, dtype=torch.bfloat16)
            ours = bench(lambda: ops.fp8_grouped_linear(x, q, s, off))
            # the same bytes and FLOPs as one dense e4m3 GEMM over all routed rows x one expert's weight
            # would not be comparable; _scaled_mm has no grouped form on every supported torch: no baseline
            table.append(_row(name, ids.numel(), n, k, ours, None, None, e))
    print(f"\n{'kernel':24s} {'M':>6s} {'N':>6s} {'K':>6s} {'path':>7s} {'ours ms':>9s} {'_scaled_mm':>10s} "
          f"{'ratio':>6s} {'bf16 mm':>8s} {'TFLOP/s':>8s} {'triton ms':>9s}")
    for r in table:
        sm = f"{r['scaled_mm_ms']:.4f}" if r["scaled_mm_ms"] else "-"
        ratio = f"{r['scaled_mm_ms'] / r['ours_ms']:.2f}" if r["scaled_mm_ms"] else "-"
        bf = f"{r['bf16_mm_ms']:.4f}" if r["bf16_mm_ms"] else "-"
        tr = f"{r['triton_ms']:.4f}" if "triton_ms" in r else "-"
        print(f"{r['kernel']:24s} {r['m']:6d} {r['n']:6d} {r['k']:6d} {r.get('path', 'grouped'):>7s} "
              f"{r['ours_ms']:9.4f} {sm:>10s} {ratio:>6s} {bf:>8s} {r['ours_tflops']:8.1f} {tr:>9s}")
    return table


def _row(name, m, n, k, ours, scaled, bf16, experts):
    return {"kernel": name, "m": m, "n": n, "k": k, "experts": experts, "ours_ms": float(ours),
            "scaled_mm_ms": float(scaled) if scaled is not None else None,
            "bf16_mm_ms": float(bf16) if bf16 is not None else None,
            "ours_tflops": 2 * m * n * k / (float(ours) * 1e-3) / 1e12}


# --------------------------------------------------------------------------------------------
# --sweep: the decode kernels
# --------------------------------------------------------------------------------------------


def tp_slices(linear, experts, tp: int) -> tuple[list, list]:
    """The sweep's shapes as one of ``tp`` ranks holds them (``--tp``): column-parallel projections and
    the experts' gate_up split their output rows, :data:`ROW_PARALLEL` ones and the experts' down_proj
    their input columns."""
    def split(size, what):
        if size % tp:
            raise SystemExit(f"--tp {tp}: {what} of {size} does not split evenly")
        return size // tp

    lin = [(name, n, split(k, name)) if name in ROW_PARALLEL else (name, split(n, name), k) for name, n, k in linear]
    exp = [(name, e, n, split(k, name)) if "down" in name else (name, e, split(n, name), k) for name, e, n, k in experts]
    return lin, exp


def _gemv_grid(grid, rows_per_program, k) -> list[tuple]:
    import itertools

    from hybrid_compile.ops.triton.common import pow2

    out = []
    for bn, bk, warps, stages in (itertools.product(*grid.values()) if grid else ()):
        regs = (rows_per_program + 1) * bn * bk / (32 * warps)  # fp32 accumulators + weight tile, a thread
        if bk <= pow2(k, 16) and regs <= 160:
            out.append((bn, bk, warps, stages))
    return out


def _gemv_grid_arg(text: str) -> dict:
    """``--gemv-grid``: a JSON object of exactly the four GEMV tile lists, each non-empty integers."""
    grid = json.loads(text)
    keys = ("block_n", "block_k", "warps", "stages")
    if not isinstance(grid, dict) or set(grid) != set(keys) or not all(
            isinstance(grid[key], list) and grid[key] and all(isinstance(v, int) and v > 0 for v in grid[key])
            for key in keys):
        raise argparse.ArgumentTypeError(f"--gemv-grid wants a JSON object of {', '.join(keys)}: non-empty lists of "
                                         f"positive integers, got {text!r}")
    return {key: tuple(grid[key]) for key in keys}


def _check(got, want, label) -> str | None:
    """None when ``got`` matches ``want`` (bf16 output of an fp32 sum), else what is wrong."""
    err = float((got.float() - want.float()).abs().max())
    tol = 2e-2 * float(want.float().abs().max()) + 2e-2
    return None if err <= tol else f"wrong result ({label}): max |diff| {err:.3g} > {tol:.3g}"


def _time_candidates(cands, device, iters, copies=None) -> dict:
    """``cands``: label -> (fn, expected, weight bytes, config or None); each checked, then timed.
    ``copies``: argument tuples of ``fn`` (the weight's copies): checked on the first, timed as one call
    per copy in turn (the time per call)."""
    from fused_moe import time_ms

    out = {}
    for label, (fn, want, nbytes, cfg) in cands.items():
        entry = {"config": list(cfg) if cfg is not None else None}
        calls = [functools.partial(fn, *c) for c in copies] if copies is not None else [fn]
        try:
            with torch.inference_mode():
                wrong = _check(calls[0](), want, label)
                if wrong:
                    entry["wrong"] = wrong
                else:
                    ms, mode = time_ms(calls, device, iters)
                    entry.update(ms=ms, mode=mode, gbps=nbytes / ms / 1e6)
        except Exception as e:  # noqa: BLE001 - a baseline this torch / device lacks is recorded
            entry["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        out[label] = entry
    return out


def _summarize(case: dict, current: str) -> dict:
    t = case["times"]
    for v in t.values():  # every candidate does the same 2 * rows * N * K flops
        if "ms" in v:
            v["tflops"] = 2 * case["rows"] * case["n"] * case["k"] / (v["ms"] * 1e-3) / 1e12
    fp8_labels = [k for k in t if not k.startswith("bf16") and k != "scaled_mm" and "ms" in t[k]]
    bf16_labels = [k for k in t if k.startswith("bf16") and "ms" in t[k]]
    if not fp8_labels:
        print(f"{case['shape']:22s} {case['rows']:5d}  no FP8 candidate ran: "
              + "; ".join(f"{k}: {v.get('wrong') or v.get('error')}" for k, v in t.items()), flush=True)
        case["current"], case["best_fp8"] = current, None
        return case
    best = min(fp8_labels, key=lambda k: t[k]["ms"])
    gemvs = [k for k in fp8_labels if k.startswith("gemv")]
    case["current"], case["best_fp8"] = current, best
    case["best_gemv"] = min(gemvs, key=lambda k: t[k]["ms"]) if gemvs else None
    case["best_over_current"] = t[current]["ms"] / t[best]["ms"] if "ms" in t[current] else None
    if bf16_labels:
        b = min(bf16_labels, key=lambda k: t[k]["ms"])
        case["best_bf16"] = b
        case["bf16_over_current"] = t[b]["ms"] / t[current]["ms"] if "ms" in t[current] else None
        case["bf16_over_best_fp8"] = t[b]["ms"] / t[best]["ms"]
    cur, bst = t[current], t[best]
    cur_s = f"{cur['ms'] * 1e3:8.1f} us {cur['gbps']:5.0f} GB/s" if "ms" in cur else f"{'-':>23s}"
    cfg = tuple(bst["config"]) if bst["config"] else ""
    line = (f"{case['shape']:22s} {case['rows']:5d}  current {current:9s} {cur_s}  best {best:16s} {str(cfg):22s} "
            f"{bst['ms'] * 1e3:8.1f} us {bst['gbps']:5.0f} GB/s ({case['best_over_current'] or float('nan'):.2f}x)")
    if bf16_labels:
        vs_current = case["bf16_over_current"] or float("nan")
        line += (f"  bf16 {case['best_bf16'][5:]:10s} {t[case['best_bf16']]['ms'] * 1e3:8.1f} us  "
                 f"fp8 current/best vs bf16 {vs_current:.2f}x/{case['bf16_over_best_fp8']:.2f}x")
    if case["rows"] > 64:  # prefill sizes: compute rates
        line += f"  TFLOP/s current {cur.get('tflops', float('nan')):.0f} best {bst['tflops']:.0f}"
        if "ms" in t.get("scaled_mm", {}):
            line += f" scaled_mm {t['scaled_mm']['tflops']:.0f}"
    if case["best_gemv"] and case["best_gemv"] != best:
        g = t[case["best_gemv"]]
        line += f"  (best gemv {tuple(g['config'])} {g['ms'] * 1e3:.1f} us)"
    print(line, flush=True)
    return case


def _tc_grid(grid) -> list[tuple]:
    import itertools

    return list(itertools.product(*grid.values())) if grid else []


def sweep_dense(shapes, rows_list, grid, device, iters, tc_grid=None, copy_bytes=DECODE_SWEEP_BYTES) -> list[dict]:
    from hybrid_compile.ops.triton import fp8 as tfp8
    from hybrid_compile.ops.triton.linear import skinny_mm_triton

    cases = []
    for name, n, k in shapes:
        torch.manual_seed(0)
        q, s = fp8_ops.quantize_weight_blocks(torch.randn(n, k, device=device) / k ** 0.5)
        wb = fp8_ops.dequantize_weight_blocks(q, s, torch.bfloat16)
        fp8_bytes = q.numel() + 4 * s.numel()
        # decode sizes: each timed graph cycles over copies of the weight that together exceed the L2 cache
        # (every call streams from HBM, as in a decode step, and a replay's fixed cost is spread over the
        # calls); the copies share the values, so every copy's product is the reference's
        n_copies = 1 if tc_grid is not None else max(1, -(-copy_bytes // fp8_bytes))
        copies = [(q, s, wb)] + [(q.clone(), s.clone(), wb.clone()) for _ in range(n_copies - 1)]
        for m in rows_list:
            x = torch.randn(m, k, device=device).to(torch.bfloat16)
            want = fp8_ops.reference_block_linear(x.float(), q, s)
            want_bf16 = x.float() @ wb.float().t()
            rpp = min(m, tfp8.FP8_GEMV_MAX_ROWS)
            cands = {"tc": (lambda q, s, wb: tfp8.fp8_gemm_triton(x, q, s), want, fp8_bytes, None)}
            if tc_grid is None:  # decode sizes: the earlier decode scheme
                cands["tc_old"] = (lambda q, s, wb: tfp8.fp8_gemm_triton(x, q, s, quant_in_gemm=True), want, fp8_bytes,
                                   None)
            for cfg in _tc_grid(tc_grid):
                cands[f"tc{list(cfg)}"] = (lambda q, s, wb, cfg=cfg: tfp8.fp8_gemm_triton(x, q, s, config=cfg), want,
                                           fp8_bytes, cfg)
            if m <= max(GEMV_SWEEP_MAX_ROWS, tfp8.FP8_DECODE_MAX_ROWS):
                cands["gemv"] = (lambda q, s, wb: tfp8.fp8_gemv_triton(x, q, s), want, fp8_bytes,
                                 tfp8.fp8_gemv_config(n, k, m))
                for cfg in _gemv_grid(grid, rpp, k):
                    cands[f"gemv{list(cfg)}"] = (lambda q, s, wb, cfg=cfg: tfp8.fp8_gemv_triton(x, q, s, config=cfg),
                                                 want, fp8_bytes, cfg)
                    if tfp8.gemv_quantizes_activation(m, n, k, cfg):  # its twin after the quantize kernel
                        cands[f"gemv_sepq{list(cfg)}"] = (
                            lambda q, s, wb, cfg=cfg: tfp8.fp8_gemv_triton(x, q, s, config=cfg, quantize_in_gemv=False),
                            want, fp8_bytes, cfg)
            xq = x.to(fp8_ops.FP8_DTYPE)
            sa, sb = torch.ones(m, 1, device=device), torch.ones(1, n, device=device)
            cands["scaled_mm"] = (lambda q, s, wb: torch._scaled_mm(xq, q.t(), scale_a=sa, scale_b=sb,
                                                                     out_dtype=torch.bfloat16),
                                  xq.float() @ q.float().t(), q.numel(), None)
            if m <= 2:
                cands["bf16_skinny_mm"] = (lambda q, s, wb: skinny_mm_triton(x, wb), want_bf16, 2 * n * k, None)
            cands["bf16_mm"] = (lambda q, s, wb: torch.mm(x, wb.t()), want_bf16, 2 * n * k, None)
            case = dict(shape=name, kind="dense", rows=m, n=n, k=k, weight_copies=n_copies,
                        times=_time_candidates(cands, device, iters, copies))
            current = "gemv" if tfp8.use_gemv(m, weight_shape=(n, k)) else "tc"
            cases.append(_summarize(case, current))
        del copies
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return cases


def _grouped_reference(x, weight_of, offsets):
    """fp32 product of each expert's rows with ``weight_of(e)`` (a float ``[N, K]``)."""
    y = None
    off = offsets.tolist()
    for e in range(len(off) - 1):
        if off[e + 1] > off[e]:
            ye = x[off[e]:off[e + 1]].float() @ weight_of(e).t()
            if y is None:
                y = torch.zeros(x.shape[0], ye.shape[1], device=x.device)
            y[off[e]:off[e + 1]] = ye
    return y


def sweep_experts(shapes, tokens_list, top_k, grid, device, iters, tc_grid=None) -> list[dict]:
    from hybrid_compile.ops.triton import fp8 as tfp8
    from hybrid_compile.ops.triton.moe import moe_grouped_linear_triton

    cases = []
    for name, e, n, k in shapes:
        torch.manual_seed(0)
        q, s = fp8_ops.quantize_weight_blocks(torch.randn(e, n, k, device=device) / k ** 0.5)
        wb = fp8_ops.dequantize_weight_blocks(q, s, torch.bfloat16)
        for tokens in tokens_list:
            ids = torch.stack([torch.randperm(e, device=device)[:top_k] for _ in range(tokens)]).flatten()
            off = torch.zeros(e + 1, dtype=torch.int64, device=device)
            off[1:] = torch.bincount(ids, minlength=e).cumsum(0)
            hit = int(torch.unique(ids).numel())
            m = ids.numel()
            x = torch.randn(m, k, device=device).to(torch.bfloat16)
            want = fp8_ops.reference_grouped_linear(x.float(), q, s, off)
            want_bf16 = _grouped_reference(x, lambda i: wb[i].float(), off)
            fp8_bytes = hit * (n * k + 4 * s[0].numel())
            rpp = tfp8.FP8_GROUPED_GEMV_ROWS
            cands = {"tc": (lambda: tfp8.fp8_gemm_triton(x, q, s, expert_offsets=off), want, fp8_bytes, None)}
            if tc_grid is None:  # decode sizes: the earlier scheme and the GEMV
                # as it was: quantized in the GEMM up to 64 rows (all experts together), else once
                cands["tc_old"] = (lambda: tfp8.fp8_gemm_triton(x, q, s, expert_offsets=off, quant_in_gemm=m <= 64),
                                   want, fp8_bytes, None)
                cands["gemv"] = (lambda: tfp8.fp8_gemv_triton(x, q, s, expert_offsets=off), want, fp8_bytes,
                                 tfp8.fp8_gemv_config(n, k, rpp, grouped=True))
                cands["gemv_1row"] = (lambda: tfp8.fp8_gemv_triton(x, q, s, expert_offsets=off, rows_per_program=1),
                                      want, fp8_bytes, tfp8.fp8_gemv_config(n, k, 1, grouped=True))
                # a row pair per program (an expert's second row converts the same weight tile again for free)
                cands["gemv_2rows"] = (lambda: tfp8.fp8_gemv_triton(x, q, s, expert_offsets=off, rows_per_program=2),
                                       want, fp8_bytes, tfp8.fp8_gemv_config(n, k, 2, grouped=True))
            for cfg in _tc_grid(tc_grid):
                cands[f"tc{list(cfg)}"] = (lambda cfg=cfg: tfp8.fp8_gemm_triton(x, q, s, expert_offsets=off, config=cfg),
                                           want, fp8_bytes, cfg)
            for cfg in _gemv_grid(grid, rpp, k):
                cands[f"gemv{list(cfg)}"] = (lambda cfg=cfg: tfp8.fp8_gemv_triton(x, q, s, expert_offsets=off,
                                                                                  config=cfg), want, fp8_bytes, cfg)
                if tfp8.gemv_quantizes_activation(m, n, k, cfg):  # its twin after the quantize kernel
                    cands[f"gemv_sepq{list(cfg)}"] = (
                        lambda cfg=cfg: tfp8.fp8_gemv_triton(x, q, s, expert_offsets=off, config=cfg,
                                                             quantize_in_gemv=False), want, fp8_bytes, cfg)
            cands["bf16_grouped"] = (lambda: moe_grouped_linear_triton(x, wb, off), want_bf16, 2 * hit * n * k, None)
            offs32 = off[1:].to(torch.int32)
            cands["bf16_torch_grouped_mm"] = (lambda: torch._grouped_mm(x, wb.transpose(-2, -1), offs=offs32),
                                              want_bf16, 2 * hit * n * k, None)
            case = dict(shape=name, kind="experts", rows=m, tokens=tokens, experts_hit=hit, n=n, k=k,
                        times=_time_candidates(cands, device, iters))
            current = "gemv" if tfp8.use_gemv(m, e) else "tc"
            if "gate_up" in name and tc_grid is None:
                case["routed"] = _routed_gate_up(x, ids, off, q, s, wb, top_k, device, iters, 2 * hit * n * k)
            cases.append(_summarize(case, current))
    return cases


def _routed_gate_up(x, ids, off, q, s, wb, top_k, device, iters, bf16_bytes) -> dict:
    """The gate_up call as the experts forward makes it: each token's row gathered by the kernel and
    silu_and_mul in its epilogue (half the output columns), FP8 (``fp8_grouped_linear``'s default path)
    beside the bf16 experts op (``moe_grouped_linear``'s), each checked against its reference."""
    from hybrid_compile.ops.moe import reference_moe_grouped_linear
    from hybrid_compile.ops.triton import fp8 as tfp8
    from hybrid_compile.ops.triton.common import sm_count
    from hybrid_compile.ops.triton.moe import moe_grouped_linear_triton

    tokens = x.shape[0] // top_k
    gather = torch.argsort(ids, stable=True) // top_k  # the token of each row sorted by expert
    xt = x[:tokens].contiguous()
    act = "silu_and_mul"
    want = fp8_ops.reference_grouped_linear(xt.float(), q, s, off, gather, None, act)
    want_bf16 = reference_moe_grouped_linear(xt.float(), wb.float(), off, gather, None, act)
    e, n, k = q.shape
    tc = tfp8.fp8_gemm_config(gather.shape[0], n, k, grouped=True, experts=e, sms=sm_count(device))
    times = _time_candidates({
        "fp8": (lambda: tfp8.fp8_grouped_linear_triton(xt, q, s, off, gather, None, act), want,
                bf16_bytes // 2, None),
        # the tensor-core path whatever the size: rows gathered before, silu_and_mul after the GEMM
        "fp8_tc": (lambda: tfp8.fp8_grouped_linear_triton(xt, q, s, off, gather, None, act, config=tc), want,
                   bf16_bytes // 2, tc),
        "bf16": (lambda: moe_grouped_linear_triton(xt, wb, off, gather, None, act), want_bf16, bf16_bytes, None),
        "bf16_grouped_mm": (lambda: moe_grouped_linear_triton(xt, wb, off, gather, None, act, path="grouped_mm"),
                            want_bf16, bf16_bytes, None),
    }, device, iters)
    if "ms" in times["fp8"] and "ms" in times["bf16"]:
        times["fp8_over_bf16"] = times["bf16"]["ms"] / times["fp8"]["ms"]
        print(f"  routed gate_up + silu_and_mul, {tokens} tokens: " + ", ".join(
            f"{label} {v['ms'] * 1e3:.1f} us" for label, v in times.items() if isinstance(v, dict) and "ms" in v)
            + f" (FP8 default {times['fp8_over_bf16']:.2f}x bf16 default)", flush=True)
    return times


def run_sweep(args) -> int:
    device = torch.device(args.device)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--sweep times the Triton kernels: on a CPU run it with TRITON_INTERPRET=1 (a smoke run)")
    if args.tiny:
        linear, experts, rows, top_k, grid, grid_grouped = (
            TINY_SWEEP[key] for key in ("linear", "experts", "rows", "top_k", "grid", "grid_grouped"))
    else:
        linear, experts, rows, top_k = SWEEP_LINEAR_SHAPES, EXPERT_SHAPES, SWEEP_ROWS, 10
        grid, grid_grouped = GEMV_GRID, GEMV_GRID_GROUPED
    if args.gemv_grid is not None:
        grid = grid_grouped = args.gemv_grid
    if args.tp > 1:
        linear, experts = tp_slices(linear, experts, args.tp)
    linear = [] if args.sweep_only == "experts" else linear
    experts = [] if args.sweep_only == "dense" else experts
    tc_grid = None
    if args.prefill:  # prefill sizes: the tensor-core GEMM's tiles, no GEMV
        rows, tc_grid = (TINY_PREFILL["rows"], TINY_PREFILL["tc_grid"]) if args.tiny else (PREFILL_ROWS, TC_GRID)
        grid = grid_grouped = {}
    if args.sweep_rows:  # (decode or prefill sizes alike)
        rows = tuple(args.sweep_rows)
    print("shape                   rows  current default (what the op runs)     best FP8 candidate (config: gemv "
          "BLOCK_N, BLOCK_K, warps, stages; tc BM, BN, warps, stages, GROUP_M)       best bf16", flush=True)
    t = time.perf_counter()
    dense = sweep_dense(linear, rows, grid, device, args.iters, tc_grid,
                        TINY_SWEEP["copy_bytes"] if args.tiny else DECODE_SWEEP_BYTES)
    grouped = sweep_experts(experts, rows, top_k, grid_grouped, device, args.iters, tc_grid)
    wrong = [(c["shape"], c["rows"], label, v["wrong"]) for c in dense + grouped
             for label, v in {**c["times"], **{f"routed {k}": r for k, r in c.get("routed", {}).items()
                                               if isinstance(r, dict)}}.items()
             if "wrong" in v]
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "tiny": args.tiny, "prefill": args.prefill, "tp": args.tp,
           "seconds": time.perf_counter() - t,
           "date": time.strftime("%Y-%m-%d")}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"env": env, "dense": dense, "experts": grouped, "wrong": wrong}, indent=2))
    print(f"(rows of experts: routed rows = tokens x top-k; GB/s: weight bytes streamed / time)\nwrote {out} "
          f"({env['seconds']:.0f} s)")
    for w in wrong:
        print("WRONG:", *w)
    return 1 if wrong else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="toy sizes (CPU smoke run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=8, help="layers of the 80B shape (48 = the full model)")
    # (128: a run of 32 steps at batch 1 swung 0.72 -> 1.24 ms a step on an H200 from host hiccups, with every
    # step a graph replay; the median of DECODE_REPEATS runs of 128 kept within 0.73-0.77)
    p.add_argument("--decode-steps", type=int, default=128)
    p.add_argument("--memory-fraction", type=float, default=0.5)
    p.add_argument("--chunked-prefill", type=int, default=8192,
                   help="the engines' chunked_prefill_size (the largest prefill piece captured; the 48-layer "
                        "model's capture ran out of memory at 8192 with --memory-fraction 0.5 on an H200)")
    p.add_argument("--no-kernels", action="store_true", help="skip the kernel table")
    p.add_argument("--no-engines", action="store_true",
                   help="only the kernel table (e.g. in its own process when the engines left too little memory)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/fp8.json, "
                                                 "fp8_sweep.json with --sweep)")
    p.add_argument("--sweep", action="store_true", help="the decode kernel sweep instead (see above)")
    p.add_argument("--iters", type=int, default=10, help="--sweep: timed replays (x3) per candidate")
    p.add_argument("--tp", type=int, default=1,
                   help="--sweep: the shapes of one rank's shard at this tensor-parallel size (see tp_slices)")
    p.add_argument("--sweep-only", choices=["dense", "experts"], help="--sweep: only these cases")
    p.add_argument("--gemv-grid", type=_gemv_grid_arg, default=None,
                   help="--sweep: JSON {block_n, block_k, warps, stages: [values]} for the GEMV of both the dense "
                        "and the experts cases instead of GEMV_GRID / GEMV_GRID_GROUPED")
    p.add_argument("--sweep-rows", type=int, nargs="+",
                   help="--sweep: dense rows / expert tokens (default 1 2 4 8 16 32 64; with --prefill 4096 8192)")
    p.add_argument("--build-quantized", action="store_true",
                   help="build each layer in bf16 and quantize it before the next (with --modes fp8: a model "
                        "whose bf16 weights do not fit, e.g. --layers 48 on one H200)")
    p.add_argument("--prefill", action="store_true",
                   help="--sweep at prefill sizes instead: the tensor-core GEMM under TC_GRID (see above)")
    p.add_argument("--modes", default="bf16,fp8",
                   help=f"engines to run, in this order, from {','.join(MODES)} (fp8 last: the model is "
                        "quantized in place; fp8 alone: the model is quantized first)")
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or len(set(modes)) != len(modes) or not set(modes) <= set(MODES) \
            or modes != sorted(modes, key=list(MODES).index):
        p.error(f"--modes must be distinct names from {','.join(MODES)} in that order (the model is quantized "
                f"in place), got {args.modes!r}")
    if args.build_quantized and (args.sweep or args.no_engines or modes != ["fp8"]):
        p.error("--build-quantized builds the model for the FP8 engine alone: pass --modes fp8 (no --sweep / "
                "--no-engines)")
    if not args.sweep and (args.tp != 1 or args.sweep_only or args.sweep_rows or args.gemv_grid is not None):
        p.error("--tp, --sweep-only, --sweep-rows and --gemv-grid are options of --sweep: pass --sweep too")
    if args.prefill and args.gemv_grid is not None:
        p.error("--gemv-grid: --sweep --prefill times no GEMV")
    if args.tp < 1:
        p.error(f"--tp must be at least 1, got {args.tp}")
    if args.prefill and not args.sweep:
        p.error("--prefill is a size range of --sweep: pass --sweep too")
    if (args.sweep or args.no_engines) and args.modes != "bf16,fp8":
        p.error("--modes picks the engines: it does not apply to --sweep or --no-engines")
    if args.out is None:
        args.out = (f"benchmarks/results/fp8_sweep{'_prefill' * args.prefill}.json" if args.sweep
                    else "benchmarks/results/fp8.json")
    if args.sweep:
        return run_sweep(args)
    device = torch.device(args.device)
    tiny = args.tiny
    decode_batches = (1, 2) if tiny else (1, 16, 64)
    prefill_lens = (64,) if tiny else (4096, 32768)
    steps = 2 if tiny else args.decode_steps
    layers = 4 if tiny else args.layers
    config = qwen3_next_80b_config(layers, tiny)
    if args.no_engines:
        if device.type != "cuda" or args.no_kernels:
            p.error("--no-engines runs only the kernel table: it needs --device cuda and no --no-kernels")
        results = {"env": {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                           "date": time.strftime("%Y-%m-%d")}, "kernels": kernel_table((1, 16, 64, 4096))}
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))
        print(f"wrote {out}")
        return 0
    t = time.perf_counter()
    if args.build_quantized:
        model = build_quantized(config, device, seed=0)
    else:
        model = _build(transformers.Qwen3NextForCausalLM, config, torch.bfloat16, device, seed=0)
    build_s = time.perf_counter() - t
    params = sum(p.numel() for p in model.parameters())
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "transformers": transformers.__version__, "layers": layers,
           "params": params, "tiny": tiny, "build_quantized": args.build_quantized, "build_seconds": build_s,
           "date": time.strftime("%Y-%m-%d")}
    if device.type == "cuda":  # what serves the FP8 engine's dense GEMMs above decode size
        from hybrid_compile.ops.triton import fp8 as tfp8
        env["fp8_dense_gemm"] = ("triton" if tfp8.fp8_gemm_choice() == "triton"
                                 or not tfp8.cublas_block_gemm_supported(device) else "cublas block-scaled")
    print(f"model: {params / 1e9:.2f} B parameters, {layers} layers, built in {build_s:.1f} s on {env['device']}")
    # Mamba slots given explicitly (running requests + as many for the prefix cache): sized from the
    # budget they would depend on what the first engine left reserved, and differ between the modes
    engine_kw = dict(max_running_requests=max(decode_batches), mamba_cache_size=2 * max(decode_batches),
                     memory_fraction=args.memory_fraction,
                     max_context_len=max(prefill_lens) + 64,
                     chunked_prefill_size=min(args.chunked_prefill, max(prefill_lens)))
    results = {"env": env}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after each part: a later failure (out of memory, a time limit) keeps the rest
        out.write_text(json.dumps(results, indent=2))

    memory = results["memory_gib"] = {}

    def note_memory(when: str) -> None:  # what the caching allocator holds: the next engine's budget sees it
        if device.type == "cuda":
            memory[when] = {"allocated": torch.cuda.memory_allocated(device) / 2**30,
                            "reserved": torch.cuda.memory_reserved(device) / 2**30}
            print(f"memory {when}: {memory[when]['allocated']:.2f} GiB allocated, "
                  f"{memory[when]['reserved']:.2f} GiB reserved", flush=True)

    note_memory("model built")
    for mode in modes:
        if mode == "fp8":
            t = time.perf_counter()
            quantize_model(model)
            sync_device(device)
            if device.type == "cuda":
                # the bf16 weights just replaced are free but still reserved by the caching
                # allocator: give them back, or the engine's memory budget sees them as used
                gc.collect()
                torch.cuda.empty_cache()
            env["quantize_seconds"] = time.perf_counter() - t
            note_memory("quantized")
        fp8_bytes, other = fp8_weight_bytes(model)
        print(f"{mode}: weights {(fp8_bytes + other) / 2**30:.2f} GiB", flush=True)
        t = time.perf_counter()
        engine = hc.wrap(model, **engine_kw, **MODES[mode])
        wrap_s = time.perf_counter() - t
        # what the wrap spent its time on (phases) and compiled (stats()["startup"] / ["startup_work"])
        stats = engine.stats()
        startup = {"startup": stats["startup"], "startup_work": stats["startup_work"]}
        print(f"{mode}: wrap {wrap_s:.1f} s: " + ", ".join(f"{k} {v:.1f}" for k, v in stats["startup"].items() if v),
              flush=True)
        results[mode] = {"weight_bytes": fp8_bytes + other, "wrap_seconds": wrap_s, "engine": MODES[mode], **startup,
                         **measure_engine(engine, config.vocab_size, decode_batches, steps, prefill_lens, device)}
        engine.close()
        del engine
        # the closed engine's compiled code (and what it holds) goes too, before the next engine
        # measures its memory budget
        torch._dynamo.reset()
        save()
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
        note_memory(f"{mode} engine closed")
    first = modes[0]
    for mode in modes[1:]:
        for b in decode_batches:
            r = results[first]["decode"][str(b)]["ms_per_step"] / results[mode]["decode"][str(b)]["ms_per_step"]
            print(f"decode batch {b}: {mode} {r:.2f}x {first}")
        for n in prefill_lens:
            r = results[first]["prefill"][str(n)]["seconds"] / results[mode]["prefill"][str(n)]["seconds"]
            print(f"prefill {n}: {mode} {r:.2f}x {first}")
    if device.type == "cuda" and not args.no_kernels:
        del model
        gc.collect()
        torch.cuda.empty_cache()
        try:
            results["kernels"] = kernel_table((1, 16, 64, 4096))
        except torch.cuda.OutOfMemoryError as e:  # recorded and reported, the engine results stay
            results["kernels"] = {"error": f"out of memory: {e}"}
            print(f"kernel table: out of memory ({str(e).splitlines()[0]}); rerun with --no-engines", flush=True)
    save()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
