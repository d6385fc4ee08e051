"""Triton kernels of the Mamba1 ops (``mamba1_selective_scan``, ``mamba1_state_update``).

Registered as the CUDA implementations of ``hybrid_compile::mamba1_selective_scan`` and
``hybrid_compile::mamba1_state_update``; the launchers also run on CPU tensors under
``TRITON_INTERPRET=1``. Semantics, layouts and dtype rules are those of
:mod:`hybrid_compile.ops.mamba1` (fp32 math, outputs in ``x.dtype``, slot -1 = padding). FP8 state pools: the step kernel dequantizes on load and
quantizes on store (one scale per channel over N, which a program holds whole); the scan stages the
batch's states through fp32 (:func:`.fp8_cache.stage_states`).

Both kernels give one program a block of ``BLOCK_D`` channels of one request (grid
``(cdiv(D_inner, BLOCK_D), requests)``), keep its ``[BLOCK_D, N]`` slice of the state and of ``A``
in registers (B / C are loaded per channel from the channel's group: ``G`` groups, Zamba's heads) and walk the request's tokens in order: the Mamba1 decay ``exp(dt[d] * A[d, n])``
differs per state entry, so (unlike Mamba2's SSD) there is no matmul form to chunk. Parallelism
comes from the channel blocks (``D_inner / BLOCK_D`` programs per request) and, in a step of long
requests, from time chunks (:func:`time_chunk_for`): since ``A`` is constant in time, a chunk's
decay of its start state is ``exp(A * sum dt)``, so each chunk's state from a zero start
(``_time_chunk_end_kernel``) and its ``dt`` sum give every chunk's true start state in one short
ordered pass (``_time_chunk_combine_kernel``, which also writes the final state), after which the
chunks are scanned side by side. The scan writes the state every ``chunk_size`` tokens of its
request to the chunk-state rows (``_varlen.py`` layout; row offsets computed on the device), so
the launchers never read the device and the decode / verify launcher is CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._varlen import chunk_row_offsets, max_chunk_rows
from ..fp8_cache import MAMBA1_STATE_SCALE_DIM
from ..mamba1 import _check_selective_scan, _check_state_update
from .common import flag_at, pow2, sm_count, softplus, tree_path, tree_paths
from .fp8_cache import keep_step_state, scan_on_staged_states, store_state_rows
from .launch import pdl_launch, pdl_wait_and_release

__all__ = ["mamba1_selective_scan_fp8_aware", "mamba1_selective_scan_triton", "mamba1_state_update_triton"]


@triton.jit
def _load_params(A_ptr, D_ptr, dtb_ptr, offs_d, offs_n, mask_d, mask_dn, sA_d, sA_n,
                 HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr, A_IS_LOG: tl.constexpr, BLOCK_D: tl.constexpr):
    """fp32 ``A`` block ``[BLOCK_D, BLOCK_N]`` (negated), ``D`` and ``dt_bias`` blocks ``[BLOCK_D]``."""
    A = tl.load(A_ptr + offs_d[:, None] * sA_d + offs_n[None, :] * sA_n, mask=mask_dn, other=0.0).to(tl.float32)
    if A_IS_LOG:
        A = -tl.exp(A)
    Dv = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(dtb_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    return A, Dv, bias


@triton.jit
def _channel_block(pid_d, D_inner, N, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program ``pid_d``'s channels and state columns and their masks: ``offs_d [BLOCK_D]``, ``offs_n
    [BLOCK_N]``, ``mask_d``, ``mask_dn [BLOCK_D, BLOCK_N]``."""
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_d = offs_d < D_inner
    return offs_d, offs_n, mask_d, mask_d[:, None] & (offs_n < N)[None, :]


@triton.jit
def _initial_state(s_ptrs, init_ptr, b, s_init, mask_dn, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """fp32 ``[BLOCK_D, BLOCK_N]`` start state of request ``b``: the pool's (``s_ptrs``) where its
    ``has_initial_state`` flag is set, else zeros."""
    S = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    if tl.load(init_ptr + b * s_init).to(tl.int32) != 0:
        S = tl.load(s_ptrs, mask=mask_dn, other=0.0).to(tl.float32)
    return S


@triton.jit
def _advance(S, A, bias, x_p, dt_p, B_p, mask_d, mask_dn, DT_SOFTPLUS: tl.constexpr):
    """The state half of one token for a block of channels: returns the new ``S``, ``x`` and the
    (biased, softplus'd) ``dt``."""
    x = tl.load(x_p, mask=mask_d, other=0.0).to(tl.float32)
    dt = tl.load(dt_p, mask=mask_d, other=0.0).to(tl.float32) + bias
    if DT_SOFTPLUS:
        dt = softplus(dt)
    Bt = tl.load(B_p, mask=mask_dn, other=0.0).to(tl.float32)
    S = S * tl.exp(dt[:, None] * A) + (dt * x)[:, None] * Bt
    return S, x, dt


@triton.jit
def _token(S, A, Dv, bias, x_p, dt_p, B_p, C_p, z_p, mask_d, mask_dn,
           HAS_D: tl.constexpr, HAS_Z: tl.constexpr, DT_SOFTPLUS: tl.constexpr):
    """One token of the recurrence for a block of channels: returns the new ``S`` and ``y``.
    ``B_p`` / ``C_p``: ``[BLOCK_D, BLOCK_N]`` pointers to each channel's group of B / C."""
    S, x, dt = _advance(S, A, bias, x_p, dt_p, B_p, mask_d, mask_dn, DT_SOFTPLUS)
    Ct = tl.load(C_p, mask=mask_dn, other=0.0).to(tl.float32)
    y = tl.sum(S * Ct, axis=1)
    if HAS_D:
        y += Dv * x
    if HAS_Z:
        z = tl.load(z_p, mask=mask_d, other=0.0).to(tl.float32)
        y = y * (z * tl.sigmoid(z))
    return S, y


# --------------------------------------------------------------------------------------------
# mamba1_selective_scan
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["chunk_size"])
def _scan_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dtb_ptr, state_ptr, cu_ptr, idx_ptr, init_ptr, rows_ptr,
    y_ptr, cs_ptr, tcs_ptr, tc_rows_ptr,
    D_inner, N, R, chunk_size, s_init,
    sx_t, sx_d, sdt_t, sdt_d, sA_d, sA_n, sB_t, sB_g, sB_n, sC_t, sC_g, sC_n, sz_t, sz_d,
    ss_s, ss_d, ss_n, sy_t, scs_r, scs_d,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    A_IS_LOG: tl.constexpr, CHUNK_STATES: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    TIME_CHUNK: tl.constexpr,
):
    """The scan of one channel block of one request (``TIME_CHUNK`` 0), or of one time chunk of it
    (``TIME_CHUNK`` tokens, chunk ``program_id(2)``) from the start state that
    :func:`_time_chunk_combine_kernel` left in the scratch rows ``tcs_ptr`` (the pool's state is
    then written by that kernel, not here)."""
    pid_d = tl.program_id(0)
    b = tl.program_id(1)
    slot = tl.load(idx_ptr + b).to(tl.int64)
    if slot < 0:  # padding request: y and chunk-state rows stay zero, the pool is untouched
        return
    start = tl.load(cu_ptr + b).to(tl.int64)
    end = tl.load(cu_ptr + b + 1).to(tl.int64)
    first = start
    last = end
    if TIME_CHUNK > 0:
        first = start + tl.program_id(2) * TIME_CHUNK
        if first >= end:
            return
        last = tl.minimum(first + TIME_CHUNK, end)
    offs_d, offs_n, mask_d, mask_dn = _channel_block(pid_d, D_inner, N, BLOCK_D, BLOCK_N)
    A, Dv, bias = _load_params(A_ptr, D_ptr, dtb_ptr, offs_d, offs_n, mask_d, mask_dn, sA_d, sA_n,
                               HAS_D, HAS_BIAS, A_IS_LOG, BLOCK_D)
    s_ptrs = state_ptr + slot * ss_s + offs_d[:, None] * ss_d + offs_n[None, :] * ss_n
    dn = offs_d[:, None] * N + offs_n[None, :]  # (a scratch row is [D_inner, N], contiguous)
    if TIME_CHUNK > 0:
        tc_row = tl.load(tc_rows_ptr + b) + tl.program_id(2)
        S = tl.load(tcs_ptr + tc_row * D_inner * N + dn, mask=mask_dn, other=0.0)
    else:
        S = _initial_state(s_ptrs, init_ptr, b, s_init, mask_dn, BLOCK_D, BLOCK_N)
    row0 = tl.load(rows_ptr + b)
    cs_ptrs = cs_ptr + offs_d[:, None] * scs_d + offs_n[None, :]
    B_ptrs = B_ptr + (offs_d // R)[:, None] * sB_g + offs_n[None, :] * sB_n  # each channel's B/C group
    C_ptrs = C_ptr + (offs_d // R)[:, None] * sC_g + offs_n[None, :] * sC_n
    for t in range(first, last):
        if CHUNK_STATES:
            j = t - start
            if j % chunk_size == 0:  # state after j tokens: row j // chunk_size of the request
                tl.store(cs_ptrs + (row0 + j // chunk_size) * scs_r, S, mask=mask_dn)
        S, y = _token(
            S, A, Dv, bias, x_ptr + t * sx_t + offs_d * sx_d, dt_ptr + t * sdt_t + offs_d * sdt_d,
            B_ptrs + t * sB_t, C_ptrs + t * sC_t, z_ptr + t * sz_t + offs_d * sz_d,
            mask_d, mask_dn, HAS_D, HAS_Z, DT_SOFTPLUS,
        )
        tl.store(y_ptr + t * sy_t + offs_d, y.to(y_ptr.dtype.element_ty), mask=mask_d)
    if TIME_CHUNK == 0 and end > start:
        tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=mask_dn)


@triton.jit
def _time_chunk_end_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, dtb_ptr, cu_ptr, idx_ptr, tcs_ptr, dts_ptr, tc_rows_ptr,
    D_inner, N, R, sx_t, sx_d, sdt_t, sdt_d, sA_d, sA_n, sB_t, sB_g, sB_n,
    HAS_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, A_IS_LOG: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, TIME_CHUNK: tl.constexpr,
):
    """Time-chunked scan, pass 1: each time chunk's state from a zero start (scratch row) and the
    sum of its ``dt`` per channel (its decay is ``exp(A * sum dt)``: ``A`` is constant in time)."""
    pid_d = tl.program_id(0)
    b = tl.program_id(1)
    c = tl.program_id(2)
    if tl.load(idx_ptr + b) < 0:
        return
    start = tl.load(cu_ptr + b).to(tl.int64)
    end = tl.load(cu_ptr + b + 1).to(tl.int64)
    first = start + c * TIME_CHUNK
    if first >= end:
        return
    last = tl.minimum(first + TIME_CHUNK, end)
    offs_d, offs_n, mask_d, mask_dn = _channel_block(pid_d, D_inner, N, BLOCK_D, BLOCK_N)
    A, _, bias = _load_params(A_ptr, x_ptr, dtb_ptr, offs_d, offs_n, mask_d, mask_dn, sA_d, sA_n,
                              False, HAS_BIAS, A_IS_LOG, BLOCK_D)
    B_ptrs = B_ptr + (offs_d // R)[:, None] * sB_g + offs_n[None, :] * sB_n
    S = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    dt_sum = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for t in range(first, last):
        S, _, dt = _advance(S, A, bias, x_ptr + t * sx_t + offs_d * sx_d, dt_ptr + t * sdt_t + offs_d * sdt_d,
                            B_ptrs + t * sB_t, mask_d, mask_dn, DT_SOFTPLUS)
        dt_sum += dt
    row = tl.load(tc_rows_ptr + b) + c
    tl.store(tcs_ptr + row * D_inner * N + offs_d[:, None] * N + offs_n[None, :], S, mask=mask_dn)
    tl.store(dts_ptr + row * D_inner + offs_d, dt_sum, mask=mask_d)


@triton.jit
def _time_chunk_combine_kernel(
    A_ptr, state_ptr, cu_ptr, idx_ptr, init_ptr, tcs_ptr, dts_ptr, tc_rows_ptr,
    D_inner, N, s_init, sA_d, sA_n, ss_s, ss_d, ss_n,
    A_IS_LOG: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, TIME_CHUNK: tl.constexpr,
):
    """Time-chunked scan, pass 2: walks a request's time chunks in order, replacing each scratch row
    by the chunk's true start state (``S = S * exp(A * sum dt) + chunk state``), and writes the
    final state into the pool."""
    pid_d = tl.program_id(0)
    b = tl.program_id(1)
    slot = tl.load(idx_ptr + b).to(tl.int64)
    if slot < 0:
        return
    n_tok = tl.load(cu_ptr + b + 1).to(tl.int64) - tl.load(cu_ptr + b).to(tl.int64)
    if n_tok <= 0:
        return
    offs_d, offs_n, mask_d, mask_dn = _channel_block(pid_d, D_inner, N, BLOCK_D, BLOCK_N)
    A, _, _ = _load_params(A_ptr, A_ptr, A_ptr, offs_d, offs_n, mask_d, mask_dn, sA_d, sA_n,
                           False, False, A_IS_LOG, BLOCK_D)
    s_ptrs = state_ptr + slot * ss_s + offs_d[:, None] * ss_d + offs_n[None, :] * ss_n
    S = _initial_state(s_ptrs, init_ptr, b, s_init, mask_dn, BLOCK_D, BLOCK_N)
    row0 = tl.load(tc_rows_ptr + b)
    dn = offs_d[:, None] * N + offs_n[None, :]
    for c in range((n_tok + TIME_CHUNK - 1) // TIME_CHUNK):
        p = tcs_ptr + (row0 + c) * D_inner * N + dn
        chunk = tl.load(p, mask=mask_dn, other=0.0)
        dts = tl.load(dts_ptr + (row0 + c) * D_inner + offs_d, mask=mask_d, other=0.0)
        tl.store(p, S, mask=mask_dn)
        S = S * tl.exp(A * dts[:, None]) + chunk
    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=mask_dn)


def _block_d(D_inner: int, BLOCK_N: int) -> int:
    """Channels per program, from the model's shape only (no recompile per batch): the walk over a
    request's tokens is sequential and latency-bound, so aim at ~128 programs per request (one
    prefill alone still spreads over the SMs), at least 8 channels, and a ``[BLOCK_D, BLOCK_N]`` fp32
    state + ``A`` of <= 1024 elements in registers."""
    return max(2, min(pow2(D_inner, 2), max(8, pow2(-(-D_inner // 128))), max(2, 1024 // BLOCK_N)))


# Time chunks: a step whose requests average at least TIME_CHUNK_MIN_TOKENS new tokens, and whose
# single walks leave the GPU idle, scans each request in chunks of TIME_CHUNK tokens in parallel (three
# launches: chunk states from zero, their combination in order, the scan of every chunk from its true
# start), so a long prefill is no longer one sequential walk per channel block: 4k tokens of one request
# are 16 programs per block, not one. The chunked scan does ~2.5x the single walk's work per token, so
# it pays only while the single walk runs at most TIME_CHUNK_MAX_WAVES programs per SM: the walk's time
# is its longest request's length (latency-bound, flat in the batch up to ~8 programs per SM), the
# chunks' time is the step's total tokens. Measured on an H200 at Jamba's 8192 channels (128 walk
# programs a request; benchmarks/kernels.py --only mamba1, 2026-11-29): 4k / 32k tokens of one request
# 2.10x / 2.60x faster in chunks, 8 requests of 4k each 0.42x (slower).
TIME_CHUNK = 256
TIME_CHUNK_MIN_TOKENS = 1024
TIME_CHUNK_MAX_WAVES = 2


def time_chunk_for(num_tokens: int, batch: int, D_inner: int, N: int, sms: int) -> int:
    """Tokens per time chunk of a scan over ``num_tokens`` tokens of ``batch`` requests of ``D_inner``
    channels and state size ``N`` on a GPU of ``sms`` SMs (shapes only, so one CUDA graph per bucket),
    0 for the single walk per request."""
    if batch <= 0 or num_tokens < TIME_CHUNK_MIN_TOKENS * batch:
        return 0
    walk_programs = batch * -(-D_inner // _block_d(D_inner, pow2(N, 2)))
    return TIME_CHUNK if walk_programs <= TIME_CHUNK_MAX_WAVES * sms else 0


def scan_tiles(D_inner: int, N: int, time_chunk: int) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_N, warps) of the scan kernels. Time chunks bring their own parallelism:
    ``[BLOCK_D, BLOCK_N]`` tiles of 256 on 2 warps (88 registers at Jamba's N = 16 in an sm_90
    build, against 187 for the single walk's 1024 on 4 warps), so that several programs share an SM."""
    BLOCK_N = pow2(N, 2)
    BLOCK_D = max(2, min(pow2(D_inner, 2), 256 // BLOCK_N)) if time_chunk else _block_d(D_inner, BLOCK_N)
    return BLOCK_D, BLOCK_N, 4 if BLOCK_D * BLOCK_N >= 512 else 2


def mamba1_selective_scan_triton(
    x, dt, A, B, C, D, z, dt_bias, dt_softplus, ssm_states, cu_seqlens, state_indices, has_initial_state, chunk_size,
    output_chunk_states, A_is_log=False, *, time_chunk: int | None = None,
):
    """Triton ``mamba1_selective_scan`` (same arguments, mutation and results as the op; no validation).
    ``time_chunk``: tokens per time chunk (0: one walk per request; None: :func:`time_chunk_for`)."""
    T, D_inner = x.shape
    G, N = B.shape[1], B.shape[2]
    batch = cu_seqlens.shape[0] - 1
    y = torch.zeros(T, D_inner, dtype=x.dtype, device=x.device)
    rows = max_chunk_rows(T, batch, chunk_size) if output_chunk_states else 0
    chunk_states = torch.zeros(rows, D_inner, N, dtype=torch.float32, device=x.device)
    if T == 0 or batch == 0:
        return y, chunk_states
    tc = time_chunk_for(T, batch, D_inner, N, sm_count(x.device)) if time_chunk is None else int(time_chunk)
    if tc < 0:
        raise ValueError(f"mamba1_selective_scan_triton: time_chunk must be >= 0, got {time_chunk}")
    row_offsets = chunk_row_offsets(cu_seqlens, chunk_size)
    BLOCK_D, BLOCK_N, warps = scan_tiles(D_inner, N, tc)
    # bool flags read as bytes (a strided view of the engine's metadata is fine)
    init = has_initial_state.view(torch.uint8) if has_initial_state.dtype == torch.bool else has_initial_state
    flags = dict(A_IS_LOG=bool(A_is_log), BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, TIME_CHUNK=tc)
    n_chunks = 1
    tc_states = tc_rows = y  # (unused unless time-chunked)
    if tc:
        n_chunks = triton.cdiv(T, tc)
        tc_rows = chunk_row_offsets(cu_seqlens, tc)
        tc_count = max_chunk_rows(T, batch, tc)
        tc_states = torch.empty(tc_count, D_inner, N, dtype=torch.float32, device=x.device)
        dt_sums = torch.empty(tc_count, D_inner, dtype=torch.float32, device=x.device)
        _time_chunk_end_kernel[(triton.cdiv(D_inner, BLOCK_D), batch, n_chunks)](
            x, dt, A, B, dt_bias if dt_bias is not None else x, cu_seqlens, state_indices, tc_states, dt_sums,
            tc_rows, D_inner, N, D_inner // G, *x.stride(), *dt.stride(), *A.stride(), *B.stride(),
            HAS_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus), num_warps=warps, **flags,
        )
        _time_chunk_combine_kernel[(triton.cdiv(D_inner, BLOCK_D), batch)](
            A, ssm_states, cu_seqlens, state_indices, init, tc_states, dt_sums, tc_rows,
            D_inner, N, init.stride(0), *A.stride(), *ssm_states.stride(), num_warps=warps, **flags,
        )
    _scan_kernel[(triton.cdiv(D_inner, BLOCK_D), batch, n_chunks)](
        x, dt, A, B, C, D if D is not None else x, z if z is not None else x, dt_bias if dt_bias is not None else x,
        ssm_states, cu_seqlens, state_indices, init, row_offsets, y, chunk_states, tc_states, tc_rows,
        D_inner, N, D_inner // G, chunk_size, init.stride(0),
        *x.stride(), *dt.stride(), *A.stride(), *B.stride(), *C.stride(), *(z.stride() if z is not None else (0, 0)),
        *ssm_states.stride(), y.stride(0), chunk_states.stride(0), chunk_states.stride(1),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus),
        CHUNK_STATES=bool(output_chunk_states), num_warps=warps, **flags,
    )
    return y, chunk_states


# --------------------------------------------------------------------------------------------
# mamba1_state_update
# --------------------------------------------------------------------------------------------


@triton.jit
def _update_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dtb_ptr, state_ptr, idx_ptr, inter_ptr, out_ptr,
    state_scale_ptr, inter_scale_ptr, parent_ptr,
    L, D_inner, N, R,
    sx_b, sx_t, sx_d, sdt_b, sdt_t, sdt_d, sA_d, sA_n, sB_b, sB_t, sB_g, sB_n, sC_b, sC_t, sC_g, sC_n,
    sz_b, sz_t, sz_d,
    ss_s, ss_d, ss_n, si_b, si_t, si_d, si_n, so_b, so_t, sss_s, sis_b, sis_t, spar_b, spar_t,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    UPDATE_STATE: tl.constexpr, HAS_INTER: tl.constexpr, A_IS_LOG: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    STATE_FP8: tl.constexpr = False, INTER_FP8: tl.constexpr = False, ROUND_STEPS: tl.constexpr = False,
    TREE: tl.constexpr = False, USE_PDL: tl.constexpr = False, BL: tl.constexpr = 1,
):
    """STATE_FP8 / INTER_FP8: e4m3 buffers with one scale per channel over N (held whole here).
    TREE: a draft tree (``parent_ptr`` ``[B, L]``, float buffers; ``BL`` a power of two >= L): node
    ``t`` starts from the state stored after its parent, or from the slot's state for parent -1;
    each root-to-leaf path has its own programs (grid axis 0: path-major over the channel blocks,
    :func:`.common.tree_path`) walking it with the state in registers (rounded to the intermediate
    buffer's dtype after each node, as stored), a node's output and state stored by the one path
    that owns it: depth + 1 steps, not ``L``."""
    pdl_wait_and_release(USE_PDL)  # programmatic dependent launch (launch.py)
    pid_d = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    if TREE:
        found, pid_d, i_path, on_path, owned = tree_path(parent_ptr + b * spar_b, spar_t, L, pid_d,
                                                         tl.cdiv(D_inner, BLOCK_D), BL)
        if not found:  # fewer leaves than this program's path index
            return
    else:
        i_path = 0
    offs_d, offs_n, mask_d, mask_dn = _channel_block(pid_d, D_inner, N, BLOCK_D, BLOCK_N)
    out_ptrs = out_ptr + b * so_b + offs_d
    slot = tl.load(idx_ptr + b).to(tl.int64)
    if slot < 0:  # padding row: zero output (by the first path's programs), nothing read or written
        if i_path == 0:
            for t in range(L):
                tl.store(out_ptrs + t * so_t, tl.zeros((BLOCK_D,), dtype=tl.float32).to(out_ptr.dtype.element_ty),
                         mask=mask_d)
        return
    A, Dv, bias = _load_params(A_ptr, D_ptr, dtb_ptr, offs_d, offs_n, mask_d, mask_dn, sA_d, sA_n,
                               HAS_D, HAS_BIAS, A_IS_LOG, BLOCK_D)
    s_ptrs = state_ptr + slot * ss_s + offs_d[:, None] * ss_d + offs_n[None, :] * ss_n
    S = tl.load(s_ptrs, mask=mask_dn, other=0.0).to(tl.float32)
    ss_ptrs = state_scale_ptr + slot * sss_s + offs_d
    if STATE_FP8:
        S = S * tl.load(ss_ptrs, mask=mask_d, other=0.0)[:, None]
    i_ptrs = inter_ptr + b * si_b + offs_d[:, None] * si_d + offs_n[None, :] * si_n
    B_ptrs = B_ptr + b * sB_b + (offs_d // R)[:, None] * sB_g + offs_n[None, :] * sB_n  # each channel's group
    C_ptrs = C_ptr + b * sC_b + (offs_d // R)[:, None] * sC_g + offs_n[None, :] * sC_n
    x_ptrs = x_ptr + b * sx_b + offs_d * sx_d
    dt_ptrs = dt_ptr + b * sdt_b + offs_d * sdt_d
    z_ptrs = z_ptr + b * sz_b + offs_d * sz_d
    inter_scales = inter_scale_ptr + b * sis_b + offs_d
    for t in range(L):
        if TREE:
            keep = flag_at(owned, t, BL)
            if flag_at(on_path, t, BL):  # (masks as selects: the interpreter rejects ``block & scalar``)
                S = _update_step(S, t, A, Dv, bias, x_ptrs, dt_ptrs, B_ptrs, C_ptrs, z_ptrs, out_ptrs, i_ptrs,
                                 inter_scales, mask_d, mask_dn, tl.where(keep, mask_d, False),
                                 tl.where(keep, mask_dn, False), L, sx_t, sdt_t, sB_t, sC_t, sz_t, so_t, si_t, sis_t,
                                 HAS_D, HAS_Z, DT_SOFTPLUS, HAS_INTER, INTER_FP8, ROUND_STEPS, TREE)
        else:
            S = _update_step(S, t, A, Dv, bias, x_ptrs, dt_ptrs, B_ptrs, C_ptrs, z_ptrs, out_ptrs, i_ptrs,
                             inter_scales, mask_d, mask_dn, mask_d, mask_dn, L, sx_t, sdt_t, sB_t, sC_t, sz_t, so_t,
                             si_t, sis_t, HAS_D, HAS_Z, DT_SOFTPLUS, HAS_INTER, INTER_FP8, ROUND_STEPS, TREE)
    if UPDATE_STATE:
        store_state_rows(s_ptrs, ss_ptrs, S, mask_dn, mask_d, STATE_FP8)


@triton.jit
def _update_step(S, t, A, Dv, bias, x_ptrs, dt_ptrs, B_ptrs, C_ptrs, z_ptrs, out_ptrs, i_ptrs, inter_scales,
                 mask_d, mask_dn, m_out, m_inter, L, sx_t, sdt_t, sB_t, sC_t, sz_t, so_t, si_t, sis_t,
                 HAS_D: tl.constexpr, HAS_Z: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_INTER: tl.constexpr,
                 INTER_FP8: tl.constexpr, ROUND_STEPS: tl.constexpr, TREE: tl.constexpr):
    """Step ``t`` of ``_update_kernel`` from state ``S``: its output stored under ``m_out``, the state
    after it under ``m_inter`` (the intermediate buffer); returns it (a tree: as the buffer stores
    it, the start of the node's children)."""
    S, y = _token(S, A, Dv, bias, x_ptrs + t * sx_t, dt_ptrs + t * sdt_t, B_ptrs + t * sB_t, C_ptrs + t * sC_t,
                  z_ptrs + t * sz_t, mask_d, mask_dn, HAS_D, HAS_Z, DT_SOFTPLUS)
    tl.store(out_ptrs + t * so_t, y.to(out_ptrs.dtype.element_ty), mask=m_out)
    return keep_step_state(S, t, L, i_ptrs + t * si_t, inter_scales + t * sis_t, m_inter, m_out, HAS_INTER, INTER_FP8,
                           ROUND_STEPS, TREE)


def mamba1_state_update_triton(
    x, dt, A, B, C, D, z, dt_bias, dt_softplus, ssm_states, state_indices, disable_state_update,
    intermediate_states, A_is_log=False, ssm_scales=None, intermediate_scales=None, parent_indices=None,
):
    """Triton ``mamba1_state_update`` (same arguments, mutations and result as the op; no validation)."""
    batch, steps, D_inner = x.shape
    G, N = B.shape[2], B.shape[3]
    out = torch.empty(batch, steps, D_inner, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    BLOCK_N = pow2(N, 2)
    BLOCK_D = _block_d(D_inner, BLOCK_N)
    inter = intermediate_states
    paths, bl = tree_paths(steps, parent_indices is not None)
    _update_kernel[(triton.cdiv(D_inner, BLOCK_D) * paths, batch)](
        x, dt, A, B, C, D if D is not None else x, z if z is not None else x, dt_bias if dt_bias is not None else x,
        ssm_states, state_indices, inter if inter is not None else ssm_states, out,
        ssm_scales if ssm_scales is not None else A, intermediate_scales if intermediate_scales is not None else A,
        parent_indices if parent_indices is not None else state_indices,
        steps, D_inner, N, D_inner // G,
        *x.stride(), *dt.stride(), *A.stride(), *B.stride(), *C.stride(), *(z.stride() if z is not None else (0, 0, 0)),
        *ssm_states.stride(), *(inter.stride() if inter is not None else (0, 0, 0, 0)), out.stride(0), out.stride(1),
        ssm_scales.stride(0) if ssm_scales is not None else 0,
        *(intermediate_scales.stride()[:2] if intermediate_scales is not None else (0, 0)),
        *(parent_indices.stride() if parent_indices is not None else (0, 0)),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus),
        UPDATE_STATE=not disable_state_update, HAS_INTER=inter is not None, A_IS_LOG=bool(A_is_log),
        BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, num_warps=4 if BLOCK_D * BLOCK_N >= 512 else 2,
        STATE_FP8=ssm_scales is not None, INTER_FP8=intermediate_scales is not None,
        ROUND_STEPS=ssm_scales is not None and steps > 1, TREE=parent_indices is not None,
        BL=bl,
        **pdl_launch(x.device),
    )
    return out


# --------------------------------------------------------------------------------------------
# Registration as the CUDA kernels of the ops
# --------------------------------------------------------------------------------------------


def mamba1_selective_scan_fp8_aware(
    x, dt, A, B, C, D, z, dt_bias, dt_softplus, ssm_states, cu_seqlens, state_indices, has_initial_state, chunk_size,
    output_chunk_states, A_is_log=False, ssm_scales=None,
):
    """The scan kernel on a float pool, or on an FP8 pool through an fp32 staging buffer of the
    batch's states (:func:`.fp8_cache.stage_states`)."""
    return scan_on_staged_states(
        lambda pool, slots: mamba1_selective_scan_triton(
            x, dt, A, B, C, D, z, dt_bias, dt_softplus, pool, cu_seqlens, slots, has_initial_state, chunk_size,
            output_chunk_states, A_is_log,
        ), ssm_states, ssm_scales, cu_seqlens, state_indices, MAMBA1_STATE_SCALE_DIM)


def _selective_scan_cuda_impl(
    x, dt, A, B, C, D, z, dt_bias, dt_softplus, ssm_states, cu_seqlens, state_indices, has_initial_state, chunk_size,
    output_chunk_states, A_is_log=False, ssm_scales=None,
):
    _check_selective_scan(
        x, dt, A, B, C, D, z, dt_bias, ssm_states, cu_seqlens, state_indices, has_initial_state, chunk_size, A_is_log,
        ssm_scales,
    )
    return mamba1_selective_scan_fp8_aware(
        x, dt, A, B, C, D, z, dt_bias, dt_softplus, ssm_states, cu_seqlens, state_indices, has_initial_state,
        chunk_size, output_chunk_states, A_is_log, ssm_scales,
    )


def _state_update_cuda_impl(
    x, dt, A, B, C, D, z, dt_bias, dt_softplus, ssm_states, state_indices, disable_state_update,
    intermediate_states, A_is_log=False, ssm_scales=None, intermediate_scales=None, parent_indices=None,
):
    _check_state_update(x, dt, A, B, C, D, z, dt_bias, ssm_states, state_indices, intermediate_states, A_is_log,
                        ssm_scales, intermediate_scales, disable_state_update, parent_indices)
    return mamba1_state_update_triton(
        x, dt, A, B, C, D, z, dt_bias, dt_softplus, ssm_states, state_indices, disable_state_update,
        intermediate_states, A_is_log, ssm_scales, intermediate_scales, parent_indices,
    )


torch.library.register_kernel("hybrid_compile::mamba1_selective_scan", "cuda", _selective_scan_cuda_impl)
torch.library.register_kernel("hybrid_compile::mamba1_state_update", "cuda", _state_update_cuda_impl)
