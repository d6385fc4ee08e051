"""Triton kernels of the Mamba2 ops (``ssd_chunk_scan``, ``selective_state_update``).

Registered as the CUDA implementations of ``hybrid_compile::ssd_chunk_scan`` and
``hybrid_compile::selective_state_update``; the launchers also run on CPU tensors under
``TRITON_INTERPRET=1`` (that is how the CPU tests check them). Semantics, layouts and dtype
rules are those of :mod:`hybrid_compile.ops.mamba2` (all math in fp32, outputs in
``x.dtype``, state pools fp32/bf16/fp16 or e4m3 with per-row scales (:mod:`..fp8_cache`: the step
kernel dequantizes on load and quantizes on store; the chunked scan stages the batch's states
through fp32, :func:`.fp8_cache.stage_states`), slot -1 = padding).

``selective_state_update`` (decode / verify): one program per (P block, batch row, head)
keeps its ``[BLOCK_P, N]`` slice of the state in registers and walks the row's ``L`` steps;
CUDA-graph safe (no host sync, grid from shapes, padding rows handled in the kernel).

``ssd_chunk_scan`` (prefill / extend), the SSD chunked pipeline of mamba_ssm with chunks
aligned to each request's first token (``varlen_chunk_table``, computed on the device with a
shape-only number of rows, so the launcher never reads the device):

1. ``_ssd_dt_cumsum``      dt -> bias / softplus / clamp; per chunk cumsum of ``dt * A``.
2. ``_ssd_chunk_state``    state produced by each chunk from zero: ``(x * dt * decay)^T B``.
3. ``_ssd_state_passing``  per (request, head, block of P*N): sequential over the request's
                           chunks from its initial state; overwrites each chunk's row with the
                           state *before* the chunk (= the op's ``chunk_states`` rows) and
                           writes the final state to the pool.
4. ``_ssd_bmm``            ``CB = C B^T`` per chunk and group (lower-triangular blocks only).
5. ``_ssd_chunk_scan``     ``y = exp(cum) C·S_prev + causal(CB * decay * dt) x + D x``,
                           optional ``* silu(z)``.

Matmuls use ``tl.dot`` with fp32 accumulation. fp32 (or mixed-dtype) activations: fp32
operands, ``input_precision="ieee"``. bf16/fp16 activations (x, B, C of one dtype): by
default fp32 operands on TF32 tensor cores (:data:`SSD_DOT_OPERANDS` = ``"tf32"``); with
``"activation"`` the operands (states, decay-weighted CB, ...) are cast to the activation dtype
as mamba_ssm / vLLM do: faster, but for bf16 about 4x the rounding error (and for fp16 states
above 65504 would overflow). ``C B^T`` (two raw inputs) always
multiplies in the activation dtype, which is exact there. Triton's CPU interpreter (3.9)
computes bf16 ``tl.dot`` wrongly, so there the ``"activation"`` path rounds the operands to
bf16 and multiplies in fp32 (numerically the same products).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .._varlen import chunks_per_request, max_chunk_rows
from ..fp8_cache import MAMBA2_STATE_SCALE_DIM
from ..mamba2 import _check_selective_state_update, _check_ssd_chunk_scan, varlen_chunk_table
from .fp8_cache import keep_step_state, scan_on_staged_states, store_state_rows
from .common import flag_at, pow2, tree_path, tree_paths
from .common import softplus as _softplus
from .launch import pdl_launch, pdl_wait_and_release

__all__ = ["selective_state_update_triton", "ssd_chunk_scan_triton"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

#: Operands of the SSD matmuls when x, B, C are bf16 / fp16: "tf32" (fp32 operands, TF32
#: tensor cores) or "activation" (operands cast to the activation dtype, as mamba_ssm / vLLM).
SSD_DOT_OPERANDS = "tf32"

# tl.dot modes (constexpr DOT): fp32 operands exact; operands in the activation dtype;
# interpreter emulation of the latter for bf16 (round to bf16, multiply in fp32); TF32.
_DOT_IEEE, _DOT_LOWP, _DOT_EMULATE, _DOT_TF32 = 0, 1, 2, 3


# --------------------------------------------------------------------------------------------
# Shared device helpers
# --------------------------------------------------------------------------------------------


@triton.jit
def _discretize(dt, bias, dt_min, dt_max, HAS_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr):
    if HAS_BIAS:
        dt = dt + bias
    if DT_SOFTPLUS:
        dt = _softplus(dt)
    return tl.minimum(tl.maximum(dt, dt_min), dt_max)


@triton.jit
def _dot(a, b, DOT: tl.constexpr, LP: tl.constexpr):
    """a @ b with fp32 accumulation (see the module docstring for the modes)."""
    if DOT == 0:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif DOT == 1:
        out = tl.dot(a.to(LP), b.to(LP), out_dtype=tl.float32)
    elif DOT == 2:
        out = tl.dot(a.to(LP).to(tl.float32), b.to(LP).to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32")
    return out


def _dot_mode(*tensors: torch.Tensor) -> int:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1 or torch.float32 in dtypes:
        return _DOT_IEEE
    if SSD_DOT_OPERANDS == "tf32":
        return _DOT_TF32
    if SSD_DOT_OPERANDS != "activation":
        raise ValueError(f"SSD_DOT_OPERANDS must be 'tf32' or 'activation', got {SSD_DOT_OPERANDS!r}")
    if _INTERPRET and torch.bfloat16 in dtypes:
        return _DOT_EMULATE
    return _DOT_LOWP


# --------------------------------------------------------------------------------------------
# selective_state_update
# --------------------------------------------------------------------------------------------


@triton.jit
def _ssu_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dtb_ptr, state_ptr, idx_ptr, inter_ptr, out_ptr,
    state_scale_ptr, inter_scale_ptr, parent_ptr,
    L, P, N, R, dt_min, dt_max,
    sx_b, sx_t, sx_h, sx_p,
    sdt_b, sdt_t, sdt_h,
    sB_b, sB_t, sB_g, sB_n,
    sC_b, sC_t, sC_g, sC_n,
    sz_b, sz_t, sz_h, sz_p,
    ss_s, ss_h, ss_p, ss_n,
    si_b, si_t, si_h, si_p, si_n,
    so_b, so_t, so_h,
    sss_s, sss_h, sis_b, sis_t, sis_h, spar_b, spar_t,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    UPDATE_STATE: tl.constexpr, HAS_INTER: tl.constexpr, A_IS_LOG: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    STATE_FP8: tl.constexpr = False, INTER_FP8: tl.constexpr = False, ROUND_STEPS: tl.constexpr = False,
    TREE: tl.constexpr = False, USE_PDL: tl.constexpr = False, BL: tl.constexpr = 1,
):
    """STATE_FP8 / INTER_FP8: e4m3 buffers with one scale per (head, p) row over N (held whole here):
    dequantized on load, quantized on store. TREE: a draft tree (``parent_ptr`` ``[B, L]``, float
    buffers; ``BL`` a power of two >= L): node ``t`` starts from the state stored after its parent,
    or from the slot's state for parent -1; each root-to-leaf path has its own programs (grid axis
    0: path-major over the P blocks, :func:`.common.tree_path`) walking it with the state in
    registers (rounded to the intermediate buffer's dtype after each node, as stored), a node's
    output and state stored by the one path that owns it: depth + 1 steps, not ``L``."""
    pdl_wait_and_release(USE_PDL)  # programmatic dependent launch: wait for the kernel before (launch.py)
    pid_p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    if TREE:
        found, pid_p, i_path, on_path, owned = tree_path(parent_ptr + b * spar_b, spar_t, L, pid_p,
                                                         tl.cdiv(P, BLOCK_P), BL)
        if not found:  # fewer leaves than this program's path index
            return
    else:
        i_path = 0
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N
    out_ptrs = out_ptr + b * so_b + h * so_h + offs_p
    slot = tl.load(idx_ptr + b).to(tl.int64)
    if slot < 0:  # padding row: zero output (by the first path's programs), nothing read or written
        if i_path == 0:
            for t in range(L):
                tl.store(out_ptrs + t * so_t, tl.zeros((BLOCK_P,), dtype=tl.float32).to(out_ptr.dtype.element_ty),
                         mask=mask_p)
        return

    g = h // R
    mask_pn = mask_p[:, None] & mask_n[None, :]
    s_ptrs = state_ptr + slot * ss_s + h * ss_h + offs_p[:, None] * ss_p + offs_n[None, :] * ss_n
    S = tl.load(s_ptrs, mask=mask_pn, other=0.0).to(tl.float32)
    ss_ptrs = state_scale_ptr + slot * sss_s + h * sss_h + offs_p
    if STATE_FP8:
        S = S * tl.load(ss_ptrs, mask=mask_p, other=0.0)[:, None]
    A = tl.load(A_ptr + h).to(tl.float32)
    if A_IS_LOG:
        A = -tl.exp(A)
    Dh = 0.0
    if HAS_D:
        Dh = tl.load(D_ptr + h).to(tl.float32)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(dtb_ptr + h).to(tl.float32)
    x_ptrs = x_ptr + b * sx_b + h * sx_h + offs_p * sx_p
    z_ptrs = z_ptr + b * sz_b + h * sz_h + offs_p * sz_p
    dt_p = dt_ptr + b * sdt_b + h * sdt_h
    B_ptrs = B_ptr + b * sB_b + g * sB_g + offs_n * sB_n
    C_ptrs = C_ptr + b * sC_b + g * sC_g + offs_n * sC_n
    i_ptrs = inter_ptr + b * si_b + h * si_h + offs_p[:, None] * si_p + offs_n[None, :] * si_n
    inter_scales = inter_scale_ptr + b * sis_b + h * sis_h + offs_p
    for t in range(L):
        if TREE:
            keep = flag_at(owned, t, BL)
            if flag_at(on_path, t, BL):  # (masks as selects: the interpreter rejects ``block & scalar``)
                S = _ssu_step(S, t, x_ptrs, dt_p, B_ptrs, C_ptrs, z_ptrs, out_ptrs, i_ptrs, inter_scales, A, Dh, bias,
                              dt_min, dt_max, mask_p, mask_n, tl.where(keep, mask_p, False),
                              tl.where(keep, mask_pn, False), L, sx_t, sdt_t, sB_t, sC_t, sz_t, so_t, si_t, sis_t,
                              HAS_D, HAS_Z, HAS_BIAS, DT_SOFTPLUS, HAS_INTER, INTER_FP8, ROUND_STEPS, TREE)
        else:
            S = _ssu_step(S, t, x_ptrs, dt_p, B_ptrs, C_ptrs, z_ptrs, out_ptrs, i_ptrs, inter_scales, A, Dh, bias,
                          dt_min, dt_max, mask_p, mask_n, mask_p, mask_pn, L, sx_t, sdt_t, sB_t, sC_t, sz_t, so_t,
                          si_t, sis_t, HAS_D, HAS_Z, HAS_BIAS, DT_SOFTPLUS, HAS_INTER, INTER_FP8, ROUND_STEPS, TREE)
    if UPDATE_STATE:
        store_state_rows(s_ptrs, ss_ptrs, S, mask_pn, mask_p, STATE_FP8)


@triton.jit
def _ssu_step(S, t, x_ptrs, dt_p, B_ptrs, C_ptrs, z_ptrs, out_ptrs, i_ptrs, inter_scales, A, Dh, bias, dt_min, dt_max,
              mask_p, mask_n, m_out, m_inter, L, sx_t, sdt_t, sB_t, sC_t, sz_t, so_t, si_t, sis_t,
              HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
              HAS_INTER: tl.constexpr, INTER_FP8: tl.constexpr, ROUND_STEPS: tl.constexpr, TREE: tl.constexpr):
    """Step ``t`` of ``_ssu_kernel`` from state ``S``: its output stored under ``m_out``, the state after
    it under ``m_inter`` (the intermediate buffer); returns it (a tree: as the buffer stores it, the
    start of the node's children)."""
    x = tl.load(x_ptrs + t * sx_t, mask=mask_p, other=0.0).to(tl.float32)
    dt = tl.load(dt_p + t * sdt_t).to(tl.float32)
    dt = _discretize(dt, bias, dt_min, dt_max, HAS_BIAS, DT_SOFTPLUS)
    Bt = tl.load(B_ptrs + t * sB_t, mask=mask_n, other=0.0).to(tl.float32)
    Ct = tl.load(C_ptrs + t * sC_t, mask=mask_n, other=0.0).to(tl.float32)
    S = S * tl.exp(dt * A) + (x * dt)[:, None] * Bt[None, :]
    y = tl.sum(S * Ct[None, :], axis=1)
    if HAS_D:
        y += Dh * x
    if HAS_Z:
        z = tl.load(z_ptrs + t * sz_t, mask=mask_p, other=0.0).to(tl.float32)
        y = y * (z * tl.sigmoid(z))
    tl.store(out_ptrs + t * so_t, y.to(out_ptrs.dtype.element_ty), mask=m_out)
    return keep_step_state(S, t, L, i_ptrs + t * si_t, inter_scales + t * sis_t, m_inter, m_out, HAS_INTER, INTER_FP8,
                           ROUND_STEPS, TREE)


def _strides(t: torch.Tensor | None, ndim: int) -> tuple[int, ...]:
    return tuple(t.stride()) if t is not None else (0,) * ndim


def selective_state_update_triton(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_min: float,
    dt_max: float,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    disable_state_update: bool,
    intermediate_states: torch.Tensor | None,
    A_is_log: bool = False,
    ssm_scales: torch.Tensor | None = None,
    intermediate_scales: torch.Tensor | None = None,
    parent_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton ``selective_state_update`` (same arguments, mutations and result as the op; no validation)."""
    batch, steps, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    out = torch.empty(batch, steps, H, P, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    BLOCK_N = pow2(N, 2)
    BLOCK_P = min(pow2(P, 2), max(2, 1024 // BLOCK_N))
    paths, bl = tree_paths(steps, parent_indices is not None)
    grid = (triton.cdiv(P, BLOCK_P) * paths, batch, H)
    _ssu_kernel[grid](
        x, dt, A, B, C, D if D is not None else A, z if z is not None else x,
        dt_bias if dt_bias is not None else A, ssm_states, state_indices,
        intermediate_states if intermediate_states is not None else ssm_states, out,
        ssm_scales if ssm_scales is not None else A, intermediate_scales if intermediate_scales is not None else A,
        parent_indices if parent_indices is not None else state_indices,
        steps, P, N, H // G, float(dt_min), float(dt_max),
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *_strides(z, 4), *ssm_states.stride(),
        *_strides(intermediate_states, 5), out.stride(0), out.stride(1), out.stride(2),
        *(ssm_scales.stride()[:2] if ssm_scales is not None else (0, 0)),
        *(intermediate_scales.stride()[:3] if intermediate_scales is not None else (0, 0, 0)),
        *(parent_indices.stride() if parent_indices is not None else (0, 0)),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus),
        UPDATE_STATE=not disable_state_update, HAS_INTER=intermediate_states is not None, A_IS_LOG=bool(A_is_log),
        BLOCK_P=BLOCK_P, BLOCK_N=BLOCK_N, num_warps=4 if BLOCK_P * BLOCK_N >= 512 else 2,
        STATE_FP8=ssm_scales is not None, INTER_FP8=intermediate_scales is not None,
        ROUND_STEPS=ssm_scales is not None and steps > 1, TREE=parent_indices is not None,
        BL=bl,
        **pdl_launch(x.device),
    )
    return out


# --------------------------------------------------------------------------------------------
# ssd_chunk_scan: 1. dt processing + chunk cumsum of dt * A
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=['rows'])  # batch-dependent counts: one compile for all
def _ssd_dt_cumsum_kernel(
    dt_ptr, A_ptr, dtb_ptr, cseq_ptr, cstart_ptr, clen_ptr, idx_ptr, dt_out_ptr, dA_ptr,
    H, CS, rows, dt_min, dt_max, sdt_t, sdt_h,
    HAS_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    seq = tl.load(cseq_ptr + r)
    slot = tl.load(idx_ptr + tl.maximum(seq, 0))
    if (seq < 0) | (slot < 0):
        return
    start = tl.load(cstart_ptr + r).to(tl.int64)
    clen = tl.load(clen_ptr + r)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_l = tl.arange(0, BLOCK_L)
    mask_h = offs_h < H
    valid = mask_h[:, None] & (offs_l < clen)[None, :]
    dt = tl.load(dt_ptr + (start + offs_l)[None, :] * sdt_t + offs_h[:, None] * sdt_h, mask=valid, other=0.0)
    bias = tl.zeros((BLOCK_H,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(dtb_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    dt = _discretize(dt.to(tl.float32), bias[:, None], dt_min, dt_max, HAS_BIAS, DT_SOFTPLUS)
    dt = tl.where(valid, dt, 0.0)
    A = tl.load(A_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    dA = tl.cumsum(dt * A[:, None], axis=1)
    off = offs_h[:, None].to(tl.int64) * rows * CS + r * CS + offs_l[None, :]
    store_mask = mask_h[:, None] & (offs_l < CS)[None, :]
    tl.store(dt_out_ptr + off, dt, mask=store_mask)
    tl.store(dA_ptr + off, dA, mask=store_mask)


# --------------------------------------------------------------------------------------------
# 2. chunk states (state produced by each chunk from zero, at the chunk end)
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=['rows'])  # batch-dependent counts: one compile for all
def _ssd_chunk_state_kernel(
    x_ptr, B_ptr, dt_ptr, dA_ptr, cseq_ptr, cstart_ptr, clen_ptr, idx_ptr, states_ptr,
    H, P, N, R, CS, rows,
    sx_t, sx_h, sx_p, sB_t, sB_g, sB_n,
    DOT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    pid_pn = tl.program_id(2)
    seq = tl.load(cseq_ptr + r)
    slot = tl.load(idx_ptr + tl.maximum(seq, 0))
    if (seq < 0) | (slot < 0):
        return
    start = tl.load(cstart_ptr + r).to(tl.int64)
    clen = tl.load(clen_ptr + r)
    g = h // R
    nblk_n = tl.cdiv(N, BLOCK_N)
    offs_p = (pid_pn // nblk_n) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = (pid_pn % nblk_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, BLOCK_L)
    mask_p = offs_p < P
    mask_n = offs_n < N
    cum_base = h * rows * CS + r * CS
    dA_end = tl.load(dA_ptr + cum_base + CS - 1)
    x_base = x_ptr + h * sx_h + offs_p[:, None] * sx_p
    B_base = B_ptr + g * sB_g + offs_n[None, :] * sB_n
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for l0 in range(0, clen, BLOCK_L):
        ll = l0 + offs_l
        ml = ll < clen
        tok = start + ll
        xT = tl.load(x_base + tok[None, :] * sx_t, mask=mask_p[:, None] & ml[None, :], other=0.0)  # [P, L]
        Bl = tl.load(B_base + tok[:, None] * sB_t, mask=ml[:, None] & mask_n[None, :], other=0.0)  # [L, N]
        dA_l = tl.load(dA_ptr + cum_base + ll, mask=ml, other=0.0)
        dt_l = tl.load(dt_ptr + cum_base + ll, mask=ml, other=0.0)
        scale = tl.where(ml, tl.exp(dA_end - dA_l) * dt_l, 0.0)
        acc += _dot(xT, Bl.to(tl.float32) * scale[:, None], DOT, x_ptr.dtype.element_ty)
    st = states_ptr + (r * H + h) * P * N + offs_p[:, None] * N + offs_n[None, :]
    tl.store(st, acc, mask=mask_p[:, None] & mask_n[None, :])


# --------------------------------------------------------------------------------------------
# 3. state passing across each request's chunks
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=['rows'])  # batch-dependent counts: one compile for all
def _ssd_state_passing_kernel(
    states_ptr, dA_ptr, pool_ptr, idx_ptr, hinit_ptr, nch_ptr, rowoff_ptr,
    H, P, N, CS, rows,
    sp_s, sp_h, sp_p, sp_n, shi,
    BLOCK: tl.constexpr,
):
    pid_e = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    slot = tl.load(idx_ptr + b).to(tl.int64)
    nch = tl.load(nch_ptr + b)
    if (slot < 0) | (nch == 0):
        return
    row0 = tl.load(rowoff_ptr + b).to(tl.int64)
    has_init = tl.load(hinit_ptr + b * shi).to(tl.int32)
    offs = pid_e * BLOCK + tl.arange(0, BLOCK)
    mask = offs < P * N
    pool_ptrs = pool_ptr + slot * sp_s + h * sp_h + (offs // N) * sp_p + (offs % N) * sp_n
    # (block-shaped flag: the interpreter rejects a scalar bool combined into a mask)
    read = mask & ((offs * 0 + has_init) != 0)
    s = tl.load(pool_ptrs, mask=read, other=0.0).to(tl.float32)
    for j in range(nch):
        row = row0 + j
        ptrs = states_ptr + (row * H + h) * P * N + offs
        local = tl.load(ptrs, mask=mask, other=0.0)
        tl.store(ptrs, s, mask=mask)
        decay = tl.exp(tl.load(dA_ptr + h * rows * CS + row * CS + CS - 1))
        s = s * decay + local
    tl.store(pool_ptrs, s.to(pool_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# 4. CB = C B^T per chunk and group
# --------------------------------------------------------------------------------------------


@triton.jit
def _ssd_bmm_kernel(
    B_ptr, C_ptr, cseq_ptr, cstart_ptr, clen_ptr, idx_ptr, cb_ptr,
    G, N, CS,
    sB_t, sB_g, sB_n, sC_t, sC_g, sC_n,
    DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    pid_ms = tl.program_id(2)
    nblk_s = tl.cdiv(CS, BLOCK_S)
    m0 = (pid_ms // nblk_s) * BLOCK_M
    s0 = (pid_ms % nblk_s) * BLOCK_S
    seq = tl.load(cseq_ptr + r)
    slot = tl.load(idx_ptr + tl.maximum(seq, 0))
    clen = tl.load(clen_ptr + r)
    # padding chunks, blocks past the chunk's tokens and blocks above the diagonal are never read
    if (seq < 0) | (slot < 0) | (m0 >= clen) | (s0 >= clen) | (s0 >= m0 + BLOCK_M):
        return
    start = tl.load(cstart_ptr + r).to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_s = s0 + tl.arange(0, BLOCK_S)
    offs_k = tl.arange(0, BLOCK_K)
    mm = offs_m < clen
    ms = offs_s < clen
    C_base = C_ptr + g * sC_g + (start + offs_m)[:, None] * sC_t
    B_base = B_ptr + g * sB_g + (start + offs_s)[None, :] * sB_t
    acc = tl.zeros((BLOCK_M, BLOCK_S), dtype=tl.float32)
    for k0 in range(0, N, BLOCK_K):
        kk = k0 + offs_k
        mk = kk < N
        Cm = tl.load(C_base + kk[None, :] * sC_n, mask=mm[:, None] & mk[None, :], other=0.0)
        Bt = tl.load(B_base + kk[:, None] * sB_n, mask=mk[:, None] & ms[None, :], other=0.0)
        acc += _dot(Cm, Bt, DOT, C_ptr.dtype.element_ty)
    cb = cb_ptr + (r * G + g) * CS * CS + offs_m[:, None] * CS + offs_s[None, :]
    tl.store(cb, acc, mask=mm[:, None] & ms[None, :])


# --------------------------------------------------------------------------------------------
# 5. chunk scan: outputs
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=['rows'])  # batch-dependent counts: one compile for all
def _ssd_chunk_scan_kernel(
    x_ptr, z_ptr, C_ptr, D_ptr, cb_ptr, dt_ptr, dA_ptr, states_ptr, cseq_ptr, cstart_ptr, clen_ptr, idx_ptr,
    y_ptr,
    H, G, P, N, R, CS, rows,
    sx_t, sx_h, sx_p, sz_t, sz_h, sz_p, sC_t, sC_g, sC_n, sy_t, sy_h,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    pid_mp = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    nblk_p = tl.cdiv(P, BLOCK_P)
    m0 = (pid_mp // nblk_p) * BLOCK_M
    seq = tl.load(cseq_ptr + r)
    slot = tl.load(idx_ptr + tl.maximum(seq, 0))
    clen = tl.load(clen_ptr + r)
    if (seq < 0) | (slot < 0) | (m0 >= clen):
        return
    start = tl.load(cstart_ptr + r).to(tl.int64)
    g = h // R
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_p = (pid_mp % nblk_p) * BLOCK_P + tl.arange(0, BLOCK_P)
    mm = offs_m < clen
    mp = offs_p < P
    cum_base = h * rows * CS + r * CS
    dA_m = tl.load(dA_ptr + cum_base + offs_m, mask=mm, other=0.0)
    LP = x_ptr.dtype.element_ty

    # contribution of the state before the chunk: exp(cum_m) * C_m . S_prev
    offs_n = tl.arange(0, BLOCK_N)
    C_base = C_ptr + g * sC_g + (start + offs_m)[:, None] * sC_t
    S_base = states_ptr + (r * H + h) * P * N + offs_p[None, :] * N
    acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        nn = n0 + offs_n
        mn = nn < N
        Cm = tl.load(C_base + nn[None, :] * sC_n, mask=mm[:, None] & mn[None, :], other=0.0)
        St = tl.load(S_base + nn[:, None], mask=mn[:, None] & mp[None, :], other=0.0)  # [N, P]
        acc += _dot(Cm, St, DOT, LP)
    acc = acc * tl.exp(dA_m)[:, None]

    # intra-chunk causal part: sum_{s <= m} CB[m, s] exp(cum_m - cum_s) dt_s x_s
    offs_k = tl.arange(0, BLOCK_K)
    cb_base = cb_ptr + (r * G + g) * CS * CS + offs_m[:, None] * CS
    x_base = x_ptr + h * sx_h + offs_p[None, :] * sx_p
    k_end = tl.minimum(m0 + BLOCK_M, clen)
    for k0 in range(0, k_end, BLOCK_K):
        kk = k0 + offs_k
        mk = kk < clen
        causal = (kk[None, :] <= offs_m[:, None]) & mk[None, :] & mm[:, None]
        cb = tl.load(cb_base + kk[None, :], mask=causal, other=0.0)
        dA_k = tl.load(dA_ptr + cum_base + kk, mask=mk, other=0.0)
        dt_k = tl.load(dt_ptr + cum_base + kk, mask=mk, other=0.0)
        w = cb * tl.exp(tl.where(causal, dA_m[:, None] - dA_k[None, :], float("-inf"))) * dt_k[None, :]
        xk = tl.load(x_base + (start + kk)[:, None] * sx_t, mask=mk[:, None] & mp[None, :], other=0.0)
        acc += _dot(w, xk, DOT, LP)

    mask = mm[:, None] & mp[None, :]
    tok = (start + offs_m)[:, None]
    if HAS_D:
        xm = tl.load(x_ptr + h * sx_h + tok * sx_t + offs_p[None, :] * sx_p, mask=mask, other=0.0)
        acc += tl.load(D_ptr + h).to(tl.float32) * xm.to(tl.float32)
    if HAS_Z:
        zm = tl.load(z_ptr + h * sz_h + tok * sz_t + offs_p[None, :] * sz_p, mask=mask, other=0.0).to(tl.float32)
        acc = acc * (zm * tl.sigmoid(zm))
    tl.store(y_ptr + tok * sy_t + h * sy_h + offs_p[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


# Launch configurations (no autotuning). Chosen so that none of the kernels spills registers
# on sm_90 at P=64, N=128, chunk 256 (checked with ptxas resource usage; Triton 3.9).


def _chunk_state_config(P: int, N: int, CS: int, dot: int) -> dict:
    """Blocks of _ssd_chunk_state (tile [BLOCK_P, BLOCK_N] of the state, BLOCK_L tokens per step)."""
    return dict(BLOCK_P=min(64, pow2(P, 16)), BLOCK_N=min(128, pow2(N, 16)), BLOCK_L=min(64, pow2(CS, 16)),
                num_warps=8, num_stages=1 if dot == _DOT_IEEE else 2)


def _bmm_config(N: int, CS: int, dot: int) -> dict:
    return dict(BLOCK_M=min(64, pow2(CS, 16)), BLOCK_S=min(64, pow2(CS, 16)), BLOCK_K=min(64, pow2(N, 16)),
                num_warps=4, num_stages=2)


def _scan_config(P: int, N: int, CS: int, dot: int) -> dict:
    bm = min(64, pow2(CS, 16))
    return dict(BLOCK_M=bm, BLOCK_K=bm, BLOCK_P=min(64, pow2(P, 16)), BLOCK_N=min(64, pow2(N, 16)),
                num_warps=4, num_stages=2)


def _exact_dot_mode(dot: int, dtype: torch.dtype) -> int:
    """Mode for a product of two raw bf16/fp16 inputs (C B^T): the activation dtype is exact there."""
    if dot != _DOT_TF32:
        return dot
    return _DOT_EMULATE if _INTERPRET and dtype == torch.bfloat16 else _DOT_LOWP


def ssd_chunk_scan_triton(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_min: float,
    dt_max: float,
    ssm_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    chunk_size: int,
    output_chunk_states: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``ssd_chunk_scan`` (same arguments, mutation and results as the op; no validation).

    No host synchronisation: the chunk table has ``max_chunk_rows(T, B, chunk_size)`` rows
    (padding rows and padding requests' chunks exit at once).
    """
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    batch = cu_seqlens.shape[0] - 1
    CS = int(chunk_size)
    dev = x.device
    rows = max_chunk_rows(T, batch, CS)
    y = torch.zeros(T, H, P, dtype=x.dtype, device=dev)
    if T == 0 or batch == 0 or H == 0 or P == 0:
        return y, torch.zeros(rows if output_chunk_states else 0, H, P, N, dtype=torch.float32, device=dev)

    cseq, cstart, clen = varlen_chunk_table(cu_seqlens, CS, num_rows=rows)
    nch = chunks_per_request(cu_seqlens, CS)
    row_off = torch.cumsum(nch, 0) - nch
    hinit = has_initial_state.view(torch.uint8) if has_initial_state.dtype == torch.bool else has_initial_state

    dt_out = torch.empty(H, rows, CS, dtype=torch.float32, device=dev)
    dA_cs = torch.empty(H, rows, CS, dtype=torch.float32, device=dev)
    alloc = torch.zeros if output_chunk_states else torch.empty
    states = alloc(rows, H, P, N, dtype=torch.float32, device=dev)
    CB = torch.empty(rows, G, CS, CS, dtype=torch.float32, device=dev)
    dot = _dot_mode(x, B, C)

    # 1. dt + cumsum
    BLOCK_L = pow2(CS)
    BLOCK_H = min(pow2(H), max(1, 4096 // BLOCK_L))
    _ssd_dt_cumsum_kernel[(rows, triton.cdiv(H, BLOCK_H))](
        dt, A, dt_bias if dt_bias is not None else A, cseq, cstart, clen, state_indices, dt_out, dA_cs,
        H, CS, rows, float(dt_min), float(dt_max), dt.stride(0), dt.stride(1),
        HAS_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus), BLOCK_H=BLOCK_H, BLOCK_L=BLOCK_L,
        num_warps=4,
    )

    # 2. chunk states
    cfg = _chunk_state_config(P, N, CS, dot)
    grid = (rows, H, triton.cdiv(P, cfg["BLOCK_P"]) * triton.cdiv(N, cfg["BLOCK_N"]))
    _ssd_chunk_state_kernel[grid](
        x, B, dt_out, dA_cs, cseq, cstart, clen, state_indices, states,
        H, P, N, H // G, CS, rows, *x.stride(), *B.stride(), DOT=dot, **cfg,
    )

    # 3. state passing (writes the pool)
    BLOCK = min(1024, pow2(P * N))
    _ssd_state_passing_kernel[(triton.cdiv(P * N, BLOCK), batch, H)](
        states, dA_cs, ssm_states, state_indices, hinit, nch, row_off,
        H, P, N, CS, rows, *ssm_states.stride(), hinit.stride(0),
        BLOCK=BLOCK, num_warps=4,
    )

    # 4. CB
    cfg = _bmm_config(N, CS, dot)
    grid = (rows, G, triton.cdiv(CS, cfg["BLOCK_M"]) * triton.cdiv(CS, cfg["BLOCK_S"]))
    _ssd_bmm_kernel[grid](
        B, C, cseq, cstart, clen, state_indices, CB, G, N, CS, *B.stride(), *C.stride(),
        DOT=_exact_dot_mode(dot, C.dtype), **cfg,
    )

    # 5. outputs
    cfg = _scan_config(P, N, CS, dot)
    assert cfg["BLOCK_M"] == cfg["BLOCK_K"]
    zz = z if z is not None else x
    _ssd_chunk_scan_kernel[(rows, triton.cdiv(CS, cfg["BLOCK_M"]) * triton.cdiv(P, cfg["BLOCK_P"]), H)](
        x, zz, C, D if D is not None else A, CB, dt_out, dA_cs, states, cseq, cstart, clen, state_indices, y,
        H, G, P, N, H // G, CS, rows,
        *x.stride(), *zz.stride(), *C.stride(), y.stride(0), y.stride(1),
        HAS_D=D is not None, HAS_Z=z is not None, DOT=dot, **cfg,
    )
    if not output_chunk_states:
        states = torch.zeros(0, H, P, N, dtype=torch.float32, device=dev)
    return y, states


# --------------------------------------------------------------------------------------------
# Registration as the CUDA kernels of the ops
# --------------------------------------------------------------------------------------------


def ssd_chunk_scan_fp8_aware(
    x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max, ssm_states, cu_seqlens, state_indices,
    has_initial_state, chunk_size, output_chunk_states, ssm_scales=None,
):
    """The SSD Triton pipeline on a float pool, or on an FP8 pool through an fp32 staging buffer of
    the batch's states (:func:`.fp8_cache.stage_states`)."""
    return scan_on_staged_states(
        lambda pool, slots: ssd_chunk_scan_triton(
            x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max, pool, cu_seqlens, slots,
            has_initial_state, chunk_size, output_chunk_states,
        ), ssm_states, ssm_scales, cu_seqlens, state_indices, MAMBA2_STATE_SCALE_DIM)


def _ssd_chunk_scan_cuda_impl(
    x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max, ssm_states, cu_seqlens, state_indices,
    has_initial_state, chunk_size, output_chunk_states, ssm_scales=None,
):
    _check_ssd_chunk_scan(
        x, dt, A, B, C, D, z, dt_bias, dt_min, dt_max, ssm_states, cu_seqlens, state_indices, has_initial_state,
        chunk_size, ssm_scales,
    )
    return ssd_chunk_scan_fp8_aware(
        x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max, ssm_states, cu_seqlens, state_indices,
        has_initial_state, chunk_size, output_chunk_states, ssm_scales,
    )


def _selective_state_update_cuda_impl(
    x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max, ssm_states, state_indices,
    disable_state_update, intermediate_states, A_is_log=False, ssm_scales=None, intermediate_scales=None,
    parent_indices=None,
):
    _check_selective_state_update(
        x, dt, A, B, C, D, z, dt_bias, dt_min, dt_max, ssm_states, state_indices, intermediate_states, A_is_log,
        ssm_scales, intermediate_scales, disable_state_update, parent_indices,
    )
    return selective_state_update_triton(
        x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max, ssm_states, state_indices,
        disable_state_update, intermediate_states, A_is_log, ssm_scales, intermediate_scales, parent_indices,
    )


torch.library.register_kernel("hybrid_compile::ssd_chunk_scan", "cuda", _ssd_chunk_scan_cuda_impl)
torch.library.register_kernel("hybrid_compile::selective_state_update", "cuda", _selective_state_update_cuda_impl)
