"""Self-check of every kernel op: random inputs, op vs. its per-token reference, timings.

Run by ``hybrid-compile selfcheck``. Each check builds one varlen batch (a padding row, a
request with initial state, lengths not divisible by 64), runs the op and its independent
reference from :mod:`.reference`, and reports the largest error over outputs and mutated
state against the tolerance of the input dtype, plus the op's time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from . import reference as _ref  # noqa: F401
from .reference import attention as ref_attn
from .reference import conv1d as ref_conv
from .reference import gdn as ref_gdn
from .reference import lightning as ref_lightning
from .reference import mamba1 as ref_mamba1
from .reference import mamba2 as ref_mamba2
from .reference import tree as ref_tree

ops = torch.ops.hybrid_compile

TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


@dataclass
class CheckResult:
    op: str
    max_error: float
    tolerance: float
    op_ms: float
    reference_ms: float

    @property
    def ok(self) -> bool:
        return self.max_error <= self.tolerance


def _timed(fn: Callable, reps: int = 1):
    """(result of the last call, median milliseconds per call)."""
    times, out = [], None
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return out, sorted(times)[len(times) // 2]


def _err(*pairs) -> float:
    """Largest relative-to-scale abs error over (actual, expected) pairs."""
    worst = 0.0
    for actual, expected in pairs:
        a, e = actual.detach().float().cpu(), expected.detach().float().cpu()
        scale = max(1.0, float(e.abs().max())) if e.numel() else 1.0
        if a.numel():
            worst = max(worst, float((a - e).abs().max()) / scale)
    return worst


class _Batch:
    """One varlen batch: lengths, cu_seqlens, slots (row 1 is padding), initial-state flags."""

    def __init__(self, lens, num_slots, device, gen):
        self.lens = lens
        self.device = device
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        self.T = cu[-1]
        self.B = len(lens)
        self.cu = torch.tensor(cu, dtype=torch.int32, device=device)
        slots = torch.randperm(num_slots, generator=gen)[: self.B].to(torch.int32)
        slots[1] = -1
        self.slots = slots.to(device)
        self.has_init = torch.tensor([i % 2 == 0 for i in range(self.B)], device=device)


def _rand(gen, *shape, dtype=torch.float32, device="cpu", scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)


def check_conv1d(device, dtype, gen, reps) -> list[CheckResult]:
    D, W, S = 96, 4, 8
    bt = _Batch([130, 17, 64, 1, 0], S, device, gen)
    x = _rand(gen, bt.T, D, dtype=dtype, device=device)
    w = _rand(gen, D, W, dtype=dtype, device=device, scale=0.5)
    bias = _rand(gen, D, dtype=dtype, device=device)
    pool = _rand(gen, S, W - 1, D, device=device)
    cpu = lambda t: t.cpu() if isinstance(t, torch.Tensor) else t  # noqa: E731
    results = []

    def run_fn():
        p = pool.clone()
        return ops.causal_conv1d_fn(x, w, bias, p, bt.cu, bt.slots, bt.has_init, "silu"), p

    (out, p), ms = _timed(run_fn, reps)
    (ref_out, ref_pool), ref_ms = _timed(
        lambda: ref_conv.causal_conv1d_fn_ref(*map(cpu, (x, w, bias, pool, bt.cu, bt.slots, bt.has_init)), "silu")
    )
    results.append(CheckResult("causal_conv1d_fn", _err((out, ref_out), (p, ref_pool)), TOLERANCE[dtype], ms, ref_ms))

    L = 3
    xu = _rand(gen, bt.B, L, D, dtype=dtype, device=device)
    inter = torch.zeros(bt.B, L, W - 1, D, device=device)

    def run_update():
        p, it = pool.clone(), inter.clone()
        return ops.causal_conv1d_update(xu, p, w, bias, "silu", bt.slots, False, it), p, it

    (out, p, it), ms = _timed(run_update, reps)
    ref = ref_conv.causal_conv1d_update_ref(*map(cpu, (xu, pool, w, bias)), "silu", cpu(bt.slots), False, cpu(inter))
    _, ref_ms = _timed(
        lambda: ref_conv.causal_conv1d_update_ref(*map(cpu, (xu, pool, w, bias)), "silu", cpu(bt.slots), False, cpu(inter))
    )
    results.append(
        CheckResult("causal_conv1d_update", _err((out, ref[0]), (p, ref[1]), (it, ref[2])), TOLERANCE[dtype], ms, ref_ms)
    )
    return results


def check_gdn(device, dtype, gen, reps) -> list[CheckResult]:
    Hk, Hv, K, V, S = 2, 4, 32, 32, 8
    bt = _Batch([130, 17, 70, 1, 0], S, device, gen)
    T = bt.T
    q, k = (_rand(gen, T, Hk, K, dtype=dtype, device=device) for _ in range(2))
    v = _rand(gen, T, Hv, V, dtype=dtype, device=device)
    A_log = _rand(gen, Hv, device=device, scale=0.5)
    dt_bias = _rand(gen, Hv, device=device, scale=0.5)
    a, b = (_rand(gen, T, Hv, dtype=dtype, device=device) for _ in range(2))
    pool = _rand(gen, S, Hv, K, V, device=device, scale=0.1)
    cpu = lambda t: t.cpu()  # noqa: E731
    results = []

    (g, beta), ms = _timed(lambda: ops.gdn_gating(A_log, a, b, dt_bias, 1.0, 20.0), reps)
    (rg, rb), ref_ms = _timed(lambda: ref_gdn.gating_ref(*map(cpu, (A_log, a, b, dt_bias))))
    results.append(CheckResult("gdn_gating", _err((g, rg), (beta, rb)), TOLERANCE[dtype], ms, ref_ms))

    def run_chunk():
        p = pool.clone()
        o, cs = ops.chunk_gated_delta_rule(q, k, v, g, beta, p, bt.cu, bt.slots, bt.has_init, True, 0.0, True, ssm_scales=None)
        return o, cs, p

    (o, cs, p), ms = _timed(run_chunk, reps)
    (ro, rp, rcs), ref_ms = _timed(
        lambda: ref_gdn.chunk_gated_delta_rule_ref(
            *map(cpu, (q, k, v, g, beta, pool, bt.cu, bt.slots, bt.has_init)), True, 0.0, True
        )
    )
    results.append(CheckResult("chunk_gated_delta_rule", _err((o, ro), (p, rp), (cs, rcs)), TOLERANCE[dtype], ms, ref_ms))

    B = bt.B
    qd, kd = (_rand(gen, B, Hk, K, dtype=dtype, device=device) for _ in range(2))
    vd = _rand(gen, B, Hv, V, dtype=dtype, device=device)
    ad, bd = (_rand(gen, B, Hv, dtype=dtype, device=device) for _ in range(2))

    def run_decode():
        p = pool.clone()
        return ops.fused_sigmoid_gating_delta_rule_update(
            A_log, dt_bias, qd, kd, vd, ad, bd, p, bt.slots, True, 0.0, 1.0, 20.0, ssm_scales=None,
        ), p

    (o, p), ms = _timed(run_decode, reps)
    (ro, rp), ref_ms = _timed(
        lambda: ref_gdn.fused_sigmoid_gating_delta_rule_update_ref(
            *map(cpu, (A_log, dt_bias, qd, kd, vd, ad, bd, pool, bt.slots)), True, 0.0
        )
    )
    results.append(
        CheckResult("fused_sigmoid_gating_delta_rule_update", _err((o, ro), (p, rp)), TOLERANCE[dtype], ms, ref_ms)
    )

    results.append(_check_verify("fused_recurrent_gated_delta_rule_update", device, dtype, gen, reps, bt, pool, Hk, ()))
    return results


def _check_verify(name, device, dtype, gen, reps, bt, pool, hk, gate_tail) -> CheckResult:
    """``fused_recurrent_gated_delta_rule_update`` over 4 steps; ``gate_tail`` ``()`` for a per-head
    gate, ``(K,)`` for a per-channel one."""
    B, L = bt.B, 4
    hv, K, V = pool.shape[1:]
    cpu = lambda t: t.cpu()  # noqa: E731
    qv, kv_ = (_rand(gen, B, L, hk, K, dtype=dtype, device=device) for _ in range(2))
    vv = _rand(gen, B, L, hv, V, dtype=dtype, device=device)
    gv = -torch.rand(B, L, hv, *gate_tail, generator=gen).to(device)
    bv = torch.rand(B, L, hv, generator=gen).to(device)
    inter = torch.zeros(B, L, hv, K, V, device=device)

    def run_verify():
        p, it = pool.clone(), inter.clone()
        return ops.fused_recurrent_gated_delta_rule_update(qv, kv_, vv, gv, bv, p, bt.slots, True, 0.0, True, it, ssm_scales=None, intermediate_scales=None, parent_indices=None), p, it

    (o, p, it), ms = _timed(run_verify, reps)
    (ro, rp, rit), ref_ms = _timed(
        lambda: ref_gdn.fused_recurrent_gated_delta_rule_update_ref(
            *map(cpu, (qv, kv_, vv, gv, bv, pool, bt.slots)), True, 0.0, True, cpu(inter)
        )
    )
    return CheckResult(name, _err((o, ro), (p, rp), (it, rit)), TOLERANCE[dtype], ms, ref_ms)


def check_mamba2(device, dtype, gen, reps) -> list[CheckResult]:
    H, G, P, N, S, CH = 4, 2, 16, 16, 8, 64
    bt = _Batch([130, 17, 70, 1, 0], S, device, gen)
    T = bt.T
    x = _rand(gen, T, H, P, dtype=dtype, device=device)
    dt = _rand(gen, T, H, dtype=dtype, device=device)
    A = -torch.rand(H, generator=gen).to(device) - 0.1
    Bm, Cm = (_rand(gen, T, G, N, dtype=dtype, device=device) for _ in range(2))
    D = _rand(gen, H, device=device)
    dt_bias = _rand(gen, H, device=device, scale=0.5)
    pool = _rand(gen, S, H, P, N, device=device, scale=0.1)
    cpu = lambda t: t.cpu() if isinstance(t, torch.Tensor) else t  # noqa: E731
    inf = float("inf")
    results = []

    def run_scan():
        p = pool.clone()
        y, _ = ops.ssd_chunk_scan(x, dt, A, Bm, Cm, D, None, dt_bias, True, 0.0, inf, p, bt.cu, bt.slots, bt.has_init, CH, False, ssm_scales=None)
        return y, p

    (y, p), ms = _timed(run_scan, reps)
    (ry, rp, _), ref_ms = _timed(
        lambda: ref_mamba2.ssd_scan_reference(
            *map(cpu, (x, dt, A, Bm, Cm, D, None, dt_bias)), True, 0.0, inf, *map(cpu, (pool, bt.cu, bt.slots, bt.has_init))
        )
    )
    results.append(CheckResult("ssd_chunk_scan", _err((y, ry), (p, rp)), TOLERANCE[dtype], ms, ref_ms))

    B, L = bt.B, 3
    xs = _rand(gen, B, L, H, P, dtype=dtype, device=device)
    dts = _rand(gen, B, L, H, dtype=dtype, device=device)
    Bs, Cs = (_rand(gen, B, L, G, N, dtype=dtype, device=device) for _ in range(2))
    inter = torch.zeros(B, L, H, P, N, device=device)

    def run_update():
        p, it = pool.clone(), inter.clone()
        y = ops.selective_state_update(xs, dts, A, Bs, Cs, D, None, dt_bias, True, 0.0, inf, p, bt.slots, False, it, A_is_log=False, ssm_scales=None, intermediate_scales=None, parent_indices=None)
        return y, p, it

    (y, p, it), ms = _timed(run_update, reps)
    (ry, rp, rit), ref_ms = _timed(
        lambda: ref_mamba2.selective_state_update_reference(
            *map(cpu, (xs, dts, A, Bs, Cs, D, None, dt_bias)), True, 0.0, inf, cpu(pool), cpu(bt.slots), False, cpu(inter)
        )
    )
    results.append(CheckResult("selective_state_update", _err((y, ry), (p, rp), (it, rit)), TOLERANCE[dtype], ms, ref_ms))
    return results


def check_kda(device, dtype, gen, reps) -> list[CheckResult]:
    """Kimi Delta Attention: the delta-rule ops with a per-channel gate ``g [..., H, K]``."""
    H, K, V, S = 4, 32, 32, 8
    bt = _Batch([130, 17, 70, 1, 0], S, device, gen)
    q, k = (_rand(gen, bt.T, H, K, dtype=dtype, device=device) for _ in range(2))
    v = _rand(gen, bt.T, H, V, dtype=dtype, device=device)
    g = (-torch.rand(bt.T, H, K, generator=gen)).to(device)
    beta = torch.rand(bt.T, H, generator=gen).to(device)
    pool = _rand(gen, S, H, K, V, device=device, scale=0.1)
    cpu = lambda t: t.cpu()  # noqa: E731

    def run_chunk():
        p = pool.clone()
        o, cs = ops.chunk_gated_delta_rule(q, k, v, g, beta, p, bt.cu, bt.slots, bt.has_init, True, 0.0, True, ssm_scales=None)
        return o, cs, p

    (o, cs, p), ms = _timed(run_chunk, reps)
    (ro, rp, rcs), ref_ms = _timed(lambda: ref_gdn.chunk_gated_delta_rule_ref(
        *map(cpu, (q, k, v, g, beta, pool, bt.cu, bt.slots, bt.has_init)), True, 0.0, True))
    results = [CheckResult("chunk_gated_delta_rule (per-channel g)", _err((o, ro), (p, rp), (cs, rcs)),
                           TOLERANCE[dtype], ms, ref_ms)]
    results.append(_check_verify("fused_recurrent_gated_delta_rule_update (per-channel g)", device, dtype, gen, reps,
                                 bt, pool, H, (K,)))
    return results


def check_lightning(device, dtype, gen, reps) -> list[CheckResult]:
    """MiniMax lightning attention: chunked prefill with chunk states, and verify with intermediates."""
    H, K, V, S, L = 4, 32, 32, 8, 3
    bt = _Batch([130, 17, 70, 1, 0], S, device, gen)
    q, k = (_rand(gen, bt.T, H, K, dtype=dtype, device=device, scale=K ** -0.5) for _ in range(2))
    v = _rand(gen, bt.T, H, V, dtype=dtype, device=device)
    slope = (0.5 ** (torch.arange(H) + 1)).float().to(device)
    pool = _rand(gen, S, H, K, V, device=device, scale=0.1)
    cpu = lambda t: t.cpu()  # noqa: E731

    def run_chunk():
        p = pool.clone()
        o, cs = ops.chunk_lightning_attention(q, k, v, slope, p, bt.cu, bt.slots, bt.has_init, True, None)
        return o, cs, p

    (o, cs, p), ms = _timed(run_chunk, reps)
    (ro, rp, rcs), ref_ms = _timed(lambda: ref_lightning.chunk_lightning_attention_ref(
        *map(cpu, (q, k, v, slope, pool, bt.cu, bt.slots, bt.has_init)), True))
    results = [CheckResult("chunk_lightning_attention", _err((o, ro), (p, rp), (cs, rcs)), TOLERANCE[dtype], ms, ref_ms)]
    vq, vk = (x[: bt.B * L].reshape(bt.B, L, H, K) for x in (q, k))
    vv = v[: bt.B * L].reshape(bt.B, L, H, V)
    inter = torch.zeros(bt.B, L, H, K, V, device=device)

    def run_verify():
        p, i = pool.clone(), inter.clone()
        return ops.recurrent_lightning_attention_update(vq, vk, vv, slope, p, bt.slots, False, i, None, None), p, i

    (o, p, i), ms = _timed(run_verify, reps)
    (ro, rp, ri), ref_ms = _timed(lambda: ref_lightning.recurrent_lightning_attention_update_ref(
        *map(cpu, (vq, vk, vv, slope, pool, bt.slots)), False, inter.cpu()))
    results.append(CheckResult("recurrent_lightning_attention_update", _err((o, ro), (p, rp), (i, ri)),
                               TOLERANCE[dtype], ms, ref_ms))
    return results


def check_attention(device, dtype, gen, reps) -> list[CheckResult]:
    Hq, Hkv, Dh, NS = 8, 2, 32, 1024
    prefix = [40, 0, 100, 7]
    new = [130, 17, 64, 1]
    k_cache = _rand(gen, NS, Hkv, Dh, device=device)
    v_cache = _rand(gen, NS, Hkv, Dh, device=device)
    perm = torch.randperm(NS - 1, generator=gen) + 1
    kv_lens = [p + n for p, n in zip(prefix, new)]
    kv_indices = perm[: sum(kv_lens)].to(device)
    kv_indptr = torch.tensor([0] + torch.tensor(kv_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    qo_indptr = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q = _rand(gen, sum(new), Hq, Dh, dtype=dtype, device=device)
    scale = Dh ** -0.5
    cpu = lambda t: t.cpu()  # noqa: E731
    results = []
    (o, lse), ms = _timed(
        lambda: ops.paged_attention_extend(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, scale, True, -1, 0.0), reps
    )
    (ro, rlse), ref_ms = _timed(
        lambda: ref_attn.paged_attention_extend_ref(*map(cpu, (q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices)), scale)
    )
    results.append(CheckResult("paged_attention_extend", _err((o, ro), (lse, rlse)), TOLERANCE[dtype], ms, ref_ms))

    qd = _rand(gen, len(new), Hq, Dh, dtype=dtype, device=device)
    (o, lse), ms = _timed(
        lambda: ops.paged_attention_decode(qd, k_cache, v_cache, kv_indptr, kv_indices, scale, -1, 0.0), reps
    )
    (ro, rlse), ref_ms = _timed(
        lambda: ref_attn.paged_attention_decode_ref(*map(cpu, (qd, k_cache, v_cache, kv_indptr, kv_indices)), scale)
    )
    results.append(CheckResult("paged_attention_decode", _err((o, ro), (lse, rlse)), TOLERANCE[dtype], ms, ref_ms))

    # multi-head latent attention, absorbed: one KV head [latent 512, rope key 64], V = the latent (a view);
    # fewer new tokens (the per-query reference is slow at this head dim)
    new = [9, 1, 5, 1]
    kv_lens = [p + n for p, n in zip(prefix, new)]
    kv_indices = perm[: sum(kv_lens)].to(device)
    kv_indptr = torch.tensor([0] + torch.tensor(kv_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    qo_indptr = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, device=device)
    mla = _rand(gen, NS, 1, 576, dtype=dtype, device=device)
    qm = _rand(gen, sum(new), 16, 576, dtype=dtype, device=device)
    (o, lse), ms = _timed(lambda: ops.paged_attention_extend(qm, mla, mla[..., :512], qo_indptr, kv_indptr, kv_indices,
                                                             192 ** -0.5, True, -1, 0.0), reps)
    (ro, rlse), ref_ms = _timed(lambda: ref_attn.paged_attention_extend_ref(
        cpu(qm), cpu(mla), cpu(mla)[..., :512], *map(cpu, (qo_indptr, kv_indptr, kv_indices)), 192 ** -0.5))
    results.append(CheckResult("paged_attention_extend (MLA 512+64)", _err((o, ro), (lse, rlse)), TOLERANCE[dtype], ms,
                               ref_ms))
    qmd = qm[: len(new)]
    (o, lse), ms = _timed(lambda: ops.paged_attention_decode(qmd, mla, mla[..., :512], kv_indptr, kv_indices,
                                                             192 ** -0.5, -1, 0.0), reps)
    (ro, rlse), ref_ms = _timed(lambda: ref_attn.paged_attention_decode_ref(
        cpu(qmd), cpu(mla), cpu(mla)[..., :512], *map(cpu, (kv_indptr, kv_indices)), 192 ** -0.5))
    results.append(CheckResult("paged_attention_decode (MLA 512+64)", _err((o, ro), (lse, rlse)), TOLERANCE[dtype], ms,
                               ref_ms))
    return results


def check_linear(device, dtype, gen, reps) -> list[CheckResult]:
    """skinny_mm at one row and at two long rows (its Triton kernel on CUDA) vs an fp64 matmul."""
    w = _rand(gen, 96, 4160, dtype=dtype, device=device, scale=4160 ** -0.5)
    x1, x2 = _rand(gen, 1, 4160, dtype=dtype, device=device), _rand(gen, 2, 4160, dtype=dtype, device=device)
    (y1, y2), ms = _timed(lambda: (ops.skinny_mm(x1, w), ops.skinny_mm(x2, w)), reps)
    (r1, r2), ref_ms = _timed(lambda: tuple((x.double().cpu() @ w.double().cpu().t()) for x in (x1, x2)))
    return [CheckResult("skinny_mm", _err((y1, r1), (y2, r2)), TOLERANCE[dtype], ms, ref_ms)]


def check_trees(device, dtype, gen, reps) -> list[CheckResult]:
    """The verify ops over speculative draft trees (``parent_indices``, ``tree_mask``) against the
    chain references run along every node's root path (``reference.tree``): 4 requests (one a
    padding row) of 10-node random trees."""
    B, L, S = 4, 10, 8
    parents = ref_tree.random_parents(B, L, gen)
    slots = torch.randperm(S, generator=gen)[:B].to(torch.int32)
    slots[1] = -1
    real = [0, 2, 3]
    P_, slots_d = parents.to(device), slots.to(device)
    inf = float("inf")
    results = []

    def result(name, op_fn, chain, per_token):
        (got_out, got_state), ms = _timed(op_fn, reps)
        (want_out, want_state), ref_ms = _timed(lambda: ref_tree.tree_by_paths(chain, per_token, parents))
        err = _err((got_out[real], want_out[real]), (got_state[real], want_state[real]))
        results.append(CheckResult(name + " (tree)", err, TOLERANCE[dtype], ms, ref_ms))

    D, W = 96, 4
    x = _rand(gen, B, L, D, dtype=dtype, device=device)
    w, bias = _rand(gen, D, W, dtype=dtype, device=device, scale=0.5), _rand(gen, D, dtype=dtype, device=device)
    pool = _rand(gen, S, W - 1, D, device=device)

    def conv_op():
        it = torch.zeros(B, L, W - 1, D, device=device)
        return ops.causal_conv1d_update(x, pool.clone(), w, bias, "silu", slots_d, True, it, P_), it

    def conv_chain(b, xs, n):
        o, _, it = ref_conv.causal_conv1d_update_ref(xs[0], pool.cpu(), w.cpu(), bias.cpu(), "silu", slots[b:b + 1],
                                                     True, torch.zeros(1, n, W - 1, D))
        return o, it

    result("causal_conv1d_update", conv_op, conv_chain, [x])

    Hk, Hv, K, V = 2, 4, 32, 32
    q, k = (_rand(gen, B, L, Hk, K, dtype=dtype, device=device) for _ in range(2))
    v = _rand(gen, B, L, Hv, V, dtype=dtype, device=device)
    g = -torch.rand(B, L, Hv, generator=gen).to(device)
    beta = torch.rand(B, L, Hv, generator=gen).to(device)
    gpool = _rand(gen, S, Hv, K, V, device=device, scale=0.1)

    def gdn_op():
        it = torch.zeros(B, L, Hv, K, V, device=device)
        o = ops.fused_recurrent_gated_delta_rule_update(q, k, v, g, beta, gpool.clone(), slots_d, True, 0.0, True, it,
                                                        None, None, P_)
        return o, it

    def gdn_chain(b, xs, n):
        o, _, it = ref_gdn.fused_recurrent_gated_delta_rule_update_ref(
            *xs, gpool.cpu(), slots[b:b + 1], True, 0.0, True, torch.zeros(1, n, Hv, K, V))
        return o, it

    result("fused_recurrent_gated_delta_rule_update", gdn_op, gdn_chain, [q, k, v, g, beta])

    H, G, P, N = 4, 2, 16, 16
    xs = _rand(gen, B, L, H, P, dtype=dtype, device=device)
    dts = _rand(gen, B, L, H, dtype=dtype, device=device)
    A = -torch.rand(H, generator=gen).to(device) - 0.1
    Bs, Cs = (_rand(gen, B, L, G, N, dtype=dtype, device=device) for _ in range(2))
    Dm, dt_bias = _rand(gen, H, device=device), _rand(gen, H, device=device, scale=0.5)
    mpool = _rand(gen, S, H, P, N, device=device, scale=0.1)

    def m2_op():
        it = torch.zeros(B, L, H, P, N, device=device)
        y = ops.selective_state_update(xs, dts, A, Bs, Cs, Dm, None, dt_bias, True, 0.0, inf, mpool.clone(), slots_d,
                                       True, it, False, None, None, P_)
        return y, it

    def m2_chain(b, ins, n):
        y, _, it = ref_mamba2.selective_state_update_reference(
            ins[0], ins[1], A.cpu(), ins[2], ins[3], Dm.cpu(), None, dt_bias.cpu(), True, 0.0, inf, mpool.cpu(),
            slots[b:b + 1], True, torch.zeros(1, n, H, P, N))
        return y, it

    result("selective_state_update", m2_op, m2_chain, [xs, dts, Bs, Cs])

    Di, G1, N1 = 64, 4, 16  # Mamba1: a decay per (channel, state) entry; Zamba-like B/C groups
    x1, z1 = (_rand(gen, B, L, Di, dtype=dtype, device=device) for _ in range(2))
    dt1 = _rand(gen, B, L, Di, dtype=dtype, device=device) - 1.0
    A1 = -torch.exp(torch.rand(Di, N1, generator=gen)).to(device)
    B1, C1 = (_rand(gen, B, L, G1, N1, dtype=dtype, device=device, scale=0.5) for _ in range(2))
    D1, dt_bias1 = _rand(gen, Di, device=device), _rand(gen, Di, device=device, scale=0.5)
    m1pool = _rand(gen, S, Di, N1, device=device)

    def m1_op():
        it = torch.zeros(B, L, Di, N1, device=device)
        y = ops.mamba1_state_update(x1, dt1, A1, B1, C1, D1, z1, dt_bias1, True, m1pool.clone(), slots_d, True, it,
                                    False, None, None, P_)
        return y, it

    def m1_chain(b, ins, n):
        y, _, it = ref_mamba1.mamba1_state_update_reference(
            ins[0], ins[1], A1.cpu(), ins[2], ins[3], D1.cpu(), ins[4], dt_bias1.cpu(), True, m1pool.cpu(),
            slots[b:b + 1], True, torch.zeros(1, n, Di, N1))
        return y, it

    result("mamba1_state_update", m1_op, m1_chain, [x1, dt1, B1, C1, z1])

    Hl, Kl, Vl = 4, 32, 32  # lightning attention: a fixed decay per head
    ql, kl = (_rand(gen, B, L, Hl, Kl, dtype=dtype, device=device, scale=Kl ** -0.5) for _ in range(2))
    vl = _rand(gen, B, L, Hl, Vl, dtype=dtype, device=device)
    slope = (0.5 ** (torch.arange(Hl) + 1)).float().to(device)
    lpool = _rand(gen, S, Hl, Kl, Vl, device=device, scale=0.1)

    def lightning_op():
        it = torch.zeros(B, L, Hl, Kl, Vl, device=device)
        o = ops.recurrent_lightning_attention_update(ql, kl, vl, slope, lpool.clone(), slots_d, True, it, None, None,
                                                     P_)
        return o, it

    def lightning_chain(b, ins, n):
        o, _, it = ref_lightning.recurrent_lightning_attention_update_ref(
            *ins, slope.cpu(), lpool.cpu(), slots[b:b + 1], True, torch.zeros(1, n, Hl, Kl, Vl))
        return o, it

    result("recurrent_lightning_attention_update", lightning_op, lightning_chain, [ql, kl, vl])

    # attention: every node sees the prefix and its root path; the reference attends a chain of the path
    Hq, Hkv, Dh, NS = 8, 2, 32, 512
    prefix = [40, 0, 100, 7]
    k_cache, v_cache = _rand(gen, NS, Hkv, Dh, device=device), _rand(gen, NS, Hkv, Dh, device=device)
    kv_lens = [p + L for p in prefix]
    kv_indices = (torch.randperm(NS - 1, generator=gen) + 1)[: sum(kv_lens)]
    kv_indptr = torch.tensor([0] + torch.tensor(kv_lens).cumsum(0).tolist(), dtype=torch.int32)
    qo_indptr = torch.arange(0, B * L + 1, L, dtype=torch.int32)
    qa = _rand(gen, B * L, Hq, Dh, dtype=dtype, device=device)
    mask = torch.tensor([m for row in parents.tolist() for m in ref_tree.ancestor_bits(row)], dtype=torch.int64)
    scale = Dh ** -0.5

    def attention_by_paths(window):
        """A node at the prefix length + its depth (its root path as a chain), for the window too."""
        outs = []
        for b in range(B):
            slots_b = kv_indices[kv_indptr[b]: kv_indptr[b + 1]]
            for t in range(L):
                keys = slots_b[list(range(prefix[b])) + [prefix[b] + a for a in ref_tree.root_path(parents[b].tolist(), t)]]
                ro, rl = ref_attn.paged_attention_extend_ref(
                    qa[b * L + t: b * L + t + 1].cpu(), k_cache.cpu(), v_cache.cpu(), torch.tensor([0, 1]),
                    torch.tensor([0, len(keys)]), keys, scale, True, window)
                outs.append((ro[0], rl[0]))
        return torch.stack([a for a, _ in outs]), torch.stack([b for _, b in outs])

    for window, name in ((-1, "paged_attention_extend (tree)"), (24, "paged_attention_extend (tree, window 24)")):
        (o, lse), ms = _timed(lambda: ops.paged_attention_extend(
            qa, k_cache, v_cache, qo_indptr.to(device), kv_indptr.to(device), kv_indices.to(device), scale, True,
            window, 0.0, None, None, mask.to(device)), reps)
        (ro, rlse), ref_ms = _timed(lambda: attention_by_paths(window))
        results.append(CheckResult(name, _err((o, ro), (lse, rlse)), TOLERANCE[dtype], ms, ref_ms))
    return results


CHECKS = (check_conv1d, check_gdn, check_kda, check_lightning, check_mamba2, check_attention, check_linear, check_trees)


def run_selfcheck(device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0, reps: int = 3) -> list[CheckResult]:
    gen = torch.Generator().manual_seed(seed)
    results: list[CheckResult] = []
    for check in CHECKS:
        results.extend(check(torch.device(device), dtype, gen, reps))
    return results


def format_results(results: list[CheckResult]) -> str:
    lines = [f"{'op':56s} {'max err':>10s} {'tol':>8s} {'op ms':>9s} {'ref ms':>9s}  status"]
    for r in results:
        lines.append(
            f"{r.op:56s} {r.max_error:10.2e} {r.tolerance:8.0e} {r.op_ms:9.2f} {r.reference_ms:9.1f}  "
            f"{'ok' if r.ok else 'FAIL'}"
        )
    return "\n".join(lines)
