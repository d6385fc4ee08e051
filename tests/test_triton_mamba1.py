"""Triton Mamba1 kernels (:mod:`hybrid_compile.ops.triton.mamba1`) against the plain-torch ops and the
per-token reference.

CPU: the launchers run in Triton's interpreter (conftest sets TRITON_INTERPRET=1) on tiny shapes
(D_inner 12-40 so several channel blocks run, N 8-16, chunk 8/16 so requests span several chunks);
on a CUDA machine the same tests run the compiled kernels on the GPU. GPU (``gpu`` marker): the
registered CUDA ops at Mamba1 shapes (D_inner 1536-4096, N 16) against the plain-torch op on CPU
copies, opcheck on CUDA, and the decode op captured in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

import hybrid_compile.ops.triton.mamba1 as tm
from hybrid_compile.ops import _varlen
from hybrid_compile.ops.reference import tree as ref_tree
from hybrid_compile.ops.mamba1 import mamba1_selective_scan, mamba1_state_update
from op_testing import assert_close, run_opcheck
from test_ops_mamba1 import SCAN_ORDER, UPDATE_ORDER, check_scan, make_scan, make_tree_update, make_update, tree_oracle
from test_triton_mamba2 import KDEV, _clone, _to


# RecurrentGemma's RG-LRU as models/recurrent_gemma.py runs it: one state per channel, dt without
# softplus or bias, no D, no gate
RG_LRU = dict(N=1, with_D=False, with_z=False, with_bias=False, softplus=False)


def _run_scan_kernel(inp, chunk_size, output_chunk_states=True):
    """Launcher on KDEV; returns y, chunk states and the pool, all on the CPU."""
    tri = _to(inp, KDEV)
    y, cs = tm.mamba1_selective_scan_triton(*(tri[k] for k in SCAN_ORDER), chunk_size, output_chunk_states)
    return y.cpu(), cs.cpu(), tri["ssm_states"].cpu()


SCAN_CASES = [
    ([0, 1, 15, 16, 17, 40], 16, dict(pad_rows=(2,))),
    ([0, 1, 15, 16, 17, 40], 16, dict(dtype=torch.bfloat16, pool_dtype=torch.bfloat16, pad_rows=(4,))),
    ([9, 0, 20], 8, dict(with_D=False, with_z=False, with_bias=False, softplus=False, N=16, D_inner=40)),
    ([17, 0, 33], 8, dict(dtype=torch.float16, pool_dtype=torch.float16, init=[True, True, False])),
    ([21, 4], 8, dict(G=4, D_inner=40, init=[True, False])),  # B/C groups, several per channel block
    ([5, 3], 16, dict(pad_rows=(0, 1))),  # every request is padding
    ([9, 0, 20], 8, dict(RG_LRU, D_inner=40)),
]


@pytest.mark.parametrize("lens,chunk_size,opts", SCAN_CASES)
def test_selective_scan_triton(lens, chunk_size, opts):
    inp = make_scan(lens, **opts)
    inp["_before"] = inp["ssm_states"].clone()
    plain = _clone(inp)
    y_op, cs_op = mamba1_selective_scan(*(plain[k] for k in SCAN_ORDER), chunk_size, True, A_is_log=False, ssm_scales=None)
    y, cs, pool = _run_scan_kernel(inp, chunk_size)
    dtype = inp["x"].dtype
    check_scan(dict(inp, ssm_states=pool), chunk_size, y, cs, dtype)
    assert_close(y, y_op, dtype, msg="y vs plain op")
    assert_close(cs, cs_op, dtype, msg="chunk states vs plain op")


TIME_CHUNK_CASES = [
    ([0, 1, 15, 16, 17, 40], 16, 4, dict(pad_rows=(2,))),  # chunks of 4 inside cache chunks of 16
    ([33, 0, 9], 8, 5, dict(dtype=torch.bfloat16, pool_dtype=torch.bfloat16)),  # 5 does not divide 8
    ([21, 4], 8, 8, dict(G=4, D_inner=40, init=[True, False])),
    ([9, 0, 20], 8, 3, dict(RG_LRU, D_inner=40)),
    ([5, 3], 16, 2, dict(pad_rows=(0, 1))),  # every request is padding
]


@pytest.mark.parametrize("lens,chunk_size,time_chunk,opts", TIME_CHUNK_CASES)
def test_selective_scan_time_chunks(lens, chunk_size, time_chunk, opts):
    """The time-chunked scan (chunk states from zero, their ordered combination, every chunk scanned
    from its true start) against the per-token reference and the plain op: y, chunk states, pool."""
    inp = make_scan(lens, **opts)
    inp["_before"] = inp["ssm_states"].clone()
    plain = _clone(inp)
    y_op, cs_op = mamba1_selective_scan(*(plain[k] for k in SCAN_ORDER), chunk_size, True, A_is_log=False, ssm_scales=None)
    tri = _to(inp, KDEV)
    y, cs = tm.mamba1_selective_scan_triton(*(tri[k] for k in SCAN_ORDER), chunk_size, True, time_chunk=time_chunk)
    y, cs, pool = y.cpu(), cs.cpu(), tri["ssm_states"].cpu()
    dtype = inp["x"].dtype
    check_scan(dict(inp, ssm_states=pool), chunk_size, y, cs, dtype)
    assert_close(y, y_op, dtype, msg="y vs plain op")
    assert_close(cs, cs_op, dtype, msg="chunk states vs plain op")
    assert_close(pool, plain["ssm_states"], dtype, msg="pool vs plain op")


def test_time_chunks_are_chosen_from_shapes_and_refuse_a_negative_size():
    """Time chunks from 1024 tokens a request while the single walks fill at most two waves of SMs:
    Jamba's 8192 channels are 128 walk programs a request, so one or two requests on 132 SMs."""
    tc = tm.TIME_CHUNK
    assert tm.time_chunk_for(4096, 1, 8192, 16, 132) == tc and tm.time_chunk_for(8192, 2, 8192, 16, 132) == tc
    assert tm.time_chunk_for(3 * 4096, 3, 8192, 16, 132) == 0  # 384 walk programs: the walks are as fast
    assert tm.time_chunk_for(1023, 1, 8192, 16, 132) == 0 and tm.time_chunk_for(0, 0, 8192, 16, 132) == 0
    assert tm.time_chunk_for(4 * 4096, 4, 4096, 16, 132) == 0 and tm.time_chunk_for(4 * 4096, 4, 4096, 16, 264) == tc
    assert tm.time_chunk_for(4096, 4, 64, 16, 132) == tc and tm.time_chunk_for(4095, 4, 64, 16, 132) == 0
    inp = _to(make_scan([6, 3]), KDEV)
    with pytest.raises(ValueError, match="time_chunk must be >= 0"):
        tm.mamba1_selective_scan_triton(*(inp[k] for k in SCAN_ORDER), 4, True, time_chunk=-1)


def test_selective_scan_triton_no_chunk_states_A_log_strided_flags_and_empty():
    inp = make_scan([6, 13], D_inner=20)
    inp["has_initial_state"] = torch.tensor([True, False, False, True])[::2]  # a strided view: [True, False]
    plain = _clone(inp)
    a_log = torch.log(-inp["A"])
    y_op, _ = mamba1_selective_scan(*(plain[k] for k in SCAN_ORDER), 4, False, A_is_log=False, ssm_scales=None)
    tri = _to(dict(inp, A=a_log), KDEV)
    y, cs = tm.mamba1_selective_scan_triton(*(tri[k] for k in SCAN_ORDER), 4, False, True)
    assert cs.shape == (0, 20, 8)
    assert_close(y.cpu(), y_op)
    assert_close(tri["ssm_states"].cpu(), plain["ssm_states"])
    empty = _to(make_scan([]), KDEV)
    y, cs = tm.mamba1_selective_scan_triton(*(empty[k] for k in SCAN_ORDER), 4, True)
    assert y.shape == (0, 12) and cs.shape == (0, 12, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "batch,steps,opts",
    [
        (3, 1, dict(pad_rows=(1,), inter=False)),
        (2, 4, dict(disable=True, D_inner=40, N=16)),
        (4, 3, dict(pad_rows=(0, 3), with_D=False, with_z=False, with_bias=False)),
        (2, 3, dict(G=5, D_inner=40, N=16)),
        (3, 4, dict(RG_LRU, D_inner=40, pad_rows=(1,))),
    ],
)
def test_state_update_triton(dtype, batch, steps, opts):
    inp = make_update(batch, steps, dtype=dtype, pool_dtype=dtype, **opts)
    plain = _clone(inp)
    y_op = mamba1_state_update(*(plain[k] for k in UPDATE_ORDER), A_is_log=False, ssm_scales=None, intermediate_scales=None)
    tri = _to(inp, KDEV)
    y = tm.mamba1_state_update_triton(*(tri[k] for k in UPDATE_ORDER)).cpu()
    assert y.dtype == dtype
    assert_close(y, y_op, dtype)
    for r, slot in enumerate(inp["state_indices"].tolist()):
        if slot < 0:
            assert torch.all(y[r] == 0)
    assert_close(tri["ssm_states"].cpu(), plain["ssm_states"], dtype)
    if inp["disable_state_update"]:
        assert torch.equal(tri["ssm_states"].cpu(), inp["ssm_states"])
    if inp["intermediate_states"] is not None:
        assert_close(tri["intermediate_states"].cpu(), plain["intermediate_states"], dtype)


def test_registered_as_cuda_kernels_and_validate():
    for op in ("mamba1_selective_scan", "mamba1_state_update"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"hybrid_compile::{op}", "CUDA")
    inp = _to(make_scan([9, 0, 3], pad_rows=(2,)), KDEV)
    y, cs = tm._selective_scan_cuda_impl(*(inp[k] for k in SCAN_ORDER), 4, True)
    assert y.shape == inp["x"].shape and cs.shape[0] == _varlen.max_chunk_rows(12, 3, 4)
    bad = dict(inp, dt=torch.randn(12, 3, device=KDEV))
    with pytest.raises(ValueError, match="mamba1_selective_scan: `dt`"):
        tm._selective_scan_cuda_impl(*(bad[k] for k in SCAN_ORDER), 4, True)
    dec = _to(make_update(2, 1), KDEV)
    dec["z"] = torch.randn(2, 1, 5, device=KDEV)  # D_inner is 12
    with pytest.raises(ValueError, match="mamba1_state_update: `z`"):
        tm._state_update_cuda_impl(*(dec[k] for k in UPDATE_ORDER))


# --------------------------------------------------------------------------------------------
# GPU: the registered CUDA ops at Mamba1 shapes
# --------------------------------------------------------------------------------------------


def _gpu_compare(actual, expected, dtype, what):
    actual, expected = actual.float().cpu(), expected.float().cpu()
    rel = ((actual - expected).norm() / expected.norm().clamp_min(1e-6)).item()
    assert rel < (2e-5 if dtype == torch.float32 else 1e-2), f"{what}: relative error {rel}"
    atol, rtol = (5e-4, 5e-4) if dtype == torch.float32 else (6e-2, 3e-2)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=what)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "lens,opts",
    [
        ([1000, 0, 257, 1, 700], dict(D_inner=1536, dtype=torch.bfloat16, pad_rows=(3,),
                                       init=[True, False, True, True, False])),
        ([513, 256, 40], dict(D_inner=2048, dtype=torch.bfloat16, pool_dtype=torch.bfloat16)),
        pytest.param([300, 17], dict(D_inner=4096, init=[True, False]), marks=pytest.mark.smoke),
        ([600, 33], dict(D_inner=3072, G=16, dtype=torch.bfloat16)),  # Zamba-like heads as B/C groups
        ([700, 1, 300], dict(RG_LRU, D_inner=2560, init=[True, False, True])),  # RecurrentGemma-2B's lru_width
        # time-chunked (tm.time_chunk_for: >= 1024 tokens a request, <= 2 waves of walks): Jamba's 8192
        # channels, one long request and two uneven ones
        ([3000], dict(D_inner=8192, dtype=torch.bfloat16, init=[True])),
        ([2500, 100], dict(D_inner=4096, init=[False, True])),
    ],
)
def test_gpu_selective_scan_matches_plain(lens, opts):
    dtype = opts.get("dtype", torch.float32)
    inp = make_scan(lens, **{"N": 16, **opts})
    cpu = _clone(inp)
    y_ref, cs_ref = mamba1_selective_scan(*(cpu[k] for k in SCAN_ORDER), 64, True, A_is_log=False, ssm_scales=None)
    gpu = _to(inp, "cuda")
    y, cs = torch.ops.hybrid_compile.mamba1_selective_scan(*(gpu[k] for k in SCAN_ORDER), 64, True, A_is_log=False, ssm_scales=None)
    _gpu_compare(y, y_ref, dtype, "y")
    _gpu_compare(cs, cs_ref, dtype, "chunk states")
    _gpu_compare(gpu["ssm_states"], cpu["ssm_states"], dtype, "pool")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "batch,steps,opts",
    [
        pytest.param(64, 1, dict(D_inner=4096, dtype=torch.bfloat16, pad_rows=(3, 40), inter=False),
                     marks=pytest.mark.smoke),
        (16, 4, dict(D_inner=2048, disable=True)),
        (8, 5, dict(D_inner=1536, dtype=torch.bfloat16, pool_dtype=torch.bfloat16)),
        (32, 1, dict(D_inner=3072, G=16, dtype=torch.bfloat16)),
        (16, 4, dict(RG_LRU, D_inner=2560)),  # RecurrentGemma decode / verify
    ],
)
def test_gpu_state_update_matches_plain(batch, steps, opts):
    dtype = opts.get("dtype", torch.float32)
    inp = make_update(batch, steps, **{"N": 16, "num_slots": batch + 8, **opts})  # distinct slots for every row
    cpu = _clone(inp)
    y_ref = mamba1_state_update(*(cpu[k] for k in UPDATE_ORDER), A_is_log=False, ssm_scales=None, intermediate_scales=None)
    gpu = _to(inp, "cuda")
    y = torch.ops.hybrid_compile.mamba1_state_update(*(gpu[k] for k in UPDATE_ORDER), A_is_log=False, ssm_scales=None, intermediate_scales=None)
    _gpu_compare(y, y_ref, dtype, "y")
    _gpu_compare(gpu["ssm_states"], cpu["ssm_states"], dtype, "pool")
    if inp["intermediate_states"] is not None:
        _gpu_compare(gpu["intermediate_states"], cpu["intermediate_states"], dtype, "intermediate states")


@pytest.mark.gpu
def test_gpu_opcheck():
    pre = _to(make_scan([0, 37, 1, 20], pad_rows=(3,), dtype=torch.bfloat16, D_inner=64), "cuda")
    run_opcheck(torch.ops.hybrid_compile.mamba1_selective_scan.default,
                tuple(pre[k] for k in SCAN_ORDER) + (16, True, False))  # A_is_log=False: make_scan gives A
    dec = _to(make_update(3, 2, pad_rows=(1,), D_inner=64), "cuda")
    run_opcheck(torch.ops.hybrid_compile.mamba1_state_update.default, tuple(dec[k] for k in UPDATE_ORDER) + (False,))
    a_log = torch.log(-dec["A"])  # the A_log path of the CUDA kernel too
    run_opcheck(torch.ops.hybrid_compile.mamba1_state_update.default,
                tuple(a_log if k == "A" else dec[k] for k in UPDATE_ORDER) + (True,))


@pytest.mark.gpu
@pytest.mark.smoke
def test_gpu_decode_cuda_graph_replay():
    batch, num_slots = 8, 16
    opts = dict(D_inner=2048, N=16, dtype=torch.bfloat16, num_slots=num_slots, inter=False)
    inp = make_update(batch, 1, **opts)
    static = _to(inp, "cuda")
    op = torch.ops.hybrid_compile.mamba1_state_update

    def call():
        return op(*(static[k] for k in UPDATE_ORDER), A_is_log=False, ssm_scales=None, intermediate_scales=None)

    pool0 = static["ssm_states"].clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()  # compile + warm up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    static["ssm_states"].copy_(pool0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = call()
    for pad_rows in [(), (2, 7)]:
        new = make_update(batch, 1, pad_rows=pad_rows, **opts)
        new["A"], new["D"], new["dt_bias"] = inp["A"], inp["D"], inp["dt_bias"]
        for k in ("x", "dt", "B", "C", "z", "ssm_states", "state_indices"):
            static[k].copy_(new[k])
        graph.replay()
        torch.cuda.synchronize()
        cpu = _clone(new)
        y_ref = mamba1_state_update(*(cpu[k] for k in UPDATE_ORDER), A_is_log=False, ssm_scales=None, intermediate_scales=None)
        torch.testing.assert_close(y_static.float().cpu(), y_ref.float(), atol=3e-2, rtol=3e-2)
        for r in pad_rows:
            assert torch.all(y_static[r] == 0)
        torch.testing.assert_close(static["ssm_states"].float().cpu(), cpu["ssm_states"].float(), atol=3e-2, rtol=3e-2)


# --------------------------------------------------------------------------------------------
# draft trees (parent_indices)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,opts", [(torch.float32, {}), (torch.float32, dict(G=4)),
                                        (torch.bfloat16, {}), (torch.float32, RG_LRU)])
def test_state_update_tree_triton(dtype, opts):
    """The kernel over trees against the literal per-path chain recurrence and the plain op."""
    inp, parents = make_tree_update(dtype, **opts)
    _check_tree_update(inp, parents, pad_row=0, dtype=dtype)


def _check_tree_update(inp, parents, pad_row, dtype=torch.float32):
    """The kernel over the trees of ``parents`` against the literal per-path chain recurrence and the
    plain op; the padding row zero, its and the buffer's extra row's states untouched, the pool too."""
    want_y, want_states = tree_oracle(inp, parents)
    plain = _clone(inp)
    y_op = mamba1_state_update(*(plain[k] for k in UPDATE_ORDER), False, None, None, parents)
    tri = _to(inp, KDEV)
    y = tm.mamba1_state_update_triton(*(tri[k] for k in UPDATE_ORDER), False, None, None, parents.to(KDEV)).cpu()
    inter = tri["intermediate_states"].cpu()
    real = [r for r in range(parents.shape[0]) if r != pad_row]
    assert_close(y[real], want_y[real], dtype)
    assert_close(inter[real], want_states[real], dtype)
    assert_close(y, y_op, dtype)
    assert_close(inter, plain["intermediate_states"], dtype)
    assert torch.all(y[pad_row] == 0) and torch.all(inter[pad_row] == 7.0) and torch.all(inter[-1] == 7.0)
    assert torch.equal(tri["ssm_states"].cpu(), inp["ssm_states"])


def test_state_update_random_trees_one_program_per_path():
    """The kernel walks each root-to-leaf path in its own programs (``common.tree_path``): random trees
    of 11 nodes, a forest (several nodes from the slot's state) and a chain, five channel blocks,
    against the literal per-path chain recurrence and the plain op; every node stored exactly once."""
    gen = torch.Generator().manual_seed(7)
    B, L = 5, 11
    inp = make_update(B, L, D_inner=40, pad_rows=(1,), disable=True)
    parents = ref_tree.trees_forest_and_chain(B, gen)  # random trees, a forest, a chain
    _check_tree_update(inp, parents, pad_row=1)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "batch,steps,opts",
    [
        (16, 16, dict(D_inner=4096)),  # Mamba-2.8B-like width, a 16-node tree per request
        (8, 12, dict(D_inner=3072, G=16, dtype=torch.bfloat16, pool_dtype=torch.bfloat16)),  # Zamba-like heads
        (8, 10, dict(RG_LRU, D_inner=2560)),  # RecurrentGemma's RG-LRU
    ],
)
def test_gpu_state_update_tree_matches_plain(batch, steps, opts):
    """The registered CUDA op over random draft trees against the plain-torch op on CPU copies, and opcheck."""
    dtype = opts.get("dtype", torch.float32)
    gen = torch.Generator().manual_seed(batch * steps)
    inp = make_update(batch, steps, **{"N": 16, "num_slots": batch + 8, "pad_rows": (3,), "disable": True, **opts})
    parents = ref_tree.random_parents(batch, steps, gen)
    cpu = _clone(inp)
    y_ref = mamba1_state_update(*(cpu[k] for k in UPDATE_ORDER), False, None, None, parents)
    gpu = _to(inp, "cuda")
    op = torch.ops.hybrid_compile.mamba1_state_update
    y = op(*(gpu[k] for k in UPDATE_ORDER), False, None, None, parents.cuda())
    _gpu_compare(y, y_ref, dtype, "y")
    _gpu_compare(gpu["intermediate_states"], cpu["intermediate_states"], dtype, "intermediate states")
    assert torch.equal(gpu["ssm_states"].cpu(), inp["ssm_states"])
    run_opcheck(op.default, tuple(gpu[k] for k in UPDATE_ORDER) + (False, None, None, parents.cuda()))


_SM90_BUILD = r'''
import json
from benchmarks.kda_intra_build import build_kernel
from hybrid_compile.ops.triton import mamba1 as m

# Jamba's mixer: 8192 channels, state 16, bf16 activations, an fp32 pool
pointers = dict(cu_ptr="*i32", idx_ptr="*i32", init_ptr="*u8", rows_ptr="*i64", tc_rows_ptr="*i64", x_ptr="*bf16",
                dt_ptr="*bf16", B_ptr="*bf16", C_ptr="*bf16", z_ptr="*bf16", y_ptr="*bf16")
for tc in (0, m.TIME_CHUNK):
    bd, bn, warps = m.scan_tiles(8192, 16, tc)
    flags = dict(BLOCK_D=bd, BLOCK_N=bn, A_IS_LOG=False, TIME_CHUNK=tc)
    kernels = [(m._scan_kernel, dict(flags, HAS_D=True, HAS_Z=True, HAS_BIAS=True, DT_SOFTPLUS=True, CHUNK_STATES=True))]
    if tc:
        kernels += [(m._time_chunk_end_kernel, dict(flags, HAS_BIAS=True, DT_SOFTPLUS=True)),
                    (m._time_chunk_combine_kernel, flags)]
    for kern, consts in kernels:
        sig = {n: "constexpr" if n in consts else pointers.get(n, "*fp32" if n.endswith("_ptr") else "i32")
               for n in kern.arg_names}
        stats = build_kernel(kern, sig, consts, warps)
        print(json.dumps(dict(kernel=kern.fn.__name__, time_chunk=tc, regs=stats["regs"], spill_stores=stats["spill_stores"])))
'''


def test_scan_kernels_build_for_sm90_without_spilling(tmp_path):
    """The scan kernels at Jamba's width, single walk and time-chunked, compiled for sm_90 at the
    launcher's tiles (``scan_tiles``; the interpreter runs kernels but never compiles them): all four
    build, none spills, and the time-chunked tiles take fewer registers than the single walk's (what
    lets several of their programs share an SM)."""
    from sm90_builds import build_stats

    rows = build_stats(_SM90_BUILD, tmp_path)
    assert [(r["kernel"], r["time_chunk"]) for r in rows] == [
        ("_scan_kernel", 0), ("_scan_kernel", tm.TIME_CHUNK), ("_time_chunk_end_kernel", tm.TIME_CHUNK),
        ("_time_chunk_combine_kernel", tm.TIME_CHUNK)], rows
    assert all(r["spill_stores"] == 0 for r in rows), rows
    assert rows[1]["regs"] < rows[0]["regs"], rows
