"""Triton Gated DeltaNet kernels (hybrid_compile/ops/triton/gdn.py, gdn_chunk.py) against the
plain-torch ops and the per-token reference.

On CPU the launchers run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1)
at tiny head dims (tl.dot needs blocks >= 16); the ``gpu`` tests run the registered CUDA ops at
Qwen3-Next shapes, under opcheck and in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_compile.ops import gdn
from hybrid_compile.ops._varlen import chunk_row_offsets, max_chunk_rows
from hybrid_compile.ops.reference import gdn as ref
from hybrid_compile.ops.triton import gdn as tgdn
from op_testing import assert_close, cu_seqlens_of, distinct_slots, run_opcheck

# CPU tests here call the launchers on CPU tensors under Triton's interpreter (see conftest).
INTERPRETER_ONLY = True

ops = torch.ops.hybrid_compile
C = gdn.GDN_CHUNK_SIZE
NUM_SLOTS = 10


def make_qkv(lead, hk, hv, kd, vd, dtype, device="cpu"):
    """q, k [*lead, Hk, K], v [*lead, Hv, V]: strided views of one projection (like HF's split)."""
    mixed = torch.randn(*lead, 2 * hk * kd + hv * vd)
    mixed[..., : 2 * hk * kd] /= kd ** 0.5  # |k| ~ 1 keeps the un-normalised delta rule stable
    mixed = mixed.to(device=device, dtype=dtype)
    q, k, v = torch.split(mixed, [hk * kd, hk * kd, hv * vd], dim=-1)
    return q.unflatten(-1, (hk, kd)), k.unflatten(-1, (hk, kd)), v.unflatten(-1, (hv, vd))


def make_gb(lead, hv, device="cpu", strength=0.4):
    g = -torch.rand(*lead, hv) * strength - 0.01
    return g.to(device), torch.rand(*lead, hv).to(device)


def make_pool(hv, kd, vd, dtype, num_slots=NUM_SLOTS, device="cpu"):
    return (torch.randn(num_slots, hv, kd, vd) * 0.5).to(device=device, dtype=dtype)


def check_pool(actual, expected, original, slots, dtype):
    """Written slots close to `expected`; every other slot bit-identical to `original`."""
    written = sorted({int(s) for s in slots if int(s) >= 0})
    untouched = [i for i in range(original.shape[0]) if i not in written]
    assert actual.dtype == original.dtype
    if untouched:
        assert torch.equal(actual[untouched], original[untouched]), "untouched slots changed"
    if written:
        assert_close(actual[written], expected[written], dtype, msg="written slots")


def tol_dtype(*dtypes):
    return torch.bfloat16 if torch.bfloat16 in dtypes or torch.float16 in dtypes else torch.float32


def test_cuda_kernels_registered():
    for name in ("chunk_gated_delta_rule", "fused_sigmoid_gating_delta_rule_update",
                 "fused_recurrent_gated_delta_rule_update"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"hybrid_compile::{name}", "CUDA"), name


# ----------------------------------------------------------------------------------------------
# chunk_gated_delta_rule
# ----------------------------------------------------------------------------------------------

# (lens, (Hk, Hv, K, V), input dtype, pool dtype, padding rows, l2norm, scale)
CHUNK_CASES = [
    ([130, 0, 1, 63], (2, 4, 16, 16), torch.float32, torch.float32, (), True, 0.0),
    ([64, 65, 1, 5], (1, 2, 16, 16), torch.bfloat16, torch.bfloat16, (3,), False, 0.37),
    ([5, 63, 0, 2, 1], (1, 4, 16, 16), torch.float32, torch.bfloat16, (0,), True, 0.0),
    ([65, 3], (1, 2, 24, 72), torch.float32, torch.float32, (), True, 0.5),  # K, V not powers of 2; V > 64
    ([1, 1, 1], (2, 2, 16, 16), torch.bfloat16, torch.float32, (1,), True, 0.0),
]


def chunk_inputs(lens, dims, dtype, pool_dtype, pad_rows, device="cpu", num_slots=NUM_SLOTS):
    hk, hv, kd, vd = dims
    T, B = sum(lens), len(lens)
    q, k, v = make_qkv((T,), hk, hv, kd, vd, dtype, device)
    g, beta = make_gb((T,), hv, device)
    pool = make_pool(hv, kd, vd, pool_dtype, num_slots, device)
    cu = cu_seqlens_of(lens, device=device)
    slots = distinct_slots(B, num_slots, pad_rows=pad_rows).to(device)
    has_init = (torch.arange(B) % 2 == 0).to(device)  # both with and without an initial state
    return q, k, v, g, beta, pool, cu, slots, has_init


@pytest.mark.parametrize("case", range(len(CHUNK_CASES)))
def test_chunk_matches_op_and_reference(case):
    lens, dims, dtype, pool_dtype, pad_rows, l2, scale = CHUNK_CASES[case]
    q, k, v, g, beta, pool, cu, slots, has_init = chunk_inputs(lens, dims, dtype, pool_dtype, pad_rows)
    tol = tol_dtype(dtype, pool_dtype)

    got_pool = pool.clone()
    o, cs = tgdn.chunk_gated_delta_rule_triton(q, k, v, g, beta, got_pool, cu, slots, has_init, l2, scale, True)
    op_pool = pool.clone()
    op_o, op_cs = gdn.chunk_gated_delta_rule(q, k, v, g, beta, op_pool, cu, slots, has_init, l2, scale, True, ssm_scales=None)
    ro, rpool, rcs = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, pool, cu, slots, has_init, l2, scale, True)

    assert o.dtype == dtype and o.shape == v.shape and o.is_contiguous()
    assert cs.dtype == torch.float32 and cs.shape == (max_chunk_rows(sum(lens), len(lens), C), *pool.shape[1:])
    assert_close(o, ro, dtype, msg="output vs reference")
    assert_close(o, op_o, dtype, msg="output vs op")
    check_pool(got_pool, rpool, pool, slots, tol)
    check_pool(got_pool, op_pool, pool, slots, tol)
    assert_close(cs, rcs, torch.float32 if pool_dtype == torch.float32 else tol, msg="chunk states vs reference")
    assert_close(cs, op_cs, torch.float32 if pool_dtype == torch.float32 else tol, msg="chunk states vs op")
    # padding requests: zero output and zero chunk-state rows; rows past the last chunk zero
    offs = chunk_row_offsets(cu, C)
    for r in pad_rows:
        assert torch.all(o[cu[r] : cu[r + 1]] == 0)
        assert torch.all(cs[offs[r] : offs[r] + -(-lens[r] // C)] == 0)
    used = sum(-(-n // C) for n in lens)
    assert torch.all(cs[used:] == 0)

    if case < 2:  # without chunk states: same output and pool, bit for bit, and a 0-row tensor
        pool2 = pool.clone()
        o2, cs2 = tgdn.chunk_gated_delta_rule_triton(q, k, v, g, beta, pool2, cu, slots, has_init, l2, scale, False)
        assert cs2.shape == (0, *pool.shape[1:]) and cs2.dtype == torch.float32
        assert torch.equal(o2, o) and torch.equal(pool2, got_pool)


def test_chunk_strong_decay_and_mixed_dtypes():
    """Large |g| (exp(c_i - c_j) would overflow if the masked part were evaluated) and q in bf16
    with k in fp32 (the q.k^T matmul then runs in fp32)."""
    lens = [70, 2]
    dims = (1, 2, 16, 16)
    q, k, v, g, beta, pool, cu, slots, has_init = chunk_inputs(lens, dims, torch.float32, torch.float32, ())
    g = -torch.rand(g.shape) * 30.0
    q = q.bfloat16()
    got_pool = pool.clone()
    o, cs = tgdn.chunk_gated_delta_rule_triton(q, k, v, g, beta, got_pool, cu, slots, has_init, True, 0.0, True)
    ro, rpool, rcs = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, pool, cu, slots, has_init, True, 0.0, True)
    assert torch.isfinite(o).all() and torch.isfinite(cs).all()
    assert_close(o, ro, torch.float32)
    assert_close(cs, rcs, torch.float32)
    check_pool(got_pool, rpool, pool, slots, torch.float32)


def test_chunk_more_requests_than_one_scan_block():
    """More requests than the kernels scan per block (``bb``, fixed whatever the batch so that a
    new batch size compiles no new variant): every request finds its chunk rows across blocks."""
    lens = [1, 5, 64, 2, 70, 3, 1, 9, 0, 4, 65, 2, 7, 1, 3, 12, 6, 1, 30, 2, 8]  # 21 > 16 requests
    dims = (1, 2, 16, 16)
    q, k, v, g, beta, pool, cu, slots, has_init = chunk_inputs(lens, dims, torch.float32, torch.float32, (),
                                                               num_slots=2 * len(lens))
    got_pool = pool.clone()
    o, cs = tgdn.chunk_gated_delta_rule_triton(q, k, v, g, beta, got_pool, cu, slots, has_init, True, 0.0, True)
    ro, rpool, rcs = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, pool, cu, slots, has_init, True, 0.0, True)
    assert_close(o, ro, torch.float32)
    assert_close(cs, rcs, torch.float32)
    check_pool(got_pool, rpool, pool, slots, torch.float32)


def test_chunk_all_padding_and_empty():
    dims = (1, 2, 16, 16)
    q, k, v, g, beta, pool, cu, slots, has_init = chunk_inputs([3, 4], dims, torch.float32, torch.float32, (0, 1))
    got_pool = pool.clone()
    o, cs = tgdn.chunk_gated_delta_rule_triton(q, k, v, g, beta, got_pool, cu, slots, has_init, True, 0.0, True)
    assert torch.all(o == 0) and torch.all(cs == 0) and torch.equal(got_pool, pool)
    assert cs.shape == (max_chunk_rows(7, 2, C), 2, 16, 16)
    # no requests, no tokens
    q, k, v, g, beta, pool, cu, slots, has_init = chunk_inputs([], dims, torch.float32, torch.float32, ())
    o, cs = tgdn.chunk_gated_delta_rule_triton(q, k, v, g, beta, got_pool, cu, slots, has_init, True, 0.0, True)
    assert o.shape == (0, 2, 16) and cs.shape == (0, 2, 16, 16)
    # only zero-length requests: nothing written
    q, k, v, g, beta, pool, cu, slots, has_init = chunk_inputs([0, 0], dims, torch.float32, torch.float32, ())
    got_pool = pool.clone()
    o, cs = tgdn.chunk_gated_delta_rule_triton(q, k, v, g, beta, got_pool, cu, slots, has_init, True, 0.0, True)
    assert o.shape == (0, 2, 16) and cs.shape == (2, 2, 16, 16) and torch.all(cs == 0)
    assert torch.equal(got_pool, pool)


def test_chunk_cuda_impl_validates():
    """The registered CUDA impl runs the op's checks before launching."""
    q, k, v, g, beta, pool, cu, slots, hi = chunk_inputs([3, 4], (1, 2, 16, 16), torch.float32, torch.float32, ())
    with pytest.raises(ValueError, match="chunk_gated_delta_rule.*`g`"):
        tgdn._chunk_cuda_impl(q, k, v, g[:-1], beta, pool, cu, slots, hi, True, 0.0, False)
    with pytest.raises(ValueError, match="chunk_gated_delta_rule.*head_k_dim"):
        big = torch.zeros(2, 1, 512)
        tgdn.chunk_gated_delta_rule_triton(big, big, torch.zeros(2, 1, 16), torch.zeros(2, 1), torch.zeros(2, 1),
                                           torch.zeros(1, 1, 512, 16), cu_seqlens_of([2]), torch.tensor([0]),
                                           torch.tensor([False]), True, 0.0, False)


# ----------------------------------------------------------------------------------------------
# fused_sigmoid_gating_delta_rule_update (decode)
# ----------------------------------------------------------------------------------------------


def decode_inputs(B, dims, dtype, pool_dtype, pad_rows, device="cpu", num_slots=NUM_SLOTS):
    hk, hv, kd, vd = dims
    q, k, v = make_qkv((B,), hk, hv, kd, vd, dtype, device)
    A_log = torch.log(torch.empty(hv).uniform_(0.05, 1.0)).to(device)
    dt_bias = (torch.randn(hv) * 0.5).to(device)
    ab = (torch.randn(B, 2 * hv) * 3).to(device=device, dtype=dtype)
    a, b = ab[:, :hv], ab[:, hv:]  # strided views
    pool = make_pool(hv, kd, vd, pool_dtype, num_slots, device)
    slots = distinct_slots(B, num_slots, pad_rows=pad_rows).to(device)
    return A_log, dt_bias, q, k, v, a, b, pool, slots


@pytest.mark.parametrize("dtype,pool_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                              (torch.float32, torch.bfloat16)], ids=["f32", "bf16", "bf16pool"])
@pytest.mark.parametrize("dims,l2,sp", [((2, 4, 16, 16), True, (1.0, 20.0)), ((1, 2, 12, 40), False, (2.0, 3.0))],
                         ids=["gqa", "odd"])
@pytest.mark.parametrize("pad_rows", [(), (1, 4)], ids=["nopad", "pad"])
def test_decode_matches_op_and_reference(dtype, pool_dtype, dims, l2, sp, pad_rows):
    B = 5
    A_log, dt_bias, q, k, v, a, b, pool, slots = decode_inputs(B, dims, dtype, pool_dtype, pad_rows)
    scale = 0.0 if l2 else 0.3
    got_pool = pool.clone()
    o = tgdn.fused_sigmoid_gating_delta_rule_update_triton(A_log, dt_bias, q, k, v, a, b, got_pool, slots, l2, scale,
                                                          *sp)
    op_pool = pool.clone()
    op_o = gdn.fused_sigmoid_gating_delta_rule_update(A_log, dt_bias, q, k, v, a, b, op_pool, slots, l2, scale, *sp, ssm_scales=None)
    ro, rpool = ref.fused_sigmoid_gating_delta_rule_update_ref(A_log, dt_bias, q, k, v, a, b, pool, slots, l2, scale,
                                                               *sp)
    tol = tol_dtype(dtype, pool_dtype)
    assert o.dtype == dtype and o.shape == v.shape
    assert_close(o, ro, tol, msg="output vs reference")
    assert_close(o, op_o, tol, msg="output vs op")
    check_pool(got_pool, rpool, pool, slots, tol)
    check_pool(got_pool, op_pool, pool, slots, tol)
    for r in pad_rows:
        assert torch.all(o[r] == 0)


def test_decode_all_padding_and_empty():
    A_log, dt_bias, q, k, v, a, b, pool, slots = decode_inputs(3, (1, 2, 16, 16), torch.float32, torch.float32,
                                                               (0, 1, 2))
    got_pool = pool.clone()
    o = tgdn.fused_sigmoid_gating_delta_rule_update_triton(A_log, dt_bias, q, k, v, a, b, got_pool, slots, True, 0.0,
                                                          1.0, 20.0)
    assert torch.all(o == 0) and torch.equal(got_pool, pool)
    A_log, dt_bias, q, k, v, a, b, pool, slots = decode_inputs(0, (1, 2, 16, 16), torch.float32, torch.float32, ())
    o = tgdn.fused_sigmoid_gating_delta_rule_update_triton(A_log, dt_bias, q, k, v, a, b, pool, slots, True, 0.0,
                                                          1.0, 20.0)
    assert o.shape == (0, 2, 16)


# ----------------------------------------------------------------------------------------------
# fused_recurrent_gated_delta_rule_update (verify)
# ----------------------------------------------------------------------------------------------


def verify_inputs(B, L, dims, dtype, pool_dtype, pad_rows, device="cpu", num_slots=NUM_SLOTS):
    hk, hv, kd, vd = dims
    q, k, v = make_qkv((B, L), hk, hv, kd, vd, dtype, device)
    g, beta = make_gb((B, L), hv, device)
    pool = make_pool(hv, kd, vd, pool_dtype, num_slots, device)
    slots = distinct_slots(B, num_slots, pad_rows=pad_rows).to(device)
    return q, k, v, g, beta, pool, slots


@pytest.mark.parametrize("dtype,pool_dtype,inter_dtype", [
    (torch.float32, torch.float32, torch.float32),
    (torch.bfloat16, torch.float32, torch.float32),
    (torch.float32, torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32, None),
], ids=["f32", "bf16", "bf16pool", "nointer"])
@pytest.mark.parametrize("disable_state_update", [False, True])
@pytest.mark.parametrize("pad_rows", [(), (0, 2)], ids=["nopad", "pad"])
def test_verify_matches_op_and_reference(dtype, pool_dtype, inter_dtype, disable_state_update, pad_rows):
    B, L = 4, 3
    dims = [(2, 4, 16, 16), (1, 2, 12, 40)][int(disable_state_update)]
    hk, hv, kd, vd = dims
    q, k, v, g, beta, pool, slots = verify_inputs(B, L, dims, dtype, pool_dtype, pad_rows)
    l2, scale = (True, 0.0) if not pad_rows else (False, 0.4)
    inter = None if inter_dtype is None else torch.randn(B + 2, L + 1, hv, kd, vd).to(inter_dtype)
    got_pool, got_inter = pool.clone(), None if inter is None else inter.clone()
    o = tgdn.fused_recurrent_gated_delta_rule_update_triton(q, k, v, g, beta, got_pool, slots, l2, scale,
                                                            disable_state_update, got_inter)
    op_pool, op_inter = pool.clone(), None if inter is None else inter.clone()
    op_o = gdn.fused_recurrent_gated_delta_rule_update(q, k, v, g, beta, op_pool, slots, l2, scale,
                                                       disable_state_update, op_inter, ssm_scales=None, intermediate_scales=None, parent_indices=None)
    ro, rpool, rinter = ref.fused_recurrent_gated_delta_rule_update_ref(q, k, v, g, beta, pool, slots, l2, scale,
                                                                        disable_state_update, inter)
    tol = tol_dtype(dtype, pool_dtype)
    assert o.dtype == dtype and o.shape == v.shape
    assert_close(o, ro, tol, msg="output vs reference")
    assert_close(o, op_o, tol, msg="output vs op")
    if disable_state_update:
        assert torch.equal(got_pool, pool)
    else:
        check_pool(got_pool, rpool, pool, slots, tol)
        check_pool(got_pool, op_pool, pool, slots, tol)
    if inter is not None:
        real = [i for i in range(B) if int(slots[i]) >= 0]
        untouched = torch.ones(inter.shape[:2], dtype=torch.bool)
        untouched[real, :L] = False
        assert torch.equal(got_inter[untouched], inter[untouched]), "intermediate rows/steps not owned were written"
        assert_close(got_inter[real, :L], rinter[real, :L], tol)
        assert_close(got_inter[real, :L], op_inter[real, :L], tol)
    for r in pad_rows:
        assert torch.all(o[r] == 0)


@pytest.mark.parametrize("tree", [False, True])
def test_verify_gating_in_the_kernel_matches_the_op(tree):
    """The kernel gating the raw ``a`` / ``b`` itself (``A_log`` / ``dt_bias`` given) against the plain op
    given the same (which gates with ``gdn_gating``), a chain and a tree."""
    B, L = 3, 4
    dims = (1, 2, 16, 16)
    q, k, v, _, _, pool, slots = verify_inputs(B, L, dims, torch.bfloat16, torch.float32, (1,))
    gen = torch.Generator().manual_seed(11)
    A_log, dt_bias = torch.randn(2, generator=gen), torch.randn(2, generator=gen)
    a, b = torch.randn(B, L, 2, generator=gen).bfloat16(), torch.randn(B, L, 2, generator=gen).bfloat16()
    parents = torch.tensor([[-1, 0, 1, 0]] * B, dtype=torch.int32) if tree else None
    inter, op_inter = (torch.full((B, L, 2, 16, 16), 7.0) for _ in range(2))
    o = tgdn.fused_recurrent_gated_delta_rule_update_triton(q, k, v, a, b, pool.clone(), slots, True, 0.0, True,
                                                            inter, None, None, parents, A_log, dt_bias)
    op_o = gdn.fused_recurrent_gated_delta_rule_update(q, k, v, a, b, pool.clone(), slots, True, 0.0, True, op_inter,
                                                       None, None, parents, A_log=A_log, dt_bias=dt_bias)
    assert_close(o, op_o, torch.bfloat16)
    assert_close(inter, op_inter)
    assert torch.all(o[1] == 0) and torch.all(inter[1] == 7.0)


def test_verify_last_step_equals_decode_steps():
    """L verify steps from a slot end in the state that L decode steps reach (same kernel family,
    different entry points), and verify's intermediate states are the per-step states."""
    dims = (1, 2, 16, 16)
    L = 3
    A_log, dt_bias, q, k, v, a, b, pool, slots = decode_inputs(2, dims, torch.float32, torch.float32, ())
    qs, ks, vs = make_qkv((2, L), *dims, torch.float32)
    ab = torch.randn(2, L, 4)
    a_s, b_s = ab[..., :2], ab[..., 2:]
    g, beta = gdn.gdn_gating(A_log, a_s.reshape(-1, 2), b_s.reshape(-1, 2), dt_bias)
    g, beta = g.view(2, L, 2), beta.view(2, L, 2)
    pv, pd = pool.clone(), pool.clone()
    inter = torch.zeros(2, L, 2, 16, 16)
    ov = tgdn.fused_recurrent_gated_delta_rule_update_triton(qs, ks, vs, g, beta, pv, slots, True, 0.0, False, inter)
    for t in range(L):
        od = tgdn.fused_sigmoid_gating_delta_rule_update_triton(A_log, dt_bias, qs[:, t], ks[:, t], vs[:, t],
                                                               a_s[:, t], b_s[:, t], pd, slots, True, 0.0, 1.0, 20.0)
        assert_close(od, ov[:, t], torch.float32)
        assert_close(inter[:, t], pd[slots.long()], torch.float32)
    assert_close(pv, pd, torch.float32)


# ----------------------------------------------------------------------------------------------
# GPU: the registered CUDA ops at model shapes (run by the lead on an H100)
# ----------------------------------------------------------------------------------------------

QWEN3_NEXT = (16, 32, 128, 128)  # Hk, Hv, K, V
GPU_SLOTS = 64
GPU_LENS = [1000, 0, 1, 63, 64, 65, 130, 300]  # request 5 is a padding row in the chunk test


DEV = "cuda"  # the gpu tests' device (a module constant so their logic can be dry-run elsewhere)


def _sync():
    if torch.device(DEV).type == "cuda":
        torch.cuda.synchronize()


def _cpu(*xs):
    return [None if x is None else x.cpu() for x in xs]


GPU_LENS_48 = GPU_LENS + [3, 70, 1, 17, 64, 2, 129, 5] * 5  # GPU_LENS first, then 40 more requests


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,pool_dtype,lens", [
    pytest.param(torch.bfloat16, torch.float32, GPU_LENS, id="bf16-8reqs", marks=pytest.mark.smoke),
    pytest.param(torch.bfloat16, torch.float32, GPU_LENS_48, id="bf16-48reqs"),
    pytest.param(torch.float32, torch.float32, GPU_LENS_48, id="f32-48reqs"),
    pytest.param(torch.float16, torch.float32, GPU_LENS, id="f16-8reqs"),  # fp32 intermediates, TF32 MMAs
    pytest.param(torch.bfloat16, torch.bfloat16, GPU_LENS_48, id="bf16pool-48reqs"),
])
def test_gpu_chunk_matches_torch_op(dtype, pool_dtype, lens):
    """At model shapes; 48 requests: more than one block of the kernels' request scan. Each dtype
    pair compiles its own kernel variants; 8 vs 48 requests compiles none (the request count is a
    run-time argument), so 8 requests (one block of the scan) runs for one dtype pair only: the 48
    start with the same 8, and the CPU reference of each case costs tens of seconds."""
    pad_rows = (5,)
    q, k, v, g, beta, pool, cu, slots, has_init = chunk_inputs(lens, QWEN3_NEXT, dtype, pool_dtype, pad_rows, DEV,
                                                               GPU_SLOTS)
    got_pool = pool.clone()
    o, cs = ops.chunk_gated_delta_rule(q, k, v, g, beta, got_pool, cu, slots, has_init, True, 0.0, True, ssm_scales=None)
    _sync()
    cq, ck, cv, cg, cb, cpool, ccu, cslots, chi = _cpu(q, k, v, g, beta, pool, cu, slots, has_init)
    want_pool = cpool.clone()
    want_o, want_cs = gdn.chunk_gated_delta_rule(cq, ck, cv, cg, cb, want_pool, ccu, cslots, chi, True, 0.0, True, ssm_scales=None)
    tol = tol_dtype(dtype, pool_dtype)
    assert_close(o.cpu(), want_o, tol, msg="output")
    check_pool(got_pool.cpu(), want_pool, cpool, cslots, tol)
    assert_close(cs.cpu(), want_cs, tol, msg="chunk states")
    offs = chunk_row_offsets(ccu, C)
    assert torch.all(o[cu[5] : cu[6]] == 0) and torch.all(cs[offs[5] : offs[5] + 2] == 0)
    # no chunk states: same output
    pool2 = pool.clone()
    o2, cs2 = ops.chunk_gated_delta_rule(q, k, v, g, beta, pool2, cu, slots, has_init, True, 0.0, False, ssm_scales=None)
    assert cs2.shape[0] == 0 and torch.equal(o2, o) and torch.equal(pool2, got_pool)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,pool_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("B", [1, 48])
def test_gpu_decode_matches_torch_op(dtype, pool_dtype, B):
    pad = (B // 2,) if B > 1 else ()
    args = decode_inputs(B, QWEN3_NEXT, dtype, pool_dtype, pad, DEV, GPU_SLOTS)
    pool = args[7]
    got_pool = pool.clone()
    o = ops.fused_sigmoid_gating_delta_rule_update(*args[:7], got_pool, args[8], True, 0.0, 1.0, 20.0, ssm_scales=None)
    cargs = _cpu(*args)
    want_pool = cargs[7].clone()
    want = gdn.fused_sigmoid_gating_delta_rule_update(*cargs[:7], want_pool, cargs[8], True, 0.0, 1.0, 20.0, ssm_scales=None)
    tol = tol_dtype(dtype, pool_dtype)
    assert_close(o.cpu(), want, tol)
    check_pool(got_pool.cpu(), want_pool, cargs[7], cargs[8], tol)


@pytest.mark.gpu
@pytest.mark.parametrize("disable,gating", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_verify_matches_torch_op(dtype, disable, gating):
    """``gating``: raw a / b with ``A_log`` / ``dt_bias``, gated in the kernel (the engine's verify)."""
    B, L = 16, 4
    hk, hv, kd, vd = QWEN3_NEXT
    q, k, v, g, beta, pool, slots = verify_inputs(B, L, QWEN3_NEXT, dtype, torch.float32, (3,), DEV, GPU_SLOTS)
    gates = {}
    if gating:
        g, beta = torch.randn(B, L, hv, device=DEV).to(dtype), torch.randn(B, L, hv, device=DEV).to(dtype)
        gates = dict(A_log=torch.randn(hv, device=DEV), dt_bias=torch.randn(hv, device=DEV))
    inter = torch.zeros(B, L + 1, hv, kd, vd, device=DEV)
    got_pool, got_inter = pool.clone(), inter.clone()
    o = ops.fused_recurrent_gated_delta_rule_update(q, k, v, g, beta, got_pool, slots, True, 0.0, disable, got_inter, ssm_scales=None, intermediate_scales=None, parent_indices=None, **gates)
    cq, ck, cv, cg, cb, cpool, cslots, cinter = _cpu(q, k, v, g, beta, pool, slots, inter)
    want_pool, want_inter = cpool.clone(), cinter.clone()
    want = gdn.fused_recurrent_gated_delta_rule_update(cq, ck, cv, cg, cb, want_pool, cslots, True, 0.0, disable,
                                                       want_inter, ssm_scales=None, intermediate_scales=None, parent_indices=None,
                                                       **{name: t.cpu() for name, t in gates.items()})
    tol = tol_dtype(dtype)
    assert_close(o.cpu(), want, tol)
    if disable:
        assert torch.equal(got_pool, pool)
    else:
        check_pool(got_pool.cpu(), want_pool, cpool, cslots, tol)
    assert_close(got_inter.cpu(), want_inter, tol)
    assert torch.all(got_inter[:, L] == 0) and torch.all(got_inter[3] == 0)


@pytest.mark.gpu
def test_gpu_opcheck():
    dims = (2, 4, 128, 128)
    args = chunk_inputs([70, 0, 5], dims, torch.bfloat16, torch.float32, (), DEV, GPU_SLOTS)
    run_opcheck(ops.chunk_gated_delta_rule, (*args, True, 0.0, True))
    run_opcheck(ops.chunk_gated_delta_rule, (*args, True, 0.0, False))
    dargs = decode_inputs(3, dims, torch.bfloat16, torch.float32, (1,), DEV, GPU_SLOTS)
    run_opcheck(ops.fused_sigmoid_gating_delta_rule_update, (*dargs, True, 0.0, 1.0, 20.0))
    q, k, v, g, beta, pool, slots = verify_inputs(3, 2, dims, torch.bfloat16, torch.float32, (1,), DEV, GPU_SLOTS)
    inter = torch.zeros(3, 2, *pool.shape[1:], device=DEV)
    run_opcheck(ops.fused_recurrent_gated_delta_rule_update, (q, k, v, g, beta, pool, slots, True, 0.0, False, inter))
    run_opcheck(ops.fused_recurrent_gated_delta_rule_update, (q, k, v, g, beta, pool, slots, True, 0.0, True, None))


@pytest.mark.gpu
@pytest.mark.smoke
def test_gpu_decode_and_verify_in_cuda_graph():
    """Capture decode and verify once; replay with new inputs (and new -1 padding rows) copied into
    the captured buffers; every replay matches the torch op on CPU copies."""
    B, L = 8, 3
    hk, hv, kd, vd = QWEN3_NEXT
    A_log, dt_bias, q, k, v, a, b, pool, slots = decode_inputs(B, QWEN3_NEXT, torch.bfloat16, torch.float32, (2,),
                                                               DEV)
    vq, vk, vv, vg, vb, _, _ = verify_inputs(B, L, QWEN3_NEXT, torch.bfloat16, torch.float32, (), DEV, GPU_SLOTS)
    inter = torch.zeros(B, L, hv, kd, vd, device=DEV)

    def decode():
        return ops.fused_sigmoid_gating_delta_rule_update(A_log, dt_bias, q, k, v, a, b, pool, slots, True, 0.0,
                                                          1.0, 20.0, ssm_scales=None)

    def verify():
        return ops.fused_recurrent_gated_delta_rule_update(vq, vk, vv, vg, vb, pool, slots, True, 0.0, True, inter, ssm_scales=None, intermediate_scales=None, parent_indices=None)

    pool0 = pool.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (Triton compiles outside the capture)
        decode()
        verify()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g_dec, g_ver = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_dec):
        out_dec = decode()
    with torch.cuda.graph(g_ver):
        out_ver = verify()
    pool.copy_(pool0)

    for it, pad in enumerate([(2,), (0, 5, 7), ()]):
        n_A, n_dt, nq, nk, nv, na, nb, _, nslots = decode_inputs(B, QWEN3_NEXT, torch.bfloat16, torch.float32, pad,
                                                                 DEV)
        for dst, src in ((q, nq), (k, nk), (v, nv), (a, na), (b, nb), (slots, nslots.to(slots.dtype))):
            dst.copy_(src)
        before = pool.cpu()
        want_pool = before.clone()
        want = gdn.fused_sigmoid_gating_delta_rule_update(*_cpu(A_log, dt_bias, q, k, v, a, b), want_pool,
                                                          slots.cpu(), True, 0.0, 1.0, 20.0, ssm_scales=None)
        g_dec.replay()
        torch.cuda.synchronize()
        assert_close(out_dec.cpu(), want, torch.bfloat16, msg=f"decode replay {it}")
        check_pool(pool.cpu(), want_pool, before, slots.cpu(), torch.bfloat16)
        for r in pad:
            assert torch.all(out_dec[r] == 0)

        nq, nk, nv, ng, nb2, _, _ = verify_inputs(B, L, QWEN3_NEXT, torch.bfloat16, torch.float32, (), DEV, GPU_SLOTS)
        for dst, src in ((vq, nq), (vk, nk), (vv, nv), (vg, ng), (vb, nb2)):
            dst.copy_(src)
        inter.zero_()
        before = pool.cpu()
        want_inter = torch.zeros(B, L, hv, kd, vd)
        want = gdn.fused_recurrent_gated_delta_rule_update(*_cpu(vq, vk, vv, vg, vb), before.clone(), slots.cpu(),
                                                           True, 0.0, True, want_inter, ssm_scales=None, intermediate_scales=None)
        g_ver.replay()
        torch.cuda.synchronize()
        assert_close(out_ver.cpu(), want, torch.bfloat16, msg=f"verify replay {it}")
        assert_close(inter.cpu(), want_inter, torch.bfloat16)
        assert torch.equal(pool.cpu(), before)  # disable_state_update
