"""Triton kernels of the chunked Gated DeltaNet prefill (``chunk_gated_delta_rule``).

Same math, layouts and padding rules as :func:`hybrid_compile.ops.gdn.chunk_gated_delta_rule`
(WY / UT form over chunks of ``C = 64`` tokens aligned to each request's first token). Per
chunk and value head, with ``c`` the chunk-local cumulative sum of ``g``, ``k``/``q`` the
L2-normalised (optional) keys/queries and ``r = Hv // Hk`` (value head ``h`` reads q/k head
``h // r``)::

    A    = strictly_lower(beta_i * k_i.k_j * exp(c_i - c_j))         [C, C]
    T    = (I + A)^-1                                                 (unit lower triangular)
    w    = T (beta * exp(c) * k),  u = T (beta * v)                   [C, K], [C, V]
    h_0  = initial state (or zeros);   for chunk n = 0, 1, ...:
    v'   = u - w h_n
    h_n+1= exp(c_last) h_n + k^T (exp(c_last - c) * v')
    o    = scale * (exp(c) * q h_n + (causal(q.k^T * exp(c_i - c_j))) v')

Pipeline (no host sync; every size comes from shapes):

0. Chunk table (a few torch ops on device): ``NR = T // 64 + B`` rows (the bound
   ``max_chunk_rows`` of ``_varlen.py``); row ``n`` = chunk ``n`` in request order, i.e. exactly
   the ``chunk_states`` row layout; extra rows are marked -1 and their programs do nothing.
1. ``_chunk_intra_kernel``, grid ``(NR, Hv)``: per (chunk, value head): the cumsum of ``g``
   (four 16-token sub-blocks), the key Gram matrix in 16x16 blocks (``tl.dot`` over ``K`` in
   blocks of ``BK``, in the input dtype: exact products for bf16/fp16), key norms from the same
   loads, ``A``, its inverse (exact fp32 forward substitution inside each 16x16 diagonal block
   in registers, then the block formula for the off-diagonal blocks, as fla's ``solve_tril``),
   then ``w`` and ``u``. Writes fp32 ``w [T, Hv, K]``, ``u [T, Hv, V]``, ``c [T, Hv]`` and the
   key inverse norms ``rk [T, Hv]``.
2. ``_chunk_state_kernel``, grid ``(B, Hv, cdiv(V, BV))``: the sequential pass. The state block
   ``[K, BV]`` (fp32, K padded to a power of two) stays in registers while the program walks
   its request's chunks: stores ``h_n`` (the chunk state, which IS ``chunk_states`` row
   ``chunk_row_offsets[b] + n`` when requested), overwrites ``u`` with ``v'``, updates the
   state, and finally writes it to the pool slot (cast to the pool dtype).
3. ``_chunk_output_kernel``, grid ``(NR, Hv, cdiv(V, BV))``: ``q h_n`` and ``q k^T`` over ``K``
   blocks (query norms from the same loads), the causal intra-chunk part, output in ``v.dtype``.

Padding requests (slot -1) and zero-length requests: nothing read or written, zero output
(``o`` is zero-initialised) and zero ``chunk_states`` rows.

Precision: fp32 everywhere; matmuls of derived fp32 operands use TF32x3 (near-fp32) when any
input is fp32 and TF32 when the inputs are bf16/fp16 (their error is far below bf16's).

Constraints: ``K <= 256`` (the state pass keeps a ``[K, BV]`` block in registers); any ``V``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._varlen import max_chunk_rows
from ..gdn import GDN_CHUNK_SIZE

_EPS = 1e-6
MAX_HEAD_K_DIM = 256

assert GDN_CHUNK_SIZE == 64, "the Triton chunk kernels are written for 64-token chunks"


# ----------------------------------------------------------------------------------------------
# device helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _inv_unit_lower16(A, n):
    """(I + A)^-1 of a strictly lower triangular [16, 16] fp32 tile, by forward substitution:
    row i of the inverse = e_i - A[i, :] @ inverse (rows < i are final already). The row product
    is a 16x16 matmul with only row i of the left operand non-zero, in exact fp32 ("ieee": FMA,
    no tensor-core rounding). Rows >= n of A are zero (past the chunk's end), so their inverse
    rows are identity rows and are not computed."""
    o = tl.arange(0, 16)
    eye = tl.where(o[:, None] == o[None, :], 1.0, 0.0)
    Ai = eye
    for i in range(1, tl.minimum(n, 16)):
        sel = o[:, None] == i
        prod = tl.dot(tl.where(sel, A, 0.0), Ai, input_precision="ieee")
        Ai = tl.where(sel, eye - prod, Ai)
    return Ai


@triton.jit
def _decay_block(G, bi, ri, ci, rj, cj, DIAG: tl.constexpr):
    """A block: G * (beta_i rk_i) rk_j exp(c_i - c_j); strictly lower part only on the diagonal."""
    o = tl.arange(0, 16)
    d = ci[:, None] - cj[None, :]
    if DIAG:
        low = o[:, None] > o[None, :]
        return tl.where(low, G * (bi * ri)[:, None] * rj[None, :] * tl.exp(tl.where(low, d, 0.0)), 0.0)
    else:
        return G * (bi * ri)[:, None] * rj[None, :] * tl.exp(d)


# ----------------------------------------------------------------------------------------------
# 1. intra-chunk: cumsum of g, A, (I + A)^-1, w, u
# ----------------------------------------------------------------------------------------------


@triton.jit
def _chunk_intra_kernel(
    k, v, g, beta, state_indices, chunk_req, chunk_start, chunk_len,
    w, u, gcum, rk,
    s_kt, s_kh, s_kd,
    s_vt, s_vh, s_vd,
    s_gt, s_gh,
    s_bt, s_bh,
    HV: tl.constexpr, R: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_L2: tl.constexpr, PREC: tl.constexpr, KPREC: tl.constexpr,
    RAW_K: tl.constexpr,
):
    i_r = tl.program_id(0)
    i_h = tl.program_id(1)
    i_hk = i_h // R
    req = tl.load(chunk_req + i_r)
    slot = tl.load(state_indices + tl.maximum(req, 0))
    if (req < 0) | (slot < 0):  # past the last chunk, or a padding request
        return
    start = tl.load(chunk_start + i_r).to(tl.int64)
    n = tl.load(chunk_len + i_r)

    o16 = tl.arange(0, 16)
    t1 = start + o16
    t2 = t1 + 16
    t3 = t1 + 32
    t4 = t1 + 48
    m1 = o16 < n
    m2 = (o16 + 16) < n
    m3 = (o16 + 32) < n
    m4 = (o16 + 48) < n

    # chunk-local cumulative log-decay (masked tail: g = 0, beta = 0)
    c1 = tl.cumsum(tl.load(g + t1 * s_gt + i_h * s_gh, mask=m1, other=0.0).to(tl.float32), 0)
    c2 = tl.cumsum(tl.load(g + t2 * s_gt + i_h * s_gh, mask=m2, other=0.0).to(tl.float32), 0)
    c3 = tl.cumsum(tl.load(g + t3 * s_gt + i_h * s_gh, mask=m3, other=0.0).to(tl.float32), 0)
    c4 = tl.cumsum(tl.load(g + t4 * s_gt + i_h * s_gh, mask=m4, other=0.0).to(tl.float32), 0)
    c2 += tl.sum(tl.where(o16 == 15, c1, 0.0), 0)
    c3 += tl.sum(tl.where(o16 == 15, c2, 0.0), 0)
    c4 += tl.sum(tl.where(o16 == 15, c3, 0.0), 0)
    b1 = tl.load(beta + t1 * s_bt + i_h * s_bh, mask=m1, other=0.0).to(tl.float32)
    b2 = tl.load(beta + t2 * s_bt + i_h * s_bh, mask=m2, other=0.0).to(tl.float32)
    b3 = tl.load(beta + t3 * s_bt + i_h * s_bh, mask=m3, other=0.0).to(tl.float32)
    b4 = tl.load(beta + t4 * s_bt + i_h * s_bh, mask=m4, other=0.0).to(tl.float32)

    # Gram matrix k k^T in 16x16 blocks (lower half), and the key norms
    G11 = tl.zeros([16, 16], dtype=tl.float32)
    G21 = tl.zeros([16, 16], dtype=tl.float32)
    G22 = tl.zeros([16, 16], dtype=tl.float32)
    G31 = tl.zeros([16, 16], dtype=tl.float32)
    G32 = tl.zeros([16, 16], dtype=tl.float32)
    G33 = tl.zeros([16, 16], dtype=tl.float32)
    G41 = tl.zeros([16, 16], dtype=tl.float32)
    G42 = tl.zeros([16, 16], dtype=tl.float32)
    G43 = tl.zeros([16, 16], dtype=tl.float32)
    G44 = tl.zeros([16, 16], dtype=tl.float32)
    ss1 = tl.zeros([16], dtype=tl.float32)
    ss2 = tl.zeros([16], dtype=tl.float32)
    ss3 = tl.zeros([16], dtype=tl.float32)
    ss4 = tl.zeros([16], dtype=tl.float32)
    p_k = k + i_hk * s_kh
    for kb in range(0, K, BK):
        o_k = kb + tl.arange(0, BK)
        mk = o_k < K
        k1 = tl.load(p_k + t1[:, None] * s_kt + o_k[None, :] * s_kd, mask=m1[:, None] & mk[None, :], other=0.0)
        k2 = tl.load(p_k + t2[:, None] * s_kt + o_k[None, :] * s_kd, mask=m2[:, None] & mk[None, :], other=0.0)
        k3 = tl.load(p_k + t3[:, None] * s_kt + o_k[None, :] * s_kd, mask=m3[:, None] & mk[None, :], other=0.0)
        k4 = tl.load(p_k + t4[:, None] * s_kt + o_k[None, :] * s_kd, mask=m4[:, None] & mk[None, :], other=0.0)
        if USE_L2:
            f1 = k1.to(tl.float32)
            f2 = k2.to(tl.float32)
            f3 = k3.to(tl.float32)
            f4 = k4.to(tl.float32)
            ss1 += tl.sum(f1 * f1, 1)
            ss2 += tl.sum(f2 * f2, 1)
            ss3 += tl.sum(f3 * f3, 1)
            ss4 += tl.sum(f4 * f4, 1)
        if not RAW_K:  # matmul in fp32 instead of the input dtype
            k1 = k1.to(tl.float32)
            k2 = k2.to(tl.float32)
            k3 = k3.to(tl.float32)
            k4 = k4.to(tl.float32)
        k1t = tl.trans(k1)
        k2t = tl.trans(k2)
        k3t = tl.trans(k3)
        G11 = tl.dot(k1, k1t, G11, input_precision=KPREC)
        G21 = tl.dot(k2, k1t, G21, input_precision=KPREC)
        G22 = tl.dot(k2, k2t, G22, input_precision=KPREC)
        G31 = tl.dot(k3, k1t, G31, input_precision=KPREC)
        G32 = tl.dot(k3, k2t, G32, input_precision=KPREC)
        G33 = tl.dot(k3, k3t, G33, input_precision=KPREC)
        G41 = tl.dot(k4, k1t, G41, input_precision=KPREC)
        G42 = tl.dot(k4, k2t, G42, input_precision=KPREC)
        G43 = tl.dot(k4, k3t, G43, input_precision=KPREC)
        G44 = tl.dot(k4, tl.trans(k4), G44, input_precision=KPREC)
    if USE_L2:
        r1 = tl.math.rsqrt(ss1 + 1e-6)
        r2 = tl.math.rsqrt(ss2 + 1e-6)
        r3 = tl.math.rsqrt(ss3 + 1e-6)
        r4 = tl.math.rsqrt(ss4 + 1e-6)
    else:
        r1 = tl.full([16], 1.0, tl.float32)
        r2 = tl.full([16], 1.0, tl.float32)
        r3 = tl.full([16], 1.0, tl.float32)
        r4 = tl.full([16], 1.0, tl.float32)

    # A (blocks of I + A below the diagonal are the A blocks themselves)
    A11 = _decay_block(G11, b1, r1, c1, r1, c1, True)
    A22 = _decay_block(G22, b2, r2, c2, r2, c2, True)
    A33 = _decay_block(G33, b3, r3, c3, r3, c3, True)
    A44 = _decay_block(G44, b4, r4, c4, r4, c4, True)
    A21 = _decay_block(G21, b2, r2, c2, r1, c1, False)
    A31 = _decay_block(G31, b3, r3, c3, r1, c1, False)
    A32 = _decay_block(G32, b3, r3, c3, r2, c2, False)
    A41 = _decay_block(G41, b4, r4, c4, r1, c1, False)
    A42 = _decay_block(G42, b4, r4, c4, r2, c2, False)
    A43 = _decay_block(G43, b4, r4, c4, r3, c3, False)

    # T = (I + A)^-1, block lower triangular: T_ii = inv(I + A_ii),
    # T_ij = -T_ii sum_{j <= m < i} A_im T_mj
    T11 = _inv_unit_lower16(A11, n - 0)
    T22 = _inv_unit_lower16(A22, n - 16)
    T33 = _inv_unit_lower16(A33, n - 32)
    T44 = _inv_unit_lower16(A44, n - 48)
    T21 = -tl.dot(T22, tl.dot(A21, T11, input_precision=PREC), input_precision=PREC)
    T32 = -tl.dot(T33, tl.dot(A32, T22, input_precision=PREC), input_precision=PREC)
    T43 = -tl.dot(T44, tl.dot(A43, T33, input_precision=PREC), input_precision=PREC)
    T31 = -tl.dot(T33, tl.dot(A32, T21, tl.dot(A31, T11, input_precision=PREC), input_precision=PREC),
                  input_precision=PREC)
    T42 = -tl.dot(T44, tl.dot(A43, T32, tl.dot(A42, T22, input_precision=PREC), input_precision=PREC),
                  input_precision=PREC)
    X41 = tl.dot(A41, T11, input_precision=PREC)
    X41 = tl.dot(A42, T21, X41, input_precision=PREC)
    X41 = tl.dot(A43, T31, X41, input_precision=PREC)
    T41 = -tl.dot(T44, X41, input_precision=PREC)

    # w = T (beta * rk * exp(c) * k_raw)
    e1 = b1 * r1 * tl.exp(c1)
    e2 = b2 * r2 * tl.exp(c2)
    e3 = b3 * r3 * tl.exp(c3)
    e4 = b4 * r4 * tl.exp(c4)
    for kb in range(0, K, BK):
        o_k = kb + tl.arange(0, BK)
        mk = o_k < K
        k1 = tl.load(p_k + t1[:, None] * s_kt + o_k[None, :] * s_kd, mask=m1[:, None] & mk[None, :], other=0.0)
        k2 = tl.load(p_k + t2[:, None] * s_kt + o_k[None, :] * s_kd, mask=m2[:, None] & mk[None, :], other=0.0)
        k3 = tl.load(p_k + t3[:, None] * s_kt + o_k[None, :] * s_kd, mask=m3[:, None] & mk[None, :], other=0.0)
        k4 = tl.load(p_k + t4[:, None] * s_kt + o_k[None, :] * s_kd, mask=m4[:, None] & mk[None, :], other=0.0)
        x1 = k1.to(tl.float32) * e1[:, None]
        x2 = k2.to(tl.float32) * e2[:, None]
        x3 = k3.to(tl.float32) * e3[:, None]
        x4 = k4.to(tl.float32) * e4[:, None]
        w1 = tl.dot(T11, x1, input_precision=PREC)
        w2 = tl.dot(T22, x2, tl.dot(T21, x1, input_precision=PREC), input_precision=PREC)
        w3 = tl.dot(T31, x1, input_precision=PREC)
        w3 = tl.dot(T32, x2, w3, input_precision=PREC)
        w3 = tl.dot(T33, x3, w3, input_precision=PREC)
        w4 = tl.dot(T41, x1, input_precision=PREC)
        w4 = tl.dot(T42, x2, w4, input_precision=PREC)
        w4 = tl.dot(T43, x3, w4, input_precision=PREC)
        w4 = tl.dot(T44, x4, w4, input_precision=PREC)
        p_w = w + i_h * K + o_k[None, :]
        tl.store(p_w + t1[:, None] * (HV * K), w1, mask=m1[:, None] & mk[None, :])
        tl.store(p_w + t2[:, None] * (HV * K), w2, mask=m2[:, None] & mk[None, :])
        tl.store(p_w + t3[:, None] * (HV * K), w3, mask=m3[:, None] & mk[None, :])
        tl.store(p_w + t4[:, None] * (HV * K), w4, mask=m4[:, None] & mk[None, :])

    # u = T (beta * v)
    p_v = v + i_h * s_vh
    for vb in range(0, V, BV):
        o_v = vb + tl.arange(0, BV)
        mv = o_v < V
        x1 = tl.load(p_v + t1[:, None] * s_vt + o_v[None, :] * s_vd, mask=m1[:, None] & mv[None, :], other=0.0)
        x2 = tl.load(p_v + t2[:, None] * s_vt + o_v[None, :] * s_vd, mask=m2[:, None] & mv[None, :], other=0.0)
        x3 = tl.load(p_v + t3[:, None] * s_vt + o_v[None, :] * s_vd, mask=m3[:, None] & mv[None, :], other=0.0)
        x4 = tl.load(p_v + t4[:, None] * s_vt + o_v[None, :] * s_vd, mask=m4[:, None] & mv[None, :], other=0.0)
        x1 = x1.to(tl.float32) * b1[:, None]
        x2 = x2.to(tl.float32) * b2[:, None]
        x3 = x3.to(tl.float32) * b3[:, None]
        x4 = x4.to(tl.float32) * b4[:, None]
        u1 = tl.dot(T11, x1, input_precision=PREC)
        u2 = tl.dot(T22, x2, tl.dot(T21, x1, input_precision=PREC), input_precision=PREC)
        u3 = tl.dot(T31, x1, input_precision=PREC)
        u3 = tl.dot(T32, x2, u3, input_precision=PREC)
        u3 = tl.dot(T33, x3, u3, input_precision=PREC)
        u4 = tl.dot(T41, x1, input_precision=PREC)
        u4 = tl.dot(T42, x2, u4, input_precision=PREC)
        u4 = tl.dot(T43, x3, u4, input_precision=PREC)
        u4 = tl.dot(T44, x4, u4, input_precision=PREC)
        p_u = u + i_h * V + o_v[None, :]
        tl.store(p_u + t1[:, None] * (HV * V), u1, mask=m1[:, None] & mv[None, :])
        tl.store(p_u + t2[:, None] * (HV * V), u2, mask=m2[:, None] & mv[None, :])
        tl.store(p_u + t3[:, None] * (HV * V), u3, mask=m3[:, None] & mv[None, :])
        tl.store(p_u + t4[:, None] * (HV * V), u4, mask=m4[:, None] & mv[None, :])

    tl.store(gcum + t1 * HV + i_h, c1, mask=m1)
    tl.store(gcum + t2 * HV + i_h, c2, mask=m2)
    tl.store(gcum + t3 * HV + i_h, c3, mask=m3)
    tl.store(gcum + t4 * HV + i_h, c4, mask=m4)
    tl.store(rk + t1 * HV + i_h, r1, mask=m1)
    tl.store(rk + t2 * HV + i_h, r2, mask=m2)
    tl.store(rk + t3 * HV + i_h, r3, mask=m3)
    tl.store(rk + t4 * HV + i_h, r4, mask=m4)


# ----------------------------------------------------------------------------------------------
# 2. inter-chunk state pass
# ----------------------------------------------------------------------------------------------


@triton.jit
def _chunk_state_kernel(
    k, w, u, gcum, rk, cu_seqlens, state_indices, has_init, chunk_off, pool, hbuf,
    s_kt, s_kh, s_kd,
    s_ps, s_ph, s_pk, s_pv,
    HV: tl.constexpr, R: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    KP: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    i_hk = i_h // R
    slot = tl.load(state_indices + i_b).to(tl.int64)
    bos = tl.load(cu_seqlens + i_b).to(tl.int64)
    eos = tl.load(cu_seqlens + i_b + 1).to(tl.int64)
    length = tl.where(slot >= 0, eos - bos, 0)
    n_chunks = (length + 63) // 64
    init = (tl.load(has_init + i_b) != 0) & (slot >= 0)
    row0 = tl.load(chunk_off + i_b).to(tl.int64)

    o_k = tl.arange(0, KP)
    o_v = i_v * BV + tl.arange(0, BV)
    mk = o_k < K
    mv = o_v < V
    m_h = mk[:, None] & mv[None, :]
    p_pool = pool + tl.maximum(slot, 0) * s_ps + i_h * s_ph + o_k[:, None] * s_pk + o_v[None, :] * s_pv
    k_init = tl.where(init, K, 0)
    S = tl.load(p_pool, mask=(o_k[:, None] < k_init) & mv[None, :], other=0.0).to(tl.float32)

    o_t = tl.arange(0, 64)
    p_k = k + i_hk * s_kh + o_k[:, None] * s_kd
    for j in range(n_chunks):
        row = row0 + j
        tl.store(hbuf + (row * HV + i_h) * (K * V) + o_k[:, None] * V + o_v[None, :], S, mask=m_h)
        t = bos + j * 64 + o_t
        mt = (j * 64 + o_t) < length
        b_w = tl.load(w + (t[:, None] * HV + i_h) * K + o_k[None, :], mask=mt[:, None] & mk[None, :], other=0.0)
        p_u = u + (t[:, None] * HV + i_h) * V + o_v[None, :]
        b_u = tl.load(p_u, mask=mt[:, None] & mv[None, :], other=0.0)
        vn = b_u - tl.dot(b_w, S, input_precision=PREC)
        tl.store(p_u, vn, mask=mt[:, None] & mv[None, :])
        last = tl.minimum(j * 64 + 64, length) - 1
        c_last = tl.load(gcum + (bos + last) * HV + i_h)
        c = tl.load(gcum + t * HV + i_h, mask=mt, other=0.0)
        r_k = tl.load(rk + t * HV + i_h, mask=mt, other=0.0)
        vs = vn * tl.where(mt, tl.exp(c_last - c) * r_k, 0.0)[:, None]
        kt = tl.load(p_k + t[None, :] * s_kt, mask=mk[:, None] & mt[None, :], other=0.0).to(tl.float32)
        S = S * tl.exp(c_last) + tl.dot(kt, vs, input_precision=PREC)

    k_fin = tl.where(length > 0, K, 0)
    tl.store(p_pool, S.to(pool.dtype.element_ty), mask=(o_k[:, None] < k_fin) & mv[None, :])


# ----------------------------------------------------------------------------------------------
# 3. output
# ----------------------------------------------------------------------------------------------


@triton.jit
def _chunk_output_kernel(
    q, k, u, gcum, rk, hbuf, state_indices, chunk_req, chunk_start, chunk_len, o, scale,
    s_qt, s_qh, s_qd,
    s_kt, s_kh, s_kd,
    s_ot, s_oh, s_od,
    HV: tl.constexpr, R: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_L2: tl.constexpr, RAW_QK: tl.constexpr, PREC: tl.constexpr,
    QKPREC: tl.constexpr,
):
    i_r = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    i_hk = i_h // R
    req = tl.load(chunk_req + i_r)
    slot = tl.load(state_indices + tl.maximum(req, 0))
    if (req < 0) | (slot < 0):  # past the last chunk, or a padding request (o stays zero)
        return
    start = tl.load(chunk_start + i_r).to(tl.int64)
    n = tl.load(chunk_len + i_r)

    o_t = tl.arange(0, 64)
    t = start + o_t
    mt = o_t < n
    o_v = i_v * BV + tl.arange(0, BV)
    mv = o_v < V

    acc = tl.zeros([64, BV], dtype=tl.float32)
    qk = tl.zeros([64, 64], dtype=tl.float32)
    ss = tl.zeros([64], dtype=tl.float32)
    p_q = q + i_hk * s_qh + t[:, None] * s_qt
    p_k = k + i_hk * s_kh + t[:, None] * s_kt
    p_h = hbuf + (i_r.to(tl.int64) * HV + i_h) * (K * V) + o_v[None, :]
    for kb in range(0, K, BK):
        o_k = kb + tl.arange(0, BK)
        mk = o_k < K
        b_q = tl.load(p_q + o_k[None, :] * s_qd, mask=mt[:, None] & mk[None, :], other=0.0)
        b_k = tl.load(p_k + o_k[None, :] * s_kd, mask=mt[:, None] & mk[None, :], other=0.0)
        b_h = tl.load(p_h + o_k[:, None] * V, mask=mk[:, None] & mv[None, :], other=0.0)
        f_q = b_q.to(tl.float32)
        if USE_L2:
            ss += tl.sum(f_q * f_q, 1)
        acc = tl.dot(f_q, b_h, acc, input_precision=PREC)
        if RAW_QK:
            qk = tl.dot(b_q, tl.trans(b_k), qk, input_precision=QKPREC)
        else:
            qk = tl.dot(f_q, tl.trans(b_k.to(tl.float32)), qk, input_precision=PREC)

    c = tl.load(gcum + t * HV + i_h, mask=mt, other=0.0)
    r_k = tl.load(rk + t * HV + i_h, mask=mt, other=0.0)
    causal = (o_t[:, None] >= o_t[None, :]) & mt[:, None]  # rows past the end: no exp overflow
    P = tl.where(causal, qk * r_k[None, :] * tl.exp(tl.where(causal, c[:, None] - c[None, :], 0.0)), 0.0)
    vn = tl.load(u + (t[:, None] * HV + i_h) * V + o_v[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
    out = tl.dot(P, vn, acc * tl.exp(c)[:, None], input_precision=PREC)
    if USE_L2:
        out = out * (tl.math.rsqrt(ss + 1e-6) * scale)[:, None]
    else:
        out = out * scale
    tl.store(o + t[:, None] * s_ot + i_h * s_oh + o_v[None, :] * s_od, out.to(o.dtype.element_ty),
             mask=mt[:, None] & mv[None, :])


# ----------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------


def _raw_dot(t: torch.Tensor) -> bool:
    """Whether matmuls may take this input's dtype as is. Off the GPU (Triton's interpreter, whose
    bf16 matmul is wrong) bf16/fp16 operands are cast to fp32 first (exact: same products)."""
    return t.dtype == torch.float32 or t.device.type == "cuda"


def _dot_precision(*tensors: torch.Tensor) -> str:
    """TF32x3 (about fp32 accuracy) when any input is fp32, else TF32. Used for matmuls of fp32
    operands; for bf16/fp16 operands "tf32" is Triton's default and means the native MMA."""
    return "tf32x3" if any(t.dtype == torch.float32 for t in tensors) else "tf32"


def _chunk_table(cu_seqlens: torch.Tensor, num_rows: int, chunk: int):
    """Chunk table on device: for each of ``num_rows`` rows (chunk-state row layout of
    ``_varlen.py``) its request (-1 past the last chunk), first token and length, plus each
    request's first row. Torch ops only, no host sync."""
    cu = cu_seqlens.to(torch.int64)
    batch = cu.numel() - 1
    lens = cu[1:] - cu[:-1]
    n_chunks = (lens + chunk - 1) // chunk
    ends = torch.cumsum(n_chunks, 0)
    first_row = ends - n_chunks
    rows = torch.arange(num_rows, device=cu.device, dtype=torch.int64)
    req = torch.searchsorted(ends, rows, right=True)
    valid = req < batch
    req_c = req.clamp(max=batch - 1)
    start = cu[req_c] + (rows - first_row[req_c]) * chunk
    length = (cu[req_c + 1] - start).clamp(min=0, max=chunk)
    req = torch.where(valid, req, torch.full_like(req, -1))
    return req.to(torch.int32), start, length.to(torch.int32), first_row


def chunk_gated_delta_rule_triton(
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
    """Triton implementation of ``chunk_gated_delta_rule`` (same arguments, same results; mutates
    ``ssm_states``). No host sync: the chunk table is built on device."""
    T, hk, kd = q.shape
    hv, vd = v.shape[1], v.shape[2]
    if kd > MAX_HEAD_K_DIM:
        raise ValueError(f"chunk_gated_delta_rule (Triton): head_k_dim {kd} > {MAX_HEAD_K_DIM} is not supported")
    C = GDN_CHUNK_SIZE
    batch = state_indices.shape[0]
    dev = v.device
    n_rows = max_chunk_rows(T, batch, C)
    o = torch.zeros(T, hv, vd, dtype=v.dtype, device=dev)
    chunk_states = torch.zeros(n_rows if output_chunk_states else 0, hv, kd, vd, dtype=torch.float32, device=dev)
    if T == 0 or batch == 0:
        return o, chunk_states
    scale = float(scale) if scale > 0 else float(kd) ** -0.5
    r = hv // hk

    chunk_req, chunk_start, chunk_len, first_row = _chunk_table(cu_seqlens, n_rows, C)
    hbuf = chunk_states if output_chunk_states else torch.empty(n_rows, hv, kd, vd, dtype=torch.float32, device=dev)
    w = torch.empty(T, hv, kd, dtype=torch.float32, device=dev)
    u = torch.empty(T, hv, vd, dtype=torch.float32, device=dev)
    gcum = torch.empty(T, hv, dtype=torch.float32, device=dev)
    rk = torch.empty(T, hv, dtype=torch.float32, device=dev)
    init = has_initial_state.to(torch.int32)

    # tl.dot needs every block dim >= 16
    kp = max(triton.next_power_of_2(kd), 16)
    vp = max(triton.next_power_of_2(vd), 16)
    bk = min(kp, 64)
    prec = _dot_precision(q, k, v)

    bv_intra = min(vp, 64)
    _chunk_intra_kernel[(n_rows, hv)](
        k, v, g, beta, state_indices, chunk_req, chunk_start, chunk_len,
        w, u, gcum, rk,
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        g.stride(0), g.stride(1),
        beta.stride(0), beta.stride(1),
        HV=hv, R=r, K=kd, V=vd, BK=bk, BV=bv_intra, USE_L2=bool(use_qk_l2norm), PREC=prec,
        KPREC=_dot_precision(k), RAW_K=_raw_dot(k), num_warps=4,
    )

    bv_state = 64 if kp <= 64 else (32 if kp <= 128 else 16)
    bv_state = min(bv_state, vp)
    _chunk_state_kernel[(batch, hv, triton.cdiv(vd, bv_state))](
        k, w, u, gcum, rk, cu_seqlens, state_indices, init, first_row, ssm_states, hbuf,
        k.stride(0), k.stride(1), k.stride(2),
        ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2), ssm_states.stride(3),
        HV=hv, R=r, K=kd, V=vd, KP=kp, BV=bv_state, PREC=prec,
        num_warps=4 if kp <= 64 else 8,
    )

    bv_out = min(vp, 64)
    _chunk_output_kernel[(n_rows, hv, triton.cdiv(vd, bv_out))](
        q, k, u, gcum, rk, hbuf, state_indices, chunk_req, chunk_start, chunk_len, o, scale,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        HV=hv, R=r, K=kd, V=vd, BK=bk, BV=bv_out, USE_L2=bool(use_qk_l2norm),
        RAW_QK=q.dtype == k.dtype and _raw_dot(q), PREC=prec, QKPREC=_dot_precision(q),
        num_warps=4,
    )
    return o, chunk_states
