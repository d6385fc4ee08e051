"""Triton kernels of the lightning attention ops (:mod:`hybrid_compile.ops.lightning`), registered
as their CUDA implementations.

Same schemas and semantics as the plain-torch ops: q/k ``[..., H, K]``, v ``[..., H, V]`` (strided
views allowed), one decay slope per head, fp32 compute, outputs in ``v.dtype``, state pool
``[num_slots, H, K, V]`` read in fp32 and cast on write (or e4m3 with one scale per value column
over K: the recurrent kernel dequantizes on load and quantizes each store, the chunked kernel runs on
an fp32 staging copy of the batch's states, :func:`.fp8_cache.stage_states`), slot -1 = padding row
(zero output, nothing read or written).

Kernels (both: grid ``(B, H, cdiv(V, BV))``, the state block ``[K, BV]`` in registers, K padded
to a power of two and held whole; no host sync, so both are CUDA-graph safe):

- ``_lightning_recurrent_kernel`` (decode / verify): loops over the ``L`` steps,
  ``S = exp(-s) S + k v^T; o = q S``, stores the state after every step into
  ``intermediate_states[b, t]`` when given and the final state unless ``disable_state_update``;
  a draft tree (``TREE``) starts each step from its parent's stored row instead.
- ``_lightning_chunk_kernel`` (prefill / extend): loops over the request's chunks of
  ``LIGHTNING_CHUNK_SIZE`` tokens; per chunk ``o = (q * exp(-s (i + 1))) S + ((q k^T) * D) v``
  with ``D_ij = exp(-s (i - j))`` for ``j <= i``, then ``S = exp(-s c) S + (k * exp(-s (c-1-j)))^T v``;
  writes the state before each chunk into its ``_varlen`` chunk-state row when asked.

Import this module to register the kernels; the launchers also run on CPU tensors under
``TRITON_INTERPRET=1`` (how the tests use them).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .._varlen import chunk_row_offsets, max_chunk_rows
from ..lightning import LIGHTNING_CHUNK_SIZE, LIGHTNING_STATE_SCALE_DIM, _check_chunk, _check_recurrent
from .common import flag_at, tree_path, tree_paths
from .fp8_cache import keep_step_state, scan_on_staged_states, store_state_rows
from .launch import pdl_launch, pdl_wait_and_release

__all__ = ["chunk_lightning_attention_fp8_aware", "chunk_lightning_attention_triton",
           "recurrent_lightning_attention_update_triton"]

#: Largest head dim the kernels hold whole in registers (MiniMax: 128).
MAX_HEAD_DIM = 256


@triton.jit
def _lightning_recurrent_kernel(
    q, k, v, slope, o, pool, state_indices, inter, parents, pool_scales, inter_scales, L,
    s_qb, s_ql, s_qh, s_qd,
    s_kb, s_kl, s_kh, s_kd,
    s_vb, s_vl, s_vh, s_vd,
    s_ob, s_ol, s_oh,
    s_ps, s_ph, s_pk, s_pv,
    s_ib, s_il, s_ih, s_ik, s_iv,
    s_rb, s_rl,
    s_pss, s_psh, s_isb, s_isl, s_ish,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_INTER: tl.constexpr, UPDATE_STATE: tl.constexpr, USE_PDL: tl.constexpr, TREE: tl.constexpr = False,
    POOL_FP8: tl.constexpr = False, INTER_FP8: tl.constexpr = False, BL: tl.constexpr = 1,
):
    """TREE: a draft tree (``parents`` ``[B, L]``, float buffers; ``BL`` a power of two >= L): node ``t``
    starts from the state stored after its parent, or from the slot's state for parent -1; each
    root-to-leaf path has its own programs (grid axis 2: path-major over the value blocks,
    :func:`.common.tree_path`) walking it with the state in registers (rounded to the intermediate
    buffer's dtype after each node, as stored), a node's output and state stored by the one path
    that owns it: depth + 1 steps, not ``L``.
    POOL_FP8 / INTER_FP8: the pool / intermediate buffer is e4m3 with one scale per value column
    (``pool_scales [S, H, V]`` / ``inter_scales [B, L, H, V]``); with an e4m3 pool the state is rounded
    as a decode step would store it between the steps of a verify."""
    pdl_wait_and_release(USE_PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    iv = tl.program_id(2)
    if TREE:
        found, iv, _, on_path, owned = tree_path(parents + b * s_rb, s_rl, L, iv, (V + BV - 1) // BV, BL)
        if not found:  # fewer leaves than this program's path index
            return
    slot = tl.load(state_indices + b).to(tl.int64)
    if slot < 0:
        return  # o is zero-filled by the launcher
    rk = tl.arange(0, BK)
    rv = iv * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    m_s = mk[:, None] & mv[None, :]
    p_s = pool + slot * s_ps + h * s_ph + rk[:, None] * s_pk + rv[None, :] * s_pv
    S = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)
    p_ss = pool_scales + slot * s_pss + h * s_psh + rv
    if POOL_FP8:
        S = S * tl.load(p_ss, mask=mv, other=0.0)[None, :]
    decay = tl.exp(-tl.load(slope + h).to(tl.float32))
    p_i0 = inter + b * s_ib + h * s_ih + rk[:, None] * s_ik + rv[None, :] * s_iv
    p_q = q + b * s_qb + h * s_qh + rk * s_qd
    p_k = k + b * s_kb + h * s_kh + rk * s_kd
    p_v = v + b * s_vb + h * s_vh + rv * s_vd
    p_o = o + b * s_ob + h * s_oh + rv
    p_is = inter_scales + b * s_isb + h * s_ish + rv
    for t in range(L):
        if TREE:
            keep = flag_at(owned, t, BL)
            if flag_at(on_path, t, BL):  # (masks as selects: the interpreter rejects ``block & scalar``)
                S = _lightning_step(S, t, decay, p_q, p_k, p_v, p_o, p_i0, p_is, mk, mv,
                                    tl.where(keep, mv, False), tl.where(keep, m_s, False), L,
                                    s_ql, s_kl, s_vl, s_ol, s_il, s_isl, HAS_INTER, INTER_FP8, POOL_FP8, TREE)
        else:
            S = _lightning_step(S, t, decay, p_q, p_k, p_v, p_o, p_i0, p_is, mk, mv, mv, m_s, L,
                                s_ql, s_kl, s_vl, s_ol, s_il, s_isl, HAS_INTER, INTER_FP8, POOL_FP8, TREE)
    if UPDATE_STATE:
        store_state_rows(p_s, p_ss, S, m_s, mv, POOL_FP8, 0)


@triton.jit
def _lightning_step(S, t, decay, p_q, p_k, p_v, p_o, p_i0, p_is, mk, mv, m_out, m_inter, L,
                    s_ql, s_kl, s_vl, s_ol, s_il, s_isl, HAS_INTER: tl.constexpr, INTER_FP8: tl.constexpr,
                    POOL_FP8: tl.constexpr, TREE: tl.constexpr):
    """Step ``t`` of ``_lightning_recurrent_kernel`` from state ``S``: its output stored under
    ``m_out``, the state after it under ``m_inter`` (the intermediate buffer); returns it (a tree: as
    the buffer stores it, the start of the node's children)."""
    q_t = tl.load(p_q + t * s_ql, mask=mk, other=0.0).to(tl.float32)
    k_t = tl.load(p_k + t * s_kl, mask=mk, other=0.0).to(tl.float32)
    v_t = tl.load(p_v + t * s_vl, mask=mv, other=0.0).to(tl.float32)
    S = decay * S + k_t[:, None] * v_t[None, :]
    o_t = tl.sum(q_t[:, None] * S, axis=0)
    tl.store(p_o + t * s_ol, o_t.to(p_o.dtype.element_ty), mask=m_out)
    # FP8 pool: rounded between steps as a decode step would store it (the last: stored below)
    return keep_step_state(S, t, L, p_i0 + t * s_il, p_is + t * s_isl, m_inter, m_out, HAS_INTER,
                           INTER_FP8, POOL_FP8, TREE, 0)


@triton.jit
def _lightning_chunk_kernel(
    q, k, v, slope, o, pool, cu_seqlens, state_indices, has_initial_state, chunk_states, row_offsets,
    s_qt, s_qh, s_qd,
    s_kt, s_kh, s_kd,
    s_vt, s_vh, s_vd,
    s_ot, s_oh,
    s_ps, s_ph, s_pk, s_pv,
    s_cr, s_ch, s_ck, s_cv,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    OUT_CHUNKS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    iv = tl.program_id(2)
    slot = tl.load(state_indices + b).to(tl.int64)
    start = tl.load(cu_seqlens + b).to(tl.int64)
    end = tl.load(cu_seqlens + b + 1).to(tl.int64)
    if slot < 0 or end <= start:
        return  # o and chunk_states are zero-filled by the launcher
    rk = tl.arange(0, BK)
    rv = iv * BV + tl.arange(0, BV)
    rc = tl.arange(0, C)
    mk = rk < K
    mv = rv < V
    m_s = mk[:, None] & mv[None, :]
    p_s = pool + slot * s_ps + h * s_ph + rk[:, None] * s_pk + rv[None, :] * s_pv
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if tl.load(has_initial_state + b):
        S = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)
    s = tl.load(slope + h).to(tl.float32)
    pos = rc.to(tl.float32)
    diff = pos[:, None] - pos[None, :]
    causal = rc[:, None] >= rc[None, :]
    intra_decay = tl.where(causal, tl.exp(-s * tl.where(causal, diff, 0.0)), 0.0)  # [C, C]
    row = tl.load(row_offsets + b).to(tl.int64)
    for c0 in range(start, end, C):
        n = tl.minimum(end - c0, C)
        mt = rc < n
        if OUT_CHUNKS:
            p_c = chunk_states + row * s_cr + h * s_ch + rk[:, None] * s_ck + rv[None, :] * s_cv
            tl.store(p_c, S, mask=m_s)
            row += 1
        tok = c0 + rc
        q_c = tl.load(q + tok[:, None] * s_qt + h * s_qh + rk[None, :] * s_qd,
                      mask=mt[:, None] & mk[None, :], other=0.0).to(tl.float32)  # [C, BK]
        k_c = tl.load(k + tok[:, None] * s_kt + h * s_kh + rk[None, :] * s_kd,
                      mask=mt[:, None] & mk[None, :], other=0.0).to(tl.float32)
        v_c = tl.load(v + tok[:, None] * s_vt + h * s_vh + rv[None, :] * s_vd,
                      mask=mt[:, None] & mv[None, :], other=0.0).to(tl.float32)  # [C, BV]
        q_dec = q_c * tl.exp(-s * (pos + 1.0))[:, None]
        attn = tl.dot(q_c, tl.trans(k_c), input_precision="ieee") * intra_decay  # [C, C]
        out = tl.dot(q_dec, S, input_precision="ieee") + tl.dot(attn, v_c, input_precision="ieee")
        tl.store(o + tok[:, None] * s_ot + h * s_oh + rv[None, :], out.to(o.dtype.element_ty),
                 mask=mt[:, None] & mv[None, :])
        nf = n.to(tl.float32)
        k_dec = k_c * tl.where(mt, tl.exp(-s * (nf - 1.0 - pos)), 0.0)[:, None]
        S = tl.exp(-s * nf) * S + tl.dot(tl.trans(k_dec), v_c, input_precision="ieee")
    tl.store(p_s, S.to(pool.dtype.element_ty), mask=m_s)


def _check_head_dims(op: str, kd: int, vd: int) -> None:
    if kd > MAX_HEAD_DIM or vd > MAX_HEAD_DIM:
        raise ValueError(f"{op} (Triton): head dims K={kd}, V={vd} above {MAX_HEAD_DIM} are not supported")


def _blocks(kd: int, vd: int, cap: int):
    """(BK, BV): the whole K (at least 16, tl.dot's minimum) and V in blocks of at most ``cap``."""
    return max(16, triton.next_power_of_2(kd)), max(16, min(triton.next_power_of_2(vd), cap))


def recurrent_lightning_attention_update_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor, ssm_states: torch.Tensor,
    state_indices: torch.Tensor, disable_state_update: bool, intermediate_states: Optional[torch.Tensor],
    parent_indices: Optional[torch.Tensor] = None, ssm_scales: Optional[torch.Tensor] = None,
    intermediate_scales: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Triton implementation of ``recurrent_lightning_attention_update``. CUDA-graph safe."""
    bs, steps, h, kd = q.shape
    vd = v.shape[3]
    _check_head_dims("recurrent_lightning_attention_update", kd, vd)
    o = torch.zeros(bs, steps, h, vd, dtype=v.dtype, device=v.device)
    if bs == 0 or steps == 0:
        return o
    bk, bv = _blocks(kd, vd, 32)
    has_inter = intermediate_states is not None
    inter = intermediate_states if has_inter else ssm_states  # dummy pointer when absent
    paths, bl = tree_paths(steps, parent_indices is not None)
    _lightning_recurrent_kernel[(bs, h, triton.cdiv(vd, bv) * paths)](
        q, k, v, slope, o, ssm_states, state_indices, inter,
        parent_indices if parent_indices is not None else state_indices,
        ssm_scales if ssm_scales is not None else slope,  # dummy pointers when the buffers are float
        intermediate_scales if intermediate_scales is not None else slope, steps,
        *q.stride(), *k.stride(), *v.stride(), *o.stride()[:3], *ssm_states.stride(),
        *(intermediate_states.stride() if has_inter else (0, 0, 0, 0, 0)),
        *(parent_indices.stride() if parent_indices is not None else (0, 0)),
        *(ssm_scales.stride()[:2] if ssm_scales is not None else (0, 0)),
        *(intermediate_scales.stride()[:3] if intermediate_scales is not None else (0, 0, 0)),
        K=kd, V=vd, BK=bk, BV=bv, HAS_INTER=has_inter, UPDATE_STATE=not disable_state_update,
        TREE=parent_indices is not None, POOL_FP8=ssm_scales is not None, INTER_FP8=intermediate_scales is not None,
        BL=bl,
        num_warps=4 if bk * bv >= 4096 else 2, **pdl_launch(q.device),
    )
    return o


def chunk_lightning_attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor, ssm_states: torch.Tensor,
    cu_seqlens: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
    output_chunk_states: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of ``chunk_lightning_attention``. No host sync."""
    T, h, kd = q.shape
    vd = v.shape[2]
    _check_head_dims("chunk_lightning_attention", kd, vd)
    C = LIGHTNING_CHUNK_SIZE
    batch = state_indices.shape[0]
    o = torch.zeros(T, h, vd, dtype=v.dtype, device=v.device)
    rows = max_chunk_rows(T, batch, C) if output_chunk_states else 0
    chunk_states = torch.zeros(rows, h, kd, vd, dtype=torch.float32, device=v.device)
    if batch == 0 or T == 0:
        return o, chunk_states
    bk, bv = _blocks(kd, vd, 64 if kd <= 64 else 32)
    cs = chunk_states if output_chunk_states else o  # dummy pointer when absent
    _lightning_chunk_kernel[(batch, h, triton.cdiv(vd, bv))](
        q, k, v, slope, o, ssm_states, cu_seqlens, state_indices, has_initial_state, cs,
        chunk_row_offsets(cu_seqlens, C),
        *q.stride(), *k.stride(), *v.stride(), *o.stride()[:2], *ssm_states.stride(),
        *(chunk_states.stride() if output_chunk_states else (0, 0, 0, 0)),
        K=kd, V=vd, BK=bk, BV=bv, C=C, OUT_CHUNKS=output_chunk_states, num_warps=8 if bk >= 128 else 4,
    )
    return o, chunk_states


def chunk_lightning_attention_fp8_aware(q, k, v, slope, ssm_states, cu_seqlens, state_indices, has_initial_state,
                                        output_chunk_states, ssm_scales=None):
    """The chunked kernel on a float pool, or on an e4m3 pool through an fp32 staging copy of the
    batch's states (dequantized in, quantized back into the slots of the requests that had tokens)."""
    return scan_on_staged_states(
        lambda pool, slots: chunk_lightning_attention_triton(q, k, v, slope, pool, cu_seqlens, slots,
                                                             has_initial_state, output_chunk_states),
        ssm_states, ssm_scales, cu_seqlens, state_indices, LIGHTNING_STATE_SCALE_DIM)


def _chunk_cuda_impl(q, k, v, slope, ssm_states, cu_seqlens, state_indices, has_initial_state, output_chunk_states,
                     ssm_scales):
    _check_chunk(q, k, v, slope, ssm_states, cu_seqlens, state_indices, has_initial_state, ssm_scales)
    return chunk_lightning_attention_fp8_aware(q, k, v, slope, ssm_states, cu_seqlens, state_indices,
                                               has_initial_state, output_chunk_states, ssm_scales)


def _recurrent_cuda_impl(q, k, v, slope, ssm_states, state_indices, disable_state_update, intermediate_states,
                         ssm_scales, intermediate_scales, parent_indices=None):
    _check_recurrent(q, k, v, slope, ssm_states, state_indices, intermediate_states, disable_state_update,
                     parent_indices, ssm_scales, intermediate_scales)
    return recurrent_lightning_attention_update_triton(q, k, v, slope, ssm_states, state_indices,
                                                       disable_state_update, intermediate_states, parent_indices,
                                                       ssm_scales, intermediate_scales)


torch.library.register_kernel("hybrid_compile::chunk_lightning_attention", "cuda", _chunk_cuda_impl)
torch.library.register_kernel("hybrid_compile::recurrent_lightning_attention_update", "cuda", _recurrent_cuda_impl)
