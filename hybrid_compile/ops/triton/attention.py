"""Triton kernels for the paged attention ops (token-level KV pool, indptr/indices format).

Registered as the ``cuda`` kernels of ``hybrid_compile::store_kv_cache``,
``paged_attention_extend``, ``paged_attention_decode`` and ``merge_attention_states``; the
plain-torch ops in :mod:`hybrid_compile.ops.attention` define the semantics (masking, padding,
dtypes) these kernels reproduce. Every launcher also runs on CPU tensors under
``TRITON_INTERPRET=1`` (how the tests exercise it).

Kernels
-------
- ``_store_kv_kernel``: grid ``(T, cdiv(Hkv, BLOCK_H))``; one token's K and V rows (a block of
  kv heads) copied to its slot, cast to the pool dtype; slot -1 writes nothing.
- ``_extend_kernel``: FlashAttention-2 forward over the paged pool. Grid
  ``(Hq, cdiv(T, BLOCK_M) + B)``: the second axis enumerates *virtual* query blocks (in reverse,
  so a request's heaviest causal blocks start first), request
  ``b`` owning ids ``[qo[b] // BLOCK_M + b, qo[b+1] // BLOCK_M + b + 1)`` (always enough for its
  ``cdiv(q_len, BLOCK_M)`` blocks, and the total never exceeds the grid). Each program finds its
  request by a binary search over ``qo_indptr`` on device, so the launcher reads nothing to the
  host (it is even CUDA-graph safe); spare ids exit at once, and the ids past the last request's
  queries write the padding rows (``>= qo_indptr[-1]``: 0 / -inf). The KV loop gathers
  ``BLOCK_N`` slots per step through ``kv_indices``, starts/stops at the causal / window bounds
  of the block, and only the edge blocks pay for the 2-D mask. Online softmax in base 2, fp32
  accumulation.
- ``_decode_kernel`` (split-KV flash decoding): grid ``(B, Hkv * cdiv(G, BLOCK_G), NUM_SPLITS)``;
  all ``G`` query heads of one kv head in one program (``tl.dot`` of a ``[BLOCK_G, D]`` query tile,
  ``BLOCK_G >= 16``), split ``s`` covering its share of the request's visible kv range (the number
  of splits actually used per request shrinks on device for short requests). Partial o / lse go
  to an fp32 scratch buffer ``[B, Hq, NUM_SPLITS, Dv]`` (shape-derived size) merged by
  ``_decode_reduce_kernel`` (grid ``(B, Hq)``); with one split the kernel writes the output
  directly. ``NUM_SPLITS`` depends on shapes only (batch, heads, SM count): no host sync, fixed
  grid, CUDA-graph safe; it is a runtime argument, not a constexpr, so a new batch size compiles
  no new variant (no batch-dependent constexpr or integer specialisation anywhere here).
- ``_merge_kernel``: grid ``(T, cdiv(H, BLOCK_H))``, the log-sum-exp merge of two states.

Dtypes: ``q . k`` runs on tensor cores in bf16/fp16 when ``q`` and ``k_cache`` share that dtype,
otherwise in exact fp32 (``input_precision="ieee"``); ``p @ v`` uses ``v_cache``'s dtype (fp32 ->
ieee). Head dims up to 256, any size (padded to a power of two >= 16 with masks); above 256, a q/k
head dim split in a power of two up to 512 plus up to 256 (two dots, ``HEAD_DPE``: multi-head latent
attention's 512 latent + 64 rope channels) with a v head dim up to 512.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..attention import _check_decode, _check_extend, _check_merge, _check_store
from .common import quantize_axis, sm_count
from .launch import pdl_launch, pdl_wait_and_release

_LOG2E = 1.4426950408889634
_LOW_PRECISION = (torch.bfloat16, torch.float16)
_MAX_HEAD_DIM = 256
# multi-head latent attention (MLA, absorbed form): K = [latent, rope key], V = the latent, e.g.
# DeepSeek's / Kimi-Linear's 512 + 64 and 512; the head dim is split into two power-of-two parts
_MAX_SPLIT_HEAD_DIM = (512, 256)  # (first part, second part)
_MAX_SPLIT_HEAD_DV = 512


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(int(n)))


def _interpreting(t: torch.Tensor) -> bool:
    return t.device.type != "cuda"


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _split_head_dim(op: str, d: int, dv: int) -> tuple[int, int]:
    """(first part, second part) of the q/k head dim: ``(d, 0)`` up to 256 (one block, padded to a
    power of two); above, the largest power of two below ``d`` and the rest (MLA: 576 = 512 + 64),
    each its own dot. Raises a ValueError naming the head dims the kernels cannot take."""
    if d <= _MAX_HEAD_DIM and dv <= _MAX_HEAD_DIM:
        return d, 0
    main = 1 << (d.bit_length() - 1) if d > _MAX_HEAD_DIM else d
    rest = d - main
    if main > _MAX_SPLIT_HEAD_DIM[0] or rest > _MAX_SPLIT_HEAD_DIM[1] or dv > _MAX_SPLIT_HEAD_DV:
        raise ValueError(
            f"{op}: Triton kernel supports head dims up to {_MAX_HEAD_DIM}, or above it q/k head dims of a "
            f"power of two up to {_MAX_SPLIT_HEAD_DIM[0]} plus up to {_MAX_SPLIT_HEAD_DIM[1]} (MLA's latent + rope "
            f"key) with a v head dim up to {_MAX_SPLIT_HEAD_DV}; got q/k {d}, v {dv}"
        )
    return main, rest


def _head_dim_args(d_main: int, d_pe: int) -> dict:
    return dict(HEAD_D=d_main, BLOCK_D=_pow2(d_main), HEAD_DPE=d_pe, BLOCK_DPE=_pow2(d_pe) if d_pe else 16)


def _softmax_params(scale: float, logit_softcap: float) -> tuple[float, float, bool]:
    """(multiplier of q.k, multiplier after tanh, softcap on). Logits end up in base 2."""
    if logit_softcap > 0.0:
        return scale / logit_softcap, logit_softcap * _LOG2E, True
    return scale * _LOG2E, 1.0, False


# --------------------------------------------------------------------------------------------
# store_kv_cache
# --------------------------------------------------------------------------------------------


@triton.jit
def _to_bf16_rne(x):
    """fp32 -> bf16, round to nearest even by bit arithmetic: bit-identical to torch's cast on GPU
    and in the interpreter (whose own fp32 -> bf16 cast truncates)."""
    bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _cast_to(x, DST: tl.constexpr, MANUAL_BF16: tl.constexpr):
    if MANUAL_BF16:
        return _to_bf16_rne(x)
    else:
        return x.to(DST)


@triton.jit
def _store_kv_kernel(
    K, V, KC, VC, SLOTS, KS, VS,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcs, stride_kch, stride_vcs, stride_vch,
    stride_kss, stride_ksh, stride_vss, stride_vsh,
    HKV: tl.constexpr, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    K_BF16_RNE: tl.constexpr, V_BF16_RNE: tl.constexpr, KV_FP8: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    """KV_FP8: quantize each (token, head) vector to e4m3 with its own scale (KS / VS)."""
    pdl_wait_and_release(USE_PDL)  # programmatic dependent launch: wait for the kernel before (launch.py)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < HKV
    offs_d = tl.arange(0, BLOCK_D)
    mask = h_mask[:, None] & (offs_d < HEAD_D)[None, :]
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    if KV_FP8:
        k, k_s = quantize_axis(tl.where(mask, k.to(tl.float32), 0.0), 1)
        tl.store(KS + slot * stride_kss + offs_h * stride_ksh, k_s, mask=h_mask)
        k = k.to(KC.dtype.element_ty)
    else:
        k = _cast_to(k, KC.dtype.element_ty, K_BF16_RNE)
    tl.store(KC + slot * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :], k, mask=mask)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_v = h_mask[:, None] & (offs_dv < HEAD_DV)[None, :]
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_dv[None, :], mask=mask_v)
    if KV_FP8:
        v, v_s = quantize_axis(tl.where(mask_v, v.to(tl.float32), 0.0), 1)
        tl.store(VS + slot * stride_vss + offs_h * stride_vsh, v_s, mask=h_mask)
        v = v.to(VC.dtype.element_ty)
    else:
        v = _cast_to(v, VC.dtype.element_ty, V_BF16_RNE)
    tl.store(VC + slot * stride_vcs + offs_h[:, None] * stride_vch + offs_dv[None, :], v, mask=mask_v)


def store_kv_cache_triton(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """``k_cache[slots[t]] = k[t]``, ``v_cache[slots[t]] = v[t]`` (slot -1 skipped), in place."""
    t = slots.shape[0]
    if t == 0:
        return
    hkv, d = k_cache.shape[1], k_cache.shape[2]
    dv = v_cache.shape[2]
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("store_kv_cache: the pools' last dim must be contiguous")
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    block_d, block_dv = triton.next_power_of_2(d), triton.next_power_of_2(dv)
    block_h = min(triton.next_power_of_2(hkv), max(1, 4096 // max(block_d, block_dv)))
    grid = (t, triton.cdiv(hkv, block_h))
    ks, vs, s_strides, kv_fp8 = _scale_args(k_cache, k_scale, v_scale)
    _store_kv_kernel[grid](
        k, v, k_cache, v_cache, slots, ks, vs,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), *s_strides,
        HKV=hkv, HEAD_D=d, HEAD_DV=dv, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_DV=block_dv,
        K_BF16_RNE=k_cache.dtype == torch.bfloat16 and k.dtype != torch.bfloat16,
        V_BF16_RNE=v_cache.dtype == torch.bfloat16 and v.dtype != torch.bfloat16, KV_FP8=kv_fp8,
        num_warps=4 if block_h * max(block_d, block_dv) >= 1024 else 1,
        **pdl_launch(k.device),
    )


# --------------------------------------------------------------------------------------------
# shared inner loop: online softmax over gathered KV blocks
# --------------------------------------------------------------------------------------------


@triton.jit
def _bit_count(bits):
    """Set bits of each int64 (a draft-tree ancestor mask: its token's depth + 1)."""
    n = tl.zeros(bits.shape, tl.int32)
    for i in range(64):
        n += ((bits >> i) & 1).to(tl.int32)
    return n


@triton.jit
def _attend_block(
    acc, l_i, m_i, q,
    K_HEAD, V_HEAD, KVI_REQ, stride_kn, stride_vn,
    offs_d, d_mask, offs_dv, dv_mask,
    n0, n_hi, qpos, window, qk_mult, cap_mult,
    KS_HEAD, VS_HEAD, stride_ksn, stride_vsn,
    BLOCK_N: tl.constexpr, CAUSAL_MASK: tl.constexpr, WINDOW_MASK: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, QK_F32: tl.constexpr, PV_F32: tl.constexpr, KV_FP8: tl.constexpr,
    tree_bits, tree_base, TREE_MASK: tl.constexpr,
    q_pe=None, offs_pe=None, pe_mask=None, PE_OFF: tl.constexpr = 0, HAS_PE: tl.constexpr = False,
    wpos=None, TREE_ROWS=None, tree_len=0, TREE_WINDOW: tl.constexpr = False,
):
    """One BLOCK_N step of the online softmax: keys at positions n0 + [0, BLOCK_N) below n_hi.

    KV_FP8: K/V are e4m3 with one fp32 scale per token and head (``KS_HEAD`` / ``VS_HEAD``). The
    e4m3 values convert exactly to q's dtype, so the dots stay on q's dtype; the K scale multiplies
    the logits' columns and the V scale the probabilities' columns (both per key token).
    HAS_PE: the head dim is split in two power-of-two parts (MLA's latent + rope key, 512 + 64):
    ``q`` holds the first ``PE_OFF`` channels, ``q_pe`` the rest, and q.k is the sum of two dots.
    TREE_WINDOW: a draft tree under a sliding window: the window counts from the queries' tree
    positions ``wpos`` (``tree_base`` + depth) back over the keys' positions, a new token's being
    ``tree_base`` + its depth (from its ancestor bits, ``TREE_ROWS[rel]``, ``rel < tree_len``)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_hi
    slots = tl.load(KVI_REQ + offs_n, mask=n_mask, other=0).to(tl.int64)
    kt = tl.load(K_HEAD + slots[None, :] * stride_kn + offs_d[:, None], mask=d_mask[:, None] & n_mask[None, :], other=0.0)
    if QK_F32:
        s = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, kt.to(q.dtype))
    if HAS_PE:
        kpe = tl.load(K_HEAD + slots[None, :] * stride_kn + PE_OFF + offs_pe[:, None],
                      mask=pe_mask[:, None] & n_mask[None, :], other=0.0)
        if QK_F32:
            s += tl.dot(q_pe, kpe.to(tl.float32), input_precision="ieee")
        else:
            s += tl.dot(q_pe, kpe.to(q_pe.dtype))
    if KV_FP8:
        s = s * tl.load(KS_HEAD + slots * stride_ksn, mask=n_mask, other=0.0)[None, :]
    s = s * qk_mult
    if USE_SOFTCAP:  # cap * tanh(x / cap), tanh(y) = 2 sigmoid(2y) - 1; then to base 2
        s = (2.0 * tl.sigmoid(2.0 * s) - 1.0) * cap_mult
    visible = n_mask[None, :]
    if CAUSAL_MASK:
        visible = visible & (offs_n[None, :] <= qpos[:, None])
    if WINDOW_MASK:
        if TREE_WINDOW:
            rel_k = offs_n - tree_base
            is_new = (rel_k >= 0) & (rel_k < tree_len)
            k_bits = tl.load(TREE_ROWS + tl.maximum(rel_k, 0), mask=is_new & n_mask, other=0)
            kpos = tl.where(rel_k >= 0, tree_base + _bit_count(k_bits) - 1, offs_n)
            visible = visible & (kpos[None, :] > wpos[:, None] - window)
        else:
            visible = visible & (offs_n[None, :] > qpos[:, None] - window)
    if TREE_MASK:  # a draft tree: new tokens (from tree_base on) only where the query's ancestor bit is set
        rel = offs_n - tree_base
        bit = (tree_bits[:, None] >> tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)[None, :]) & 1
        visible = visible & ((rel[None, :] < 0) | (bit != 0))
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    vv = tl.load(V_HEAD + slots[:, None] * stride_vn + offs_dv[None, :], mask=n_mask[:, None] & dv_mask[None, :], other=0.0)
    pw = p
    if KV_FP8:
        pw = p * tl.load(VS_HEAD + slots * stride_vsn, mask=n_mask, other=0.0)[None, :]
    if PV_F32:
        pv = tl.dot(pw, vv.to(tl.float32), input_precision="ieee")
    elif KV_FP8:
        pv = tl.dot(pw.to(q.dtype), vv.to(q.dtype))
    else:
        pv = tl.dot(pw.to(vv.dtype), vv)
    acc = acc * alpha[:, None] + pv
    return acc, l_i, m_new


# --------------------------------------------------------------------------------------------
# paged_attention_extend
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=['num_reqs', 'num_rows'])  # batch-dependent counts: one compile for all
def _extend_kernel(
    Q, K, V, O, LSE, QO, KVP, KVI, KS, VS, TREE,
    num_reqs, num_rows,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh, stride_lt,
    stride_ksn, stride_ksh, stride_vsn, stride_vsh,
    qk_mult, cap_mult, window,
    GROUP: tl.constexpr, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    QK_F32: tl.constexpr, PV_F32: tl.constexpr, KV_FP8: tl.constexpr = False, USE_TREE: tl.constexpr = False,
    HEAD_DPE: tl.constexpr = 0, BLOCK_DPE: tl.constexpr = 16,
):
    """USE_TREE: ``TREE`` ``[T]`` int64 ancestor bits per query (a speculative draft tree): the
    request's new tokens are masked by them; the unmasked interior stops at the cached prefix; with
    a window, each token's position for it is the prefix length + its depth (``_attend_block``)."""
    h = tl.program_id(0)
    # heaviest (last) causal blocks first; heads fastest so the heads of one kv group run together
    bid = tl.num_programs(1) - 1 - tl.program_id(1)
    # request owning virtual block `bid`: largest b with qo[b] // BLOCK_M + b <= bid
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_reqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        vstart = tl.load(QO + mid).to(tl.int32) // BLOCK_M + mid
        if vstart <= bid:
            lo = mid
        else:
            hi = mid
    req = lo
    q_start = tl.load(QO + req).to(tl.int32)
    q_len = tl.load(QO + req + 1).to(tl.int32) - q_start
    m0 = (bid - (q_start // BLOCK_M + req)) * BLOCK_M
    # the last request's ids also cover the padding rows [qo[-1], T)
    rows_end = tl.where(req == num_reqs - 1, num_rows - q_start, q_len)
    if m0 >= rows_end:
        return

    kv_start = tl.load(KVP + req).to(tl.int64)
    kv_len = (tl.load(KVP + req + 1).to(tl.int64) - kv_start).to(tl.int32)
    pos_base = kv_len - q_len
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_mask = offs_m < rows_end
    q_mask = offs_m < q_len
    qpos = pos_base + offs_m
    first_pos = pos_base + m0
    last_pos = pos_base + tl.minimum(m0 + BLOCK_M, q_len) - 1

    # kv range any row of the block can see; full_lo..full_hi: seen by every row (no 2-D mask)
    k_lo = tl.full([], 0, tl.int32)
    k_hi = kv_len
    full_lo = k_lo
    full_hi = kv_len
    if CAUSAL:
        k_hi = tl.minimum(kv_len, last_pos + 1)
        full_hi = tl.minimum(k_hi, first_pos + 1)
    if USE_TREE:
        full_hi = tl.minimum(full_hi, pos_base)
    if USE_WINDOW:
        # (a tree's rows sit at pos_base + depth <= their row position: the window may reach back
        # from pos_base; last_pos still bounds the keys every row sees)
        k_lo = tl.maximum(k_lo, (pos_base if USE_TREE else first_pos) - window + 1)
        full_lo = tl.maximum(k_lo, last_pos - window + 1)
    k_hi = tl.where(m0 < q_len, k_hi, k_lo)  # pure padding block: no keys
    k_lo = tl.minimum(k_lo, k_hi)
    # align the unmasked range to BLOCK_N steps from k_lo
    full_lo = tl.minimum(k_lo + tl.cdiv(tl.maximum(full_lo - k_lo, 0), BLOCK_N) * BLOCK_N, k_hi)
    full_hi = tl.maximum(full_hi, full_lo)
    full_hi = tl.minimum(full_lo + ((full_hi - full_lo) // BLOCK_N) * BLOCK_N, k_hi)

    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_D
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < HEAD_DV
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=q_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if QK_F32:
        q = q.to(tl.float32)
    elif not KV_FP8:  # (an FP8 cache's values convert to q's dtype instead)
        q = q.to(K.dtype.element_ty)
    offs_pe = tl.arange(0, BLOCK_DPE)
    pe_mask = offs_pe < HEAD_DPE
    q_pe = q
    if HEAD_DPE > 0:  # the second part of a split head dim (MLA's rope key)
        q_pe = tl.load(
            Q + q_rows[:, None] * stride_qt + h * stride_qh + HEAD_D + offs_pe[None, :],
            mask=q_mask[:, None] & pe_mask[None, :],
            other=0.0,
        ).to(q.dtype)

    kvh = h // GROUP
    K_HEAD = K + kvh * stride_kh
    V_HEAD = V + kvh * stride_vh
    KS_HEAD = KS + kvh * stride_ksh
    VS_HEAD = VS + kvh * stride_vsh
    KVI_REQ = KVI + kv_start
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    tree_bits = tl.zeros([BLOCK_M], tl.int64)
    wpos = qpos
    if USE_TREE:
        tree_bits = tl.load(TREE + q_start + offs_m, mask=q_mask, other=0)
        if USE_WINDOW:
            wpos = pos_base + _bit_count(tree_bits) - 1

    # window edge (masked), interior (unmasked), causal diagonal (masked)
    for n0 in range(k_lo, full_lo, BLOCK_N):
        acc, l_i, m_i = _attend_block(
            acc, l_i, m_i, q, K_HEAD, V_HEAD, KVI_REQ, stride_kn, stride_vn, offs_d, d_mask, offs_dv, dv_mask,
            n0, full_lo, qpos, window, qk_mult, cap_mult, KS_HEAD, VS_HEAD, stride_ksn, stride_vsn,
            BLOCK_N, CAUSAL, USE_WINDOW, USE_SOFTCAP, QK_F32, PV_F32, KV_FP8, tree_bits, pos_base, USE_TREE,
            q_pe, offs_pe, pe_mask, HEAD_D, HEAD_DPE > 0, wpos, TREE + q_start, q_len, USE_TREE and USE_WINDOW,
        )
    for n0 in range(full_lo, full_hi, BLOCK_N):
        acc, l_i, m_i = _attend_block(
            acc, l_i, m_i, q, K_HEAD, V_HEAD, KVI_REQ, stride_kn, stride_vn, offs_d, d_mask, offs_dv, dv_mask,
            n0, full_hi, qpos, window, qk_mult, cap_mult, KS_HEAD, VS_HEAD, stride_ksn, stride_vsn,
            BLOCK_N, False, False, USE_SOFTCAP, QK_F32, PV_F32, KV_FP8, tree_bits, pos_base, False,
            q_pe, offs_pe, pe_mask, HEAD_D, HEAD_DPE > 0,
        )
    for n0 in range(full_hi, k_hi, BLOCK_N):
        acc, l_i, m_i = _attend_block(
            acc, l_i, m_i, q, K_HEAD, V_HEAD, KVI_REQ, stride_kn, stride_vn, offs_d, d_mask, offs_dv, dv_mask,
            n0, k_hi, qpos, window, qk_mult, cap_mult, KS_HEAD, VS_HEAD, stride_ksn, stride_vsn,
            BLOCK_N, CAUSAL, USE_WINDOW, USE_SOFTCAP, QK_F32, PV_F32, KV_FP8, tree_bits, pos_base, USE_TREE,
            q_pe, offs_pe, pe_mask, HEAD_D, HEAD_DPE > 0, wpos, TREE + q_start, q_len, USE_TREE and USE_WINDOW,
        )

    seen = (l_i > 0.0) & q_mask
    l_safe = tl.where(seen, l_i, 1.0)
    out = tl.where(seen[:, None], acc / l_safe[:, None], 0.0)
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    o_rows = (q_start + offs_m).to(tl.int64)
    tl.store(
        O + o_rows[:, None] * stride_ot + h * stride_oh + offs_dv[None, :],
        out.to(O.dtype.element_ty),
        mask=row_mask[:, None] & dv_mask[None, :],
    )
    tl.store(LSE + o_rows * stride_lt + h, lse, mask=row_mask)


def _extend_config(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, d: int, dv: int) -> dict:
    # head dims <= 128: SGLang's Hopper choices, not benchmarked here (`config=` overrides)
    if _interpreting(q):
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    if max(d, dv) <= 64:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=1)
    if max(d, dv) <= 128:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=1)
    if max(d, dv) > _MAX_HEAD_DIM:  # MLA (512 + 64, v 512): a [BLOCK_M, 512] fp32 accumulator; not benchmarked
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=8, num_stages=1)
    if any(_dot_modes(q, k_cache, v_cache)):
        # fp32 dots at head dim 256 (an fp32 cache, or an fp32 query over a 16-bit one): the [BLOCK_M,
        # 256] fp32 query and accumulator live in registers. An fp32 query over a bf16 cache at head
        # dims 192 / 128 built for sm_90 on a CPU: the 16-bit tile below takes 255 registers and spills
        # 31.5 KB a thread (40 s to build), this one 97 registers, no spills (4 s).
        # fp32 K/V tiles of head dim 256 (an fp32 cache): Triton's shared-memory count for sm_90 is
        # 295424 bytes for the bf16 tile below (over the H100's 232448); 32 x 64 needs 106624 (under the
        # A100's 166912 too). Its fp32 dots hold the [BLOCK_M, 256] query and accumulator in registers:
        # built for sm_90 on a CPU (benchmarks/kda_intra_build.build_kernel, Triton 3.9's ptxas), 32 x 64
        # with 16 warps takes 128 registers and spills 352 bytes a thread (8 warps: 255 and 1,000), 4 s to
        # build; the 64 x 64 / 4-warp tile used before spilled 238 KB a thread in 194k SASS instructions
        # and took 71 s here (~130 s on an H100 host, per process on a cold Triton cache). Its GPU test
        # passed on an H200 (2026-11-29); not timed against the old tile
        return dict(BLOCK_M=32, BLOCK_N=64, num_warps=16, num_stages=1)
    # head dim 256 (Qwen3-Next): an H100 sweep of the last 8k chunk of a 32k prompt gave 9.9 ms
    # for this tile against 29.5 ms for 64 x 64 / 1 stage (387 vs 131 TFLOP/s)
    return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)


def _dot_modes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[bool, bool]:
    """(q.k in fp32, p@v in fp32): 16-bit tensor-core dots when the operands share a 16-bit dtype.

    Triton's interpreter multiplies the raw bits of bf16 operands in ``tl.dot`` (it stores bf16 as
    uint16), so on CPU bf16 operands go through the fp32 path; fp16 dots work there."""
    low = (torch.float16,) if _interpreting(q) else _LOW_PRECISION
    if k_cache.dtype == torch.float8_e4m3fn:  # e4m3 values convert exactly to q's 16-bit dtype
        return q.dtype not in low, q.dtype not in low
    qk_f32 = not (q.dtype == k_cache.dtype and q.dtype in low)
    pv_f32 = v_cache.dtype not in low
    return qk_f32, pv_f32


def _scale_args(k_cache: torch.Tensor, k_scale, v_scale) -> tuple:
    """(k_scale, v_scale, their 4 strides, KV_FP8): dummy pointers and zero strides for a float cache."""
    if k_scale is None:
        return k_cache, k_cache, (0, 0, 0, 0), False
    return k_scale, v_scale, (*k_scale.stride(), *v_scale.stride()), True


def paged_attention_extend_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
    causal: bool = True,
    sliding_window: int = -1,
    logit_softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,
    *,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``paged_attention_extend``: same arguments and results as the op. No host sync."""
    t, hq, d = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    d_main, d_pe = _split_head_dim("paged_attention_extend", d, dv)
    num_reqs = qo_indptr.shape[0] - 1
    if t == 0 or num_reqs == 0:
        o = torch.zeros(t, hq, dv, dtype=q.dtype, device=q.device)
        return o, torch.full((t, hq), float("-inf"), dtype=torch.float32, device=q.device)
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_attention_extend: the pools' last dim must be contiguous")
    q = _last_dim_contiguous(q)
    cfg = dict(config or _extend_config(q, k_cache, v_cache, d, dv))
    block_m, block_n = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    o = torch.empty(t, hq, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(t, hq, dtype=torch.float32, device=q.device)
    qk_mult, cap_mult, use_softcap = _softmax_params(scale, logit_softcap)
    qk_f32, pv_f32 = _dot_modes(q, k_cache, v_cache)
    use_window = sliding_window > 0
    ks, vs, s_strides, kv_fp8 = _scale_args(k_cache, k_scale, v_scale)
    grid = (hq, triton.cdiv(t, block_m) + num_reqs)
    _extend_kernel[grid](
        q, k_cache, v_cache, o, lse, qo_indptr, kv_indptr, kv_indices, ks, vs,
        tree_mask if tree_mask is not None else kv_indptr,
        num_reqs, t,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        o.stride(0), o.stride(1), lse.stride(0), *s_strides,
        qk_mult, cap_mult, sliding_window if use_window else 0,
        GROUP=hq // hkv, HEAD_DV=dv, BLOCK_DV=_pow2(dv), **_head_dim_args(d_main, d_pe),
        BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=bool(causal), USE_WINDOW=use_window, USE_SOFTCAP=use_softcap, QK_F32=qk_f32, PV_F32=pv_f32,
        KV_FP8=kv_fp8, USE_TREE=tree_mask is not None, **cfg,
    )
    return o, lse


# --------------------------------------------------------------------------------------------
# paged_attention_decode (split-KV)
# --------------------------------------------------------------------------------------------


# the number of splits follows the batch size: a runtime value (and the split strides, 0 with one
# split), so that a new batch size compiles no new variant
@triton.jit(do_not_specialize=["num_splits", "stride_os", "stride_ls"])
def _decode_kernel(
    Q, K, V, O, LSE, KVP, KVI, KS, VS,
    stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_ls,
    stride_ksn, stride_ksh, stride_vsn, stride_vsh,
    qk_mult, cap_mult, window, num_splits,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_SPLIT_LEN: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, QK_F32: tl.constexpr, PV_F32: tl.constexpr,
    KV_FP8: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
    HEAD_DPE: tl.constexpr = 0, BLOCK_DPE: tl.constexpr = 16,
):
    pdl_wait_and_release(USE_PDL)  # programmatic dependent launch: wait for the kernel before (launch.py)
    b = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    G_BLOCKS: tl.constexpr = (GROUP + BLOCK_G - 1) // BLOCK_G
    kvh = hb // G_BLOCKS
    offs_g = (hb % G_BLOCKS) * BLOCK_G + tl.arange(0, BLOCK_G)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g

    kv_start = tl.load(KVP + b).to(tl.int64)
    kv_len = (tl.load(KVP + b + 1).to(tl.int64) - kv_start).to(tl.int32)
    lo = tl.full([], 0, tl.int32)
    if USE_WINDOW:
        lo = tl.maximum(lo, kv_len - window)
    n_vis = kv_len - lo
    # splits used by this request (fewer for short ones), each a multiple of BLOCK_N tokens
    n_split = tl.maximum(tl.minimum(tl.cdiv(n_vis, MIN_SPLIT_LEN), num_splits), 1)
    chunk = tl.cdiv(tl.cdiv(n_vis, n_split), BLOCK_N) * BLOCK_N
    s_lo = tl.minimum(lo + split * chunk, kv_len)
    s_hi = tl.minimum(s_lo + chunk, kv_len)

    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_D
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < HEAD_DV
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if QK_F32:
        q = q.to(tl.float32)
    elif not KV_FP8:
        q = q.to(K.dtype.element_ty)
    offs_pe = tl.arange(0, BLOCK_DPE)
    pe_mask = offs_pe < HEAD_DPE
    q_pe = q
    if HEAD_DPE > 0:  # the second part of a split head dim (MLA's rope key)
        q_pe = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + HEAD_D + offs_pe[None, :],
            mask=g_mask[:, None] & pe_mask[None, :],
            other=0.0,
        ).to(q.dtype)
    K_HEAD = K + kvh * stride_kh
    V_HEAD = V + kvh * stride_vh
    KS_HEAD = KS + kvh * stride_ksh
    VS_HEAD = VS + kvh * stride_vsh
    KVI_REQ = KVI + kv_start
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for n0 in range(s_lo, s_hi, BLOCK_N):
        acc, l_i, m_i = _attend_block(
            acc, l_i, m_i, q, K_HEAD, V_HEAD, KVI_REQ, stride_kn, stride_vn, offs_d, d_mask, offs_dv, dv_mask,
            n0, s_hi, m_i, window, qk_mult, cap_mult, KS_HEAD, VS_HEAD, stride_ksn, stride_vsn,
            BLOCK_N, False, False, USE_SOFTCAP, QK_F32, PV_F32, KV_FP8, m_i, 0, False,
            q_pe, offs_pe, pe_mask, HEAD_D, HEAD_DPE > 0,
        )
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = tl.where(seen[:, None], acc / l_safe[:, None], 0.0)
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(
        O + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_dv[None, :],
        out.to(O.dtype.element_ty),
        mask=g_mask[:, None] & dv_mask[None, :],
    )
    tl.store(LSE + b * stride_lb + heads * stride_lh + split * stride_ls, lse, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    O_PART, LSE_PART, O, LSE,
    stride_pb, stride_ph, stride_ps, stride_qb, stride_qh, stride_qs,
    stride_ob, stride_oh, stride_lb, stride_lh, num_splits,
    BLOCK_S: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait_and_release(USE_PDL)  # programmatic dependent launch: wait for the kernel before (launch.py)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_splits
    part_lse = tl.load(LSE_PART + b * stride_qb + h * stride_qh + offs_s * stride_qs, mask=s_mask, other=float("-inf"))
    m = tl.max(part_lse, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(part_lse - m_use)  # 0 for empty splits
    total = tl.sum(w, 0)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < HEAD_DV
    used = s_mask & (part_lse > float("-inf"))
    part_o = tl.load(
        O_PART + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_dv[None, :],
        mask=used[:, None] & dv_mask[None, :],
        other=0.0,
    )
    inv = tl.where(total > 0.0, 1.0 / tl.where(total > 0.0, total, 1.0), 0.0)
    out = tl.sum(part_o * (w * inv)[:, None], 0)
    lse = tl.where(total > 0.0, m_use + tl.log(tl.where(total > 0.0, total, 1.0)), float("-inf"))
    tl.store(O + b * stride_ob + h * stride_oh + offs_dv, out.to(O.dtype.element_ty), mask=dv_mask)
    tl.store(LSE + b * stride_lb + h * stride_lh, lse)


_MAX_DECODE_SPLITS = 16


def _decode_config(q: torch.Tensor, d: int, dv: int, group: int) -> dict:
    # sizes checked for register spills on sm_90 (ptxas resource usage), not yet benchmarked
    block_g = min(_pow2(group), 64 if max(d, dv) <= 128 else (32 if max(d, dv) <= _MAX_HEAD_DIM else 16))
    if _interpreting(q):
        return dict(BLOCK_G=block_g, BLOCK_N=16, num_warps=4, num_stages=1)
    block_n = 64 if max(d, dv) <= 64 and block_g <= 16 else 32
    return dict(BLOCK_G=block_g, BLOCK_N=block_n, num_warps=4 if block_g <= 16 else 8, num_stages=2)


def _decode_num_splits(q: torch.Tensor, programs: int) -> int:
    """Splits per request from shapes only: enough programs to fill about two waves of SMs."""
    sms = 4 if _interpreting(q) else sm_count(q.device)
    want = triton.cdiv(2 * sms, max(1, programs))
    return max(1, min(_MAX_DECODE_SPLITS, triton.next_power_of_2(want)))


def paged_attention_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
    sliding_window: int = -1,
    logit_softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``paged_attention_decode`` (split-KV). CUDA-graph safe: no host sync, shape-only grid."""
    bsz, hq, d = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    d_main, d_pe = _split_head_dim("paged_attention_decode", d, dv)
    o = torch.empty(bsz, hq, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(bsz, hq, dtype=torch.float32, device=q.device)
    if bsz == 0:
        return o, lse
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_attention_decode: the pools' last dim must be contiguous")
    q = _last_dim_contiguous(q)
    group = hq // hkv
    cfg = dict(config or _decode_config(q, d, dv, group))
    block_g, block_n = cfg.pop("BLOCK_G"), cfg.pop("BLOCK_N")
    head_blocks = hkv * triton.cdiv(group, block_g)
    if num_splits is None:
        num_splits = _decode_num_splits(q, bsz * head_blocks)
    qk_mult, cap_mult, use_softcap = _softmax_params(scale, logit_softcap)
    qk_f32, pv_f32 = _dot_modes(q, k_cache, v_cache)
    use_window = sliding_window > 0
    if num_splits == 1:
        o_part, lse_part, so, sl = o, lse, 0, 0
    else:
        o_part = torch.empty(bsz, hq, num_splits, dv, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(bsz, hq, num_splits, dtype=torch.float32, device=q.device)
        so, sl = o_part.stride(2), lse_part.stride(2)
    ks, vs, s_strides, kv_fp8 = _scale_args(k_cache, k_scale, v_scale)
    _decode_kernel[(bsz, head_blocks, num_splits)](
        q, k_cache, v_cache, o_part, lse_part, kv_indptr, kv_indices, ks, vs,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        o_part.stride(0), o_part.stride(1), so, lse_part.stride(0), lse_part.stride(1), sl, *s_strides,
        qk_mult, cap_mult, sliding_window if use_window else 0, num_splits,
        GROUP=group, BLOCK_G=block_g, HEAD_DV=dv, BLOCK_DV=_pow2(dv), **_head_dim_args(d_main, d_pe),
        BLOCK_N=block_n, MIN_SPLIT_LEN=max(2 * block_n, 64),
        USE_WINDOW=use_window, USE_SOFTCAP=use_softcap, QK_F32=qk_f32, PV_F32=pv_f32, KV_FP8=kv_fp8,
        **cfg,
        **pdl_launch(q.device),
    )
    if num_splits > 1:
        _decode_reduce_kernel[(bsz, hq)](
            o_part, lse_part, o, lse,
            o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
            o.stride(0), o.stride(1), lse.stride(0), lse.stride(1), num_splits,
            BLOCK_S=triton.next_power_of_2(max(num_splits, _MAX_DECODE_SPLITS)), HEAD_DV=dv,
            BLOCK_DV=triton.next_power_of_2(dv), num_warps=4 if dv >= 128 else 1,
            **pdl_launch(o.device),
        )
    return o, lse


# --------------------------------------------------------------------------------------------
# merge_attention_states
# --------------------------------------------------------------------------------------------


@triton.jit
def _merge_kernel(
    OA, LA, OB, LB, O, L,
    stride_at, stride_ah, stride_bt, stride_bh, stride_ot, stride_oh,
    stride_lat, stride_lah, stride_lbt, stride_lbh, stride_lt, stride_lh,
    H: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    la = tl.load(LA + t * stride_lat + offs_h * stride_lah, mask=h_mask, other=float("-inf"))
    lb = tl.load(LB + t * stride_lbt + offs_h * stride_lbh, mask=h_mask, other=float("-inf"))
    m = tl.maximum(la, lb)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(la - m_use)
    wb = tl.exp(lb - m_use)
    total = wa + wb
    ok = total > 0.0
    inv = tl.where(ok, 1.0 / tl.where(ok, total, 1.0), 0.0)
    offs_d = tl.arange(0, BLOCK_DV)
    mask = h_mask[:, None] & (offs_d < HEAD_DV)[None, :]
    oa = tl.load(OA + t * stride_at + offs_h[:, None] * stride_ah + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    ob = tl.load(OB + t * stride_bt + offs_h[:, None] * stride_bh + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    o = oa * (wa * inv)[:, None] + ob * (wb * inv)[:, None]
    tl.store(O + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :], o.to(O.dtype.element_ty), mask=mask)
    lse = tl.where(ok, m_use + tl.log(tl.where(ok, total, 1.0)), float("-inf"))
    tl.store(L + t * stride_lt + offs_h * stride_lh, lse, mask=h_mask)


def merge_attention_states_triton(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``merge_attention_states``: fresh ``o`` (o_a's dtype) and fp32 ``lse``."""
    t, h, dv = o_a.shape
    o = torch.empty(t, h, dv, dtype=o_a.dtype, device=o_a.device)
    lse = torch.empty(t, h, dtype=torch.float32, device=o_a.device)
    if t == 0 or h == 0:
        return o, lse
    if dv == 0:
        lse.copy_(torch.logaddexp(lse_a, lse_b))
        return o, lse
    o_a, o_b = _last_dim_contiguous(o_a), _last_dim_contiguous(o_b)
    block_dv = triton.next_power_of_2(dv)
    block_h = min(triton.next_power_of_2(h), max(1, 2048 // block_dv))
    _merge_kernel[(t, triton.cdiv(h, block_h))](
        o_a, lse_a, o_b, lse_b, o, lse,
        o_a.stride(0), o_a.stride(1), o_b.stride(0), o_b.stride(1), o.stride(0), o.stride(1),
        lse_a.stride(0), lse_a.stride(1), lse_b.stride(0), lse_b.stride(1), lse.stride(0), lse.stride(1),
        H=h, HEAD_DV=dv, BLOCK_H=block_h, BLOCK_DV=block_dv,
        num_warps=4 if block_h * block_dv >= 1024 else 1,
    )
    return o, lse


# --------------------------------------------------------------------------------------------
# registration as the CUDA kernels of the ops
# --------------------------------------------------------------------------------------------


def _store_kv_cache_cuda(k_cache, v_cache, slots, k, v, k_scale=None, v_scale=None):
    _check_store(k_cache, v_cache, slots, k, v, k_scale, v_scale)
    store_kv_cache_triton(k_cache, v_cache, slots, k, v, k_scale, v_scale)


def _paged_attention_extend_cuda(
    q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, scale, causal=True, sliding_window=-1, logit_softcap=0.0,
    k_scale=None, v_scale=None, tree_mask=None,
):
    _check_extend(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, sliding_window, logit_softcap,
                  k_scale, v_scale, causal, tree_mask)
    return paged_attention_extend_triton(
        q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, scale, causal, sliding_window, logit_softcap,
        k_scale, v_scale, tree_mask,
    )


def _paged_attention_decode_cuda(q, k_cache, v_cache, kv_indptr, kv_indices, scale, sliding_window=-1, logit_softcap=0.0,
                                 k_scale=None, v_scale=None):
    _check_decode(q, k_cache, v_cache, kv_indptr, kv_indices, sliding_window, logit_softcap, k_scale, v_scale)
    return paged_attention_decode_triton(q, k_cache, v_cache, kv_indptr, kv_indices, scale, sliding_window, logit_softcap,
                                         k_scale, v_scale)


def _merge_attention_states_cuda(o_a, lse_a, o_b, lse_b):
    _check_merge(o_a, lse_a, o_b, lse_b)
    return merge_attention_states_triton(o_a, lse_a, o_b, lse_b)


torch.library.register_kernel("hybrid_compile::store_kv_cache", "cuda", _store_kv_cache_cuda)
torch.library.register_kernel("hybrid_compile::paged_attention_extend", "cuda", _paged_attention_extend_cuda)
torch.library.register_kernel("hybrid_compile::paged_attention_decode", "cuda", _paged_attention_decode_cuda)
torch.library.register_kernel("hybrid_compile::merge_attention_states", "cuda", _merge_attention_states_cuda)
