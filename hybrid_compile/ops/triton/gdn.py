"""Triton kernels of the Gated DeltaNet ops (:mod:`hybrid_compile.ops.gdn`), registered as
their CUDA implementations.

Same schemas, semantics and layouts as the plain-torch ops: q/k ``[..., Hk, K]``, v
``[..., Hv, V]`` (strided views allowed: every stride is passed to the kernels), value head
``h`` reads q/k head ``h // (Hv // Hk)``, optional in-kernel L2 norm
``x * rsqrt(sum(x^2) + 1e-6)``, ``scale <= 0`` means ``K ** -0.5``, fp32 compute, outputs in
``v.dtype``, state pool ``[num_slots, Hv, K, V]`` fp32/bf16/fp16 read in fp32 and cast on
write (or e4m3 with per-value-column scales, :mod:`..fp8_cache`: the recurrent kernel dequantizes
on load and quantizes on store; the chunked pipeline stages the batch's states through fp32,
:func:`.fp8_cache.stage_states`), slot -1 = padding row (zero output, nothing read or written).

Kernels:

- ``_gdn_recurrent_kernel`` (decode ``fused_sigmoid_gating_delta_rule_update`` and verify
  ``fused_recurrent_gated_delta_rule_update``): grid ``(cdiv(V, BV), Hv, B)`` (the value blocks of
  one state launch together, as fla's kernel orders them: B <= 65535). Each program
  holds the state block ``[K, BV]`` (K padded to a power of two, loaded whole) in registers,
  loops over the ``L`` steps (1 for decode) with the gating (decode) and the q/k L2 norm done
  in-kernel, stores the per-step state into ``intermediate_states[b, t]`` when given, and
  writes the final state back in place unless ``disable_state_update``. CUDA-graph safe: the
  grid and the one allocation (``o``) depend on shapes only, no host sync, padding rows are
  handled inside the kernel. With a per-channel gate ``g [..., Hv, K]`` (Kimi Delta Attention)
  each state row ``k`` decays by its own ``exp(g_k)``.
- ``chunk_gated_delta_rule``: the chunked pipeline in :mod:`.gdn_chunk`, for per-head gates
  ``g [T, Hv]`` and per-channel ones ``g [T, Hv, K]`` (Kimi Delta Attention) alike.

Import this module to register the kernels (``torch.library.register_kernel(..., "cuda")``);
the launchers also run on CPU tensors under ``TRITON_INTERPRET=1`` (how the tests use them).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..fp8_cache import GDN_STATE_SCALE_DIM
from ..gdn import _check_chunk, _check_decode, _check_verify
from .common import flag_at, tree_path, tree_paths
from .fp8_cache import keep_step_state, scan_on_staged_states, store_state_rows
from .gdn_chunk import MAX_HEAD_K_DIM, chunk_gated_delta_rule_triton
from .launch import pdl_launch, pdl_wait_and_release

__all__ = [
    "chunk_gated_delta_rule_triton",
    "fused_recurrent_gated_delta_rule_update_triton",
    "fused_sigmoid_gating_delta_rule_update_triton",
]


@triton.jit
def _gdn_recurrent_kernel(
    q, k, v, g, beta, A_log, dt_bias, o, pool, state_indices, inter, pool_scales, inter_scales, parents,
    L, scale, softplus_beta, softplus_threshold,
    s_qb, s_ql, s_qh, s_qd,
    s_kb, s_kl, s_kh, s_kd,
    s_vb, s_vl, s_vh, s_vd,
    s_gb, s_gl, s_gh, s_gk,
    s_bb, s_bl, s_bh,
    s_ob, s_ol, s_oh,
    s_ps, s_ph, s_pk, s_pv,
    s_ib, s_il, s_ih, s_ik, s_iv,
    s_pss, s_psh, s_isb, s_isl, s_ish, s_parb, s_parl,
    R: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATING: tl.constexpr, USE_L2: tl.constexpr, HAS_INTER: tl.constexpr, UPDATE_STATE: tl.constexpr,
    POOL_FP8: tl.constexpr = False, INTER_FP8: tl.constexpr = False, ROUND_STEPS: tl.constexpr = False,
    TREE: tl.constexpr = False, USE_PDL: tl.constexpr = False, PER_K_GATE: tl.constexpr = False,
    BL: tl.constexpr = 1,
):
    """GATING: ``g``/``beta`` are the raw ``a``/``b`` projections and the gating is computed here.
    TREE: a draft tree (``parents`` ``[B, L]``, float buffers; ``BL`` a power of two >= L): node ``t``
    starts from the state stored after its parent, or from the slot's state for parent -1. Each
    root-to-leaf path has its own programs (grid axis 0: path-major over the value blocks,
    :func:`.common.tree_path`), which walk it with the state in registers, rounded after each
    node to the intermediate buffer's dtype as stored; a node's output and state are stored by the
    one path that owns it. A tree of depth ``d`` costs ``d + 1`` steps, not ``L``.
    POOL_FP8 / INTER_FP8: the pool / intermediate buffer is e4m3 with one scale per value column
    (over K, which this program holds whole): dequantized on load, quantized on store.
    PER_K_GATE: ``g`` holds one log-decay per key channel (Kimi Delta Attention), row ``k`` of the
    state decays by ``exp(g[..., k])``."""
    pdl_wait_and_release(USE_PDL)  # programmatic dependent launch: wait for the kernel before (launch.py)
    # grid (value blocks x paths, Hv, B): the value blocks of one (request, head) state launch
    # next to each other, so its rows are read and written while their DRAM pages are open
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2).to(tl.int64)
    i_hk = i_h // R
    if TREE:
        found, i_v, _, on_path, owned = tree_path(parents + i_b * s_parb, s_parl, L, i_v, (V + BV - 1) // BV, BL)
        if not found:  # fewer leaves than this program's path index
            return
    slot = tl.load(state_indices + i_b).to(tl.int64)
    live = slot >= 0

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mk = o_k < K
    mv = o_v < V
    # padding row: masks that select nothing (no state read or write), zero output
    m_s = (o_k[:, None] < tl.where(live, K, 0)) & mv[None, :]
    m_o = o_v < tl.where(live, V, 0)

    p_s = pool + tl.maximum(slot, 0) * s_ps + i_h * s_ph + o_k[:, None] * s_pk + o_v[None, :] * s_pv
    # the state streams through once (read here, written at the end): first out of the caches
    S = tl.load(p_s, mask=m_s, other=0.0, eviction_policy="evict_first").to(tl.float32)
    p_ss = pool_scales + tl.maximum(slot, 0) * s_pss + i_h * s_psh + o_v
    if POOL_FP8:
        S = S * tl.load(p_ss, mask=m_o, other=0.0)[None, :]
    neg_a = 0.0
    bias = 0.0
    if GATING:
        neg_a = -tl.exp(tl.load(A_log + i_h).to(tl.float32))
        bias = tl.load(dt_bias + i_h).to(tl.float32)

    p_q = q + i_b * s_qb + i_hk * s_qh + o_k * s_qd
    p_k = k + i_b * s_kb + i_hk * s_kh + o_k * s_kd
    p_v = v + i_b * s_vb + i_h * s_vh + o_v * s_vd
    p_g = g + i_b * s_gb + i_h * s_gh
    p_beta = beta + i_b * s_bb + i_h * s_bh
    p_o = o + i_b * s_ob + i_h * s_oh + o_v
    for t in range(L):
        if TREE:
            keep = flag_at(owned, t, BL)
            if flag_at(on_path, t, BL):  # (masks as selects: the interpreter rejects ``block & scalar``)
                S = _recurrent_node(S, t, p_q, p_k, p_v, p_g, p_beta, p_o, inter, inter_scales, o_k, o_v, mk, mv,
                                    tl.where(keep, m_s, False), tl.where(keep, m_o, False), tl.where(keep, mv, False),
                                    L, scale, softplus_beta, softplus_threshold, neg_a, bias,
                                    s_ql, s_kl, s_vl, s_gl, s_gk, s_bl, s_ol, i_b, i_h, s_ib, s_il, s_ih, s_ik, s_iv,
                                    s_isb, s_isl, s_ish, GATING, USE_L2, HAS_INTER, INTER_FP8, ROUND_STEPS, TREE,
                                    PER_K_GATE)
        else:
            S = _recurrent_node(S, t, p_q, p_k, p_v, p_g, p_beta, p_o, inter, inter_scales, o_k, o_v, mk, mv,
                                m_s, m_o, mv, L, scale, softplus_beta, softplus_threshold, neg_a, bias,
                                s_ql, s_kl, s_vl, s_gl, s_gk, s_bl, s_ol, i_b, i_h, s_ib, s_il, s_ih, s_ik, s_iv,
                                s_isb, s_isl, s_ish, GATING, USE_L2, HAS_INTER, INTER_FP8, ROUND_STEPS, TREE,
                                PER_K_GATE)
    if UPDATE_STATE:
        store_state_rows(p_s, p_ss, S, m_s, m_o, POOL_FP8, 0, STREAM=True)


@triton.jit
def _recurrent_node(S, t, p_q, p_k, p_v, p_g, p_beta, p_o, inter, inter_scales, o_k, o_v, mk, mv, m_s, m_o, m_out,
                    L, scale, softplus_beta, softplus_threshold, neg_a, bias,
                    s_ql, s_kl, s_vl, s_gl, s_gk, s_bl, s_ol, i_b, i_h, s_ib, s_il, s_ih, s_ik, s_iv,
                    s_isb, s_isl, s_ish, GATING: tl.constexpr, USE_L2: tl.constexpr, HAS_INTER: tl.constexpr,
                    INTER_FP8: tl.constexpr, ROUND_STEPS: tl.constexpr, TREE: tl.constexpr,
                    PER_K_GATE: tl.constexpr):
    """One step ``t`` of ``_gdn_recurrent_kernel`` from state ``S``: its output stored under
    ``m_out``, the state after it under ``m_s`` / ``m_o`` (the intermediate buffer); returns it (a
    tree: as the buffer stores it, the start of the node's children)."""
    b_q = tl.load(p_q + t * s_ql, mask=mk, other=0.0).to(tl.float32)
    b_k = tl.load(p_k + t * s_kl, mask=mk, other=0.0).to(tl.float32)
    b_v = tl.load(p_v + t * s_vl, mask=mv, other=0.0).to(tl.float32)
    if GATING:
        x = tl.load(p_g + t * s_gl).to(tl.float32) + bias
        bx = softplus_beta * x
        sp = tl.where(bx > softplus_threshold, x,
                      tl.log(1.0 + tl.exp(tl.minimum(bx, softplus_threshold))) / softplus_beta)
        b_g = neg_a * sp
        b_beta = tl.sigmoid(tl.load(p_beta + t * s_bl).to(tl.float32))
    elif PER_K_GATE:
        b_g = tl.load(p_g + t * s_gl + o_k * s_gk, mask=mk, other=0.0).to(tl.float32)
        b_beta = tl.load(p_beta + t * s_bl).to(tl.float32)
    else:
        b_g = tl.load(p_g + t * s_gl).to(tl.float32)
        b_beta = tl.load(p_beta + t * s_bl).to(tl.float32)
    if USE_L2:
        b_q = b_q * tl.math.rsqrt(tl.sum(b_q * b_q, 0) + 1e-6)
        b_k = b_k * tl.math.rsqrt(tl.sum(b_k * b_k, 0) + 1e-6)
    b_q = b_q * scale
    if PER_K_GATE:
        S = S * tl.exp(b_g)[:, None]
    else:
        S = S * tl.exp(b_g)
    delta = (b_v - tl.sum(S * b_k[:, None], 0)) * b_beta
    S = S + b_k[:, None] * delta[None, :]
    b_o = tl.sum(S * b_q[:, None], 0)
    tl.store(p_o + t * s_ol, tl.where(m_o, b_o, 0.0).to(p_o.dtype.element_ty), mask=m_out)
    p_i = inter + i_b * s_ib + t * s_il + i_h * s_ih + o_k[:, None] * s_ik + o_v[None, :] * s_iv
    return keep_step_state(S, t, L, p_i, inter_scales + i_b * s_isb + t * s_isl + i_h * s_ish + o_v, m_s, m_o,
                           HAS_INTER, INTER_FP8, ROUND_STEPS, TREE, 0)


def _recurrent_config(rows: int, kd: int, vd: int):
    """(BK, BV, num_warps) of the recurrent kernel from shapes: the whole K in one block, V split
    in blocks of 32 (16 when the grid would otherwise be small, to spread the state loads); two
    warps for a 128 x 32 block (H200, KDA decode 32 heads x 128 at batch 16-256: 2 warps stream
    the fp32 / bf16 state 5-15% faster than 4, 8 slower still;
    ``benchmarks/results/kda_decode_sweep_h200_2026-11-29.json``)."""
    bk = triton.next_power_of_2(kd)
    vp = triton.next_power_of_2(vd)
    bv = min(vp, 32)
    if rows * triton.cdiv(vd, bv) < 512:
        bv = min(vp, 16)
    num_warps = 4 if bk * bv >= 8192 else (2 if bk * bv >= 1024 else 1)
    return bk, bv, num_warps


def _check_k(op: str, kd: int) -> None:
    if kd > MAX_HEAD_K_DIM:
        raise ValueError(f"{op} (Triton): head_k_dim {kd} > {MAX_HEAD_K_DIM} is not supported")


def _launch_recurrent(q, k, v, g, beta, A_log, dt_bias, o, ssm_states, state_indices, inter, use_qk_l2norm, scale,
                      softplus_beta, softplus_threshold, gating, update_state, ssm_scales=None, inter_scales=None,
                      parents=None):
    """q, k [B, L, Hk, K]; v [B, L, Hv, V]; g/beta (or a/b) [B, L, Hv] (g also [B, L, Hv, K]);
    o [B, L, Hv, V]."""
    bs, steps, hk, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    per_k = g.dim() == 4
    g_strides = g.stride() if per_k else (*g.stride(), 0)
    bk, bv, num_warps = _recurrent_config(bs * hv, kd, vd)
    has_inter = inter is not None
    it = inter if has_inter else ssm_states  # dummy pointer when absent (never touched)
    i_strides = inter.stride() if has_inter else (0, 0, 0, 0, 0)
    a_log = A_log if gating else g
    dtb = dt_bias if gating else g
    ps = ssm_scales if ssm_scales is not None else g  # dummy pointers when the buffers are float
    iss = inter_scales if inter_scales is not None else g
    ps_strides = ssm_scales.stride()[:2] if ssm_scales is not None else (0, 0)
    is_strides = inter_scales.stride()[:3] if inter_scales is not None else (0, 0, 0)
    paths, bl = tree_paths(steps, parents is not None)
    if bs > 65535:  # the grid's third axis
        raise ValueError(f"GDN recurrent kernel (Triton): batch {bs} > 65535 rows in one call")
    _gdn_recurrent_kernel[(triton.cdiv(vd, bv) * paths, hv, bs)](
        q, k, v, g, beta, a_log, dtb, o, ssm_states, state_indices, it, ps, iss,
        parents if parents is not None else state_indices,
        steps, float(scale) if scale > 0 else float(kd) ** -0.5, float(softplus_beta), float(softplus_threshold),
        *q.stride(), *k.stride(), *v.stride(), *g_strides, *beta.stride(), *o.stride()[:3],
        *ssm_states.stride(), *i_strides, *ps_strides, *is_strides,
        *(parents.stride() if parents is not None else (0, 0)),
        R=hv // hk, K=kd, V=vd, BK=bk, BV=bv,
        GATING=gating, USE_L2=bool(use_qk_l2norm), HAS_INTER=has_inter, UPDATE_STATE=update_state,
        POOL_FP8=ssm_scales is not None, INTER_FP8=inter_scales is not None,
        ROUND_STEPS=ssm_scales is not None and steps > 1, TREE=parents is not None,
        PER_K_GATE=per_k, BL=bl,
        num_warps=num_warps,
        **pdl_launch(q.device),
    )


def fused_sigmoid_gating_delta_rule_update_triton(
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    use_qk_l2norm: bool,
    scale: float,
    softplus_beta: float,
    softplus_threshold: float,
    ssm_scales: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Triton implementation of ``fused_sigmoid_gating_delta_rule_update`` (decode; mutates
    ``ssm_states`` in place). CUDA-graph safe."""
    bs, hv, vd = v.shape
    _check_k("fused_sigmoid_gating_delta_rule_update", q.shape[-1])
    o = torch.empty(bs, hv, vd, dtype=v.dtype, device=v.device)
    if bs == 0:
        return o
    # one step: view [B, ...] as [B, 1, ...] (no copy)
    _launch_recurrent(q[:, None], k[:, None], v[:, None], a[:, None], b[:, None], A_log, dt_bias, o[:, None],
                      ssm_states, state_indices, None, use_qk_l2norm, scale, softplus_beta, softplus_threshold,
                      gating=True, update_state=True, ssm_scales=ssm_scales)
    return o


def fused_recurrent_gated_delta_rule_update_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    use_qk_l2norm: bool,
    scale: float,
    disable_state_update: bool,
    intermediate_states: Optional[torch.Tensor],
    ssm_scales: Optional[torch.Tensor] = None,
    intermediate_scales: Optional[torch.Tensor] = None,
    parent_indices: Optional[torch.Tensor] = None,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Triton implementation of ``fused_recurrent_gated_delta_rule_update`` (speculative verify;
    mutates ``ssm_states`` unless ``disable_state_update``, and ``intermediate_states[b, t]`` for
    real rows and ``t < L``; with ``A_log`` / ``dt_bias`` the kernel gates the raw ``g`` / ``beta``
    itself, as the decode kernel does). CUDA-graph safe."""
    bs, steps, hv, vd = v.shape
    _check_k("fused_recurrent_gated_delta_rule_update", q.shape[-1])
    o = torch.empty(bs, steps, hv, vd, dtype=v.dtype, device=v.device)
    if bs == 0 or steps == 0:
        return o
    _launch_recurrent(q, k, v, g, beta, A_log, dt_bias, o, ssm_states, state_indices, intermediate_states,
                      use_qk_l2norm, scale, 1.0, 20.0, gating=A_log is not None, update_state=not disable_state_update,
                      ssm_scales=ssm_scales, inter_scales=intermediate_scales, parents=parent_indices)
    return o


# ----------------------------------------------------------------------------------------------
# registration as the CUDA kernels of the ops
# ----------------------------------------------------------------------------------------------


def chunk_gated_delta_rule_fp8_aware(q, k, v, g, beta, ssm_states, cu_seqlens, state_indices, has_initial_state,
                                     use_qk_l2norm, scale, output_chunk_states, ssm_scales=None):
    """The chunked Triton kernels on a float pool, or on an FP8 pool through an fp32 staging buffer
    of the batch's states (:func:`.fp8_cache.stage_states`); the pipeline of :mod:`.gdn_chunk`
    (per-head or per-channel gate)."""
    chunk = chunk_gated_delta_rule_triton
    return scan_on_staged_states(
        lambda pool, slots: chunk(q, k, v, g, beta, pool, cu_seqlens, slots, has_initial_state, use_qk_l2norm, scale,
                                  output_chunk_states),
        ssm_states, ssm_scales, cu_seqlens, state_indices, GDN_STATE_SCALE_DIM)


def _chunk_cuda_impl(q, k, v, g, beta, ssm_states, cu_seqlens, state_indices, has_initial_state, use_qk_l2norm,
                     scale, output_chunk_states, ssm_scales=None):
    _check_chunk(q, k, v, g, beta, ssm_states, cu_seqlens, state_indices, has_initial_state, ssm_scales)
    return chunk_gated_delta_rule_fp8_aware(q, k, v, g, beta, ssm_states, cu_seqlens, state_indices,
                                            has_initial_state, use_qk_l2norm, scale, output_chunk_states, ssm_scales)


def _decode_cuda_impl(A_log, dt_bias, q, k, v, a, b, ssm_states, state_indices, use_qk_l2norm, scale, softplus_beta,
                      softplus_threshold, ssm_scales=None):
    _check_decode(A_log, dt_bias, q, k, v, a, b, ssm_states, state_indices, ssm_scales)
    return fused_sigmoid_gating_delta_rule_update_triton(A_log, dt_bias, q, k, v, a, b, ssm_states, state_indices,
                                                         use_qk_l2norm, scale, softplus_beta, softplus_threshold,
                                                         ssm_scales)


def _verify_cuda_impl(q, k, v, g, beta, ssm_states, state_indices, use_qk_l2norm, scale, disable_state_update,
                      intermediate_states, ssm_scales=None, intermediate_scales=None, parent_indices=None,
                      A_log=None, dt_bias=None):
    _check_verify(q, k, v, g, beta, ssm_states, state_indices, intermediate_states, ssm_scales, intermediate_scales,
                  disable_state_update, parent_indices, A_log, dt_bias)
    return fused_recurrent_gated_delta_rule_update_triton(q, k, v, g, beta, ssm_states, state_indices, use_qk_l2norm,
                                                          scale, disable_state_update, intermediate_states,
                                                          ssm_scales, intermediate_scales, parent_indices, A_log,
                                                          dt_bias)


torch.library.register_kernel("hybrid_compile::chunk_gated_delta_rule", "cuda", _chunk_cuda_impl)
torch.library.register_kernel("hybrid_compile::fused_sigmoid_gating_delta_rule_update", "cuda", _decode_cuda_impl)
torch.library.register_kernel("hybrid_compile::fused_recurrent_gated_delta_rule_update", "cuda", _verify_cuda_impl)
