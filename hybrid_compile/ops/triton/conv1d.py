"""Triton kernels of the causal conv1d ops (:mod:`hybrid_compile.ops.conv1d`).

Same schemas, semantics and layouts as the plain-torch ops: packed ``x [T, D]`` (or
``[B, L, D]`` for the update), weight ``[D, W]``, conv-state pool ``[S, W-1, D]`` token-major
(row 0 oldest, ``D`` contiguous), fp32 compute, outputs in ``x``'s dtype, pool cast on write,
slot -1 = padding (zero output, nothing read or written).

Kernels (``W``, the kernel width, is a constexpr):

- ``causal_conv1d_fn``: grid ``(T // BT + B, cdiv(D, BD))``. Tokens are cut into blocks of
  ``BT`` aligned to each request's first token (a block never straddles two requests), so
  ``sum_b ceil(len_b / BT) <= T // BT + B`` blocks exist; program ``i`` finds its request on
  device by a cumulative count of blocks per request over ``query_start_loc`` (no host sync,
  no metadata kernel), extra programs exit. Each program accumulates the ``W`` taps over
  shifted ``[BT, BD]`` tiles of ``x`` (a rolled loop: unrolled, the tiles are all loaded up
  front and spill), and only a request's first block, when it has an initial window, adds the
  taps that fall on that window; then it writes ``[BT, BD]`` outputs. ``BT = 32`` (16 for
  short requests), ``BD = 128``, 4 warps: about 160 registers, no spills on sm_90. A second
  small kernel, grid ``(B, cdiv(D, 256))``, then writes each non-empty request's final window
  (it must run after every block has read the old window).
- ``causal_conv1d_update``: grid ``(B, cdiv(D, BD))``, a loop over the ``L`` steps; the
  stream "window ++ x" is read from memory by position, the intermediate windows and the
  final window are written by the same program (every element of a channel is read and
  written by one thread, in order, so the in-place window shift needs no barrier).
- ``track_conv_window``: a gather kernel into a ``[B, W-1, D]`` scratch buffer, then a scatter
  kernel into the destination slots (so a destination that is another row's source is read
  first, as the op documents).

The update kernel is CUDA-graph safe (grid from shapes only, no host sync, no value-dependent
allocation). The prefill kernels also avoid host syncs.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .common import cast_rne, pow2
from .launch import pdl_launch, pdl_wait_and_release
from ..conv1d import (
    _check_causal_conv1d_fn,
    _check_causal_conv1d_update,
    _check_track_conv_window,
    _is_silu,
)

__all__ = ["causal_conv1d_fn_triton", "causal_conv1d_update_triton", "track_conv_window_triton"]


def _warps_1d(block: int) -> int:
    """Warps for a 1-D block of channels: about 4 elements per thread, 1..4 warps."""
    return max(1, min(4, block // 128))


@triton.jit
def _and(block_mask, cond):
    """``block_mask & cond`` for a scalar ``cond`` (written as a select: Triton's interpreter
    turns ``block & scalar`` into an int32 array that it then rejects as a mask)."""
    return tl.where(cond, block_mask, False)


# --------------------------------------------------------------------------------------------
# causal_conv1d_fn
# --------------------------------------------------------------------------------------------


@triton.jit
def _find_token_block(qsl_ptr, B, pid, BT: tl.constexpr, BB: tl.constexpr):
    """(request, block index inside the request, found) of packed token-block ``pid``.

    Blocks of BT tokens are aligned to each request's first token; the requests' block counts
    ``ceil(len_b / BT)`` are scanned in chunks of BB requests. ``found == 0`` for a program
    past the last block.
    """
    ar = tl.arange(0, BB)
    zero = pid * 0
    carry = zero
    req = zero
    first = zero
    found = zero
    for start in range(0, B, BB):
        offs = start + ar
        m = offs < B
        s = tl.load(qsl_ptr + offs, mask=m, other=0).to(tl.int32)
        e = tl.load(qsl_ptr + offs + 1, mask=m, other=0).to(tl.int32)
        nb = tl.where(m & (e > s), (e - s + BT - 1) // BT, 0)
        incl = tl.cumsum(nb, 0) + carry
        excl = incl - nb
        hit = m & (excl <= pid) & (pid < incl)
        req += tl.sum(tl.where(hit, offs, 0), 0)
        first += tl.sum(tl.where(hit, excl, 0), 0)
        found += tl.sum(hit.to(tl.int32), 0)
        carry += tl.sum(nb, 0)
    return req, pid - first, found


@triton.jit(do_not_specialize=['B'])  # batch-dependent counts: one compile for all
def _conv1d_fwd_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, qsl_ptr, idx_ptr, init_ptr, out_ptr,
    B, D,
    stride_xt, stride_xd, stride_wd, stride_ww, stride_ss, stride_sk, stride_sd,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, BB: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    req, blk, found = _find_token_block(qsl_ptr, B, pid_t, BT, BB)
    start = tl.load(qsl_ptr + req).to(tl.int32)
    end = tl.load(qsl_ptr + req + 1).to(tl.int32)
    slot = tl.load(idx_ptr + req).to(tl.int64)
    use_init = tl.load(init_ptr + req) != 0
    live = found > 0
    valid = live & (slot >= 0)

    t0 = start + blk * BT  # first token of the block
    rows = tl.arange(0, BT)
    toks = t0 + rows
    tmask = _and(toks < end, live)
    d = pid_d * BD + tl.arange(0, BD)
    dmask = d < D
    out_mask = tmask[:, None] & dmask[None, :]
    load_mask = _and(out_mask, valid)

    acc = tl.zeros([BT, BD], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    # A scalar base pointer per block and small int32 offsets inside it. The tap loop is a
    # rolled loop on purpose: unrolled, all W shifted tiles are loaded up front and spill.
    x_blk = x_ptr + t0.to(tl.int64) * stride_xt
    x_offs = rows[:, None] * stride_xt + d[None, :] * stride_xd
    for w in range(W):
        shift = w - (W - 1)
        in_x = (toks + shift >= start)[:, None]
        xv = tl.load(x_blk + shift * stride_xt + x_offs, mask=load_mask & in_x, other=0.0)
        wv = tl.load(w_ptr + d * stride_wd + w * stride_ww, mask=dmask, other=0.0).to(tl.float32)
        acc += xv.to(tl.float32) * wv[None, :]
    if valid & use_init & (blk == 0):
        # The first W-1 tokens of a request also see its initial window (zeros without one,
        # already accounted for by the masked loads above).
        s_offs = rows[:, None] * stride_sk + d[None, :] * stride_sd
        s_base = state_ptr + slot * stride_ss
        for w in range(W):
            shift = w - (W - 1)
            in_win = (rows + shift < 0)[:, None]  # window row (W-1) + rows + shift
            sv = tl.load(s_base + ((W - 1) + shift) * stride_sk + s_offs, mask=load_mask & in_win, other=0.0)
            wv = tl.load(w_ptr + d * stride_wd + w * stride_ww, mask=dmask, other=0.0).to(tl.float32)
            acc += sv.to(tl.float32) * wv[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    acc = tl.where(valid, acc, 0.0)
    out_ptrs = out_ptr + toks.to(tl.int64)[:, None] * D + d[None, :]
    tl.store(out_ptrs, cast_rne(acc, out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _conv1d_fwd_window_kernel(
    x_ptr, state_ptr, qsl_ptr, idx_ptr, init_ptr,
    D, stride_xt, stride_xd, stride_ss, stride_sk, stride_sd,
    K: tl.constexpr, BD: tl.constexpr,
):
    """Final window of request b: the last K inputs of (initial window ++ its tokens)."""
    b = tl.program_id(0)
    pid_d = tl.program_id(1)
    start = tl.load(qsl_ptr + b).to(tl.int32)
    end = tl.load(qsl_ptr + b + 1).to(tl.int32)
    n = end - start
    slot = tl.load(idx_ptr + b).to(tl.int64)
    use_init = tl.load(init_ptr + b) != 0
    d = pid_d * BD + tl.arange(0, BD)
    m = _and(d < D, (slot >= 0) & (n > 0))
    base = state_ptr + slot * stride_ss + d * stride_sd
    # Row j takes stream position n + j >= j + 1: rows are written in increasing order, each
    # thread owns the same channels in every row, so an old row is read before it is overwritten.
    for j in tl.static_range(K):
        pos = n + j  # 0..K-1: old window rows, K..: tokens
        in_x = pos >= K
        xv = tl.load(x_ptr + (start + pos - K).to(tl.int64) * stride_xt + d * stride_xd, mask=_and(m, in_x), other=0.0)
        sv = tl.load(base + pos.to(tl.int64) * stride_sk, mask=_and(m, (pos < K) & use_init), other=0.0)
        v = tl.where(in_x, xv.to(tl.float32), sv.to(tl.float32))
        tl.store(base + j * stride_sk, cast_rne(v, state_ptr.dtype.element_ty), mask=m)


# Block sizes depend on the model only (not on the batch): a constexpr chosen from the batch's
# shape would JIT-compile a new kernel variant (about a second on a GPU) whenever serving meets a
# new batch shape. 16-token blocks (the halo of W - 1 rows re-read per block costs ~10 % more loads
# than 32 on long requests, a small part of a prefill) and requests scanned 64 at a time.
_FN_BLOCK_T = 16
_FN_BLOCK_B = 64


def _fn_blocks(dim: int):
    # [16, 128] with 4 warps stays well under ~160 registers without spills on sm_90
    return _FN_BLOCK_T, min(128, pow2(dim))


def _causal_conv1d_fn(
    x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation,
    *, block_t: Optional[int] = None, block_d: Optional[int] = None, block_b: Optional[int] = None,
):
    silu = _is_silu("causal_conv1d_fn", activation)
    num_tokens, dim = x.shape
    width = weight.shape[1]
    batch = cache_indices.shape[0]
    out = torch.empty((num_tokens, dim), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or batch == 0:
        return out.zero_()
    bt, bd = _fn_blocks(dim)
    bt, bd = block_t or bt, block_d or bd
    bb = block_b or _FN_BLOCK_B
    qsl = query_start_loc.contiguous()
    idx = cache_indices.contiguous()
    init = has_initial_state.contiguous().view(torch.uint8)
    bias_arg = bias if bias is not None else weight  # never read without HAS_BIAS
    grid = (num_tokens // bt + batch, triton.cdiv(dim, bd))
    _conv1d_fwd_kernel[grid](
        x, weight, bias_arg, conv_states, qsl, idx, init, out,
        batch, dim,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        conv_states.stride(0), conv_states.stride(1), conv_states.stride(2),
        W=width, HAS_BIAS=bias is not None, SILU=silu, BT=bt, BD=bd, BB=bb,
        num_warps=4,
    )
    bdw = block_d or min(256, pow2(dim))
    _conv1d_fwd_window_kernel[(batch, triton.cdiv(dim, bdw))](
        x, conv_states, qsl, idx, init,
        dim, x.stride(0), x.stride(1), conv_states.stride(0), conv_states.stride(1), conv_states.stride(2),
        K=width - 1, BD=bdw, num_warps=_warps_1d(bdw),
    )
    return out


def causal_conv1d_fn_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: Optional[str],
) -> torch.Tensor:
    """Triton ``causal_conv1d_fn`` (same arguments and semantics as the op; mutates ``conv_states``)."""
    return _causal_conv1d_fn(
        x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation
    )


# --------------------------------------------------------------------------------------------
# causal_conv1d_update
# --------------------------------------------------------------------------------------------


@triton.jit
def _stream_load(x_base, state_base, pos, stride_xl, stride_sk, m, K: tl.constexpr):
    """fp32 element ``pos`` of the stream window ++ x (positions < K are window rows)."""
    in_x = pos >= K
    xv = tl.load(x_base + (pos - K) * stride_xl, mask=_and(m, in_x), other=0.0)
    sv = tl.load(state_base + pos * stride_sk, mask=_and(m, pos < K), other=0.0)
    return tl.where(in_x, xv.to(tl.float32), sv.to(tl.float32))


@triton.jit
def _conv1d_update_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, idx_ptr, out_ptr, inter_ptr, parent_ptr,
    L, D,
    stride_xb, stride_xl, stride_xd, stride_wd, stride_ww,
    stride_ss, stride_sk, stride_sd,
    stride_ib, stride_il, stride_ik, stride_id,
    stride_pb, stride_pl,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    HAS_INTER: tl.constexpr, UPDATE_STATE: tl.constexpr, BD: tl.constexpr,
    TREE: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    """TREE: a draft tree (``parent_ptr`` ``[B, L]``): node ``t``'s window is its parent's row of the
    intermediate buffer (written earlier by this same program, channel for channel) or the slot's
    window for parent -1, then ``x[t]``."""
    pdl_wait_and_release(USE_PDL)  # programmatic dependent launch: wait for the kernel before (launch.py)
    K: tl.constexpr = W - 1
    b = tl.program_id(0)
    pid_d = tl.program_id(1)
    slot = tl.load(idx_ptr + b).to(tl.int64)
    valid = slot >= 0
    d = pid_d * BD + tl.arange(0, BD)
    dmask = d < D
    m = _and(dmask, valid)
    state_base = state_ptr + slot * stride_ss + d * stride_sd
    x_base = x_ptr + b.to(tl.int64) * stride_xb + d * stride_xd
    out_base = out_ptr + b.to(tl.int64) * L * D + d
    inter_base = inter_ptr + b.to(tl.int64) * stride_ib + d * stride_id
    if HAS_BIAS:
        bias = tl.load(bias_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BD], dtype=tl.float32)
    for t in range(L):
        acc = bias
        if TREE:
            # the parent's row was stored by this program's threads in an earlier step: make
            # those stores visible whatever thread reads them back
            tl.debug_barrier()
            par = tl.load(parent_ptr + b.to(tl.int64) * stride_pb + t * stride_pl).to(tl.int64)
            from_slot = par < 0
            par_base = inter_base + tl.maximum(par, 0) * stride_il
            xt = tl.load(x_base + t * stride_xl, mask=m, other=0.0).to(tl.float32)
            for w in tl.static_range(W):
                if w < K:
                    sv = tl.load(state_base + w * stride_sk, mask=_and(m, from_slot), other=0.0).to(tl.float32)
                    pv = tl.load(par_base + w * stride_ik, mask=_and(m, par >= 0), other=0.0).to(tl.float32)
                    v = tl.where(from_slot, sv, pv)
                    if w > 0:  # the node's stored window: rows 1.. of its input window, then x[t]
                        tl.store(inter_base + t * stride_il + (w - 1) * stride_ik,
                                 cast_rne(v, inter_ptr.dtype.element_ty), mask=m)
                else:
                    v = xt
                    tl.store(inter_base + t * stride_il + (K - 1) * stride_ik,
                             cast_rne(v, inter_ptr.dtype.element_ty), mask=m)
                wv = tl.load(w_ptr + d * stride_wd + w * stride_ww, mask=dmask, other=0.0).to(tl.float32)
                acc += v * wv
        else:
            for w in tl.static_range(W):
                v = _stream_load(x_base, state_base, t + w, stride_xl, stride_sk, m, K)
                wv = tl.load(w_ptr + d * stride_wd + w * stride_ww, mask=dmask, other=0.0).to(tl.float32)
                acc += v * wv
        if SILU:
            acc = acc * tl.sigmoid(acc)
        acc = tl.where(valid, acc, 0.0)
        tl.store(out_base + t * D, cast_rne(acc, out_ptr.dtype.element_ty), mask=dmask)
        if HAS_INTER and not TREE:
            for j in tl.static_range(K):
                v = _stream_load(x_base, state_base, t + 1 + j, stride_xl, stride_sk, m, K)
                dst = inter_base + t * stride_il + j * stride_ik
                tl.store(dst, cast_rne(v, inter_ptr.dtype.element_ty), mask=m)
    if UPDATE_STATE:
        # Row j takes stream position L + j > j; rows go in increasing order and each thread owns
        # the same channels in every row, so an old row is read before it is overwritten.
        for j in tl.static_range(K):
            v = _stream_load(x_base, state_base, L + j, stride_xl, stride_sk, m, K)
            tl.store(state_base + j * stride_sk, cast_rne(v, state_ptr.dtype.element_ty), mask=m)


def _causal_conv1d_update(
    x, conv_states, weight, bias, activation, conv_state_indices, disable_state_update=False,
    intermediate_conv_windows=None, parent_indices=None, *, block_d: Optional[int] = None,
):
    silu = _is_silu("causal_conv1d_update", activation)
    batch, steps, dim = x.shape
    width = weight.shape[1]
    out = torch.empty((batch, steps, dim), dtype=x.dtype, device=x.device)
    if batch == 0 or steps == 0:
        return out.zero_()
    bd = block_d or min(256, pow2(dim))
    idx = conv_state_indices.contiguous()
    inter = intermediate_conv_windows
    has_inter = inter is not None
    inter_arg = inter if has_inter else conv_states
    inter_strides = inter.stride() if has_inter else (0, 0, 0, 0)
    bias_arg = bias if bias is not None else weight
    tree = parent_indices is not None
    _conv1d_update_kernel[(batch, triton.cdiv(dim, bd))](
        x, weight, bias_arg, conv_states, idx, out, inter_arg, parent_indices if tree else idx,
        steps, dim,
        x.stride(0), x.stride(1), x.stride(2), weight.stride(0), weight.stride(1),
        conv_states.stride(0), conv_states.stride(1), conv_states.stride(2),
        *inter_strides, *(parent_indices.stride() if tree else (0, 0)),
        W=width, HAS_BIAS=bias is not None, SILU=silu, HAS_INTER=has_inter,
        UPDATE_STATE=not disable_state_update, BD=bd, TREE=tree, num_warps=_warps_1d(bd),
        **pdl_launch(x.device),
    )
    return out


def causal_conv1d_update_triton(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    activation: Optional[str],
    conv_state_indices: torch.Tensor,
    disable_state_update: bool = False,
    intermediate_conv_windows: Optional[torch.Tensor] = None,
    parent_indices: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Triton ``causal_conv1d_update`` (same arguments and semantics as the op). CUDA-graph safe."""
    return _causal_conv1d_update(
        x, conv_states, weight, bias, activation, conv_state_indices, disable_state_update,
        intermediate_conv_windows, parent_indices,
    )


# --------------------------------------------------------------------------------------------
# track_conv_window
# --------------------------------------------------------------------------------------------


@triton.jit
def _track_gather_kernel(
    x_ptr, state_ptr, qsl_ptr, idx_ptr, init_ptr, tl_ptr, dst_ptr, tmp_ptr,
    D, stride_xt, stride_xd, stride_ss, stride_sk, stride_sd,
    K: tl.constexpr, BD: tl.constexpr,
):
    b = tl.program_id(0)
    pid_d = tl.program_id(1)
    start = tl.load(qsl_ptr + b).to(tl.int32)
    end = tl.load(qsl_ptr + b + 1).to(tl.int32)
    n = tl.load(tl_ptr + b).to(tl.int32)
    slot = tl.load(idx_ptr + b).to(tl.int64)
    dst = tl.load(dst_ptr + b)
    use_init = tl.load(init_ptr + b) != 0
    d = pid_d * BD + tl.arange(0, BD)
    m = _and(d < D, (slot >= 0) & (n >= 0) & (dst >= 0))
    state_base = state_ptr + slot * stride_ss + d * stride_sd
    tmp_base = tmp_ptr + b.to(tl.int64) * K * D + d
    for j in tl.static_range(K):
        pos = n + j  # stream position: 0..K-1 old window rows, K.. the request's tokens
        tok = start + pos - K
        in_x = pos >= K
        xv = tl.load(x_ptr + tok.to(tl.int64) * stride_xt + d * stride_xd, mask=_and(m, in_x & (tok < end)), other=0.0)
        sv = tl.load(state_base + pos.to(tl.int64) * stride_sk, mask=_and(m, (pos < K) & use_init), other=0.0)
        v = tl.where(in_x, xv.to(tl.float32), sv.to(tl.float32))
        tl.store(tmp_base + j * D, cast_rne(v, tmp_ptr.dtype.element_ty), mask=m)


@triton.jit
def _track_scatter_kernel(
    state_ptr, idx_ptr, tl_ptr, dst_ptr, tmp_ptr,
    D, stride_ss, stride_sk, stride_sd,
    K: tl.constexpr, BD: tl.constexpr,
):
    b = tl.program_id(0)
    pid_d = tl.program_id(1)
    n = tl.load(tl_ptr + b)
    slot = tl.load(idx_ptr + b)
    dst = tl.load(dst_ptr + b).to(tl.int64)
    d = pid_d * BD + tl.arange(0, BD)
    m = _and(d < D, (slot >= 0) & (n >= 0) & (dst >= 0))
    tmp_base = tmp_ptr + b.to(tl.int64) * K * D + d
    dst_base = state_ptr + dst * stride_ss + d * stride_sd
    for j in tl.static_range(K):
        v = tl.load(tmp_base + j * D, mask=m)
        tl.store(dst_base + j * stride_sk, v, mask=m)


def _track_conv_window(
    conv_states, x, query_start_loc, cache_indices, has_initial_state, track_lens, dst_slots,
    *, block_d: Optional[int] = None,
):
    batch = cache_indices.shape[0]
    if batch == 0:
        return
    k, dim = conv_states.shape[1], conv_states.shape[2]
    bd = block_d or min(256, pow2(dim))
    qsl = query_start_loc.contiguous()
    idx = cache_indices.contiguous()
    init = has_initial_state.contiguous().view(torch.uint8)
    tls = track_lens.contiguous()
    dst = dst_slots.contiguous()
    tmp = torch.empty((batch, k, dim), dtype=conv_states.dtype, device=conv_states.device)
    grid = (batch, triton.cdiv(dim, bd))
    ss = (conv_states.stride(0), conv_states.stride(1), conv_states.stride(2))
    _track_gather_kernel[grid](
        x, conv_states, qsl, idx, init, tls, dst, tmp,
        dim, x.stride(0), x.stride(1), *ss, K=k, BD=bd, num_warps=_warps_1d(bd),
    )
    _track_scatter_kernel[grid](
        conv_states, idx, tls, dst, tmp, dim, *ss, K=k, BD=bd, num_warps=_warps_1d(bd),
    )


def track_conv_window_triton(
    conv_states: torch.Tensor,
    x: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    track_lens: torch.Tensor,
    dst_slots: torch.Tensor,
) -> None:
    """Triton ``track_conv_window`` (same arguments and semantics as the op; mutates ``conv_states``)."""
    _track_conv_window(conv_states, x, query_start_loc, cache_indices, has_initial_state, track_lens, dst_slots)


# --------------------------------------------------------------------------------------------
# registration as the CUDA kernels of the ops
# --------------------------------------------------------------------------------------------


def _causal_conv1d_fn_cuda(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation):
    _check_causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation)
    return causal_conv1d_fn_triton(
        x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation
    )


def _causal_conv1d_update_cuda(
    x, conv_states, weight, bias, activation, conv_state_indices, disable_state_update=False,
    intermediate_conv_windows=None, parent_indices=None,
):
    _check_causal_conv1d_update(
        x, conv_states, weight, bias, activation, conv_state_indices, disable_state_update, intermediate_conv_windows,
        parent_indices,
    )
    return causal_conv1d_update_triton(
        x, conv_states, weight, bias, activation, conv_state_indices, disable_state_update, intermediate_conv_windows,
        parent_indices,
    )


def _track_conv_window_cuda(conv_states, x, query_start_loc, cache_indices, has_initial_state, track_lens, dst_slots):
    _check_track_conv_window(conv_states, x, query_start_loc, cache_indices, has_initial_state, track_lens, dst_slots)
    track_conv_window_triton(conv_states, x, query_start_loc, cache_indices, has_initial_state, track_lens, dst_slots)


torch.library.register_kernel("hybrid_compile::causal_conv1d_fn", "cuda", _causal_conv1d_fn_cuda)
torch.library.register_kernel("hybrid_compile::causal_conv1d_update", "cuda", _causal_conv1d_update_cuda)
torch.library.register_kernel("hybrid_compile::track_conv_window", "cuda", _track_conv_window_cuda)
