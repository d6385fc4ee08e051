"""Triton kernels of the chunked Gated DeltaNet prefill (``chunk_gated_delta_rule``), for a per-head
gate ``g [T, Hv]`` (Gated DeltaNet) or a per-channel one ``g [T, Hv, K]`` (Kimi Delta Attention).

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

Per-channel gate (constexpr ``GATE_K``): ``c [C, K]`` holds one cumsum per key channel, every
``exp(c_i - c_j)`` above sits inside the sum over K, ``exp(c)`` / ``exp(c_last - c)`` multiply the
keys / queries channel-wise and ``exp(c_last)`` the state's rows::

    A    = strictly_lower(beta_i * sum_k k_ik k_jk exp(c_ik - c_jk))
    P    = causal(sum_k q_ik k_jk exp(c_ik - c_jk))
    w    = T (beta * exp(c) * k),  u = T (beta * v)
    h_n+1= diag(exp(c_last)) h_n + (exp(c_last - c) * k)^T v'
    o    = scale * ((exp(c) * q) h_n + P v')

The decay has no lower bound (transformers' ``KimiLinearForgetGate``), so ``exp(-c)`` is never
formed. Per (chunk, value head), where every channel's cumsum falls by at most
``CONFIG["kda_gram_range"]`` (128) over the chunk, ``A`` and ``P`` are two chunk-wide 64x64 MMAs
with the decay split at each channel's mid value (``_chunk_kda_gram_kernel``: factors within
``e^+-64``, fp32 operands at TF32 / TF32x3); a steeper chunk is flagged and built in 16x16 blocks
as follows. An off-diagonal 16x16 block (rows I > columns J) of A / P is an MMA of
``k_I exp(c_I - c_ref)`` (or ``q_I ...``) and ``(k_J exp(c_ref - c_J))^T`` with ``c_ref`` the cumsum
at the row before block I (both factors ``<= 1``, ``c`` being non-increasing: ``g <= 0``). A
diagonal block is an MMA too where, per K block, every channel's cumsum falls by at most
``CONFIG["kda_intra_mma_range"]`` (64) from the row before the block to its last row, split at the
channel's mid value (factors within ``e^+-32``; see
``_diag_gram``), else four MMAs bisecting the block with every exponent ``<= 0``. The key
side (A, its inverse, w, u, ``kg = exp(c_last - c) k``, ``exp(c_last)`` per chunk row) and the query
side (``P`` in rows of 64 with the key norms applied, the query norms, the decayed queries
``qg = exp(c) q``) run in two programs of the intra kernel (``program_id(2)``), ten 16x16
accumulators each: in one program they spilled heavily. ``qg`` / ``kg`` are unnormalised (the
norms stay per-row factors); the state kernel takes ``kg`` for ``k`` and the output kernel ``qg``
and ``P`` in place of its own ``q.k^T``.

Pipeline (no host sync, no torch work besides the allocations; every size comes from shapes).
Chunk rows: ``NR = T // 64 + B`` (the bound ``max_chunk_rows`` of ``_varlen.py``); row ``n`` =
chunk ``n`` in request order, i.e. exactly the ``chunk_states`` row layout. Each program finds
its request, first token and length from ``cu_seqlens`` itself (``_locate_row``); rows past the
last chunk do nothing.

0. Per-channel gate only: ``_chunk_kda_prep_kernel``, grid ``(NR, Hv)``: the chunk-local cumsum of
   ``g`` in log2 units (``gc [T, Hv, K]``, fp32) and the key / query inverse norms; then
   ``_chunk_kda_gram_kernel``, grid ``(NR, Hv)``: the chunk-wide ``A`` (to a scratch ``[T, Hv, 64]``)
   and ``P``, ``qg``, ``kg``, ``exp(c_last)`` of the chunks within range, and ``steep[row, head]``.
1. ``_chunk_intra_kernel``, grid ``(NR, Hv)`` (per-channel gate: launched twice, the ``CHUNK_WIDE``
   compile over ``(NR, Hv)`` solving the gram kernel's chunks from its ``A``, and the block compile
   over ``(NR, Hv, 2)``, the key and the query side of the steep chunks): per (chunk, value head): the cumsum of ``g`` (four 16-token sub-blocks), the key Gram matrix in 16x16 blocks (``tl.dot`` over ``K`` in
   blocks of ``BK``, in the input dtype: exact products for bf16/fp16), key norms from the same
   loads, ``A``, its inverse (exact fp32 forward substitution of the four 16x16 diagonal blocks
   at once, as one [4, 16, 16] tensor, then the block formula for the off-diagonal blocks, as
   fla's ``solve_tril``), then ``w`` and ``u``. Writes ``w [T, Hv, K]``, ``u [T, Hv, V]``,
   ``c [T, Hv]`` and the key inverse norms ``rk [T, Hv]``. Per-channel gate: the cumsum and norms
   are the prep kernel's; the block compile writes the extras above (``P``, ``qg``, ``kg``,
   ``exp(c_last)``) of the steep chunks, in K blocks of ``CONFIG["kda_intra_bk"]``.
2. ``_chunk_state_kernel``, grid ``(B, Hv, cdiv(V, BV))``: the sequential pass. The state block
   ``[K, BV]`` (fp32, K padded to a power of two) stays in registers while the program walks
   its request's chunks (the next chunks' loads in flight, Triton's software pipelining): stores
   ``h_n`` (the output kernel's copy; ``chunk_states`` row ``chunk_row_offsets[b] + n`` when
   requested), writes ``v'``, updates the state, and finally writes it to the pool slot (cast
   to the pool dtype).
3. ``_chunk_output_kernel``, grid ``(NR, Hv, cdiv(V, BV))``: ``q h_n`` and ``q k^T`` over ``K``
   blocks (query norms from the same loads), the causal intra-chunk part, output in ``v.dtype``
   (zeros for the rows of a padding request, so ``o`` needs no zero fill).

Padding requests (slot -1) and zero-length requests: nothing read or written, zero output and
zero ``chunk_states`` rows.

Precision. fp32 inputs (any of q/k/v): fp32 everywhere; matmuls of derived fp32 operands use
TF32x3 (near-fp32). bf16 q/k/v (``CONFIG["lowp"]``, as flash-linear-attention): the recurrent
state, every sum and ``c``/``beta``/``u`` stay fp32, the inverse ``T`` and its products are
TF32, and the operands of the large matmuls are bf16 (native MMA, fp32 accumulation): ``w``,
``v'`` and the output kernel's copy of ``h_n`` are stored in bf16, and ``h_n`` / ``v'`` /
``exp(c_last - c) v'`` / the causal ``q.k^T`` block are rounded to bf16 as matmul operands.
Measured on H100 at 32k tokens: output error (relative norm, vs fp32 inputs) 2.9e-3 against
2.0e-3 for all-fp32 intermediates (bf16 output rounding alone is about 2e-3), final-state error
1.7e-3 against 0.8e-3. ``chunk_states`` stay fp32 (the exact recurrent state). fp16 inputs take
the fp32 path. Per-channel gate, bf16: also the A / P MMA operands (the diagonal blocks' too where
they take the MMAs), ``qg`` / ``kg`` and ``P`` are bf16; under the
interpreter at tiny shapes its errors match the per-head path's (not yet measured on the GPU).

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
def _stack4(a, b, c, d):
    """[4, 16, 16] from four [16, 16] tiles (index 0 = a, ..., 3 = d)."""
    ab = tl.permute(tl.join(a, b), (2, 0, 1))
    cd = tl.permute(tl.join(c, d), (2, 0, 1))
    x = tl.permute(tl.join(ab, cd), (3, 0, 1, 2))  # [2, 2, 16, 16]: [0, 0] = a, [0, 1] = b, [1, 0] = c
    return tl.reshape(x, (4, 16, 16))


@triton.jit
def _unstack4(x):
    """Inverse of ``_stack4``."""
    y = tl.permute(tl.reshape(x, (2, 2, 16, 16)), (1, 2, 3, 0))  # [2, 16, 16, 2]: [i, .., .., j] = x[2j + i]
    ab, cd = tl.split(y)
    a, b = tl.split(tl.permute(ab, (1, 2, 0)))
    c, d = tl.split(tl.permute(cd, (1, 2, 0)))
    return a, b, c, d


@triton.jit
def _inv_unit_lower16x4(A, n):
    """(I + A_b)^-1 of four strictly lower triangular [16, 16] fp32 tiles at once (``A`` [4, 16, 16],
    tile b = rows 16b.. of the chunk), by forward substitution in exact fp32: row i of each inverse
    = e_i - A_b[i, :] @ inverse_b (rows < i are final). Rows past the chunk's end are zero in A, so
    their inverse rows stay identity rows; no row at or past ``n`` needs computing."""
    r = tl.arange(0, 16)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    Ai = tl.zeros([4, 16, 16], dtype=tl.float32) + eye[None, :, :]
    r3 = r[None, :, None]
    for i in range(1, tl.minimum(n, 16)):
        sel = r3 == i
        a_i = tl.sum(tl.where(sel, A, 0.0), 1)  # [4, 16]: row i of each tile
        row = tl.where(r[None, :] == i, 1.0, 0.0) - tl.sum(a_i[:, :, None] * Ai, 1)
        Ai = tl.where(sel, row[:, None, :], Ai)
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


@triton.jit
def _locate_row(cu_seqlens, nb, i_r, BB: tl.constexpr):
    """(request, first token, length) of chunk-state row ``i_r`` (the row layout of ``_varlen.py``:
    each request's ``ceil(len / 64)`` chunks in request order); request -1 past the last chunk.
    Reads ``cu_seqlens`` in blocks of ``BB`` requests (no chunk table, no host work)."""
    zero = i_r * 0
    acc = zero  # rows of the requests before this block
    req = zero - 1
    n = zero
    start = zero.to(tl.int64)
    for b0 in range(0, nb, BB):
        ob = b0 + tl.arange(0, BB)
        mb = ob < nb
        lo = tl.load(cu_seqlens + ob, mask=mb, other=0).to(tl.int64)
        hi = tl.load(cu_seqlens + ob + 1, mask=mb, other=0).to(tl.int64)
        nc = ((hi - lo + 63) // 64).to(tl.int32)
        end = acc + tl.cumsum(nc, 0)
        beg = end - nc
        hit = (i_r >= beg) & (i_r < end)
        s = lo + (i_r - beg).to(tl.int64) * 64
        req += tl.sum(tl.where(hit, ob + 1, 0), 0)
        start += tl.sum(tl.where(hit, s, 0), 0)
        n += tl.sum(tl.where(hit, tl.minimum(hi - s, 64).to(tl.int32), 0), 0)
        acc += tl.sum(nc, 0)
    return req, start, n


@triton.jit
def _live_row(cu_seqlens, nb, state_indices, i_r, BB: tl.constexpr):
    """``(live, first token, length)`` of chunk-state row ``i_r`` (``_locate_row``); ``live`` is false
    past the last chunk and for a padding request (slot -1): the row's program has nothing to do."""
    req, start, n = _locate_row(cu_seqlens, nb, i_r, BB)
    slot = tl.load(state_indices + tl.maximum(req, 0))
    return (req >= 0) & (slot >= 0), start, n


@triton.jit
def _rows_before(cu_seqlens, i_b, BB: tl.constexpr):
    """First chunk-state row of request ``i_b``: sum of ``ceil(len / 64)`` over the requests before it."""
    acc = i_b * 0
    for b0 in range(0, i_b, BB):
        ob = b0 + tl.arange(0, BB)
        mb = ob < i_b
        lo = tl.load(cu_seqlens + ob, mask=mb, other=0).to(tl.int64)
        hi = tl.load(cu_seqlens + ob + 1, mask=mb, other=0).to(tl.int64)
        acc += tl.sum(((hi - lo + 63) // 64).to(tl.int32), 0)
    return acc


@triton.jit
def _beta_block(G, bi, ri, rj, DIAG: tl.constexpr):
    """A block from an already decay-weighted Gram block (per-channel gate): G * (beta_i rk_i) rk_j;
    strictly lower part only on the diagonal."""
    o = tl.arange(0, 16)
    A = G * (bi * ri)[:, None] * rj[None, :]
    if DIAG:
        A = tl.where(o[:, None] > o[None, :], A, 0.0)
    return A


@triton.jit
def _lower_blocks_zeros():
    """Zero fp32 accumulators for the 10 lower 16x16 blocks of a [64, 64] chunk matrix."""
    z = tl.zeros([16, 16], dtype=tl.float32)
    return z, z, z, z, z, z, z, z, z, z


@triton.jit
def _row_sums_zeros():
    """Zero fp32 row accumulators of the four 16-row blocks of a 64-row chunk."""
    z = tl.zeros([16], dtype=tl.float32)
    return z, z, z, z


@triton.jit
def _load4(p, t1, t2, t3, t4, s_t, o_c, s_c, m1, m2, m3, m4, mc):
    """The four 16-row tiles ``[16, BC]`` (fp32) of a chunk: rows ``t1`` .. ``t4``, columns ``o_c``."""
    x1 = tl.load(p + t1[:, None] * s_t + o_c[None, :] * s_c, mask=m1[:, None] & mc[None, :], other=0.0).to(tl.float32)
    x2 = tl.load(p + t2[:, None] * s_t + o_c[None, :] * s_c, mask=m2[:, None] & mc[None, :], other=0.0).to(tl.float32)
    x3 = tl.load(p + t3[:, None] * s_t + o_c[None, :] * s_c, mask=m3[:, None] & mc[None, :], other=0.0).to(tl.float32)
    x4 = tl.load(p + t4[:, None] * s_t + o_c[None, :] * s_c, mask=m4[:, None] & mc[None, :], other=0.0).to(tl.float32)
    return x1, x2, x3, x4


@triton.jit
def _store4(p, t1, t2, t3, t4, s_t, o_c, x1, x2, x3, x4, m1, m2, m3, m4, mc):
    """Stores four 16-row tiles (cast to ``p``'s dtype) at rows ``t1`` .. ``t4``, unit-stride columns ``o_c``."""
    ty = p.dtype.element_ty
    pc = p + o_c[None, :]
    tl.store(pc + t1[:, None] * s_t, x1.to(ty), mask=m1[:, None] & mc[None, :])
    tl.store(pc + t2[:, None] * s_t, x2.to(ty), mask=m2[:, None] & mc[None, :])
    tl.store(pc + t3[:, None] * s_t, x3.to(ty), mask=m3[:, None] & mc[None, :])
    tl.store(pc + t4[:, None] * s_t, x4.to(ty), mask=m4[:, None] & mc[None, :])


@triton.jit
def _gate_tiles(p_c, start, n, t1, t2, t3, t4, s_t, o_c, s_c, m1, m2, m3, m4, mc):
    """The four 16-row tiles of a chunk's per-channel cumulative gate (log2 units, from
    ``_chunk_kda_prep_kernel``) and each tile's last cumsum ``e1`` .. ``e4`` (rows past the chunk's
    end ``n`` read the last token's: ``g = 0`` there, so no factor ``exp2(c - e)`` of them exceeds 1).
    ``start``: the chunk's first token (``t1 = start + 0..15``)."""
    p = p_c + o_c * s_c
    e1 = tl.load(p + (start + tl.minimum(15, n - 1)) * s_t, mask=mc, other=0.0)
    e2 = tl.load(p + (start + tl.minimum(31, n - 1)) * s_t, mask=mc, other=0.0)
    e3 = tl.load(p + (start + tl.minimum(47, n - 1)) * s_t, mask=mc, other=0.0)
    e4 = tl.load(p + (start + tl.minimum(63, n - 1)) * s_t, mask=mc, other=0.0)
    c1, c2, c3, c4 = _load4(p_c, t1, t2, t3, t4, s_t, o_c, s_c, m1, m2, m3, m4, mc)
    c1 = tl.where(m1[:, None], c1, e1[None, :])
    c2 = tl.where(m2[:, None], c2, e2[None, :])
    c3 = tl.where(m3[:, None], c3, e3[None, :])
    c4 = tl.where(m4[:, None], c4, e4[None, :])
    return c1, c2, c3, c4, e1, e2, e3, e4


@triton.jit
def _mma(a, b, acc, LOWP: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr):
    """``acc + a @ b`` of fp32 operands: rounded to bf16 (native MMA, fp32 accumulation) on the
    low-precision path (under the interpreter the rounded values multiply in fp32: same products),
    else fp32 at ``PREC``."""
    if LOWP:
        if DOT_F32:
            r = tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32), acc, input_precision=PREC)
        else:
            r = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    else:
        r = tl.dot(a, b, acc, input_precision=PREC)
    return r


@triton.jit
def _bisect_level(xf, kf, c, G, S: tl.constexpr, PREC: tl.constexpr):
    """One level of ``_diag_gram_bisect``: the pairs (row in the upper, column in the lower half of
    a ``2S``-row group), decay split at the group's middle row."""
    o = tl.arange(0, 16)
    mid = (o // (2 * S)) * (2 * S) + S - 1  # the last row of each row's group's lower half
    r = tl.gather(c, tl.broadcast_to(mid[:, None], c.shape), 0)
    upper = ((o // S) % 2 == 1)[:, None]
    rows = xf * tl.exp2(tl.where(upper, c - r, float("-inf")))
    cols = kf * tl.exp2(tl.where(upper, float("-inf"), r - c))
    ii = o[:, None]
    jj = o[None, :]
    pairs = (ii // (2 * S) == jj // (2 * S)) & ((ii // S) % 2 == 1) & ((jj // S) % 2 == 0)
    X = tl.dot(rows, tl.trans(cols), input_precision=PREC)
    return G + tl.where(pairs, X, 0.0)


@triton.jit
def _diag_gram_bisect(xf, kf, c, G, PREC: tl.constexpr):
    """Accumulates a diagonal 16x16 block of ``sum_k x_ik k_jk 2^(c_ik - c_jk)`` (``x`` keys or
    queries, ``c`` the cumsum in log2 units) for ``i >= j`` (zero above) as four MMAs whose decay
    factors are all ``<= 1``, for any decay: every pair ``i > j`` is split by exactly one level ``s``
    (8, 4, 2, 1) of halving the block, where ``i`` lies in the upper half and ``j`` in the lower half
    of one ``2s``-row group; with ``r`` the cumsum at the group's middle (row ``m - 1``, ``m`` the upper
    half's first row), ``2^(c_i - c_j) = 2^(c_i - r) 2^(r - c_j)`` and both exponents are ``<= 0``
    (``c`` non-increasing). The level's MMA is masked to its pairs; the diagonal ``i = j`` (exponent
    0) is an elementwise sum. Diagonal-block MMAs take fp32 operands at ``PREC`` (TF32 for bf16
    inputs, TF32x3 for fp32): bf16 operands here raised the bf16 output error by a third."""
    G = _bisect_level(xf, kf, c, G, 8, PREC)
    G = _bisect_level(xf, kf, c, G, 4, PREC)
    G = _bisect_level(xf, kf, c, G, 2, PREC)
    G = _bisect_level(xf, kf, c, G, 1, PREC)
    o = tl.arange(0, 16)
    return G + tl.where(o[:, None] == o[None, :], tl.sum(xf * kf, 1)[:, None], 0.0)


@triton.jit
def _diag_gram(xr, kc, xf, kf, c, top, bot, G, MMA_RANGE: tl.constexpr, PREC: tl.constexpr):
    """Accumulates a diagonal 16x16 block of ``sum_k x_ik k_jk 2^(c_ik - c_jk)`` (``x`` keys or
    queries, ``c`` the cumsum in log2 units; rows ``i >= j`` meaningful, the entries above are finite
    and masked by the readers). ``c`` being non-increasing, the block's cumsums lie in ``[bot, top]``
    (``top`` the cumsum at the row before the block, ``bot`` at its last row), and the shared factors
    are ``xr = x 2^(c - top)``, ``kc = k 2^(bot - c)`` (both ``<= 1``). When ``D = top - bot`` is at most
    ``MMA_RANGE`` (natural-log units) on every channel: one MMA with the decay split at the channel's
    mid value, ``2^(c_i - c_j) = (2^(c_i - top) 2^(D/2)) (2^(D/2) 2^(bot - c_j))``, both factors in
    ``[e^(-D/2), e^(D/2)]``. With ``MMA_RANGE = 64`` (the default) that is ``e^+-32``: no factor times a raw
    q / k below ``1e24`` overflows, none above ``1e-24`` reaches fp32's subnormals, and even the
    discarded entries above the diagonal (``<= e^64``) stay finite. Otherwise (on some channel a decay
    steeper than ``MMA_RANGE / 16`` per token on average) ``_diag_gram_bisect`` on the raw ``xf`` /
    ``kf``: four MMAs with every factor ``<= 1``, for any decay."""
    d = top - bot
    if tl.max(d, 0) <= MMA_RANGE * 1.4426950408889634:
        half = tl.exp2(d * 0.5)[None, :]
        G = tl.dot(xr * half, tl.trans(kc * half), G, input_precision=PREC)
    else:
        G = _diag_gram_bisect(xf, kf, c, G, PREC)
    return G


@triton.jit
def _kda_gram_pass(p_x, s_xt, s_xd, p_k, s_kt, s_kd, p_c, s_ct, s_ck, out, p_glast, start, n,
                   t1, t2, t3, t4, m1, m2, m3, m4, p_idx, nch, p_part,
                   HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                   QUERIES: tl.constexpr, MMA_RANGE: tl.constexpr, LOWP: tl.constexpr, DOT_F32: tl.constexpr,
                   PREC: tl.constexpr, SPLIT: tl.constexpr):
    """One side of the per-channel-gate chunk products, over ``K`` in blocks of ``BK``: the 10 lower
    16x16 blocks of ``sum_k x_ik k_jk exp(c_ik - c_jk)`` with ``x`` the keys (``QUERIES`` off: the
    ``A`` side; stores ``kg = exp(c_last - c) k`` to ``out`` and ``exp(c_last)`` to ``p_glast``) or
    the queries (``QUERIES`` on: the ``P`` side; stores ``qg = exp(c) q`` to ``out``), of the raw
    (unnormalised) keys and queries. Each side runs in its own program, so only 10 accumulators are
    live (both sides in one program spilled heavily).

    ``p_c``: the chunk-local cumsum in log2 units. Per K block, eight exponential tiles serve every
    product: with ``e_0 = 0`` and ``e_I`` the cumsum at block ``I``'s last row, the row factors
    ``R_I = 2^(c_I - e_(I-1))`` and the column factors ``C_J = 2^(e_J - c_J)`` (all ``<= 1``); an
    off-diagonal block ``I > J`` is the MMA of ``x_I R_I 2^(e_(I-1) - e_J)`` (a per-channel vector,
    ``<= 1``, and 1 for ``J = I - 1``) and ``(k_J C_J)^T``, a diagonal one ``_diag_gram``'s, and the
    stored ``qg`` / ``kg`` are ``x_I R_I 2^(e_(I-1))`` / ``k_J C_J 2^(e_4 - e_J)``.

    ``SPLIT`` (``CONFIG["kda_split_channels"]``): only the ``nch`` channels listed at ``p_idx`` (the
    chunk's steep ones), the sums starting from the other channels' (``p_part``, rows of 64, raw:
    ``_chunk_kda_gram_kernel``'s chunk-wide MMAs) unless every channel is listed."""
    if SPLIT:
        if nch < K:
            X11, X21, X22, X31, X32, X33, X41, X42, X43, X44 = _load_lower_blocks(
                p_part, t1, t2, t3, t4, m1, m2, m3, m4, HV)
        else:
            X11, X21, X22, X31, X32, X33, X41, X42, X43, X44 = _lower_blocks_zeros()
        kend = nch
    else:
        X11, X21, X22, X31, X32, X33, X41, X42, X43, X44 = _lower_blocks_zeros()
        kend = K
    for kb in range(0, kend, BK):
        if SPLIT:  # the listed channels, gathered
            j = kb + tl.arange(0, BK)
            mk = j < nch
            o_k = tl.load(p_idx + j, mask=mk, other=0)
        else:
            o_k = kb + tl.arange(0, BK)
            mk = o_k < K
        k1, k2, k3, k4 = _load4(p_k, t1, t2, t3, t4, s_kt, o_k, s_kd, m1, m2, m3, m4, mk)
        c1, c2, c3, c4, e1, e2, e3, e4 = _gate_tiles(p_c, start, n, t1, t2, t3, t4, s_ct, o_k, s_ck,
                                                     m1, m2, m3, m4, mk)
        e0 = tl.zeros_like(e1)  # the cumsum before the chunk
        if QUERIES:
            x1, x2, x3, x4 = _load4(p_x, t1, t2, t3, t4, s_xt, o_k, s_xd, m1, m2, m3, m4, mk)
        else:
            x1, x2, x3, x4 = k1, k2, k3, k4
        xr1 = x1 * tl.exp2(c1)
        xr2 = x2 * tl.exp2(c2 - e1[None, :])
        xr3 = x3 * tl.exp2(c3 - e2[None, :])
        xr4 = x4 * tl.exp2(c4 - e3[None, :])
        kc1 = k1 * tl.exp2(e1[None, :] - c1)
        kc2 = k2 * tl.exp2(e2[None, :] - c2)
        kc3 = k3 * tl.exp2(e3[None, :] - c3)
        kc4 = k4 * tl.exp2(e4[None, :] - c4)
        X11 = _diag_gram(xr1, kc1, x1, k1, c1, e0, e1, X11, MMA_RANGE, PREC)
        X22 = _diag_gram(xr2, kc2, x2, k2, c2, e1, e2, X22, MMA_RANGE, PREC)
        X33 = _diag_gram(xr3, kc3, x3, k3, c3, e2, e3, X33, MMA_RANGE, PREC)
        X44 = _diag_gram(xr4, kc4, x4, k4, c4, e3, e4, X44, MMA_RANGE, PREC)
        kt1 = tl.trans(kc1)
        kt2 = tl.trans(kc2)
        X21 = _mma(xr2, kt1, X21, LOWP, DOT_F32, PREC)
        X31 = _mma(xr3 * tl.exp2(e2 - e1)[None, :], kt1, X31, LOWP, DOT_F32, PREC)
        X32 = _mma(xr3, kt2, X32, LOWP, DOT_F32, PREC)
        X41 = _mma(xr4 * tl.exp2(e3 - e1)[None, :], kt1, X41, LOWP, DOT_F32, PREC)
        X42 = _mma(xr4 * tl.exp2(e3 - e2)[None, :], kt2, X42, LOWP, DOT_F32, PREC)
        X43 = _mma(xr4, tl.trans(kc3), X43, LOWP, DOT_F32, PREC)
        # the decayed queries / keys of the output and state kernels (unnormalised), exp(c_last)
        if QUERIES:
            _store4(out, t1, t2, t3, t4, HV * K, o_k, xr1, xr2 * tl.exp2(e1)[None, :], xr3 * tl.exp2(e2)[None, :],
                    xr4 * tl.exp2(e3)[None, :], m1, m2, m3, m4, mk)
        else:
            _store4(out, t1, t2, t3, t4, HV * K, o_k, kc1 * tl.exp2(e4 - e1)[None, :], kc2 * tl.exp2(e4 - e2)[None, :],
                    kc3 * tl.exp2(e4 - e3)[None, :], kc4, m1, m2, m3, m4, mk)
            tl.store(p_glast + o_k, tl.exp2(e4), mask=mk)
    return X11, X21, X22, X31, X32, X33, X41, X42, X43, X44


@triton.jit
def _inv_norm(ss, USE_L2: tl.constexpr):
    """Inverse L2 norms of rows with squared norms ``ss`` (ones without the L2 normalisation)."""
    if USE_L2:
        r = tl.math.rsqrt(ss + 1e-6)
    else:
        r = tl.full(ss.shape, 1.0, tl.float32)
    return r


@triton.jit
def _store_query_side(pbuf, i_h, t1, t2, t3, t4, m1, m2, m3, m4,
                      Q11, Q21, Q22, Q31, Q32, Q33, Q41, Q42, Q43, Q44, r1, r2, r3, r4, HV: tl.constexpr):
    """Stores ``P = Q rk_j`` (rows of 64, ``r1`` .. ``r4`` the key inverse norms; the query norm and
    scale are the output kernel's, which masks the entries above the diagonal)."""
    p_p = pbuf + i_h * 64 + tl.arange(0, 16)[None, :]
    ty = pbuf.dtype.element_ty
    tl.store(p_p + t1[:, None] * (HV * 64), (Q11 * r1[None, :]).to(ty), mask=m1[:, None])
    tl.store(p_p + t2[:, None] * (HV * 64), (Q21 * r1[None, :]).to(ty), mask=m2[:, None])
    tl.store(p_p + t2[:, None] * (HV * 64) + 16, (Q22 * r2[None, :]).to(ty), mask=m2[:, None])
    tl.store(p_p + t3[:, None] * (HV * 64), (Q31 * r1[None, :]).to(ty), mask=m3[:, None])
    tl.store(p_p + t3[:, None] * (HV * 64) + 16, (Q32 * r2[None, :]).to(ty), mask=m3[:, None])
    tl.store(p_p + t3[:, None] * (HV * 64) + 32, (Q33 * r3[None, :]).to(ty), mask=m3[:, None])
    tl.store(p_p + t4[:, None] * (HV * 64), (Q41 * r1[None, :]).to(ty), mask=m4[:, None])
    tl.store(p_p + t4[:, None] * (HV * 64) + 16, (Q42 * r2[None, :]).to(ty), mask=m4[:, None])
    tl.store(p_p + t4[:, None] * (HV * 64) + 32, (Q43 * r3[None, :]).to(ty), mask=m4[:, None])
    tl.store(p_p + t4[:, None] * (HV * 64) + 48, (Q44 * r4[None, :]).to(ty), mask=m4[:, None])


@triton.jit
def _tri_apply(T11, T21, T22, T31, T32, T33, T41, T42, T43, T44, x1, x2, x3, x4, PREC: tl.constexpr):
    """``T x`` for the block lower triangular ``T`` [64, 64] and a ``[64, N]`` operand in four 16-row tiles."""
    y1 = tl.dot(T11, x1, input_precision=PREC)
    y2 = tl.dot(T22, x2, tl.dot(T21, x1, input_precision=PREC), input_precision=PREC)
    y3 = tl.dot(T31, x1, input_precision=PREC)
    y3 = tl.dot(T32, x2, y3, input_precision=PREC)
    y3 = tl.dot(T33, x3, y3, input_precision=PREC)
    y4 = tl.dot(T41, x1, input_precision=PREC)
    y4 = tl.dot(T42, x2, y4, input_precision=PREC)
    y4 = tl.dot(T43, x3, y4, input_precision=PREC)
    y4 = tl.dot(T44, x4, y4, input_precision=PREC)
    return y1, y2, y3, y4


@triton.jit
def _solve_tril64(A11, A21, A22, A31, A32, A33, A41, A42, A43, A44, n, PREC: tl.constexpr):
    """T = (I + A)^-1 of the strictly lower triangular chunk matrix ``A`` given as its 10 lower 16x16
    blocks: the four diagonal inverses by exact forward substitution at once, then the block formula
    ``T_ij = -T_ii sum_{j <= m < i} A_im T_mj``. Returns the 10 lower blocks of ``T``."""
    T11, T22, T33, T44 = _unstack4(_inv_unit_lower16x4(_stack4(A11, A22, A33, A44), n))
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
    return T11, T21, T22, T31, T32, T33, T41, T42, T43, T44


# ----------------------------------------------------------------------------------------------
# 0. per-channel gate only: the chunk-local cumsum of g in log2 units, the q / k inverse norms
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=['nb'])  # batch-dependent counts: one compile for all
def _chunk_kda_prep_kernel(q, k, g, cu_seqlens, nb, state_indices, gc, rk, rq,
                           s_qt, s_qh, s_qd, s_kt, s_kh, s_kd, s_gt, s_gh, s_gk,
                           HV: tl.constexpr, R: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                           BB: tl.constexpr, USE_L2: tl.constexpr):
    """Grid ``(NR, HV)``, per chunk row and value head: ``gc [T, HV, K]`` (fp32) = ``log2(e) *
    cumsum(g)`` along the chunk's tokens, and the inverse L2 norms of its keys / queries ``rk`` /
    ``rq [T, HV]`` (``rk`` ones without the normalisation; ``rq`` then unwritten). Done once here for
    the intra kernel's two programs and its ``w`` pass: they take ``exp2`` of cumsum differences
    (one MUFU instruction each) and read the norms instead of reducing rows in every K block.
    Rows of padding requests are not written (nothing reads them)."""
    i_r = tl.program_id(0)
    i_h = tl.program_id(1)
    live, start, n = _live_row(cu_seqlens, nb, state_indices, i_r, BB)
    if not live:
        return
    t = start + tl.arange(0, 64)
    mt = tl.arange(0, 64) < n
    ssk = tl.zeros([64], dtype=tl.float32)
    ssq = tl.zeros([64], dtype=tl.float32)
    for kb in range(0, K, BK):
        o_k = kb + tl.arange(0, BK)
        m = mt[:, None] & (o_k < K)[None, :]
        x = tl.load(g + i_h * s_gh + t[:, None] * s_gt + o_k[None, :] * s_gk, mask=m, other=0.0).to(tl.float32)
        tl.store(gc + (t[:, None] * HV + i_h) * K + o_k[None, :], tl.cumsum(x, 0) * 1.4426950408889634, mask=m)
        if USE_L2:
            kx = tl.load(k + (i_h // R) * s_kh + t[:, None] * s_kt + o_k[None, :] * s_kd, mask=m, other=0.0).to(tl.float32)
            qx = tl.load(q + (i_h // R) * s_qh + t[:, None] * s_qt + o_k[None, :] * s_qd, mask=m, other=0.0).to(tl.float32)
            ssk += tl.sum(kx * kx, 1)
            ssq += tl.sum(qx * qx, 1)
    tl.store(rk + t * HV + i_h, _inv_norm(ssk, USE_L2), mask=mt)
    if USE_L2:
        tl.store(rq + t * HV + i_h, _inv_norm(ssq, USE_L2), mask=mt)


@triton.jit(do_not_specialize=['nb'])  # batch-dependent counts: one compile for all
def _chunk_kda_gram_kernel(q, k, gc, beta, cu_seqlens, nb, state_indices, rk, qg, kg, glast, pbuf, ascr, steep,
                           sidx, pscr,
                           s_qt, s_qh, s_qd, s_kt, s_kh, s_kd, s_bt, s_bh,
                           HV: tl.constexpr, R: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                           BB: tl.constexpr, MMA_RANGE: tl.constexpr, PREC: tl.constexpr, SPLIT: tl.constexpr):
    """Grid ``(NR, HV)``: the per-channel-gate chunk products of a chunk whose decay spans at most
    ``MMA_RANGE`` (natural-log units, ``CONFIG["kda_gram_range"]``) on every channel, as two 64x64 MMAs
    per K block. With ``c`` the log2 cumsum (``gc``), ``e`` its value at the chunk's last token and
    ``m = e / 2`` the channel's mid value, ``2^(c_i - c_j) = 2^(c_i - m) 2^(m - c_j)``, both factors in
    ``[e^(-R/2), e^(R/2)]`` (``R = MMA_RANGE``), so ``A = (k 2^(c - m)) (k 2^(m - c))^T`` and
    ``P = (q 2^(c - m)) (k 2^(m - c))^T`` over the whole chunk at once, in fp32 operands at ``PREC``
    (TF32 for bf16 inputs). At ``R = 128`` every factor is a normal fp32 number (``e^+-64``; fp32's
    normal range is ``e^+-87``) whose product with a raw q / k below ``1e10`` stays finite; each
    entry at or below the diagonal is a sum of terms no larger than their true values
    ``|q_i k_j| e^(c_i - c_j)``, so its rounding is relative to them; the entries above the
    diagonal (``e^(c_i - c_j)`` up to ``e^R``) may overflow and are discarded with ``where``. Writes ``P`` (causal, times the key norms) to ``pbuf``, ``A`` (strictly
    lower, times ``beta`` and both key norms) to ``ascr`` for the intra kernel's solve, ``qg``, ``kg``,
    ``glast``, and ``steep[row, head]`` = 0. A steeper chunk gets ``steep`` = 1 and nothing else: the
    intra kernel's two programs then build its products in 16x16 blocks (``_kda_gram_pass``).

    ``SPLIT`` (``CONFIG["kda_split_channels"]``): a chunk's channels are split instead: ``steep[row,
    head]`` is the number of channels whose span exceeds the range, listed at ``sidx[row, head]``;
    when some channels are in range, the chunk-wide MMAs run over those (the others' factors set to 1
    and their q / k to 0) and store their raw sums, ``A`` to ``ascr`` and ``P`` to ``pscr`` (strictly
    lower / lower), and ``qg`` / ``kg`` of those channels; the intra kernel's blocks add the listed
    channels and scale the sums (the blocks' cost scales with the steep channels, not with K)."""
    i_r = tl.program_id(0)
    i_h = tl.program_id(1)
    live, start, n = _live_row(cu_seqlens, nb, state_indices, i_r, BB)
    if not live:
        return
    p_last = gc + (start + n - 1) * (HV * K) + i_h * K  # the cumsum at the chunk's last token
    lim = MMA_RANGE * 1.4426950408889634  # the range in log2 units
    if SPLIT:  # list the steep channels (an exclusive prefix count gives each its place)
        p_idx = sidx + (i_r.to(tl.int64) * HV + i_h) * K
        flag = 0
        for kb in range(0, K, BK):
            o_k = kb + tl.arange(0, BK)
            st = ((-tl.load(p_last + o_k, mask=o_k < K, other=0.0)) > lim) & (o_k < K)
            sti = st.to(tl.int32)
            tl.store(p_idx + flag + tl.cumsum(sti, 0) - sti, o_k, mask=st)
            flag += tl.sum(sti, 0)
        tl.store(steep + i_r * HV + i_h, flag)
        if flag == K:  # no channel in range: the blocks take it all
            return
    else:
        span = 0.0
        for kb in range(0, K, BK):
            o_k = kb + tl.arange(0, BK)
            span = tl.maximum(span, tl.max(-tl.load(p_last + o_k, mask=o_k < K, other=0.0), 0))
        flag = (span > lim).to(tl.int8)
        tl.store(steep + i_r * HV + i_h, flag)
        if flag != 0:
            return
    o = tl.arange(0, 64)
    t = start + o
    mt = o < n
    Akk = tl.zeros([64, 64], dtype=tl.float32)
    Aqk = tl.zeros([64, 64], dtype=tl.float32)
    for kb in range(0, K, BK):
        o_k = kb + tl.arange(0, BK)
        mk = o_k < K
        m2 = mt[:, None] & mk[None, :]
        kx = tl.load(k + (i_h // R) * s_kh + t[:, None] * s_kt + o_k[None, :] * s_kd, mask=m2, other=0.0).to(tl.float32)
        qx = tl.load(q + (i_h // R) * s_qh + t[:, None] * s_qt + o_k[None, :] * s_qd, mask=m2, other=0.0).to(tl.float32)
        e = tl.load(p_last + o_k, mask=mk, other=0.0)
        c = tl.load(gc + t[:, None] * (HV * K) + i_h * K + o_k[None, :], mask=m2, other=0.0)
        c = tl.where(mt[:, None], c, e[None, :])  # rows past the chunk: g = 0 (their q / k are 0)
        mid = e * 0.5
        if SPLIT:  # the steep channels: no contribution here, factors 1 (finite), q / k / qg / kg theirs
            mild = -e <= lim
            c = tl.where(mild[None, :], c, mid[None, :])
            kx = tl.where(mild[None, :], kx, 0.0)
            qx = tl.where(mild[None, :], qx, 0.0)
            m2 = m2 & mild[None, :]
        up = tl.exp2(c - mid[None, :])
        kc = kx * tl.exp2(mid[None, :] - c)
        kt = tl.trans(kc)
        Akk = tl.dot(kx * up, kt, Akk, input_precision=PREC)
        qr = qx * up
        Aqk = tl.dot(qr, kt, Aqk, input_precision=PREC)
        # the decayed queries / keys of the output and state kernels (unnormalised), exp(c_last)
        p_out = (t[:, None] * HV + i_h) * K + o_k[None, :]
        tl.store(qg + p_out, (qr * tl.exp2(mid)[None, :]).to(qg.dtype.element_ty), mask=m2)
        tl.store(kg + p_out, (kc * tl.exp2(e - mid)[None, :]).to(kg.dtype.element_ty), mask=m2)
        tl.store(glast + (i_r.to(tl.int64) * HV + i_h) * K + o_k, tl.exp2(e), mask=mk)
    ii = o[:, None]
    jj = o[None, :]
    p_row = (t[:, None] * HV + i_h) * 64 + jj
    if SPLIT:
        if flag > 0:  # raw partial sums for the intra kernel's blocks
            tl.store(pscr + p_row, tl.where(ii >= jj, Aqk, 0.0), mask=mt[:, None])
            tl.store(ascr + p_row, tl.where(ii > jj, Akk, 0.0), mask=mt[:, None])
            return
    r = tl.load(rk + t * HV + i_h, mask=mt, other=0.0)
    b = tl.load(beta + t * s_bt + i_h * s_bh, mask=mt, other=0.0).to(tl.float32)
    tl.store(pbuf + p_row, tl.where(ii >= jj, Aqk * r[None, :], 0.0).to(pbuf.dtype.element_ty), mask=mt[:, None])
    tl.store(ascr + p_row, tl.where(ii > jj, Akk * (b * r)[:, None] * r[None, :], 0.0), mask=mt[:, None])


@triton.jit
def _load_lower_blocks(p, t1, t2, t3, t4, m1, m2, m3, m4, HV: tl.constexpr):
    """The 10 lower 16x16 blocks of a chunk matrix stored in rows of 64 (``[T, HV, 64]``, ``p`` at
    the head's first column): ``_chunk_kda_gram_kernel``'s ``A``; rows past the chunk read 0."""
    c = tl.arange(0, 16)[None, :]
    A11 = tl.load(p + t1[:, None] * (HV * 64) + c, mask=m1[:, None], other=0.0)
    A21 = tl.load(p + t2[:, None] * (HV * 64) + c, mask=m2[:, None], other=0.0)
    A22 = tl.load(p + t2[:, None] * (HV * 64) + 16 + c, mask=m2[:, None], other=0.0)
    A31 = tl.load(p + t3[:, None] * (HV * 64) + c, mask=m3[:, None], other=0.0)
    A32 = tl.load(p + t3[:, None] * (HV * 64) + 16 + c, mask=m3[:, None], other=0.0)
    A33 = tl.load(p + t3[:, None] * (HV * 64) + 32 + c, mask=m3[:, None], other=0.0)
    A41 = tl.load(p + t4[:, None] * (HV * 64) + c, mask=m4[:, None], other=0.0)
    A42 = tl.load(p + t4[:, None] * (HV * 64) + 16 + c, mask=m4[:, None], other=0.0)
    A43 = tl.load(p + t4[:, None] * (HV * 64) + 32 + c, mask=m4[:, None], other=0.0)
    A44 = tl.load(p + t4[:, None] * (HV * 64) + 48 + c, mask=m4[:, None], other=0.0)
    return A11, A21, A22, A31, A32, A33, A41, A42, A43, A44


# ----------------------------------------------------------------------------------------------
# 1. intra-chunk: cumsum of g, A, (I + A)^-1, w, u (per-channel gate: also P, qg, kg, exp(c_last))
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=['nb'])  # batch-dependent counts: one compile for all
def _chunk_intra_kernel(
    q, k, v, g, beta, cu_seqlens, nb, state_indices,
    w, u, gcum, rk, qg, kg, glast, pbuf, ascr, steep, sidx, pscr,
    s_qt, s_qh, s_qd,
    s_kt, s_kh, s_kd,
    s_vt, s_vh, s_vd,
    s_gt, s_gh, s_gk,
    s_bt, s_bh,
    HV: tl.constexpr, R: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BB: tl.constexpr, USE_L2: tl.constexpr, PREC: tl.constexpr,
    KPREC: tl.constexpr, RAW_K: tl.constexpr, GATE_K: tl.constexpr, LOWP: tl.constexpr,
    DOT_F32: tl.constexpr, MMA_RANGE: tl.constexpr, CHUNK_WIDE: tl.constexpr, SPLIT: tl.constexpr = False,
):
    i_r = tl.program_id(0)
    i_h = tl.program_id(1)
    i_hk = i_h // R
    live, start, n = _live_row(cu_seqlens, nb, state_indices, i_r, BB)
    if not live:  # past the last chunk, or a padding request
        return

    o16 = tl.arange(0, 16)
    t1 = start + o16
    t2 = t1 + 16
    t3 = t1 + 32
    t4 = t1 + 48
    m1 = o16 < n
    m2 = (o16 + 16) < n
    m3 = (o16 + 32) < n
    m4 = (o16 + 48) < n

    b1 = tl.load(beta + t1 * s_bt + i_h * s_bh, mask=m1, other=0.0).to(tl.float32)
    b2 = tl.load(beta + t2 * s_bt + i_h * s_bh, mask=m2, other=0.0).to(tl.float32)
    b3 = tl.load(beta + t3 * s_bt + i_h * s_bh, mask=m3, other=0.0).to(tl.float32)
    b4 = tl.load(beta + t4 * s_bt + i_h * s_bh, mask=m4, other=0.0).to(tl.float32)
    if not GATE_K:
        # chunk-local cumulative log-decay (masked tail: g = 0, beta = 0)
        c1 = tl.cumsum(tl.load(g + t1 * s_gt + i_h * s_gh, mask=m1, other=0.0).to(tl.float32), 0)
        c2 = tl.cumsum(tl.load(g + t2 * s_gt + i_h * s_gh, mask=m2, other=0.0).to(tl.float32), 0)
        c3 = tl.cumsum(tl.load(g + t3 * s_gt + i_h * s_gh, mask=m3, other=0.0).to(tl.float32), 0)
        c4 = tl.cumsum(tl.load(g + t4 * s_gt + i_h * s_gh, mask=m4, other=0.0).to(tl.float32), 0)
        c2 += tl.sum(tl.where(o16 == 15, c1, 0.0), 0)
        c3 += tl.sum(tl.where(o16 == 15, c2, 0.0), 0)
        c4 += tl.sum(tl.where(o16 == 15, c3, 0.0), 0)

    # Gram matrix k k^T in 16x16 blocks (lower half), and the key norms; with a per-channel gate
    # the decay sits inside the sum over K (so the blocks are decay-weighted), and the query
    # products (P, lower, diagonal included) are the second program's (program_id(2) = 1)
    p_k = k + i_hk * s_kh
    if GATE_K:
        p_g = g + i_h * s_gh  # the chunk-local cumsum in log2 units (_chunk_kda_prep_kernel)
        # steep 0: _chunk_kda_gram_kernel took the chunk (A in ascr; P, qg, kg, glast written), and
        # the CHUNK_WIDE compile solves it; 1: the block compile does everything (two programs)
        flag = tl.load(steep + i_r * HV + i_h)
        if CHUNK_WIDE:
            if flag != 0:
                return
        else:
            if flag == 0:
                return
        # the key inverse norms (_chunk_kda_prep_kernel's)
        r1 = tl.load(rk + t1 * HV + i_h, mask=m1, other=0.0)
        r2 = tl.load(rk + t2 * HV + i_h, mask=m2, other=0.0)
        r3 = tl.load(rk + t3 * HV + i_h, mask=m3, other=0.0)
        r4 = tl.load(rk + t4 * HV + i_h, mask=m4, other=0.0)
        # SPLIT: flag = the steep channels listed at sidx (the others' raw sums in ascr / pscr)
        p_idx = sidx + (i_r.to(tl.int64) * HV + i_h) * K
        if not CHUNK_WIDE:
            if tl.program_id(2) == 1:  # the query side: P, qg
                Q11, Q21, Q22, Q31, Q32, Q33, Q41, Q42, Q43, Q44 = _kda_gram_pass(
                    q + i_hk * s_qh, s_qt, s_qd, p_k, s_kt, s_kd, p_g, s_gt, s_gk, qg + i_h * K, glast, start, n,
                    t1, t2, t3, t4, m1, m2, m3, m4, p_idx, flag, pscr + i_h * 64,
                    HV, K, BK, True, MMA_RANGE, LOWP, DOT_F32, PREC, SPLIT)
                _store_query_side(pbuf, i_h, t1, t2, t3, t4, m1, m2, m3, m4,
                                  Q11, Q21, Q22, Q31, Q32, Q33, Q41, Q42, Q43, Q44, r1, r2, r3, r4, HV)
                return
        if CHUNK_WIDE:
            A11, A21, A22, A31, A32, A33, A41, A42, A43, A44 = _load_lower_blocks(
                ascr + i_h * 64, t1, t2, t3, t4, m1, m2, m3, m4, HV)
        else:
            G11, G21, G22, G31, G32, G33, G41, G42, G43, G44 = _kda_gram_pass(
                p_k, s_kt, s_kd, p_k, s_kt, s_kd, p_g, s_gt, s_gk, kg + i_h * K,
                glast + (i_r.to(tl.int64) * HV + i_h) * K, start, n,
                t1, t2, t3, t4, m1, m2, m3, m4, p_idx, flag, ascr + i_h * 64,
                HV, K, BK, False, MMA_RANGE, LOWP, DOT_F32, PREC, SPLIT)
            A11 = _beta_block(G11, b1, r1, r1, True)
            A22 = _beta_block(G22, b2, r2, r2, True)
            A33 = _beta_block(G33, b3, r3, r3, True)
            A44 = _beta_block(G44, b4, r4, r4, True)
            A21 = _beta_block(G21, b2, r2, r1, False)
            A31 = _beta_block(G31, b3, r3, r1, False)
            A32 = _beta_block(G32, b3, r3, r2, False)
            A41 = _beta_block(G41, b4, r4, r1, False)
            A42 = _beta_block(G42, b4, r4, r2, False)
            A43 = _beta_block(G43, b4, r4, r3, False)
    else:
        G11, G21, G22, G31, G32, G33, G41, G42, G43, G44 = _lower_blocks_zeros()
        ss1, ss2, ss3, ss4 = _row_sums_zeros()
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
        r1 = _inv_norm(ss1, USE_L2)
        r2 = _inv_norm(ss2, USE_L2)
        r3 = _inv_norm(ss3, USE_L2)
        r4 = _inv_norm(ss4, USE_L2)
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

    # T = (I + A)^-1, block lower triangular
    T11, T21, T22, T31, T32, T33, T41, T42, T43, T44 = _solve_tril64(
        A11, A21, A22, A31, A32, A33, A41, A42, A43, A44, n, PREC)

    # w = T (beta * rk * exp(c) * k_raw)   (exp(c) per key channel with a per-channel gate)
    e1 = b1 * r1
    e2 = b2 * r2
    e3 = b3 * r3
    e4 = b4 * r4
    if not GATE_K:
        e1 = e1 * tl.exp(c1)
        e2 = e2 * tl.exp(c2)
        e3 = e3 * tl.exp(c3)
        e4 = e4 * tl.exp(c4)
    for kb in range(0, K, BK):
        o_k = kb + tl.arange(0, BK)
        mk = o_k < K
        x1, x2, x3, x4 = _load4(p_k, t1, t2, t3, t4, s_kt, o_k, s_kd, m1, m2, m3, m4, mk)
        x1 = x1 * e1[:, None]
        x2 = x2 * e2[:, None]
        x3 = x3 * e3[:, None]
        x4 = x4 * e4[:, None]
        if GATE_K:
            # the log2 cumsum (rows past the chunk read 0: their keys are 0)
            c1, c2, c3, c4 = _load4(g + i_h * s_gh, t1, t2, t3, t4, s_gt, o_k, s_gk, m1, m2, m3, m4, mk)
            x1 = x1 * tl.exp2(c1)
            x2 = x2 * tl.exp2(c2)
            x3 = x3 * tl.exp2(c3)
            x4 = x4 * tl.exp2(c4)
        w1, w2, w3, w4 = _tri_apply(T11, T21, T22, T31, T32, T33, T41, T42, T43, T44, x1, x2, x3, x4, PREC)
        _store4(w + i_h * K, t1, t2, t3, t4, HV * K, o_k, w1, w2, w3, w4, m1, m2, m3, m4, mk)

    # u = T (beta * v)
    for vb in range(0, V, BV):
        o_v = vb + tl.arange(0, BV)
        mv = o_v < V
        x1, x2, x3, x4 = _load4(v + i_h * s_vh, t1, t2, t3, t4, s_vt, o_v, s_vd, m1, m2, m3, m4, mv)
        u1, u2, u3, u4 = _tri_apply(T11, T21, T22, T31, T32, T33, T41, T42, T43, T44, x1 * b1[:, None],
                                    x2 * b2[:, None], x3 * b3[:, None], x4 * b4[:, None], PREC)
        _store4(u + i_h * V, t1, t2, t3, t4, HV * V, o_v, u1, u2, u3, u4, m1, m2, m3, m4, mv)

    if not GATE_K:
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
    k, w, u, vn, gcum, rk, glast, cu_seqlens, state_indices, has_init, pool, hbuf, cstates,
    s_kt, s_kh, s_kd,
    s_ps, s_ph, s_pk, s_pv,
    HV: tl.constexpr, R: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    KP: tl.constexpr, BV: tl.constexpr, BB: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr,
    DOT_F32: tl.constexpr, STORE_CS: tl.constexpr, GATE_K: tl.constexpr,
):
    # per-channel gate: ``k`` is the intra kernel's decayed keys ``kg`` (one per value head, R = 1)
    # and the decay of the state rows is ``glast`` = exp(c_last) of the chunk row
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
    row0 = _rows_before(cu_seqlens, i_b, BB).to(tl.int64)

    o_k = tl.arange(0, KP)
    o_v = i_v * BV + tl.arange(0, BV)
    mk = o_k < K
    mv = o_v < V
    m_h = mk[:, None] & mv[None, :]
    p_pool = pool + tl.maximum(slot, 0) * s_ps + i_h * s_ph + o_k[:, None] * s_pk + o_v[None, :] * s_pv
    k_init = tl.where(init, K, 0)
    S = tl.load(p_pool, mask=(o_k[:, None] < k_init) & mv[None, :], other=0.0).to(tl.float32)

    o_t = tl.arange(0, 64)
    p_w = w + i_h * K + o_k[None, :]
    p_u = u + i_h * V + o_v[None, :]
    p_vn = vn + i_h * V + o_v[None, :]
    p_k = k + i_hk * s_kh + o_k[:, None] * s_kd
    o_h = i_h * (K * V) + o_k[:, None] * V + o_v[None, :]
    # the loads are software-pipelined by Triton (num_stages); a hand-written register prefetch of
    # the next chunk (loop-carried tiles fed to the MMAs) was miscompiled by Triton 3.6 (wrong states)
    for j in range(n_chunks):
        row = row0 + j
        c_t = bos + j * 64 + o_t
        c_mt = (j * 64 + o_t) < length
        c_w = tl.load(p_w + c_t[:, None] * (HV * K), mask=c_mt[:, None] & mk[None, :], other=0.0)
        c_u = tl.load(p_u + c_t[:, None] * (HV * V), mask=c_mt[:, None] & mv[None, :], other=0.0)
        c_r = tl.load(rk + c_t * HV + i_h, mask=c_mt, other=0.0)
        c_k = tl.load(p_k + c_t[None, :] * s_kt, mask=mk[:, None] & c_mt[None, :], other=0.0)
        # the state before this chunk: chunk_states row (fp32) and the output kernel's copy
        if LOWP:
            S_d = S.to(hbuf.dtype.element_ty)
        else:
            S_d = S
        tl.store(hbuf + row * (HV * K * V) + o_h, S_d, mask=m_h)
        if STORE_CS:
            tl.store(cstates + row * (HV * K * V) + o_h, S, mask=m_h)
        # v' = u - w h
        if DOT_F32:
            wh = tl.dot(c_w.to(tl.float32), S_d.to(tl.float32), input_precision=PREC)
        else:
            wh = tl.dot(c_w, S_d, input_precision=PREC)
        v_new = c_u.to(tl.float32) - wh
        tl.store(p_vn + c_t[:, None] * (HV * V), v_new.to(vn.dtype.element_ty), mask=c_mt[:, None] & mv[None, :])
        # h <- exp(c_last) h + k^T (exp(c_last - c) rk v')   (per channel: kg = exp(c_last - c) k)
        if GATE_K:
            decay = tl.load(glast + (row * HV + i_h) * K + o_k, mask=mk, other=0.0)[:, None]
            v_s = v_new * tl.where(c_mt, c_r, 0.0)[:, None]
        else:
            c_c = tl.load(gcum + c_t * HV + i_h, mask=c_mt, other=0.0)
            n_in = tl.minimum(length - j * 64, 64)
            c_last = tl.sum(tl.where(o_t == n_in - 1, c_c, 0.0), 0)
            decay = tl.exp(c_last)
            v_s = v_new * tl.where(c_mt, tl.exp(c_last - c_c) * c_r, 0.0)[:, None]
        if LOWP:
            v_s = v_s.to(c_k.dtype)
        else:
            c_k = c_k.to(tl.float32)
        if DOT_F32:
            S = tl.dot(c_k.to(tl.float32), v_s.to(tl.float32), S * decay, input_precision=PREC)
        else:
            S = tl.dot(c_k, v_s, S * decay, input_precision=PREC)

    k_fin = tl.where(length > 0, K, 0)
    tl.store(p_pool, S.to(pool.dtype.element_ty), mask=(o_k[:, None] < k_fin) & mv[None, :])


# ----------------------------------------------------------------------------------------------
# 3. output
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=['nb'])  # batch-dependent counts: one compile for all
def _chunk_output_kernel(
    q, k, vn, gcum, rk, hbuf, pbuf, rq, cu_seqlens, nb, state_indices, o, scale,
    s_qt, s_qh, s_qd,
    s_kt, s_kh, s_kd,
    s_ot, s_oh, s_od,
    HV: tl.constexpr, R: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BB: tl.constexpr, USE_L2: tl.constexpr, RAW_QK: tl.constexpr,
    PREC: tl.constexpr, QKPREC: tl.constexpr, LOWP: tl.constexpr, DOT_F32: tl.constexpr, GATE_K: tl.constexpr,
):
    # per-channel gate: ``q`` is the intra kernel's decayed queries ``qg`` (one per value head,
    # R = 1), the intra-chunk products ``P`` come from ``pbuf`` and the query norms from ``rq``
    i_r = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    i_hk = i_h // R
    req, start, n = _locate_row(cu_seqlens, nb, i_r, BB)
    if req < 0:  # past the last chunk
        return
    slot = tl.load(state_indices + req)

    o_t = tl.arange(0, 64)
    t = start + o_t
    mt = o_t < n
    o_v = i_v * BV + tl.arange(0, BV)
    mv = o_v < V
    p_o = o + t[:, None] * s_ot + i_h * s_oh + o_v[None, :] * s_od
    if slot < 0:  # a padding request: zero output
        tl.store(p_o, tl.zeros([64, BV], dtype=o.dtype.element_ty), mask=mt[:, None] & mv[None, :])
        return

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
        b_h = tl.load(p_h + o_k[:, None] * V, mask=mk[:, None] & mv[None, :], other=0.0)
        f_q = b_q.to(tl.float32)
        if USE_L2 and not GATE_K:
            ss += tl.sum(f_q * f_q, 1)
        if LOWP:  # bf16 q and h: native MMA (exact products, fp32 sums)
            if DOT_F32:
                acc = tl.dot(f_q, b_h.to(tl.float32), acc, input_precision=PREC)
            else:
                acc = tl.dot(b_q, b_h, acc)
        else:
            acc = tl.dot(f_q, b_h, acc, input_precision=PREC)
        if not GATE_K:
            b_k = tl.load(p_k + o_k[None, :] * s_kd, mask=mt[:, None] & mk[None, :], other=0.0)
            if RAW_QK:
                qk = tl.dot(b_q, tl.trans(b_k), qk, input_precision=QKPREC)
            else:
                qk = tl.dot(f_q, tl.trans(b_k.to(tl.float32)), qk, input_precision=PREC)

    causal = (o_t[:, None] >= o_t[None, :]) & mt[:, None]  # rows past the end: no exp overflow
    if GATE_K:  # the decay is in qg and P already
        P = tl.load(pbuf + (t[:, None] * HV + i_h) * 64 + o_t[None, :], mask=causal, other=0.0)
        inter = acc
    else:
        c = tl.load(gcum + t * HV + i_h, mask=mt, other=0.0)
        r_k = tl.load(rk + t * HV + i_h, mask=mt, other=0.0)
        P = tl.where(causal, qk * r_k[None, :] * tl.exp(tl.where(causal, c[:, None] - c[None, :], 0.0)), 0.0)
        inter = acc * tl.exp(c)[:, None]
    b_vn = tl.load(vn + (t[:, None] * HV + i_h) * V + o_v[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
    if LOWP:
        if DOT_F32:
            out = tl.dot(P.to(b_vn.dtype).to(tl.float32), b_vn.to(tl.float32), inter, input_precision=PREC)
        else:
            out = tl.dot(P.to(b_vn.dtype), b_vn, inter)
    else:
        out = tl.dot(P, b_vn, inter, input_precision=PREC)
    if USE_L2:
        if GATE_K:
            r_q = tl.load(rq + t * HV + i_h, mask=mt, other=0.0)
        else:
            r_q = tl.math.rsqrt(ss + 1e-6)
        out = out * (r_q * scale)[:, None]
    else:
        out = out * scale
    tl.store(p_o, out.to(o.dtype.element_ty), mask=mt[:, None] & mv[None, :])


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


#: Launch settings and the low-precision switch, module-level so that
#: ``benchmarks/profile_gdn_chunk.py`` can compare variants. ``None`` = the default below (chosen
#: from H100 measurements at Qwen3-Next shapes; see that script).
CONFIG = {
    "lowp": True,  # bf16 q/k/v: bf16 MMA operands, bf16 w / v' / h copies (fp32 state, sums, u)
    "u_bf16": False,  # also u in bf16 (about 3% faster at 32k tokens, about 1.3x the state error)
    "intra_warps": None,  # 2 on the bf16 path (the 16x16 tiles replicate over more warps), else 4
    "intra_stages": None,
    "state_bv": None,  # V block of the sequential pass: 32 for K <= 128
    "state_warps": None,  # 4 on the bf16 path (K <= 128), else 8
    "state_stages": None,  # Triton's default (3; 2 for fp32 intermediates at K 128): the next chunks' loads are in flight
    "out_bv": None,  # the whole V (<= 128) on the bf16 path, else 64
    "out_warps": None,  # 4
    "out_stages": None,
    # per-channel gate (Kimi Delta Attention) only: the intra kernel's K block and warps (the block
    # path of steep chunks: two programs per (chunk, head), 10 [16, 16] accumulators and [16, BK]
    # tiles each; also the CHUNK_WIDE compile's warps, see kda_solve_warps). Timed on an H100
    # (2026-11-27, benchmarks/profile_gdn_chunk.py --kda --sweep, 32k tokens, when every chunk took the
    # blocks; intra kernel / whole prefill, us): BK 16 / 2 warps 5476 / 7045; 16 / 4 6874 / 8395;
    # 16 / 8 12853 / 14296; 32 / 8 11025 / 12507: fewer warps per program win despite the spills
    # (more programs resident per SM). On an H200 (2026-11-29, the chunk-wide path taking every chunk)
    # kda_intra_warps 4 made the whole prefill 5.83 ms against 4.44 at 2.
    "kda_intra_bk": None,  # 16
    "kda_intra_warps": None,  # 2
    # Triton's default (3: the next K blocks' loads in flight); 1 was slower (above)
    "kda_intra_stages": None,
    "kda_intra_mma_range": None,  # 64.0 (see _diag_gram; -1 = always the bisection, any decay, and no chunk-wide path)
    # _chunk_kda_gram_kernel (the chunk-wide 64x64 products): the largest decay span over a chunk it
    # takes (natural-log units, <= 128; -1 = none: every chunk in 16x16 blocks)
    "kda_gram_range": None,  # 128.0
    "kda_gram_bk": None,  # 16 (the GPU tests' setting). On an H200 at 32k tokens 32 took 805-807 us
    # against 889-925 at 16 (4 warps; 8 warps: 1007 at 16, 828 at 32; profile_kda_gram /
    # _solve_h200_2026-11-29.json), 1 % of the whole prefill, not yet GPU-tested. sm_90 build
    # (Triton 3.9): 32 / 4 250 registers, 16 / 4 174, 16 / 8 125, 32 / 8 158, none spilling
    "kda_gram_warps": None,  # 4
    "kda_gram_stages": None,
    # warps of the intra kernel's CHUNK_WIDE compile (solve, w, u of the gram kernel's chunks): None =
    # kda_intra_warps (2). sm_90 build (Triton 3.9): 2 warps 255 registers, 224 B spills; 4 warps 240,
    # none; yet on an H200 at 32k tokens 2 warps 1284 us, 4 warps 2267 (more programs resident)
    "kda_solve_warps": None,
    # a chunk with some channels steeper than kda_gram_range: the chunk-wide MMAs over the channels in
    # range, the 16x16 blocks over the steep ones only (listed per chunk and head), instead of the
    # blocks over every channel. Interpreter-tested; not yet run on a GPU, hence off
    "kda_split_channels": False,
}


def state_launch(cfg, lowp, kp, vp):
    """``(BV, num_warps, num_stages)`` of ``_chunk_state_kernel`` (``num_stages`` None = Triton's
    default, 3). fp32 intermediates (fp32 or fp16 inputs, or ``CONFIG["lowp"]`` off) at K >= 128 take
    two stages: with fp16 inputs (TF32 MMAs on the fp32 key / w tiles) three stages need 246 KB of
    shared memory on sm_90 (Triton 3.6 and 3.9), past the 227 KB a block may have; fp32 inputs
    (TF32x3) need 181 KB at three, 107 KB at two (``benchmarks/kda_intra_build.py --kernel state``
    prints it)."""
    bv = cfg["state_bv"] or (64 if kp <= 64 else (32 if kp <= 128 else 16))
    bv = max(min(bv, vp), 16)
    warps = cfg["state_warps"] or (4 if lowp and kp <= 128 else 8)
    stages = cfg["state_stages"]
    if stages is None and not lowp and kp >= 128:
        stages = 2
    return bv, warps, stages


def _launch_opts(warps, stages):
    opts = {"num_warps": warps}
    if stages is not None:
        opts["num_stages"] = stages
    return opts


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
    ``ssm_states``), for a per-head gate ``g [T, Hv]`` or a per-channel one ``g [T, Hv, K]``. No
    host sync and no torch work besides the allocations: each kernel finds its chunk from
    ``cu_seqlens`` itself."""
    T, hk, kd = q.shape
    hv, vd = v.shape[1], v.shape[2]
    if kd > MAX_HEAD_K_DIM:
        raise ValueError(f"chunk_gated_delta_rule (Triton): head_k_dim {kd} > {MAX_HEAD_K_DIM} is not supported")
    C = GDN_CHUNK_SIZE
    batch = state_indices.shape[0]
    dev = v.device
    n_rows = max_chunk_rows(T, batch, C)
    cfg = CONFIG
    # every token belongs to a chunk row, and every row's program writes its tokens (zeros for a
    # padding request), so ``o`` needs no zero fill
    o = torch.empty(T, hv, vd, dtype=v.dtype, device=dev)
    chunk_states = torch.zeros(n_rows if output_chunk_states else 0, hv, kd, vd, dtype=torch.float32, device=dev)
    if T == 0 or batch == 0:
        return o, chunk_states
    scale = float(scale) if scale > 0 else float(kd) ** -0.5
    r = hv // hk
    bb = 16  # requests scanned per block by _locate_row / _rows_before: fixed, not from the batch (one JIT variant)

    # low precision: bf16 inputs -> bf16 MMA operands and bf16 intermediates
    lowp = bool(cfg["lowp"]) and q.dtype == k.dtype == v.dtype == torch.bfloat16
    dot_f32 = not _raw_dot(k)  # the interpreter: cast bf16 operands to fp32 (same products)
    low = torch.bfloat16
    f32 = torch.float32
    w = torch.empty(T, hv, kd, dtype=low if lowp else f32, device=dev)
    u = torch.empty(T, hv, vd, dtype=low if lowp and cfg["u_bf16"] else f32, device=dev)
    vn = torch.empty(T, hv, vd, dtype=low if lowp else f32, device=dev)
    rk = torch.empty(T, hv, dtype=f32, device=dev)
    gate_k = g.dim() == 3
    if gate_k:  # decayed q / k, exp(c_last) per chunk row, query norms, intra-chunk products P
        qg = torch.empty(T, hv, kd, dtype=low if lowp else f32, device=dev)
        kg = torch.empty(T, hv, kd, dtype=low if lowp else f32, device=dev)
        glast = torch.empty(n_rows, hv, kd, dtype=f32, device=dev)
        rq = torch.empty(T, hv, dtype=f32, device=dev)
        pbuf = torch.empty(T, hv, C, dtype=low if lowp else f32, device=dev)
        gcum = rk  # unused
    else:
        gcum = torch.empty(T, hv, dtype=f32, device=dev)
        qg = kg = glast = rq = pbuf = rk  # unused
    if lowp:
        hbuf = torch.empty(n_rows, hv, kd, vd, dtype=low, device=dev)
        store_cs = output_chunk_states
    else:
        hbuf = chunk_states if output_chunk_states else torch.empty(n_rows, hv, kd, vd, dtype=f32, device=dev)
        store_cs = False

    # tl.dot needs every block dim >= 16
    kp = max(triton.next_power_of_2(kd), 16)
    vp = max(triton.next_power_of_2(vd), 16)
    bk = min(kp, 64)
    prec = _dot_precision(q, k, v)

    bv_intra = min(vp, 64)
    mma_range = float(64.0 if cfg["kda_intra_mma_range"] is None else cfg["kda_intra_mma_range"])
    if mma_range > 64.0:  # see _diag_gram: the bound that keeps every MMA entry finite
        raise ValueError(f'gdn_chunk.CONFIG["kda_intra_mma_range"] must be <= 64, not {mma_range}')
    gram_range = float(128.0 if cfg["kda_gram_range"] is None else cfg["kda_gram_range"])
    if gram_range > 128.0:  # see _chunk_kda_gram_kernel: every factor a normal fp32 number
        raise ValueError(f'gdn_chunk.CONFIG["kda_gram_range"] must be <= 128, not {gram_range}')
    if mma_range < 0:  # the bisection everywhere: no mid-value split at all
        gram_range = -1.0
    split = bool(cfg["kda_split_channels"]) and g.dim() == 3
    if gate_k:
        bk_intra = max(min(cfg["kda_intra_bk"] or 16, kp), 16)
        warps_intra = cfg["kda_intra_warps"] or 2
        stages_intra = cfg["kda_intra_stages"]
    else:
        bk_intra = bk
        warps_intra = cfg["intra_warps"] or (2 if lowp else 4)
        stages_intra = cfg["intra_stages"]
    if gate_k:  # the intra kernel reads the chunk-local cumsum (log2 units) in place of g, and the norms
        gc = torch.empty(T, hv, kd, dtype=f32, device=dev)
        _chunk_kda_prep_kernel[(n_rows, hv)](
            q, k, g, cu_seqlens, batch, state_indices, gc, rk, rq,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            g.stride(0), g.stride(1), g.stride(2),
            HV=hv, R=r, K=kd, BK=min(kp, 32), BB=bb, USE_L2=bool(use_qk_l2norm), num_warps=4)
        g_in = gc
        # chunks of a gentle enough decay: A and P as 64x64 MMAs (steep[row, head] = 0); the others
        # (steep = 1) are the intra kernel's, in 16x16 blocks
        ascr = torch.empty(T, hv, C, dtype=f32, device=dev)
        if split:  # steep channel counts and lists, the query side's raw partial sums
            steep = torch.empty(n_rows, hv, dtype=torch.int32, device=dev)
            sidx = torch.empty(n_rows, hv, kd, dtype=torch.int32, device=dev)
            pscr = torch.empty(T, hv, C, dtype=f32, device=dev)
        else:
            steep = torch.empty(n_rows, hv, dtype=torch.int8, device=dev)
            sidx = pscr = ascr  # unused
        _chunk_kda_gram_kernel[(n_rows, hv)](
            q, k, gc, beta, cu_seqlens, batch, state_indices, rk, qg, kg, glast, pbuf, ascr, steep, sidx, pscr,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            beta.stride(0), beta.stride(1),
            HV=hv, R=r, K=kd, BK=max(min(cfg["kda_gram_bk"] or 16, kp), 16), BB=bb, MMA_RANGE=gram_range, PREC=prec,
            SPLIT=split, **_launch_opts(cfg["kda_gram_warps"] or 4, cfg["kda_gram_stages"]))
    else:
        g_in = g
        ascr = steep = sidx = pscr = rk  # unused
    # per-channel gate: compiled twice, CHUNK_WIDE (the solve, w and u of the gram kernel's chunks: no
    # 16x16 product code, so far fewer registers) and the block path of the steep chunks, where
    # program_id(2) picks the key side (A, solve, w, u) or the query side (P)
    for chunk_wide in ((True, False) if gate_k else (False,)):
        _chunk_intra_kernel[(n_rows, hv, 2 if gate_k and not chunk_wide else 1)](
            q, k, v, g_in, beta, cu_seqlens, batch, state_indices,
            w, u, gcum, rk, qg, kg, glast, pbuf, ascr, steep, sidx, pscr,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            g_in.stride(0), g_in.stride(1), g_in.stride(2) if gate_k else 0,
            beta.stride(0), beta.stride(1),
            HV=hv, R=r, K=kd, V=vd, BK=bk_intra, BV=bv_intra, BB=bb, USE_L2=bool(use_qk_l2norm), PREC=prec,
            KPREC=_dot_precision(k), RAW_K=_raw_dot(k), GATE_K=gate_k, LOWP=lowp, DOT_F32=dot_f32,
            MMA_RANGE=mma_range, CHUNK_WIDE=chunk_wide, SPLIT=split,
            **_launch_opts((cfg["kda_solve_warps"] or warps_intra) if chunk_wide else warps_intra, stages_intra),
        )
    # the state and output kernels read the decayed keys / queries (one per value head) instead
    k_state, q_out, r_io = (kg, qg, 1) if gate_k else (k, q, r)

    bv_state, warps_state, stages_state = state_launch(cfg, lowp, kp, vp)
    _chunk_state_kernel[(batch, hv, triton.cdiv(vd, bv_state))](
        k_state, w, u, vn, gcum, rk, glast, cu_seqlens, state_indices, has_initial_state, ssm_states, hbuf,
        chunk_states if store_cs else hbuf,
        k_state.stride(0), k_state.stride(1), k_state.stride(2),
        ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2), ssm_states.stride(3),
        HV=hv, R=r_io, K=kd, V=vd, KP=kp, BV=bv_state, BB=bb, PREC=prec, LOWP=lowp, DOT_F32=dot_f32,
        STORE_CS=store_cs, GATE_K=gate_k,
        **_launch_opts(warps_state, stages_state),
    )

    bv_out = max(min(cfg["out_bv"] or (128 if lowp else 64), vp), 16)
    warps_out = cfg["out_warps"] or 4
    _chunk_output_kernel[(n_rows, hv, triton.cdiv(vd, bv_out))](
        q_out, k, vn, gcum, rk, hbuf, pbuf, rq, cu_seqlens, batch, state_indices, o, scale,
        q_out.stride(0), q_out.stride(1), q_out.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        HV=hv, R=r_io, K=kd, V=vd, BK=bk, BV=bv_out, BB=bb, USE_L2=bool(use_qk_l2norm),
        RAW_QK=q.dtype == k.dtype and _raw_dot(q), PREC=prec, QKPREC=_dot_precision(q), LOWP=lowp,
        DOT_F32=dot_f32, GATE_K=gate_k, **_launch_opts(warps_out, cfg["out_stages"]),
    )
    return o, chunk_states
