"""Kernel benchmarks: our Triton CUDA kernels vs. the plain-torch implementation of the same op
vs. flash-linear-attention (where it has the same op), on realistic shapes; ``skinny_mm`` against
cuBLAS (``torch.mm``) at the reference model's projection shapes at 1-4 rows.

    python benchmarks/kernels.py [--quick] [--only kda,...] [--out benchmarks/results/kernels.json]
        [--chunk-config '{"kda_intra_bk": 32, "kda_intra_warps": 8}']

``--chunk-config`` overrides launch settings of the chunked GDN / KDA prefill kernels
(``hybrid_compile/ops/triton/gdn_chunk.py``'s ``CONFIG``) for the whole run, e.g. to time the KDA
intra kernel's variants one run each (per-kernel times: ``benchmarks/profile_gdn_chunk.py --kda``).

Shapes: Qwen3-Next-like GDN (16 key heads / 32 value heads x 128, conv kernel 4, conv_dim
8192), Kimi-Linear-48B KDA (32 heads x 128, per-channel gate) and MLA (32 heads, 576 / 512 over a
compressed cache, and the ``mla_layer`` op absorbed / expanded at prefill; groups ``kda`` and ``mla``), Jamba's Mamba1 (8192 channels, state 16, group ``mamba1``:
the prefill scan through the op beside both of its forms, the sequential walk per request and the
time chunks), Mamba2-like (128 heads x 64, state 128, 8 groups), attention (16 q heads, 2 kv heads,
head dim 256). Decode at batch 1..256, prefill at 1k..32k tokens. Every row reports the median
time of each system and, for our kernel, achieved memory bandwidth (decode / memory-bound ops)
or TFLOP/s (prefill ops) as a fraction of the peak measured in the same run on this device.
Needs a CUDA device. Writes JSON and prints a table.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hybrid_compile.layers import attention as layer_attention  # noqa: E402
from hybrid_compile.layers.context import ForwardContext, ForwardMetadata, ForwardMode, forward_context  # noqa: E402
from hybrid_compile.ops import attention as A  # noqa: E402
from hybrid_compile.ops import conv1d as C  # noqa: E402
from hybrid_compile.ops import gdn as G  # noqa: E402
from hybrid_compile.ops import lightning as LA  # noqa: E402
from hybrid_compile.ops import mamba1 as M1  # noqa: E402
from hybrid_compile.ops import mamba2 as M  # noqa: E402
from hybrid_compile.ops.triton import mamba1 as TM1  # noqa: E402
from hybrid_compile.ops.triton.common import sm_count  # noqa: E402

ops = torch.ops.hybrid_compile
DEV = "cuda"
BF16 = torch.bfloat16


def plain(op):
    """The plain-torch implementation behind a ``kernel_op`` (what the CPU path runs)."""
    return op.__wrapped__


def _events_ms(fn, iters, max_seconds):
    times = []
    t_start = time.perf_counter()
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
        if time.perf_counter() - t_start > max_seconds:
            break
    times.sort()
    return times[len(times) // 2]


class Ms(float):
    """Milliseconds, remembering how they were measured ("cuda_graph" or "eager")."""

    def __new__(cls, value, mode):
        obj = super().__new__(cls, value)
        obj.mode = mode
        return obj


def eager_ms(fn, warmup=3, iters=10, max_seconds=2.0):
    """Median milliseconds of eager calls of fn(), CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return _events_ms(fn, iters, max_seconds)


def capture_graph(fn, warmup=1) -> torch.cuda.CUDAGraph:
    """fn() captured in a CUDA graph, after ``warmup`` calls on the capture stream (raises if fn
    cannot be captured)."""
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
        with torch.cuda.graph(g, stream=stream):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return g


def replay_ms(graph, iters=30, max_seconds=2.0):
    """Median milliseconds of one replay of a captured CUDA graph (after one warm-up replay), CUDA
    events around each replay."""
    graph.replay()
    torch.cuda.synchronize()
    return _events_ms(graph.replay, iters, max_seconds)


def cuda_graph_ms(fn, iters=30, max_seconds=2.0):
    """Median milliseconds of replays of fn() captured in a CUDA graph (raises if fn cannot be
    captured): the kernel time the engine sees under CUDA graphs, free of launch overhead."""
    fn()
    torch.cuda.synchronize()
    return replay_ms(capture_graph(fn), iters, max_seconds)


def bench(fn, warmup=3, iters=10, max_seconds=2.0, graph=True):
    """Median milliseconds of fn() on the GPU: CUDA-graph replays with ``graph`` (default) when
    the call can be captured, else eager calls (prefill paths that read lengths on the host);
    the returned :class:`Ms` says which."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if graph:
        try:
            return Ms(cuda_graph_ms(fn, iters * 3, max_seconds), "cuda_graph")
        except Exception:  # noqa: BLE001 - not capturable: time eagerly
            torch.cuda.synchronize()
    return Ms(_events_ms(fn, iters, max_seconds), "eager")


def _copy_bytes_per_second():
    n = 1 << 28  # 512 MiB of bf16 (1 GiB read+write per copy)
    a = torch.empty(n, dtype=BF16, device=DEV)
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a), iters=20)
    return 2 * a.numel() * a.element_size() / (ms * 1e-3)


def _matmul_tflops():
    x = torch.randn(8192, 8192, dtype=BF16, device=DEV)
    y = torch.randn(8192, 8192, dtype=BF16, device=DEV)
    ms = bench(lambda: x @ y, iters=20)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def measure_peaks():
    """(copy bandwidth in bytes/s, bf16 matmul TFLOP/s) of this device."""
    bw, tflops = _copy_bytes_per_second(), _matmul_tflops()
    torch.cuda.empty_cache()
    return bw, tflops


def try_import_fla():
    try:
        from fla.modules.causal_conv1d import causal_conv1d, causal_conv1d_update
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        return {"chunk": chunk_gated_delta_rule, "recurrent": fused_recurrent_gated_delta_rule,
                "conv": causal_conv1d, "conv_update": causal_conv1d_update}
    except Exception as e:  # noqa: BLE001 - reported in the JSON
        return {"error": f"{type(e).__name__}: {e}"}


def varlen(total, batch):
    base = total // batch
    lens = [base] * batch
    lens[-1] += total - base * batch
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEV)
    return lens, cu


ROWS = []


def record(op, shape, ours, torch_ms=None, fla_ms=None, bytes_moved=None, flops=None, note=""):
    row = {"op": op, "shape": shape, "ours_ms": ours, "plain_torch_ms": torch_ms, "fla_ms": fla_ms, "note": note,
           "timing": {k: getattr(v, "mode", None) for k, v in (("ours", ours), ("plain_torch", torch_ms), ("fla", fla_ms))}}
    if bytes_moved and ours:
        row["ours_GBps"] = bytes_moved / (ours * 1e-3) / 1e9
        row["bw_fraction"] = row["ours_GBps"] * 1e9 / PEAK_BW
    if flops and ours:
        row["ours_TFLOPs"] = flops / (ours * 1e-3) / 1e12
        row["flop_fraction"] = row["ours_TFLOPs"] / PEAK_TFLOPS
    if torch_ms and ours:
        row["speedup_vs_plain"] = torch_ms / ours
    if fla_ms and ours:
        row["speedup_vs_fla"] = fla_ms / ours
    ROWS.append(row)
    fmt = lambda v: "-" if v is None else (f"{float(v):.4f}" if isinstance(v, float) else str(v))  # noqa: E731
    extra = ""
    if "bw_fraction" in row:
        extra = f"{row['ours_GBps']:.0f} GB/s ({100 * row['bw_fraction']:.0f}% peak)"
    elif "flop_fraction" in row:
        extra = f"{row['ours_TFLOPs']:.1f} TFLOP/s ({100 * row['flop_fraction']:.0f}% peak)"
    mode = "graph" if getattr(ours, "mode", None) == "cuda_graph" else "eager"
    print(f"{op:40s} {shape:34s} ours {fmt(ours):>9s} ({mode})  torch {fmt(torch_ms):>9s}  fla {fmt(fla_ms):>9s}  "
          f"{extra} {note}", flush=True)


def safe(fn):
    try:
        return fn()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        return None


# --------------------------------------------------------------------------------------------


def bench_gdn(quick, fla):
    Hk, Hv, K, V, W = 16, 32, 128, 128, 4
    conv_dim = 2 * Hk * K + Hv * V
    S = 512
    ssm = torch.zeros(S, Hv, K, V, dtype=torch.float32, device=DEV)
    conv_pool = torch.zeros(S, W - 1, conv_dim, dtype=BF16, device=DEV)
    weight = torch.randn(conv_dim, W, dtype=BF16, device=DEV) * 0.3
    A_log = torch.randn(Hv, device=DEV) * 0.3
    dt_bias = torch.randn(Hv, device=DEV) * 0.3

    for batch in ([1, 64, 256] if quick else [1, 16, 64, 128, 256]):
        slots = torch.arange(batch, dtype=torch.int32, device=DEV)
        x = torch.randn(batch, 1, conv_dim, dtype=BF16, device=DEV)
        bytes_conv = 2 * batch * (W - 1) * conv_dim * 2 + 2 * batch * conv_dim * 2
        f = lambda: ops.causal_conv1d_update(x, conv_pool, weight, None, "silu", slots, False, None)  # noqa: E731
        p = lambda: plain(C.causal_conv1d_update)(x, conv_pool, weight, None, "silu", slots, False, None)  # noqa: E731
        fla_ms = None
        if "conv_update" in fla:
            cache = torch.zeros(batch, conv_dim, W, dtype=BF16, device=DEV)  # fla keeps the whole window
            fla_fn = lambda: fla["conv_update"](x, cache, weight=weight, activation="silu")  # noqa: E731
            fla_ms = safe(lambda: bench(fla_fn))
        record("causal_conv1d_update", f"B={batch} D={conv_dim}", safe(lambda: bench(f)), safe(lambda: bench(p, graph=False)),
               fla_ms, bytes_moved=bytes_conv)

        q = torch.randn(batch, Hk, K, dtype=BF16, device=DEV)
        k = torch.randn(batch, Hk, K, dtype=BF16, device=DEV)
        v = torch.randn(batch, Hv, V, dtype=BF16, device=DEV)
        a = torch.randn(batch, Hv, dtype=BF16, device=DEV)
        b = torch.randn(batch, Hv, dtype=BF16, device=DEV)
        state_bytes = 2 * batch * Hv * K * V * 4
        f = lambda: ops.fused_sigmoid_gating_delta_rule_update(A_log, dt_bias, q, k, v, a, b, ssm, slots, True, 0.0, 1.0, 20.0, ssm_scales=None)  # noqa: E731
        p = lambda: plain(G.fused_sigmoid_gating_delta_rule_update)(A_log, dt_bias, q, k, v, a, b, ssm, slots, True, 0.0, 1.0, 20.0, ssm_scales=None)  # noqa: E731
        fla_ms = None
        if "recurrent" in fla:
            state = ssm[:batch].clone()
            g_ = -A_log.exp() * torch.nn.functional.softplus(a.float() + dt_bias)
            rep = Hv // Hk
            qf, kf = q.repeat_interleave(rep, 1)[:, None], k.repeat_interleave(rep, 1)[:, None]
            fla_fn = lambda: fla["recurrent"](qf, kf, v[:, None], g_[:, None], b.sigmoid()[:, None], initial_state=state,  # noqa: E731
                                               output_final_state=True, use_qk_l2norm_in_kernel=True)
            fla_ms = safe(lambda: bench(fla_fn))
        record("fused_sigmoid_gating_delta_rule_update", f"B={batch} Hv={Hv} K=V={K}", safe(lambda: bench(f)),
               safe(lambda: bench(p, graph=False)), fla_ms, bytes_moved=state_bytes)

        L = 4
        qv = torch.randn(batch, L, Hk, K, dtype=BF16, device=DEV)
        kv = torch.randn(batch, L, Hk, K, dtype=BF16, device=DEV)
        vv = torch.randn(batch, L, Hv, V, dtype=BF16, device=DEV)
        gv = -torch.rand(batch, L, Hv, device=DEV)
        bv = torch.rand(batch, L, Hv, device=DEV)
        inter = torch.zeros(batch, L, Hv, K, V, dtype=BF16, device=DEV)
        f = lambda: ops.fused_recurrent_gated_delta_rule_update(qv, kv, vv, gv, bv, ssm, slots, True, 0.0, True, inter, ssm_scales=None, intermediate_scales=None, parent_indices=None)  # noqa: E731
        p = lambda: plain(G.fused_recurrent_gated_delta_rule_update)(qv, kv, vv, gv, bv, ssm, slots, True, 0.0, True, inter, ssm_scales=None, intermediate_scales=None)  # noqa: E731
        record("fused_recurrent_gated_delta_rule_update", f"B={batch} L={L}", safe(lambda: bench(f)), safe(lambda: bench(p, graph=False)),
               None, bytes_moved=batch * Hv * K * V * (4 + L * 2))

    for total in ([2048, 32768] if quick else [1024, 2048, 8192, 16384, 32768]):
        for batch in (1, 8):
            lens, cu = varlen(total, batch)
            slots = torch.arange(batch, dtype=torch.int32, device=DEV)
            has = torch.zeros(batch, dtype=torch.bool, device=DEV)
            x = torch.randn(total, conv_dim, dtype=BF16, device=DEV)
            f = lambda: ops.causal_conv1d_fn(x, weight, None, conv_pool, cu, slots, has, "silu")  # noqa: E731
            p = lambda: plain(C.causal_conv1d_fn)(x, weight, None, conv_pool, cu, slots, has, "silu")  # noqa: E731
            fla_ms = None
            if "conv" in fla:
                fla_fn = lambda: fla["conv"](x[None], weight=weight, activation="silu", cu_seqlens=cu.long())  # noqa: E731
                fla_ms = safe(lambda: bench(fla_fn, graph=False))
            conv_graph_ms = safe(lambda: bench(f))
            record("causal_conv1d_fn", f"T={total} B={batch}", safe(lambda: bench(f, graph=False)),
                   safe(lambda: bench(p, graph=False)), fla_ms, bytes_moved=2 * total * conv_dim * 2,
                   note=f"(eager, like fla; under a CUDA graph {conv_graph_ms:.4f} ms)" if conv_graph_ms else "(eager)")

            q = torch.randn(total, Hk, K, dtype=BF16, device=DEV)
            k = torch.randn(total, Hk, K, dtype=BF16, device=DEV)
            v = torch.randn(total, Hv, V, dtype=BF16, device=DEV)
            a = torch.randn(total, Hv, dtype=BF16, device=DEV)
            b = torch.randn(total, Hv, dtype=BF16, device=DEV)
            f = lambda: ops.gdn_gating(A_log, a, b, dt_bias, 1.0, 20.0)  # noqa: E731
            p = lambda: plain(G.gdn_gating)(A_log, a, b, dt_bias, 1.0, 20.0)  # noqa: E731
            record("gdn_gating", f"T={total}", safe(lambda: bench(f)), safe(lambda: bench(p, graph=False)), None,
                   bytes_moved=total * Hv * (2 + 2 + 4 + 4))
            g, beta = ops.gdn_gating(A_log, a, b, dt_bias, 1.0, 20.0)
            chunk = 64
            flops = total * Hv * (4 * K * V + 2 * chunk * (K + V) + 2 * chunk * K)
            f = lambda: ops.chunk_gated_delta_rule(q, k, v, g, beta, ssm, cu, slots, has, True, 0.0, False, ssm_scales=None)  # noqa: E731
            p = lambda: plain(G.chunk_gated_delta_rule)(q, k, v, g, beta, ssm, cu, slots, has, True, 0.0, False, ssm_scales=None)  # noqa: E731
            fla_ms = None
            if "chunk" in fla:
                rep = Hv // Hk
                qf, kf = q.repeat_interleave(rep, 1)[None], k.repeat_interleave(rep, 1)[None]
                fla_fn = lambda: fla["chunk"](qf, kf, v[None], g[None], beta[None], initial_state=ssm[:batch],  # noqa: E731
                                               output_final_state=True, cu_seqlens=cu.long(),
                                               use_qk_l2norm_in_kernel=True)
                fla_ms = safe(lambda: bench(fla_fn))
            graph_ms = safe(lambda: bench(f))
            record("chunk_gated_delta_rule", f"T={total} B={batch}", safe(lambda: bench(f, graph=False)),
                   safe(lambda: bench(p, iters=3, graph=False)) if total <= 16384 else None, fla_ms, flops=flops,
                   note=f"(eager, like fla; under a CUDA graph {graph_ms:.4f} ms)" if graph_ms else "(eager, like fla)")


def bench_mamba2(quick):
    H, P, N, G_, CH = 128, 64, 128, 8, 256
    S = 512
    ssm = torch.zeros(S, H, P, N, dtype=torch.float32, device=DEV)
    Am = -torch.rand(H, device=DEV) - 0.1
    D = torch.randn(H, device=DEV)
    dt_bias = torch.randn(H, device=DEV) * 0.3
    inf = float("inf")
    for batch in ([1, 64, 256] if quick else [1, 16, 64, 128, 256]):
        slots = torch.arange(batch, dtype=torch.int32, device=DEV)
        x = torch.randn(batch, 1, H, P, dtype=BF16, device=DEV)
        dt = torch.randn(batch, 1, H, dtype=BF16, device=DEV)
        B = torch.randn(batch, 1, G_, N, dtype=BF16, device=DEV)
        Cm = torch.randn(batch, 1, G_, N, dtype=BF16, device=DEV)
        f = lambda: ops.selective_state_update(x, dt, Am, B, Cm, D, None, dt_bias, True, 0.0, inf, ssm, slots, False, None, A_is_log=False, ssm_scales=None, intermediate_scales=None, parent_indices=None)  # noqa: E731
        p = lambda: plain(M.selective_state_update)(x, dt, Am, B, Cm, D, None, dt_bias, True, 0.0, inf, ssm, slots, False, None, A_is_log=False, ssm_scales=None, intermediate_scales=None)  # noqa: E731
        record("selective_state_update", f"B={batch} H={H} P={P} N={N}", safe(lambda: bench(f)), safe(lambda: bench(p, graph=False)),
               None, bytes_moved=2 * batch * H * P * N * 4, note="(no fla equivalent)")
    for total in ([2048, 32768] if quick else [1024, 2048, 8192, 16384, 32768]):
        for batch in (1, 8):
            lens, cu = varlen(total, batch)
            slots = torch.arange(batch, dtype=torch.int32, device=DEV)
            has = torch.zeros(batch, dtype=torch.bool, device=DEV)
            x = torch.randn(total, H, P, dtype=BF16, device=DEV)
            dt = torch.randn(total, H, dtype=BF16, device=DEV)
            B = torch.randn(total, G_, N, dtype=BF16, device=DEV)
            Cm = torch.randn(total, G_, N, dtype=BF16, device=DEV)
            flops = total * H * (2 * CH * N / H * G_ + 2 * CH * P + 4 * P * N)
            f = lambda: ops.ssd_chunk_scan(x, dt, Am, B, Cm, D, None, dt_bias, True, 0.0, inf, ssm, cu, slots, has, CH, False, ssm_scales=None)  # noqa: E731
            p = lambda: plain(M.ssd_chunk_scan)(x, dt, Am, B, Cm, D, None, dt_bias, True, 0.0, inf, ssm, cu, slots, has, CH, False, ssm_scales=None)  # noqa: E731
            record("ssd_chunk_scan", f"T={total} B={batch}", safe(lambda: bench(f)),
                   safe(lambda: bench(p, iters=3, graph=False)) if total <= 16384 else None, None, flops=flops,
                   note="(no fla equivalent)")


def bench_mamba1(quick):
    """Jamba's Mamba1 mixer (d_inner 8192, state 16, one B/C group): the decode update, and the prefill
    scan through the op (``TM1.time_chunk_for`` picks the form) beside both of its forms forced through
    the launcher: the single sequential walk per request (``time_chunk=0``) and the time chunks."""
    Di, N, S = 8192, 16, 256
    ssm = torch.zeros(S, Di, N, dtype=torch.float32, device=DEV)
    A = -torch.rand(Di, N, device=DEV) - 0.1
    D = torch.randn(Di, device=DEV)
    dt_bias = torch.randn(Di, device=DEV) * 0.3
    for batch in ([1, 64] if quick else [1, 16, 64, 256]):
        slots = torch.arange(batch, dtype=torch.int32, device=DEV)
        x, z, dt = (torch.randn(batch, 1, Di, dtype=BF16, device=DEV) for _ in range(3))
        B, Cm = (torch.randn(batch, 1, 1, N, dtype=BF16, device=DEV) for _ in range(2))
        f = lambda: ops.mamba1_state_update(x, dt, A, B, Cm, D, z, dt_bias, True, ssm, slots, False, None, False, None, None)  # noqa: E731
        p = lambda: plain(M1.mamba1_state_update)(x, dt, A, B, Cm, D, z, dt_bias, True, ssm, slots, False, None, False, None, None)  # noqa: E731
        record("mamba1_state_update", f"B={batch} D={Di} N={N}", safe(lambda: bench(f)), safe(lambda: bench(p, graph=False)),
               None, bytes_moved=2 * batch * Di * N * 4, note="(no fla equivalent)")
    for total in ([4096, 32768] if quick else [1024, 4096, 8192, 32768]):
        for batch in ((1, 2, 8) if quick else (1, 2, 4, 8)):
            lens, cu = varlen(total, batch)
            slots = torch.arange(batch, dtype=torch.int32, device=DEV)
            has = torch.zeros(batch, dtype=torch.bool, device=DEV)
            x, z, dt = (torch.randn(total, Di, dtype=BF16, device=DEV) for _ in range(3))
            B, Cm = (torch.randn(total, 1, N, dtype=BF16, device=DEV) for _ in range(2))
            args = (x, dt, A, B, Cm, D, z, dt_bias, True, ssm, cu, slots, has, 256, False)
            f = lambda: ops.mamba1_selective_scan(*args[0:15], False, None)  # noqa: E731
            p = lambda: plain(M1.mamba1_selective_scan)(*args[0:15], False, None)  # noqa: E731
            tc = TM1.time_chunk_for(total, batch, Di, N, sm_count(x.device))
            forms = {}
            for name, size in (("single walk", 0), ("time chunks", TM1.TIME_CHUNK)):
                launch = functools.partial(TM1.mamba1_selective_scan_triton, *args, time_chunk=size)
                forms[name] = safe(lambda: bench(launch, graph=False))
            ours = safe(lambda: bench(f, graph=False))
            record("mamba1_selective_scan", f"T={total} B={batch}", ours,
                   safe(lambda: bench(p, iters=2, graph=False)) if total <= 4096 else None, None,
                   bytes_moved=total * Di * 2 * 4,
                   note=f"picked {'time chunks' if tc else 'single walk'}; "
                        + "; ".join(f"{k} {v if v is None else round(v, 4)} ms" for k, v in forms.items()))


def bench_lightning(quick):
    """MiniMax-Text-01 lightning attention: 64 heads of 128, fp32 state, bf16 inputs."""
    H, D, S = 64, 128, 512
    ssm = torch.zeros(S, H, D, D, dtype=torch.float32, device=DEV)
    slope = (0.5 ** (torch.arange(H, device=DEV) * 8 / H + 8 / H)).float()
    for batch in ([1, 64] if quick else [1, 16, 64, 256]):
        slots = torch.arange(batch, dtype=torch.int32, device=DEV)
        q, k, v = (torch.randn(batch, 1, H, D, dtype=BF16, device=DEV) * D ** -0.5 for _ in range(3))
        # (no intermediates; a float pool: no scales)
        f = lambda: ops.recurrent_lightning_attention_update(  # noqa: E731
            q, k, v, slope, ssm, slots, False, None, None, None)
        p = lambda: plain(LA.recurrent_lightning_attention_update)(  # noqa: E731
            q, k, v, slope, ssm, slots, False, None, None, None)
        record("recurrent_lightning_attention_update", f"B={batch} H={H} D={D}", safe(lambda: bench(f)),
               safe(lambda: bench(p, graph=False)), None, bytes_moved=2 * batch * H * D * D * 4, note="decode")
    for total in ([2048, 32768] if quick else [2048, 8192, 32768]):
        for batch in (1, 8):
            lens, cu = varlen(total, batch)
            slots = torch.arange(batch, dtype=torch.int32, device=DEV)
            has = torch.zeros(batch, dtype=torch.bool, device=DEV)
            q, k, v = (torch.randn(total, H, D, dtype=BF16, device=DEV) * D ** -0.5 for _ in range(3))
            C_ = LA.LIGHTNING_CHUNK_SIZE
            flops = total * H * (2 * C_ * D * 2 + 2 * D * D * 2)  # q k^T, (qk) v; q S, k^T v
            f = lambda: ops.chunk_lightning_attention(q, k, v, slope, ssm, cu, slots, has, False, None)  # noqa: E731
            p = lambda: plain(LA.chunk_lightning_attention)(  # noqa: E731
                q, k, v, slope, ssm, cu, slots, has, False, None)
            record("chunk_lightning_attention", f"T={total} B={batch}", safe(lambda: bench(f, graph=False)),
                   safe(lambda: bench(p, iters=3, graph=False)) if total <= 8192 else None, None, flops=flops,
                   note="(fp32 dots)")


def bench_attention(quick):
    Hq, Hkv, Dh = 16, 2, 256
    NS = 600_000
    k_cache = torch.randn(NS, Hkv, Dh, dtype=BF16, device=DEV)
    v_cache = torch.randn(NS, Hkv, Dh, dtype=BF16, device=DEV)
    scale = Dh ** -0.5
    for batch in ([1, 64] if quick else [1, 16, 64, 128]):
        ctx = 4096
        kv_indptr = torch.arange(batch + 1, dtype=torch.int32, device=DEV) * ctx
        kv_indices = torch.randperm(NS - 1, device=DEV)[: batch * ctx] + 1
        q = torch.randn(batch, Hq, Dh, dtype=BF16, device=DEV)
        f = lambda: ops.paged_attention_decode(q, k_cache, v_cache, kv_indptr, kv_indices, scale, -1, 0.0)  # noqa: E731
        p = lambda: plain(A.paged_attention_decode)(q, k_cache, v_cache, kv_indptr, kv_indices, scale, -1, 0.0)  # noqa: E731
        record("paged_attention_decode", f"B={batch} ctx={ctx}", safe(lambda: bench(f)), safe(lambda: bench(p, graph=False)), None,
               bytes_moved=2 * batch * ctx * Hkv * Dh * 2)
    for total in ([2048, 32768] if quick else [1024, 2048, 8192, 16384, 32768]):
        batch = 1 if total >= 16384 else 4
        lens, qo = varlen(total, batch)
        kv_indices = torch.randperm(NS - 1, device=DEV)[:total] + 1
        q = torch.randn(total, Hq, Dh, dtype=BF16, device=DEV)
        flops = sum(4 * n * n / 2 * Hq * Dh for n in lens)
        f = lambda: ops.paged_attention_extend(q, k_cache, v_cache, qo, qo, kv_indices, scale, True, -1, 0.0)  # noqa: E731
        sdpa_q = q.view(batch, -1, Hq, Dh).transpose(1, 2) if total % batch == 0 else None
        kd = torch.randn(batch, Hkv, total // batch, Dh, dtype=BF16, device=DEV)
        sd = lambda: torch.nn.functional.scaled_dot_product_attention(sdpa_q, kd, kd, is_causal=True, enable_gqa=True)  # noqa: E731
        record("paged_attention_extend", f"T={total} B={batch}", safe(lambda: bench(f)), None,
               safe(lambda: bench(sd)) if sdpa_q is not None else None, flops=flops,
               note="(fla column = torch SDPA on contiguous K/V)")


def try_import_fla_kda():
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except Exception as exc:  # noqa: BLE001 - optional
        return {"error": repr(exc)}
    return {"chunk": chunk_kda, "recurrent": fused_recurrent_kda}


def bench_kda(quick):
    """Kimi-Linear-48B shapes: Kimi Delta Attention (32 heads x 128, per-channel gate) prefill and
    decode, beside fla's ``chunk_kda`` / ``fused_recurrent_kda``."""
    fla = try_import_fla_kda()
    H, K, V, S = 32, 128, 128, 256
    ssm = torch.zeros(S, H, K, V, dtype=torch.float32, device=DEV)
    for total in ([2048, 32768] if quick else [1024, 2048, 8192, 32768]):
        for batch in (1, 8):
            lens, cu = varlen(total, batch)
            slots = torch.arange(batch, dtype=torch.int32, device=DEV)
            has = torch.zeros(batch, dtype=torch.bool, device=DEV)
            q, k, v = (torch.randn(total, H, K, dtype=BF16, device=DEV) for _ in range(3))
            g = -torch.rand(total, H, K, device=DEV) * 0.5
            beta = torch.rand(total, H, device=DEV)
            f = lambda: ops.chunk_gated_delta_rule(q, k, v, g, beta, ssm, cu, slots, has, True, 0.0, False, ssm_scales=None)  # noqa: E731
            fla_ms = None
            if "chunk" in fla:
                fla_fn = lambda: fla["chunk"](q[None], k[None], v[None], g[None], beta[None], initial_state=ssm[:batch],  # noqa: E731
                                               output_final_state=True, cu_seqlens=cu.long(),
                                               use_qk_l2norm_in_kernel=True)
                fla_ms = safe(lambda: bench(fla_fn, graph=False))
            record("chunk_gated_delta_rule (KDA, per-channel g)", f"T={total} B={batch}",
                   safe(lambda: bench(f, graph=False)), None, fla_ms,
                   flops=total * H * (4 * K * V + 2 * 16 * (K + V) + 4 * 16 * K), note="(eager)")
    # decode with the fp32 state, and with a bf16 state pool (EngineConfig.ssm_state_dtype="bfloat16",
    # vLLM's default for these layers: half the bytes; fla given the same bf16 initial states)
    ssm_bf16 = ssm.to(BF16)
    for state, pool in (("fp32", ssm), ("bf16", ssm_bf16)):
        for batch in ([1, 64] if quick else [1, 16, 64, 256]):
            L = 1
            slots = torch.arange(batch, dtype=torch.int32, device=DEV)
            q, k = (torch.randn(batch, L, H, K, dtype=BF16, device=DEV) for _ in range(2))
            v = torch.randn(batch, L, H, V, dtype=BF16, device=DEV)
            g = -torch.rand(batch, L, H, K, device=DEV)
            beta = torch.rand(batch, L, H, device=DEV)
            f = lambda: ops.fused_recurrent_gated_delta_rule_update(q, k, v, g, beta, pool, slots, True, 0.0, False, None, ssm_scales=None, intermediate_scales=None, parent_indices=None)  # noqa: E731
            fla_ms = None
            if "recurrent" in fla:  # fla updates the batch's first states in place (its serving mode)
                fla_fn = lambda: fla["recurrent"](q, k, v, g, beta, initial_state=pool[:batch], output_final_state=True,  # noqa: E731
                                                  use_qk_l2norm_in_kernel=True)
                fla_ms = safe(lambda: bench(fla_fn))
            record(f"fused_recurrent_gated_delta_rule_update (KDA decode, {state} state)", f"B={batch}",
                   safe(lambda: bench(f)), None, fla_ms, bytes_moved=2 * batch * H * K * V * pool.element_size())


def bench_mla(quick):
    """Kimi-Linear-48B's MLA, absorbed: one KV head [latent 512, rope 64] over the compressed
    cache, V a view of the latent (decode and extend)."""
    # MLA, absorbed: one KV head [latent 512, rope 64], V a view of the latent
    hq, rank, rope, NS = 32, 512, 64, 600_000
    cache = torch.randn(NS, 1, rank + rope, dtype=BF16, device=DEV)
    scale = 192 ** -0.5
    for batch in ([1, 64] if quick else [1, 16, 64, 128]):
        ctx = 4096
        kv_indptr = torch.arange(batch + 1, dtype=torch.int32, device=DEV) * ctx
        kv_indices = torch.randperm(NS - 1, device=DEV)[: batch * ctx] + 1
        q = torch.randn(batch, hq, rank + rope, dtype=BF16, device=DEV)
        f = lambda: ops.paged_attention_decode(q, cache, cache[..., :rank], kv_indptr, kv_indices, scale, -1, 0.0)  # noqa: E731
        record("paged_attention_decode (MLA 512+64)", f"B={batch} ctx={ctx}", safe(lambda: bench(f)), None, None,
               bytes_moved=batch * ctx * (rank + rope) * 2)
    for total in ([2048, 8192] if quick else [1024, 2048, 8192, 16384]):
        batch = 1 if total >= 16384 else 4
        lens, qo = varlen(total, batch)
        kv_indices = torch.randperm(NS - 1, device=DEV)[:total] + 1
        q = torch.randn(total, hq, rank + rope, dtype=BF16, device=DEV)
        f = lambda: ops.paged_attention_extend(q, cache, cache[..., :rank], qo, qo, kv_indices, scale, True, -1, 0.0)  # noqa: E731
        record("paged_attention_extend (MLA 512+64)", f"T={total} B={batch}", safe(lambda: bench(f)), None, None,
               flops=sum(2 * n * n / 2 * hq * (2 * rank + rope) for n in lens))
    bench_mla_layer(quick, hq, rank, rope, scale)


def bench_mla_layer(quick, hq, rank, rope, scale, nope=128, v_dim=128):
    """The ``mla_layer`` op (Kimi-Linear's MLA core: the compressed row's store, then attention) on one
    prompt without a prefix, in the form its cost rule picks (expanded at these lengths) beside the
    absorbed form forced (``layer_attention.mla_expands`` replaced for the run)."""
    g = torch.Generator(device=DEV).manual_seed(0)
    w_uk = torch.randn(hq, nope, rank, dtype=BF16, device=DEV, generator=g) * rank ** -0.5
    w_uv = torch.randn(hq, v_dim, rank, dtype=BF16, device=DEV, generator=g) * rank ** -0.5
    rule = layer_attention.mla_expands
    for total in ([4096, 16384] if quick else [1024, 4096, 16384, 32768]):
        cache = torch.zeros(total + 1, 1, rank + rope, dtype=BF16, device=DEV)
        i32 = dict(dtype=torch.int32, device=DEV)
        qsl = torch.tensor([0, total], **i32)
        slots = torch.arange(1, total + 1, device=DEV)
        md = ForwardMetadata(
            mode=ForwardMode.EXTEND, positions=torch.arange(total, device=DEV), query_start_loc=qsl,
            seq_lens=torch.tensor([total], **i32), prefix_lens=torch.zeros(1, **i32),
            mamba_cache_indices=torch.zeros(1, **i32), has_initial_state=torch.zeros(1, dtype=torch.bool, device=DEV),
            out_cache_loc=slots, kv_indptr=qsl, kv_indices=slots, logits_indices=qsl[1:].long() - 1,
            extend_lens_cpu=[total], seq_lens_cpu=[total])
        q_nope = torch.randn(total, hq, nope, dtype=BF16, device=DEV, generator=g)
        q_rope = torch.randn(total, hq, rope, dtype=BF16, device=DEV, generator=g)
        latent = torch.randn(total, rank, dtype=BF16, device=DEV, generator=g)
        k_rope = torch.randn(total, rope, dtype=BF16, device=DEV, generator=g)
        f = lambda: ops.mla_layer(q_nope, q_rope, latent, k_rope, w_uk, w_uv, 0, scale)  # noqa: E731
        times = {}
        for form, choose in (("per step", rule), ("absorbed", lambda *a: False)):
            layer_attention.mla_expands = choose
            try:
                with forward_context(ForwardContext(md, {0: (cache, cache[..., :rank])}, {})):
                    times[form] = safe(lambda: bench(f, graph=False))
            finally:
                layer_attention.mla_expands = rule
        picked = "expanded" if rule(md, hq, nope, rope, rank, v_dim, 2) else "absorbed"
        ours, absorbed = times["per step"], times["absorbed"]
        record(f"mla_layer ({picked})", f"T={total} B=1 H={hq}", ours, None, None,
               flops=2 * total * total / 2 * hq * (nope + rope + v_dim if picked == "expanded" else 2 * rank + rope),
               note=f"absorbed form {absorbed if absorbed is None else round(absorbed, 4)} ms"
                    + (f" ({absorbed / ours:.2f}x)" if ours and absorbed else ""))


#: (name, N, K) of the reference Qwen3-Next's projections at decode, packed as the rewrite pass packs them
SKINNY_SHAPES = (("gdn in_proj_qkvz+ba", 12352, 2048), ("mlp gate+up", 11264, 2048), ("mlp down", 2048, 5632),
                 ("gdn out_proj / attn o_proj", 2048, 4096), ("attn q+k+v", 9216, 2048), ("lm head", 151936, 2048))


#: (BLOCK_N, BLOCK_K, warps, stages) tried for the skinny kernel at 2 rows (bench_skinny)
SKINNY_ROW_TILES = ((2, 512, 4, 3), (2, 1024, 4, 1), (2, 1024, 4, 2), (2, 256, 4, 3), (4, 512, 4, 2),
                    (4, 1024, 8, 2), (8, 512, 8, 2), (8, 2048, 8, 2))


def bench_skinny(quick):
    """skinny_mm (decode projections at 1-4 rows) vs torch.mm (cuBLAS). Each timed call cycles over
    copies of the weight that together exceed the L2 cache, so every matmul streams from HBM as in a
    decode step; one CUDA graph per system, time per matmul. At 2 rows also the skinny kernel itself
    over :data:`SKINNY_ROW_TILES` whatever the op picks: row ``skinny_mm kernel``, its best tile
    against cuBLAS, the tile in the note (where ``skinny_mm_config``'s 2-row tiles come from).
    At 3-4 rows the op calls cuBLAS (see :func:`~hybrid_compile.ops.triton.linear.use_skinny_kernel`)."""
    from hybrid_compile.ops.triton.linear import skinny_mm_triton

    for name, n, k in SKINNY_SHAPES[:3] if quick else SKINNY_SHAPES:
        copies = max(2, -(-(400 << 20) // (n * k * 2)))
        weights = [torch.randn(n, k, dtype=BF16, device=DEV) / k ** 0.5 for _ in range(copies)]
        for m in (1, 2, 3, 4):
            x = torch.randn(m, k, dtype=BF16, device=DEV)
            f = lambda: [ops.skinny_mm(x, w) for w in weights]  # noqa: E731
            p = lambda: [torch.mm(x, w.t()) for w in weights]  # noqa: E731
            ours, cublas = safe(lambda: bench(f)), safe(lambda: bench(p))
            record("skinny_mm", f"{name} M={m} N={n} K={k}", ours and Ms(ours / copies, ours.mode),
                   cublas and Ms(cublas / copies, cublas.mode), None, bytes_moved=n * k * 2,
                   note="(torch column = torch.mm, cuBLAS)")
            if m != 2:
                continue
            want = torch.mm(x, weights[0].t()).float()
            best = None
            for tile in SKINNY_ROW_TILES:
                y = skinny_mm_triton(x, weights[0], tile)
                err = (y.float() - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
                if not err < 2e-2:
                    raise AssertionError(f"skinny_mm kernel {name} M={m} tile {tile}: relative error {err:.2e}")
                t = safe(lambda: bench(lambda: [skinny_mm_triton(x, w, tile) for w in weights]))
                if t and (best is None or t < best[0]):
                    best = (t, tile)
            if best is not None:
                record("skinny_mm kernel", f"{name} M={m} N={n} K={k}", Ms(best[0] / copies, best[0].mode),
                       cublas and Ms(cublas / copies, cublas.mode), None, bytes_moved=n * k * 2,
                       note=f"(best tile {best[1]} of {len(SKINNY_ROW_TILES)}; torch column = cuBLAS)")
        weights.clear()  # (the copies freed before the next shape's)
        torch.cuda.empty_cache()


def chunk_config_overrides(cfg, option="--chunk-config"):
    """``cfg`` (a parsed JSON value) checked as a dict of ``gdn_chunk.CONFIG`` overrides: anything
    else, or an unknown key, ends the run with an error naming ``option``. Returns it."""
    from hybrid_compile.ops.triton import gdn_chunk

    if not isinstance(cfg, dict):
        raise SystemExit(f"{option}: a JSON object of gdn_chunk.CONFIG overrides")
    unknown = sorted(set(cfg) - set(gdn_chunk.CONFIG))
    if unknown:
        raise SystemExit(f"{option}: unknown key(s) {', '.join(unknown)}; known: {', '.join(gdn_chunk.CONFIG)}")
    return cfg


def apply_chunk_config(text):
    """``--chunk-config``: a JSON object of ``gdn_chunk.CONFIG`` overrides, applied in place;
    unknown keys are refused. Returns the overrides."""
    from hybrid_compile.ops.triton import gdn_chunk

    cfg = chunk_config_overrides(json.loads(text))
    gdn_chunk.CONFIG.update(cfg)
    return cfg


def main():
    global PEAK_BW, PEAK_TFLOPS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--out", default="benchmarks/results/kernels.json")
    parser.add_argument("--only", default=",".join(GROUPS), help="comma list of groups")
    parser.add_argument("--chunk-config", default=None,
                        help="JSON object of hybrid_compile/ops/triton/gdn_chunk.py CONFIG overrides (gdn / kda prefill)")
    args = parser.parse_args()
    groups = args.only.split(",")
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        raise SystemExit(f"--only: unknown group(s) {', '.join(unknown)}; known: {','.join(GROUPS)}")
    chunk_config = apply_chunk_config(args.chunk_config) if args.chunk_config else {}
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels.py needs a CUDA device")
    torch.manual_seed(0)
    PEAK_BW, PEAK_TFLOPS = measure_peaks()
    device = torch.cuda.get_device_name()
    print(f"device: {device}; measured peak {PEAK_BW / 1e9:.0f} GB/s copy bandwidth, {PEAK_TFLOPS:.0f} TFLOP/s bf16 matmul")
    if chunk_config:
        print(f"gdn_chunk.CONFIG overrides: {chunk_config}")
    fla = try_import_fla()
    print(f"flash-linear-attention: {'available' if 'chunk' in fla else fla.get('error')}")
    if "gdn" in groups:
        bench_gdn(args.quick, fla)
    if "kda" in groups:
        bench_kda(args.quick)
    if "mla" in groups:
        bench_mla(args.quick)
    if "lightning" in groups:
        bench_lightning(args.quick)
    if "mamba1" in groups:
        bench_mamba1(args.quick)
    if "mamba2" in groups:
        bench_mamba2(args.quick)
    if "attention" in groups:
        bench_attention(args.quick)
    if "skinny_mm" in groups:
        bench_skinny(args.quick)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "peak_GBps": PEAK_BW / 1e9,
                   "peak_TFLOPs": PEAK_TFLOPS, "fla": "chunk" in fla, "chunk_config": chunk_config, "rows": ROWS}, f,
                  indent=1)
    print(f"wrote {args.out}")


PEAK_BW = PEAK_TFLOPS = math.nan
GROUPS = ("gdn", "kda", "mla", "lightning", "mamba1", "mamba2", "attention", "skinny_mm")

if __name__ == "__main__":
    main()
