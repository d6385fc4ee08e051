"""Fused MoE experts micro-benchmark: transformers' experts forward vs ours (``fused_moe_experts``).

    python benchmarks/fused_moe.py [--tokens 1 2 4 8 16 64] [--out benchmarks/results/fused_moe.json]
    python benchmarks/fused_moe.py --tp 2            # one rank's slice of the experts (intermediate / 2)
    python benchmarks/fused_moe.py --tiny --device cpu   # CPU smoke run (tests/test_benchmarks_fused_moe.py)
    python benchmarks/fused_moe.py --sweep --tokens 1 2 4 8 16 64   # tile sweep of both our kernels (CUDA)
    python benchmarks/fused_moe.py --sweep --sweep-paths gemv --shapes qwen3_next_80b_a3b --tokens 1 2 4 8 16

Shapes: Qwen3.5-35B-A3B's experts (256 experts, top-8, hidden 2048, expert width 512, silu-gated:
transformers' ``Qwen3NextExperts``, the same layout as ``Qwen3_5MoeExperts``), Qwen3-Next-80B-A3B's
(512 experts, top-10, hidden 2048, width 512, silu-gated) and Nemotron-3-Nano-30B-A3B's (128 experts, top-6, hidden 2688, width 1856, relu2 without a gate:
``NemotronHExperts``), random bf16 weights, random routing with distinct experts per token. For each
token count: transformers' forward with each of its experts implementations (``eager``: a loop over
the hit experts with host syncs; ``grouped_mm``: ``torch._grouped_mm`` after a sort; ``batched_mm``)
and ours, the median of CUDA-graph replays where the call can be captured, else of eager calls (the
``mode`` field says which; ``ours_eager``: ours without a graph, launch overhead included; on CUDA a
case of at most :data:`FEW_TOKENS` tokens is timed per call of a graph of :data:`CALLS_PER_GRAPH`
calls, each over its own routing draw: ``calls_per_timing``), plus
the bytes of expert weights the step must read (the experts hit) and the bandwidth that time
implies; ``path``: which kernel our ``moe_grouped_linear`` took (on CUDA ``moe_path``'s: the
CUDA-core ``gemv`` at decode, at most two rows per expert on average, else ``tensor_cores``; both
projections have the same rows; on a CPU run ``plain_torch``). Our output is checked against transformers' ``eager`` forward
first. ``ours_grouped_mm`` (CUDA, bf16): ours with ``torch._grouped_mm`` for the calls above decode
size (``ops.triton.moe.LARGE_CALLS_PATH``), checked the same way. Prints a table; writes JSON.

``--sweep``: instead, the tile sweep of the kernels of ``moe_grouped_linear`` on the same shapes
and routings: for each token count and projection (``up``: the tokens gathered into
``gate_up_proj`` / ``up_proj`` with the activation fused as the engine fuses it; ``down``: the
sorted rows into ``down_proj``, scattered back) the default (the path and tiles the op takes),
every tensor-core (BM, BN, BK, warps, stages) of :data:`SWEEP_GRID` (16-row tiles only below 16
tokens) and, up to :data:`GEMV_SWEEP_MAX_TOKENS` tokens, every GEMV (rows per program, BLOCK_N,
BLOCK_K, warps, stages) of :data:`GEMV_SWEEP_GRID` and of the by-expert GEMV
(``gemv_by_expert``, :data:`GEMV_BY_EXPERT_SWEEP_GRID`) (but tiles of more accumulators than
:data:`GEMV_SWEEP_MAX_ACCUMULATORS`), each output checked against the default's,
timed as above; prints the default and the best of each path per case, writes every timing. On
CPU it needs ``TRITON_INTERPRET=1`` (a smoke run: the interpreter's times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import transformers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import hybrid_compile  # noqa: E402,F401  (registers the ops)
from hybrid_compile.ops.moe import fused_moe_experts  # noqa: E402
from hybrid_compile.ops.triton import moe as tmoe  # noqa: E402
from hybrid_compile.ops.triton.moe import moe_path  # noqa: E402

IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
SHAPE_NAMES = ("qwen3_5_35b_a3b", "qwen3_next_80b_a3b", "nemotron3_nano_30b")  # the keys of shapes()


def shapes(tiny: bool, tp: int) -> dict:
    """name -> (experts class, config, top_k); expert widths divided by ``tp`` (one rank's slice)."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextExperts

    e1, h1, i1, k1 = (8, 64, 32, 2) if tiny else (256, 2048, 512, 8)
    e3, h3, i3, k3 = (16, 32, 32, 4) if tiny else (512, 2048, 512, 10)
    e2, h2, i2, k2 = (8, 48, 40, 2) if tiny else (128, 2688, 1856, 6)
    qwen35 = transformers.Qwen3NextConfig(num_experts=e1, hidden_size=h1, moe_intermediate_size=i1 // tp,
                                          num_experts_per_tok=k1, hidden_act="silu")
    qwen3_next = transformers.Qwen3NextConfig(num_experts=e3, hidden_size=h3, moe_intermediate_size=i3 // tp,
                                              num_experts_per_tok=k3, hidden_act="silu")
    nemo = transformers.NemotronHConfig(n_routed_experts=e2, hidden_size=h2, moe_intermediate_size=i2 // tp,
                                        num_experts_per_tok=k2, mlp_hidden_act="relu2", moe_latent_size=None)
    return dict(zip(SHAPE_NAMES, ((Qwen3NextExperts, qwen35, k1), (Qwen3NextExperts, qwen3_next, k3),
                                  (NemotronHExperts, nemo, k2))))


def ours_path(rows: int, experts: int, device: torch.device, down_k: int) -> str:
    """The kernels our ``moe_grouped_linear`` takes on ``device`` for ``rows`` over ``experts``: on CUDA
    :func:`moe_path`'s (``gemv`` / ``gemv_by_expert`` / ``tensor_cores``; ``up/down`` where the
    projections differ: the down projection's ``down_k`` input channels are short); elsewhere the op's
    plain-torch implementation."""
    if device.type != "cuda":
        return "plain_torch"
    up, down = moe_path(rows, experts), moe_path(rows, experts, k=down_k)
    return up if up == down else f"{up}/{down}"


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


#: On CUDA calls of at most FEW_TOKENS tokens are timed CALLS_PER_GRAPH at a time (one graph of them, each
#: over its own routing draw; the time per call; ``calls_per_timing`` in the JSON): such a call takes a
#: few microseconds, less than what timing a replay of it alone adds (an H200 sweep of 2026-11-28 timed
#: every tile of TP 4's one-token calls at 10 or 16 us, where the model's decode graph spends 5.7 us a call)
FEW_TOKENS = 8
CALLS_PER_GRAPH = 16


def _draws(tokens: int, device) -> int:
    """How many routing draws (calls timed in one graph) a case of ``tokens`` tokens takes."""
    return CALLS_PER_GRAPH if tokens <= FEW_TOKENS and device.type == "cuda" else 1


def time_ms(fn, device, iters: int, graph: bool = True) -> tuple[float, str]:
    """Median ms of ``fn``: CUDA-graph replays when ``graph`` and it can be captured (CUDA), else eager
    calls. ``fn`` may be a list of calls: they run in turn (one graph holding all of them) and the time
    is per call."""
    fns = list(fn) if isinstance(fn, (list, tuple)) else [fn]

    def run():
        for f in fns:
            f()

    for _ in range(3 if device.type == "cuda" else 1):  # (on the CPU a smoke run: its times mean nothing)
        run()
    _sync(device)
    if device.type == "cuda":
        from kernels import bench

        ms = bench(run, iters=iters, graph=graph)
        return float(ms) / len(fns), ms.mode
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        run()
        times.append((time.perf_counter() - t) * 1e3 / len(fns))
    return statistics.median(times), "eager"


def run_shape(name, cls, config, top_k, tokens_list, device, dtype, iters) -> list[dict]:
    torch.manual_seed(0)
    experts = cls(config).to(device=device, dtype=dtype)
    has_gate = hasattr(experts, "gate_up_proj")
    up = experts.gate_up_proj if has_gate else experts.up_proj
    with torch.no_grad():
        up.normal_(0, up.shape[-1] ** -0.5)
        experts.down_proj.normal_(0, experts.down_proj.shape[-1] ** -0.5)
    num, hidden, inter = experts.down_proj.shape
    rows = []
    for tokens in tokens_list:
        # drawn on the host: a CUDA-graph capture that failed (an implementation that syncs) can leave
        # the device generator refusing the next draw. A few tokens: several draws (_draws)
        draws = []
        for _ in range(_draws(tokens, device)):
            draws.append((torch.stack([torch.randperm(num)[:top_k] for _ in range(tokens)]).to(device),
                          torch.softmax(torch.randn(tokens, top_k), -1).to(device=device, dtype=dtype),
                          torch.randn(tokens, hidden).to(device=device, dtype=dtype)))
        idx, w, x = draws[0]
        hit = sum(int(torch.unique(d[0]).numel()) for d in draws) / len(draws)
        # up [E, (2)I, H] and down [E, H, I] of each expert hit
        weight_bytes = hit * hidden * (up.shape[1] + inter) * up.element_size()

        def ours(idx=idx, w=w, x=x):
            return fused_moe_experts(x, idx, w, up, experts.down_proj, experts.act_fn, has_gate)

        def each_draw(fn):
            """``fn(idx, w, x)`` once per draw: the calls ``time_ms`` times in turn."""
            return [lambda d=d: fn(*d) for d in draws]

        row = dict(shape=name, tokens=tokens, experts=num, top_k=top_k, hidden=hidden, intermediate=inter,
                   experts_hit=hit, calls_per_timing=len(draws), weight_bytes=weight_bytes,
                   path=ours_path(tokens * top_k, num, device, inter), times={})
        with torch.inference_mode():
            config._experts_implementation = "eager"
            want = experts(x, idx, w).float()
            got = ours().float()
            row["max_abs_diff_vs_eager"] = float((got - want).abs().max())
            scale = float(want.abs().max())
            assert row["max_abs_diff_vs_eager"] <= 0.05 * scale + 1e-3, (name, tokens, row["max_abs_diff_vs_eager"], scale)
            for impl in IMPLEMENTATIONS:
                try:
                    config._experts_implementation = impl
                    # transformers' eager loop reads the routing on the host: no graph to capture
                    ms, mode = time_ms(each_draw(lambda i, w_, x_: experts(x_, i, w_)), device, iters,
                                       graph=impl != "eager")
                except Exception as e:  # noqa: BLE001 - an implementation this torch lacks is recorded
                    row["times"][f"hf_{impl}"] = dict(error=f"{type(e).__name__}: {str(e)[:120]}")
                    continue
                row["times"][f"hf_{impl}"] = dict(ms=ms, mode=mode, gbps=weight_bytes / ms / 1e6)
            ms, mode = time_ms(each_draw(ours), device, iters)
            row["times"]["ours"] = dict(ms=ms, mode=mode, gbps=weight_bytes / ms / 1e6)
            ms, mode = time_ms(each_draw(ours), device, iters, graph=False)  # launch overhead included
            row["times"]["ours_eager"] = dict(ms=ms, mode=mode, gbps=weight_bytes / ms / 1e6)
            if device.type == "cuda" and dtype == torch.bfloat16:
                # ours with torch._grouped_mm for the calls above decode size (tmoe.LARGE_CALLS_PATH)
                saved, tmoe.LARGE_CALLS_PATH = tmoe.LARGE_CALLS_PATH, "grouped_mm"
                try:
                    diff = float((ours().float() - want).abs().max())
                    assert diff <= 0.05 * scale + 1e-3, (name, tokens, "grouped_mm", diff, scale)
                    ms, mode = time_ms(each_draw(ours), device, iters)
                    row["times"]["ours_grouped_mm"] = dict(ms=ms, mode=mode, gbps=weight_bytes / ms / 1e6,
                                                           max_abs_diff_vs_eager=diff)
                finally:
                    tmoe.LARGE_CALLS_PATH = saved
        rows.append(row)
    return rows


SWEEP_GRID = dict(bm=(16, 32, 64), bn=(16, 32, 64, 128), bk=(64, 128, 256), warps=(4, 8), stages=(3, 4))
#: GEMV tiles of the sweep (rows per program, BLOCK_N, BLOCK_K, warps, stages), around the defaults
#: (``GROUPED_GEMV_TILES``: 16 x 256, 8 x 256 for silu_and_mul, 4 warps); stages fixed at 2, as in the FP8
#: sweep's grouped grid (the loop's loads are not staged through shared memory).
GEMV_SWEEP_GRID = dict(rows=(1, 2), block_n=(4, 8, 16, 32, 64, 128), block_k=(128, 256, 512), warps=(4, 8),
                       stages=(2,))
#: The GEMV is swept up to this many tokens (the decode sizes it serves: 64 tokens of top-10 routing
#: over 512 experts are 1.25 rows per expert)
GEMV_SWEEP_MAX_TOKENS = 64
#: GEMV tiles holding more fp32 accumulators than this (rows x BLOCK_N x BLOCK_K, twice for
#: silu_and_mul) are left out: 4x the default tile's 4096, beyond which the registers spill
GEMV_SWEEP_MAX_ACCUMULATORS = 16384
#: Tiles of the by-expert GEMV (``path="gemv_by_expert"``: a program per expert and column tile, its
#: rows ``rows`` at a time): the same fields, more rows a pass (an expert of 64 top-10 tokens over 512
#: experts has 1.25 rows on average, and a pass reads the slab once for all of them)
GEMV_BY_EXPERT_SWEEP_GRID = dict(rows=(1, 2, 4), block_n=(8, 16, 32, 64), block_k=(128, 256), warps=(4, 8),
                                 stages=(2,))
TINY_GRID = dict(bm=(16,), bn=(16, 32), bk=(32,), warps=(4,), stages=(2,))
TINY_GEMV_GRID = dict(rows=(1, 2), block_n=(4,), block_k=(16,), warps=(2,), stages=(1,))
#: The swept kernels (``--sweep-paths``) and their grids, full size and tiny
SWEEP_PATHS = ("gemv", "gemv_by_expert", "tensor_cores")
GRIDS = dict(tensor_cores=SWEEP_GRID, gemv=GEMV_SWEEP_GRID, gemv_by_expert=GEMV_BY_EXPERT_SWEEP_GRID)
TINY_GRIDS = dict(tensor_cores=TINY_GRID, gemv=TINY_GEMV_GRID, gemv_by_expert=dict(TINY_GEMV_GRID, rows=(2,)))


def _candidates(tokens, rows, n, k, experts, dtype, sms, gated, grids: dict) -> list[dict]:
    """The default first (the path and tiles ``moe_grouped_linear`` takes), then the other tiles of
    ``grids`` (path -> grid; a path left out is not swept): ``dict(path, config[, rows_per_program])``."""
    import itertools

    from hybrid_compile.ops.triton.moe import moe_gemm_config, moe_gemv_tiles

    path = moe_path(rows, experts, dtype, k, gated)
    if path in ("gemv", "gemv_by_expert"):
        config, rpp = moe_gemv_tiles(path, n, k, dtype, gated, rows)
        default = dict(path=path, config=list(config), rows_per_program=rpp)
    else:
        default = dict(path=path, config=list(moe_gemm_config(rows, n, k, experts, dtype, sms=sms, gated=gated)))
    found = [default]
    grid = grids.get("tensor_cores")
    for c in itertools.product(*grid.values()) if grid is not None else ():
        if (c[0] == 16 or tokens >= 16) and dict(path="tensor_cores", config=list(c)) != default:
            found.append(dict(path="tensor_cores", config=list(c)))
    for gemv_path in ("gemv", "gemv_by_expert"):
        if gemv_path not in grids or tokens > GEMV_SWEEP_MAX_TOKENS:
            continue
        for rpp, *c in itertools.product(*grids[gemv_path].values()):
            cand = dict(path=gemv_path, config=list(c), rows_per_program=rpp)
            accumulators = rpp * c[0] * min(c[1], k) * (2 if gated else 1)
            if cand != default and accumulators <= GEMV_SWEEP_MAX_ACCUMULATORS:
                found.append(cand)
    return found


def _label(timing) -> str:
    rpp = f" x{timing['rows_per_program']} rows" if "rows_per_program" in timing else ""
    return f"{timing['path']} {tuple(timing['config'])}{rpp}"


def sweep_shape(name, cls, config, top_k, tokens_list, device, dtype, iters, grids: dict) -> list[dict]:
    """Tile sweep of both projections of ``name``'s experts (see the module docstring); ``grids``:
    path -> its grid, of the kernels swept."""
    from hybrid_compile.ops.moe import fused_activation, grouped_output_width, sort_pairs_by_expert
    from hybrid_compile.ops.triton.common import sm_count
    from hybrid_compile.ops.triton.moe import moe_grouped_linear_triton

    torch.manual_seed(0)
    experts = cls(config).to(device=device, dtype=dtype)
    up = experts.gate_up_proj if hasattr(experts, "gate_up_proj") else experts.up_proj
    down = experts.down_proj
    with torch.no_grad():
        up.normal_(0, up.shape[-1] ** -0.5)
        down.normal_(0, down.shape[-1] ** -0.5)
    num, hidden, inter = down.shape
    sms = sm_count(device)
    rows = []
    act = fused_activation(experts.act_fn, hasattr(experts, "gate_up_proj"))  # as the engine's first GEMM
    for tokens in tokens_list:
        # a few tokens: several draws (_draws), other experts in each (a call does not find its weights in
        # L2 from the one before)
        draws = []
        for _ in range(_draws(tokens, device)):
            idx = torch.stack([torch.randperm(num, device=device)[:top_k] for _ in range(tokens)])
            draws.append((idx, sort_pairs_by_expert(idx, num), torch.randn(tokens, hidden, device=device, dtype=dtype),
                          torch.randn(tokens * top_k, inter, device=device, dtype=dtype)))
        hit = sum(int(torch.unique(idx).numel()) for idx, *_ in draws) / len(draws)
        # projection: (weight, activation, the call's (input, gather, scatter) of a draw)
        cases = {"up": (up, act, lambda routing, x, h: (x, routing.token_of_row, None)),
                 "down": (down, "none", lambda routing, x, h: (h, None, routing.order))}
        for projection, (weight, activation, operands) in cases.items():
            candidates = _candidates(tokens, tokens * top_k, grouped_output_width(weight.shape[1], activation),
                                     weight.shape[2], num, dtype, sms, activation == "silu_and_mul", grids)
            weight_bytes = hit * weight.shape[1] * weight.shape[2] * weight.element_size()
            want = None
            timings = []
            with torch.inference_mode():
                for cand in candidates:
                    def call(routing, x, h, cand=cand, weight=weight, activation=activation, operands=operands):
                        inp, gather, scatter = operands(routing, x, h)
                        return moe_grouped_linear_triton(inp, weight, routing.expert_offsets, gather, scatter,
                                                         activation, config=tuple(cand["config"]), path=cand["path"],
                                                         rows_per_program=cand.get("rows_per_program"))
                    calls = [lambda d=d, call=call: call(*d[1:]) for d in draws]
                    try:
                        got = calls[0]().float()
                    except Exception as e:  # noqa: BLE001 - a tile this device cannot hold is recorded
                        timings.append(dict(cand, error=f"{type(e).__name__}: {str(e)[:120]}"))
                        continue
                    if want is None:
                        want = got
                    err = float((got - want).abs().max())
                    assert err <= 0.02 * float(want.abs().max()) + 1e-3, (name, tokens, projection, cand, err)
                    ms, mode = time_ms(calls, device, iters)
                    timings.append(dict(cand, ms=ms, mode=mode, gbps=weight_bytes / ms / 1e6))
            timed = [t for t in timings if "ms" in t]
            best = min(timed, key=lambda t: t["ms"])
            best_by_path = {p: min((t for t in timed if t["path"] == p), key=lambda t: t["ms"])
                            for p in SWEEP_PATHS if any(t["path"] == p for t in timed)}
            rows.append(dict(shape=name, tokens=tokens, projection=projection, activation=activation, experts_hit=hit,
                             calls_per_timing=len(draws), weight_bytes=weight_bytes, default=timed[0], best=best,
                             best_by_path=best_by_path,
                             timings=timings))
            d = timed[0]
            per_path = "  ".join(f"best {_label(t)} {t['ms'] * 1e3:.1f} us ({d['ms'] / t['ms']:.2f}x)"
                                 for t in best_by_path.values())
            print(f"{name:20s} T={tokens:<4d} {projection:4s} default {_label(d)} {d['ms'] * 1e3:8.1f} us "
                  f"({d['gbps']:5.0f} GB/s)  {per_path}", flush=True)
    return rows


def print_table(rows) -> None:
    cols = ["hf_" + i for i in IMPLEMENTATIONS] + ["ours_eager", "ours"]
    if any("ours_grouped_mm" in r["times"] for r in rows):
        cols.insert(-2, "ours_grouped_mm")
    print(f"\n{'shape':20s} {'T':>4s} {'hit':>4s} {'MB':>7s} {'ours path':>19s} "
          + " ".join(f"{c + ' ms':>16s}" for c in cols) + f" {'ours GB/s':>9s} {'vs best hf':>10s}")
    for r in rows:
        t = r["times"]
        cells = [f"{t[c]['ms']:.4f}{'g' if t[c]['mode'] == 'cuda_graph' else 'e'}" if "ms" in t.get(c, {}) else
                 ("error" if c in t else "-") for c in cols]
        best = min((t[c]["ms"] for c in cols if c.startswith("hf_") and "ms" in t[c]), default=float("nan"))
        print(f"{r['shape']:20s} {r['tokens']:4d} {r['experts_hit']:4.0f} {r['weight_bytes'] / 1e6:7.1f} {r['path']:>19s} "
              + " ".join(f"{c:>16s}" for c in cells)
              + f" {t['ours']['gbps']:9.0f} {best / t['ours']['ms']:9.2f}x")
    print("(g: CUDA-graph replays, e: eager calls; MB: expert weights the step reads; ours path: the kernel our "
          "moe_grouped_linear took)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="toy sizes (CPU smoke run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--tp", type=int, default=1, help="serve one rank's slice: expert widths / tp")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="the tile sweep of our kernels (tensor cores, GEMV) instead")
    p.add_argument("--sweep-paths", nargs="+", choices=SWEEP_PATHS,
                   help="with --sweep: the kernels whose grids are swept (default all; the default config is "
                        "always timed first)")
    p.add_argument("--shapes", nargs="+", choices=SHAPE_NAMES, default=list(SHAPE_NAMES),
                   help="the expert shapes to run (default all)")
    p.add_argument("--out", default="benchmarks/results/fused_moe.json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.sweep_paths and not args.sweep:
        raise SystemExit("--sweep-paths chooses the grids of --sweep: pass --sweep too")
    if args.sweep and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--sweep times the Triton kernel: on a CPU run it with TRITON_INTERPRET=1 (a smoke run)")
    rows = []
    for name, (cls, config, top_k) in shapes(args.tiny, args.tp).items():
        if name not in args.shapes:
            continue
        if args.sweep:
            paths = args.sweep_paths or SWEEP_PATHS
            grids = {p: g for p, g in (TINY_GRIDS if args.tiny else GRIDS).items() if p in paths}
            rows += sweep_shape(name, cls, config, top_k, args.tokens, device, dtype, args.iters, grids)
        else:
            rows += run_shape(name, cls, config, top_k, args.tokens, device, dtype, args.iters)
    if not args.sweep:
        print_table(rows)
    env = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", dtype=args.dtype,
               tp=args.tp, tiny=args.tiny, sweep=args.sweep, shapes=args.shapes, torch=torch.__version__,
               transformers=transformers.__version__)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(env=env, rows=rows), indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
