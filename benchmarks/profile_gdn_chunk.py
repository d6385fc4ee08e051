"""Profile the Triton chunked gated-delta-rule prefill (``hybrid_compile/ops/triton/gdn_chunk.py``)
on one CUDA device: per-kernel times (torch.profiler), eager / CUDA-graph / host times of the whole
call, accuracy against a near-fp32 run, launch-setting variants, and flash-linear-attention on the
same inputs.

    python benchmarks/profile_gdn_chunk.py [--tokens 2048,8192,32768] [--batch 1] [--sweep]
        [--old path/to/old_gdn_chunk.py] [--fla] [--out results.json]

Shapes are Qwen3-Next's (Hk=16, Hv=32, K=V=128, bf16 q/k/v, fp32 g/beta and state), inputs as in
``benchmarks/kernels.py``; ``--kda`` takes Kimi-Linear-48B's instead (Kimi Delta Attention: Hk=Hv=32,
K=V=128, a per-channel gate ``g [T, Hv, K]``; ``--fla`` then times fla's ``chunk_kda``), e.g.
``--kda --fla --sweep '[{"kda_intra_warps": 8}, {"kda_intra_stages": 1}, {"kda_intra_mma_range": -1}]'``;
``--kda-steep-channels N`` gives N evenly spaced channels of the gate a steep decay (every chunk then has
channels past the chunk-wide range: ``--sweep '[{"kda_split_channels": true}]'`` times the channel split). ``--old`` loads another version of the module (a copy of the file
with its relative imports made absolute, ``from ..gdn`` -> ``from hybrid_compile.ops.gdn``) to compare with in
the same run (with ``--kda`` one that has the per-channel gate). ``--sweep`` times variants of ``gdn_chunk.CONFIG`` (per kernel) at the largest size.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hybrid_compile  # noqa: E402,F401  (registers the ops)
from hybrid_compile.ops.triton import gdn_chunk as G  # noqa: E402
from kernels import chunk_config_overrides, cuda_graph_ms, eager_ms  # noqa: E402  (benchmarks/kernels.py: one timing method)

DEV = "cuda"
HK, HV, K, V = 16, 32, 128, 128
KDA = False  # --kda: Kimi-Linear shapes and a per-channel gate
STEEP_CHANNELS = 0  # --kda-steep-channels
ops = torch.ops.hybrid_compile
DEFAULT_CFG = dict(G.CONFIG)


def load_module(path):
    spec = importlib.util.spec_from_file_location("gdn_chunk_other", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_inputs(total, batch, decay="gating", seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(total, HK, K, dtype=torch.bfloat16, device=DEV, generator=gen)
    k = torch.randn(total, HK, K, dtype=torch.bfloat16, device=DEV, generator=gen)
    v = torch.randn(total, HV, V, dtype=torch.bfloat16, device=DEV, generator=gen)
    if KDA:  # as benchmarks/kernels.py ("gating"), or a slow decay
        g = -torch.rand(total, HV, K, device=DEV, generator=gen) * (0.5 if decay == "gating" else 0.02)
        if STEEP_CHANNELS:  # every (K / n)-th channel steep: -3 to -23 a token (every chunk past the range)
            g[..., :: K // STEEP_CHANNELS] = -torch.rand(total, HV, STEEP_CHANNELS, device=DEV, generator=gen) * 20 - 3
        beta = torch.rand(total, HV, device=DEV, generator=gen)
    elif decay == "gating":  # as benchmarks/kernels.py: gdn_gating of random projections
        A_log = torch.randn(HV, device=DEV, generator=gen) * 0.3
        dt_bias = torch.randn(HV, device=DEV, generator=gen) * 0.3
        a = torch.randn(total, HV, device=DEV, generator=gen).bfloat16()
        b = torch.randn(total, HV, device=DEV, generator=gen).bfloat16()
        g, beta = ops.gdn_gating(A_log, a, b, dt_bias, 1.0, 20.0)
    else:  # slow decay: long memory, errors in the state carry far
        g = -torch.rand(total, HV, device=DEV, generator=gen) * 0.02
        beta = torch.rand(total, HV, device=DEV, generator=gen)
    base = total // batch
    lens = [base] * batch
    lens[-1] += total - base * batch
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEV)
    slots = torch.arange(batch, dtype=torch.int32, device=DEV)
    pool = torch.randn(batch, HV, K, V, device=DEV, generator=gen) * 0.1
    return q, k, v, g, beta, pool, cu, slots


def host_us(fn, iters=20):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / iters * 1e6


def kernel_us(fn, iters=5):
    """Mean device time per call of each kernel (microseconds), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None)
        if t is None:
            t = getattr(ev, "cuda_time_total", 0.0)
        if t and t > 0:
            name = ev.key if len(ev.key) < 40 else ev.key[:37] + "..."
            out[name] = out.get(name, 0.0) + t / iters
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def call(mod, inp, pool, has, cs=False):
    q, k, v, g, beta, _, cu, slots = inp
    return mod.chunk_gated_delta_rule_triton(q, k, v, g, beta, pool, cu, slots, has, True, 0.0, cs)


def accuracy(mods, total, batch, decay, ref_mod=None):
    """Output and final-state errors (relative norm) against a near-fp32 run (fp32-upcast inputs:
    the TF32x3 path of ``ref_mod``, default the first module)."""
    inp = make_inputs(total, batch, decay, seed=1)
    q, k, v, g, beta, pool0, cu, slots = inp
    has = torch.ones(batch, dtype=torch.bool, device=DEV)
    ref_pool = pool0.clone()
    ref_in = (q.float(), k.float(), v.float(), g, beta, None, cu, slots)
    ro, _ = call(ref_mod or mods[0][1], ref_in, ref_pool, has)
    res = {}
    for name, mod, cfg in mods:
        if cfg is not None:
            G.CONFIG.clear()
            G.CONFIG.update(cfg)
        p = pool0.clone()
        o, _ = call(mod, inp, p, has)
        res[name] = {"o": rel(o, ro), "state": rel(p, ref_pool)}
    G.CONFIG.clear()
    G.CONFIG.update(DEFAULT_CFG)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="2048,8192,32768")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--old", default=None)
    ap.add_argument("--fla", action="store_true")
    ap.add_argument("--kda", action="store_true", help="Kimi-Linear shapes with a per-channel gate")
    ap.add_argument("--kda-steep-channels", type=int, default=0,
                    help="--kda: this many of the 128 channels (evenly spaced) decay steeply (-3 to -23 a token), "
                         "so every chunk has channels past the chunk-wide range (CONFIG['kda_split_channels'])")
    ap.add_argument("--sweep", default=None, help="JSON list of CONFIG overrides to time at the largest size")
    ap.add_argument("--sweep-tokens", type=int, default=32768)
    ap.add_argument("--accuracy", default="8192,32768")
    ap.add_argument("--cfg", default=None, help="JSON CONFIG overrides for every run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.kda_steep_channels and (not args.kda or K % args.kda_steep_channels):
        ap.error(f"--kda-steep-channels needs --kda and a divisor of {K}, got {args.kda_steep_channels}")
    global STEEP_CHANNELS
    STEEP_CHANNELS = args.kda_steep_channels
    if args.kda:
        if args.old and "GATE_K" not in open(args.old).read():
            ap.error(f"--old {args.old}: a gdn_chunk.py from before the per-channel gate cannot run --kda")
        global HK, KDA
        HK, KDA = HV, True
    variants = json.loads(args.sweep) if args.sweep else []
    if not isinstance(variants, list):
        ap.error("--sweep: a JSON list of gdn_chunk.CONFIG overrides")
    for cfg in variants:  # (all checked before anything runs: an unknown key is an error, not ignored)
        chunk_config_overrides(cfg, "--sweep")
    if args.cfg:
        G.CONFIG.update(chunk_config_overrides(json.loads(args.cfg), "--cfg"))
        DEFAULT_CFG.update(G.CONFIG)
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"triton {__import__('triton').__version__}", flush=True)
    report = {"rows": [], "sweep": [], "accuracy": {}}
    old = load_module(args.old) if args.old else None
    fla = None
    if args.fla:
        try:
            if KDA:
                from fla.ops.kda import chunk_kda as fla
            else:
                from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla
        except Exception as e:  # noqa: BLE001
            print(f"fla unavailable: {type(e).__name__}: {e}")

    systems = []
    if old is not None:
        systems.append(("old", lambda inp, pool, has: call(old, inp, pool, has)))
    systems.append(("new", lambda inp, pool, has: call(G, inp, pool, has)))
    systems.append(("new-op", lambda inp, pool, has: ops.chunk_gated_delta_rule(
        *inp[:5], pool, inp[6], inp[7], has, True, 0.0, False, ssm_scales=None)))

    for batch in [int(x) for x in args.batch.split(",")]:
        for total in [int(x) for x in args.tokens.split(",")]:
            inp = make_inputs(total, batch)
            pool = inp[5]
            has = torch.zeros(batch, dtype=torch.bool, device=DEV)
            for name, f in systems:
                fn = lambda: f(inp, pool, has)  # noqa: E731
                row = {"system": name, "T": total, "B": batch, "eager_ms": eager_ms(fn, warmup=2, max_seconds=60), "graph_ms": cuda_graph_ms(fn, 20, max_seconds=60),
                       "host_us": host_us(fn)}
                if name != "new-op":
                    row["kernels_us"] = kernel_us(fn)
                report["rows"].append(row)
                print(f"T={total:6d} B={batch} {name:7s} eager {row['eager_ms']:.3f} ms  graph {row['graph_ms']:.3f} ms  "
                      f"host {row['host_us']:.0f} us  " + "  ".join(f"{k}={v:.0f}" for k, v in row.get("kernels_us", {}).items()),
                      flush=True)
            if fla is not None:
                q, k, v, g, beta, _, cu, slots = inp
                rep = HV // HK
                qf, kf = q.repeat_interleave(rep, 1)[None], k.repeat_interleave(rep, 1)[None]
                st = torch.zeros(batch, HV, K, V, device=DEV)
                fn = lambda: fla(qf, kf, v[None], g[None], beta[None], initial_state=st, output_final_state=True,  # noqa: E731
                                 cu_seqlens=cu.long(), use_qk_l2norm_in_kernel=True)
                try:
                    row = {"system": "fla", "T": total, "B": batch, "eager_ms": eager_ms(fn, warmup=2, max_seconds=60), "kernels_us": kernel_us(fn)}
                    report["rows"].append(row)
                    print(f"T={total:6d} B={batch} fla     eager {row['eager_ms']:.3f} ms  " +
                          "  ".join(f"{k}={v:.0f}" for k, v in row["kernels_us"].items()), flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"fla failed: {type(e).__name__}: {e}")
            del inp, pool
            torch.cuda.empty_cache()

    if args.accuracy:
        mods = [("old-bf16", old, None)] if old is not None else []
        mods.append(("new-bf16", G, dict(DEFAULT_CFG)))
        mods.append(("new-bf16-u16", G, dict(DEFAULT_CFG, u_bf16=True)))
        mods.append(("new-nolowp", G, dict(DEFAULT_CFG, lowp=False)))
        for total in [int(x) for x in args.accuracy.split(",")]:
            for decay in ("gating", "slow"):
                res = accuracy(mods, total, 1, decay, old)
                report["accuracy"][f"{total}-{decay}"] = res
                print(f"accuracy T={total} decay={decay}: " +
                      "  ".join(f"{n}: o {r['o']:.2e} state {r['state']:.2e}" for n, r in res.items()), flush=True)
                torch.cuda.empty_cache()

    if variants:
        total = args.sweep_tokens
        inp = make_inputs(total, 1)
        pool = inp[5]
        has = torch.zeros(1, dtype=torch.bool, device=DEV)
        for cfg in variants:
            G.CONFIG.clear()
            G.CONFIG.update(DEFAULT_CFG)
            G.CONFIG.update(cfg)
            fn = lambda: call(G, inp, pool, has)  # noqa: E731
            try:
                ku = kernel_us(fn, iters=3)
                gm = cuda_graph_ms(fn, 5, max_seconds=60)
            except Exception as e:  # noqa: BLE001
                print(f"sweep {cfg}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            report["sweep"].append({"cfg": cfg, "graph_ms": gm, "kernels_us": ku})
            print(f"sweep T={total} {json.dumps(cfg):70s} graph {gm:.3f} ms  " +
                  "  ".join(f"{k.replace('_chunk_', '').replace('_kernel', '')}={v:.0f}" for k, v in ku.items()
                            if k.startswith("_chunk")), flush=True)
        G.CONFIG.clear()
        G.CONFIG.update(DEFAULT_CFG)
        del inp, pool
        torch.cuda.empty_cache()

    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
