"""Triton kernel of the chunked Kimi Delta Attention prefill: ``chunk_gated_delta_rule`` with a
per-channel gate ``g [T, Hv, K]``.

Same math, layouts and padding rules as :func:`hybrid_compile.ops.gdn.chunk_gated_delta_rule`.
One program per (request, value head, value block), grid ``(B, Hv, cdiv(V, BV))``, holds the state
block ``[K, BV]`` (fp32) in registers and walks its request in sub-chunks of ``BT = 16`` tokens.
Per sub-chunk, with ``c`` the sub-chunk-local cumulative sum of ``g`` (one column per key
channel)::

    A    = strictly_lower(beta_i * sum_k k_ik k_jk exp(c_ik - c_jk))      [BT, BT]
    P    = lower(sum_k q_ik k_jk exp(c_ik - c_jk))                        (diagonal included)
    u, w = (I + A)^-1 (beta * v),  (I + A)^-1 (beta * exp(c) * k)        (forward substitution)
    v'   = u - w S
    o    = (exp(c) * q) S + P v'
    S    = exp(c_last) * S + (exp(c_last - c) * k)^T v'                  (rows of S per channel)

Every exponent is a difference ``c_i - c_j`` with ``j <= i`` (or ``c`` itself), so every factor is
``<= 1``: unlike the per-head pipeline of :mod:`.gdn_chunk`, no ``exp(-c)`` is ever formed, which a
per-channel decay (no lower bound in transformers' ``KimiLinearForgetGate``) would overflow. The
decay-weighted products ``A`` / ``P`` need the per-channel decay inside the sum over ``K``, so they
are built one column ``j`` at a time from ``[BT, K]`` tiles; the state products are ``tl.dot``.
The state before every ``GDN_CHUNK_SIZE`` tokens goes to ``chunk_states`` (64 is a multiple of 16).
fp32 compute throughout (``tl.dot`` in IEEE fp32); outputs in ``v.dtype``; float pools (an FP8
pool is staged through fp32 by the caller, :func:`.fp8_cache.stage_states`). CUDA-graph safe: no
host sync, shape-only grid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._varlen import chunk_row_offsets, max_chunk_rows
from ..gdn import GDN_CHUNK_SIZE
from .gdn_chunk import MAX_HEAD_K_DIM

_BT = 16
assert GDN_CHUNK_SIZE % _BT == 0, "chunk-state rows must fall on sub-chunk boundaries"


@triton.jit
def _row(x, o_t, i):
    """Row ``i`` of a ``[BT, N]`` tile as an ``[N]`` vector."""
    return tl.sum(tl.where(o_t[:, None] == i, x, 0.0), 0)


@triton.jit
def _kda_chunk_kernel(
    q, k, v, g, beta, o, pool, state_indices, cu_seqlens, has_initial_state, chunk_states, chunk_rows,
    scale,
    s_qt, s_qh, s_qd, s_kt, s_kh, s_kd, s_vt, s_vh, s_vd, s_gt, s_gh, s_gk, s_bt, s_bh, s_ot, s_oh,
    s_ps, s_ph, s_pk, s_pv, s_cr, s_ch, s_ck, s_cv,
    R: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, CHUNK: tl.constexpr, USE_L2: tl.constexpr, CHUNK_STATES: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    i_hk = i_h // R
    slot = tl.load(state_indices + i_b).to(tl.int64)
    live = slot >= 0
    bos = tl.load(cu_seqlens + i_b).to(tl.int64)
    L = (tl.load(cu_seqlens + i_b + 1).to(tl.int64) - bos).to(tl.int32)
    n_run = tl.where(live, L, 0)  # a padding request runs no sub-chunk (its output stays zero)

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mk = o_k < K
    mv = o_v < V
    m_s = (o_k[:, None] < tl.where(live & (L > 0), K, 0)) & mv[None, :]  # empty request: slot untouched
    p_s = pool + tl.maximum(slot, 0) * s_ps + i_h * s_ph + o_k[:, None] * s_pk + o_v[None, :] * s_pv
    S = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)
    S = tl.where(tl.load(has_initial_state + i_b) != 0, S, 0.0)
    if CHUNK_STATES:
        row0 = tl.load(chunk_rows + i_b).to(tl.int64)

    for t0 in range(0, n_run, BT):
        if CHUNK_STATES:
            if t0 % CHUNK == 0:  # the state before this 64-token chunk
                p_c = chunk_states + (row0 + t0 // CHUNK) * s_cr + i_h * s_ch + o_k[:, None] * s_ck + o_v[None, :] * s_cv
                tl.store(p_c, S, mask=mk[:, None] & mv[None, :])
        tok = bos + t0 + o_t
        mt = (t0 + o_t) < L
        m_tk = mt[:, None] & mk[None, :]
        b_q = tl.load(q + tok[:, None] * s_qt + i_hk * s_qh + o_k[None, :] * s_qd, mask=m_tk, other=0.0).to(tl.float32)
        b_k = tl.load(k + tok[:, None] * s_kt + i_hk * s_kh + o_k[None, :] * s_kd, mask=m_tk, other=0.0).to(tl.float32)
        b_v = tl.load(v + tok[:, None] * s_vt + i_h * s_vh + o_v[None, :] * s_vd, mask=mt[:, None] & mv[None, :],
                      other=0.0).to(tl.float32)
        b_g = tl.load(g + tok[:, None] * s_gt + i_h * s_gh + o_k[None, :] * s_gk, mask=m_tk, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + tok * s_bt + i_h * s_bh, mask=mt, other=0.0).to(tl.float32)
        if USE_L2:
            b_q = b_q * tl.math.rsqrt(tl.sum(b_q * b_q, 1) + 1e-6)[:, None]
            b_k = b_k * tl.math.rsqrt(tl.sum(b_k * b_k, 1) + 1e-6)[:, None]
        b_q = b_q * scale
        c = tl.cumsum(b_g, 0)  # [BT, BK]; padded rows add g = 0, so row BT-1 is the sub-chunk's total

        # decay-weighted A (strictly lower, beta rows) and P (lower incl. diagonal), column by column
        A = tl.zeros([BT, BT], dtype=tl.float32)
        P = tl.zeros([BT, BT], dtype=tl.float32)
        for j in tl.static_range(BT):
            k_j = _row(b_k, o_t, j)
            c_j = _row(c, o_t, j)
            e = tl.exp(tl.where(o_t[:, None] >= j, c - c_j[None, :], float("-inf")))  # 0 above the diagonal
            ke = k_j[None, :] * e
            a_col = tl.where(o_t > j, tl.sum(b_k * ke, 1) * b_beta, 0.0)
            A = tl.where(o_t[None, :] == j, a_col[:, None], A)
            P = tl.where(o_t[None, :] == j, tl.sum(b_q * ke, 1)[:, None], P)

        # forward substitution of (I + A) [u | w] = [beta v | beta exp(c) k]
        bv = b_v * b_beta[:, None]
        bk = b_k * tl.exp(c) * b_beta[:, None]
        U = tl.zeros([BT, BV], dtype=tl.float32)
        W = tl.zeros([BT, BK], dtype=tl.float32)
        for i in tl.static_range(BT):
            a_i = _row(A, o_t, i)  # zero at columns >= i: only the rows already solved count
            u_i = _row(bv, o_t, i) - tl.sum(a_i[:, None] * U, 0)
            w_i = _row(bk, o_t, i) - tl.sum(a_i[:, None] * W, 0)
            U = tl.where(o_t[:, None] == i, u_i[None, :], U)
            W = tl.where(o_t[:, None] == i, w_i[None, :], W)

        vn = U - tl.dot(W, S, input_precision="ieee")  # [BT, BV]
        out = tl.dot(b_q * tl.exp(c), S, input_precision="ieee") + tl.dot(P, vn, input_precision="ieee")
        tl.store(o + tok[:, None] * s_ot + i_h * s_oh + o_v[None, :], out.to(o.dtype.element_ty),
                 mask=mt[:, None] & mv[None, :])
        c_last = _row(c, o_t, BT - 1)
        k_dec = b_k * tl.exp(c_last[None, :] - c)
        S = S * tl.exp(c_last)[:, None] + tl.dot(tl.trans(k_dec), vn, input_precision="ieee")

    tl.store(p_s, S.to(pool.dtype.element_ty), mask=m_s)


def kda_chunk_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    use_qk_l2norm: bool,
    scale: float,
    output_chunk_states: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk_gated_delta_rule`` with ``g [T, Hv, K]`` on a float pool (mutated in place)."""
    T, hk, kd = q.shape
    hv, vd = v.shape[1], v.shape[2]
    if kd > MAX_HEAD_K_DIM:
        raise ValueError(f"chunk_gated_delta_rule (Triton): head_k_dim {kd} > {MAX_HEAD_K_DIM} is not supported")
    batch = state_indices.shape[0]
    o = torch.zeros(T, hv, vd, dtype=v.dtype, device=v.device)
    n_rows = max_chunk_rows(T, batch, GDN_CHUNK_SIZE) if output_chunk_states else 0
    chunk_states = torch.zeros(n_rows, hv, kd, vd, dtype=torch.float32, device=v.device)
    if T == 0 or batch == 0:
        return o, chunk_states
    rows = chunk_row_offsets(cu_seqlens, GDN_CHUNK_SIZE)
    bk = max(triton.next_power_of_2(kd), 16)
    bv = max(min(triton.next_power_of_2(vd), 32), 16)
    cs = chunk_states if output_chunk_states else ssm_states  # dummy pointer when absent (never touched)
    c_strides = chunk_states.stride() if output_chunk_states else (0, 0, 0, 0)
    _kda_chunk_kernel[(batch, hv, triton.cdiv(vd, bv))](
        q, k, v, g, beta, o, ssm_states, state_indices, cu_seqlens, has_initial_state, cs, rows,
        float(scale) if scale > 0 else float(kd) ** -0.5,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *o.stride()[:2],
        *ssm_states.stride(), *c_strides,
        R=hv // hk, K=kd, V=vd, BK=bk, BV=bv, BT=_BT, CHUNK=GDN_CHUNK_SIZE, USE_L2=bool(use_qk_l2norm),
        CHUNK_STATES=bool(output_chunk_states), num_warps=4,
    )
    return o, chunk_states
