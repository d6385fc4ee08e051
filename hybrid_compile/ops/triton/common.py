"""Helpers shared by the Triton kernel modules: :func:`pow2` (block sizes), :func:`cast_rne`
(fp32 -> storage dtype, rounding to nearest even under Triton's CPU interpreter too, which
otherwise truncates fp32 -> bf16), :func:`div_rn` (IEEE-rounded fp32 division), :func:`softplus`
(torch's, for the Mamba dt),
:func:`expert_row_tile` (which expert owns a row tile of an MoE grouped GEMM) and
:func:`apply_activation` (the epilogue of the grouped GEMM and the GEMV), :func:`round_to_e4m3` and
:func:`quantize_axis` (e4m3 with one scale per vector: the block-FP8 activation quantization of the
quantize kernel and of the GEMV that quantizes its own activation, and the FP8 caches'), and
:func:`sm_count` (the SMs that launch-shape rules size grids for), :func:`tree_path` / :func:`tree_paths` / :func:`flag_at`
(a draft tree's root-to-leaf path per program)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..fp8 import FP8_EPS, FP8_MAX

__all__ = ["apply_activation", "cast_rne", "div_rn", "expert_row_tile", "grouped_row_tiles", "pow2",
           "quantize_axis", "flag_at", "round_to_e4m3", "sm_count", "softplus", "tree_path", "tree_paths"]

FP8_EPS_C = tl.constexpr(FP8_EPS)
FP8_MAX_C = tl.constexpr(FP8_MAX)


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """SMs of ``device``; an H100 / H200's 132 for a non-CUDA device (the interpreter), so that the
    launch-shape rules pick on the CPU what they pick on those GPUs."""
    if device.type != "cuda":
        return 132
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def pow2(n: int, lo: int = 1) -> int:
    """The smallest power of two >= ``n`` (and >= ``lo``): block sizes of the launchers."""
    return max(lo, triton.next_power_of_2(max(int(n), 1)))


def grouped_row_tiles(rows: int, bm: int, experts: int) -> int:
    """Row tiles a grouped GEMM launches: a bound on ``sum_e cdiv(rows_e, bm)`` known from the shapes
    alone (each non-empty expert adds at most one partial tile, and has at least one row)."""
    return min(rows, triton.cdiv(rows, bm) + experts)


@triton.jit
def expert_row_tile(offsets_ptr, E, pid_m, BM: tl.constexpr, BLOCK_E: tl.constexpr):
    """Row tile ``pid_m`` of a grouped GEMM over rows sorted by expert (``offsets_ptr``: ``E + 1``
    first rows): ``(expert, row0, row_end)``. Tiles are numbered by the experts' cumulative tile
    counts; past the last used tile ``expert == E`` and ``row_end == 0`` (no rows).

    One-row tiles (``BM == 1``, the GEMV's decode launch: a program per row and column tile, tens of
    thousands of them at batch 64 over 512 experts) skip the scan: tile ``pid_m`` is row ``pid_m``,
    and its expert is the number of experts that end at or before it (the experts' rows lie back to
    back), one compare and one sum over the ``E`` end offsets."""
    eidx = tl.arange(0, BLOCK_E)
    e_ok = eidx < E
    if BM == 1:
        ends = tl.load(offsets_ptr + eidx + 1, mask=e_ok, other=2147483647).to(tl.int32)
        expert = tl.sum((ends <= pid_m).to(tl.int32), axis=0)
        row0 = pid_m
        row_end = tl.where(expert < E, pid_m + 1, 0)
    else:
        lo = tl.load(offsets_ptr + eidx, mask=e_ok, other=0).to(tl.int32)
        hi = tl.load(offsets_ptr + eidx + 1, mask=e_ok, other=0).to(tl.int32)
        ntiles = (hi - lo + BM - 1) // BM
        tile_end = tl.cumsum(ntiles, 0)
        expert = tl.sum((tile_end <= pid_m).to(tl.int32), axis=0)
        mine = eidx == expert
        row0 = tl.sum(tl.where(mine, lo + (pid_m - (tile_end - ntiles)) * BM, 0), axis=0)
        row_end = tl.sum(tl.where(mine, hi, 0), axis=0)
    return expert, row0, row_end


@triton.jit
def apply_activation(acc, acc_up, ACT: tl.constexpr):
    """The fp32 epilogue of ``moe_grouped_linear`` (``ACT``: the index in
    :data:`~hybrid_compile.ops.moe.GROUPED_ACTIVATIONS`): 0 ``acc``; 1 ``silu(acc) * acc_up`` (the gate
    and the up products); 2 ``relu(acc) ** 2``."""
    if ACT == 1:
        acc = acc * tl.sigmoid(acc) * acc_up
    elif ACT == 2:
        acc = tl.maximum(acc, 0.0)
        acc = acc * acc
    return acc


@triton.jit
def cast_rne(v, dtype: tl.constexpr):
    """fp32 ``v`` cast to ``dtype`` rounding to nearest even, as torch does.

    The GPU backend already rounds this way; Triton's interpreter truncates fp32 -> bf16, so the
    bf16 case rounds explicitly on the bits (the final cast is then exact). NaN stays NaN.
    Shared by the sibling kernel modules.
    """
    if dtype == tl.bfloat16:
        u = v.to(tl.uint32, bitcast=True)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        v = tl.where(v != v, v, r.to(tl.float32, bitcast=True))
    return v.to(dtype)


@triton.jit
def div_rn(x, y):
    """``x / y`` rounded to nearest as IEEE (and torch on the CPU) divides; ``y`` broadcasts to ``x``'s shape.

    Triton's fp32 ``/`` is an approximate division on NVIDIA GPUs (off by an ulp at times), the
    ``ieee_rounding`` flag of ``tl.fdiv`` is ignored by Triton 3.6, and ``tl.math.div_rn`` does not
    broadcast: hence the explicit broadcast (adding zeros is exact). The FP8 quantizers use it so the
    GPU writes the same bytes as the plain-torch path.
    """
    return tl.math.div_rn(x, y + tl.zeros_like(x))


@triton.jit
def softplus(v):
    """torch's softplus (threshold 20) with an accurate log1p (``log(w) * u / (w - 1)``, w = 1 + u)."""
    u = tl.exp(v)
    w = 1.0 + u
    den = tl.where(w == 1.0, 1.0, w - 1.0)
    lp = tl.where(w == 1.0, u, tl.log(w) * (u / den))
    return tl.where(v > 20.0, v, lp)


def tree_paths(steps: int, tree: bool) -> tuple[int, int]:
    """(programs per block, ``BL``) of a verify launch over ``steps`` nodes: a tree's kernel gives each
    root-to-leaf path its programs (at most ``steps`` leaves; :func:`tree_path`), a chain one."""
    return (steps, pow2(steps)) if tree else (1, 1)


@triton.jit
def tree_path(par_row, s_par, L, pid, blocks, BL: tl.constexpr):
    """Root-to-leaf path of a draft tree for the program ``pid`` of a grid axis that is path-major
    over ``blocks`` blocks (``par_row + j * s_par``: node ``j``'s parent, -1 a root, parents before
    children, ``L`` nodes, ``BL >= L`` a power of two), for kernels that give each path its own
    programs so the state stays in registers along it: (``found``: the tree has that path, the
    program's ``block`` and ``path`` index, ``on_path`` / ``owned`` ``[BL]`` int32 flags). Leaves are
    numbered in node order. A node is ``owned`` by the one path that reaches a leaf from it through
    first (lowest-numbered) children only: its outputs are that path's to store, once."""
    i_p = pid // blocks
    o = tl.arange(0, BL)
    par = tl.load(par_row + o * s_par, mask=o < L, other=-2).to(tl.int32)  # (-2: past the row)
    big = BL + 1
    child = (par[:, None] == o[None, :]) & (o[:, None] < L)  # [j, x]: node j is a child of node x
    first_child = tl.min(tl.where(child, o[:, None], big), 0)  # [x]
    leaf = (o < L) & (first_child == big)
    rank = tl.cumsum(leaf.to(tl.int32), 0) - 1
    found = tl.sum(leaf.to(tl.int32), 0) > i_p
    cur = tl.sum(tl.where(leaf & (rank == i_p), o, 0), 0)
    on_path = (o == cur).to(tl.int32)
    for _ in range(L - 1):  # up to the root (cur becomes -1 there and stays)
        up = tl.sum(tl.where(o == cur, par, 0), 0)
        cur = tl.where(cur >= 0, up, -1)
        on_path = tl.where(o == cur, 1, on_path)
    # an edge off the first-child descent below a node takes the node's ownership to another path
    fc_of_parent = tl.sum(tl.where(o[None, :] == par[:, None], first_child[None, :], 0), 1)  # [j]
    off = (on_path > 0) & (par >= 0) & (fc_of_parent != o)
    last_off = tl.max(tl.where(off, o, -1), 0)
    owned = tl.where((on_path > 0) & (o >= last_off), 1, 0)
    return found, pid % blocks, i_p, on_path, owned


@triton.jit
def flag_at(flags, t, BL: tl.constexpr):
    """``flags[t]`` of an int32 ``[BL]`` flag vector, as a scalar bool."""
    return tl.sum(tl.where(tl.arange(0, BL) == t, flags, 0), 0) > 0


@triton.jit
def round_to_e4m3(v):
    """fp32 ``v`` (already within +-448) rounded to the nearest e4m3 value, ties to even, as fp32."""
    a = tl.abs(v)
    u = v.to(tl.uint32, bitcast=True)
    normal = (((u + 0x7FFFF + ((u >> 20) & 1)) >> 20) << 20).to(tl.float32, bitcast=True)  # 3 mantissa bits
    sub = (a + 16384.0) - 16384.0  # subnormals: multiples of 2**-9 (the fp32 ulp of 2**14)
    sub = tl.where(v < 0, -sub, sub)
    return tl.where(a < 0.015625, sub, normal)


@triton.jit
def quantize_axis(x, AXIS: tl.constexpr):
    """fp32 tile ``x`` -> (e4m3-valued fp32 tile, fp32 scales): one scale per vector along ``AXIS``
    (``max(|vector|, 1e-10) / 448``, IEEE divisions: the plain-torch path's bytes; padded entries must
    be 0). The block-FP8 activation groups (``AXIS`` 1 over ``[rows, 128]``) and the FP8 caches'
    vectors; cast the values to e4m3 when storing (exact)."""
    scale = div_rn(tl.maximum(tl.max(tl.abs(x), axis=AXIS), FP8_EPS_C), FP8_MAX_C)
    if AXIS == 0:
        q = div_rn(x, scale[None, :])
    else:
        q = div_rn(x, scale[:, None])
    q = tl.minimum(tl.maximum(q, -FP8_MAX_C), FP8_MAX_C)
    return round_to_e4m3(q), scale
