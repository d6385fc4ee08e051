"""Tests of the Gated DeltaNet kernel ops against the per-token reference and transformers."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
import torch.nn.functional as F

from hybrid_compile.ops import gdn
from hybrid_compile.ops._varlen import chunk_row_offsets, max_chunk_rows
from hybrid_compile.ops.reference import gdn as ref
from op_testing import (
    VARLEN_CASES,
    assert_close,
    compile_and_compare,
    cu_seqlens_of,
    distinct_slots,
    run_opcheck,
)

ops = torch.ops.hybrid_compile
C = gdn.GDN_CHUNK_SIZE

# (Hk, Hv, K, V)
DIMS = [(1, 2, 8, 8), (2, 4, 16, 8), (2, 2, 8, 8)]
NUM_SLOTS = 9


def _hf():
    m = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    # The hub-kernel decorator may swap in FLA when it is installed; test the torch path.
    chunk = getattr(m.torch_chunk_gated_delta_rule, "__wrapped__", m.torch_chunk_gated_delta_rule)
    rec = getattr(m.torch_recurrent_gated_delta_rule, "__wrapped__", m.torch_recurrent_gated_delta_rule)
    return chunk, rec


def make_qkv(lead, hk, hv, kd, vd, dtype):
    """q, k [*lead, Hk, K] and v [*lead, Hv, V] as strided views of one projection (like HF's split)."""
    mixed = torch.randn(*lead, 2 * hk * kd + hv * vd)
    mixed[..., : 2 * hk * kd] /= kd ** 0.5  # |k| ~ 1 keeps the un-normalised delta rule stable
    mixed = mixed.to(dtype)
    q, k, v = torch.split(mixed, [hk * kd, hk * kd, hv * vd], dim=-1)
    return q.unflatten(-1, (hk, kd)), k.unflatten(-1, (hk, kd)), v.unflatten(-1, (hv, vd))


def make_gating_params(hv):
    A_log = torch.log(torch.empty(hv).uniform_(0.05, 1.0))
    dt_bias = torch.randn(hv) * 0.5
    return A_log, dt_bias


def make_gb(lead, hv):
    g = -torch.rand(*lead, hv) * 0.4 - 0.01
    beta = torch.rand(*lead, hv)
    return g, beta


def make_pool(hv, kd, vd, dtype=torch.float32, num_slots=NUM_SLOTS):
    return (torch.randn(num_slots, hv, kd, vd) * 0.5).to(dtype)


def check_pool(actual, expected, original, slots, dtype):
    """Written slots close to the reference; every other slot bit-identical to before."""
    written = sorted({int(s) for s in slots if int(s) >= 0})
    untouched = [i for i in range(original.shape[0]) if i not in written]
    assert actual.dtype == original.dtype
    if untouched:
        assert torch.equal(actual[untouched], original[untouched]), "untouched slots changed"
    if written:
        assert_close(actual[written], expected[written], dtype, msg="written slots")


# ----------------------------------------------------------------------------------------------
# gdn_gating
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sp_beta,sp_thr", [(1.0, 20.0), (2.0, 3.0)])
def test_gdn_gating_matches_reference_and_hf(dtype, sp_beta, sp_thr):
    hv, T = 4, 11
    A_log, dt_bias = make_gating_params(hv)
    a = (torch.randn(T, hv) * 4).to(dtype)  # crosses the softplus threshold for sp_thr=3
    a[0, 0] = 30.0
    b = torch.randn(T, hv).to(dtype)
    g, beta = ops.gdn_gating(A_log, a, b, dt_bias, sp_beta, sp_thr)
    assert g.dtype == torch.float32 and beta.dtype == torch.float32 and g.shape == (T, hv)
    rg, rb = ref.gating_ref(A_log, a, b, dt_bias, sp_beta, sp_thr)
    assert_close(g, rg, torch.float32)
    assert_close(beta, rb, torch.float32)
    assert torch.all(g < 0)
    if sp_beta == 1.0 and sp_thr == 20.0:  # exactly Qwen3NextGatedDeltaNet.forward
        hf_g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
        assert_close(g, hf_g, torch.float32)
        # HF takes the sigmoid in the activation dtype; the op keeps fp32 (more precise)
        assert_close(beta, b.sigmoid().float(), dtype)


def test_gdn_gating_opcheck():
    A_log, dt_bias = make_gating_params(3)
    run_opcheck(ops.gdn_gating, (A_log, torch.randn(5, 3), torch.randn(5, 3), dt_bias, 1.0, 20.0))
    run_opcheck(ops.gdn_gating, (A_log, torch.randn(0, 3), torch.randn(0, 3), dt_bias, 1.0, 20.0))
    ab = torch.randn(4, 6).to(torch.bfloat16)
    run_opcheck(ops.gdn_gating, (A_log.bfloat16(), ab[:, :3], ab[:, 3:], dt_bias, 1.5, 10.0))


def test_gdn_gating_invalid():
    A_log, dt_bias = make_gating_params(3)
    with pytest.raises(ValueError, match="gdn_gating.*`b`"):
        ops.gdn_gating(A_log, torch.randn(5, 3), torch.randn(4, 3), dt_bias)
    with pytest.raises(ValueError, match="gdn_gating.*`A_log`"):
        ops.gdn_gating(torch.randn(4), torch.randn(5, 3), torch.randn(5, 3), dt_bias)
    with pytest.raises(ValueError, match="gdn_gating.*`a`.*dtype"):
        ops.gdn_gating(A_log, torch.ones(5, 3, dtype=torch.int32), torch.randn(5, 3), dt_bias)


# ----------------------------------------------------------------------------------------------
# chunk_gated_delta_rule
# ----------------------------------------------------------------------------------------------


def chunk_case(lens, dims, dtype, pool_dtype=torch.float32, pad_rows=(), init=None):
    hk, hv, kd, vd = dims
    T, B = sum(lens), len(lens)
    q, k, v = make_qkv((T,), hk, hv, kd, vd, dtype)
    g, beta = make_gb((T,), hv)
    pool = make_pool(hv, kd, vd, pool_dtype)
    cu = cu_seqlens_of(lens)
    slots = distinct_slots(B, NUM_SLOTS, pad_rows=pad_rows)
    has_init = torch.rand(B) < 0.5 if init is None else torch.full((B,), init)
    return q, k, v, g, beta, pool, cu, slots, has_init


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(VARLEN_CASES)))
def test_chunk_matches_reference(case, dtype):
    lens = VARLEN_CASES[case]
    dims = DIMS[case % len(DIMS)]
    l2 = case % 2 == 0
    scale = 0.0 if case % 3 else 0.37
    pad_rows = (1,) if len(lens) > 1 else ()
    q, k, v, g, beta, pool, cu, slots, has_init = chunk_case(lens, dims, dtype, pad_rows=pad_rows)
    has_init[0] = True
    if len(lens) > 2:
        has_init[2] = False
    pool_op = pool.clone()
    o, cs = ops.chunk_gated_delta_rule(q, k, v, g, beta, pool_op, cu, slots, has_init, l2, scale, True, ssm_scales=None)
    ro, rpool, rcs = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, pool, cu, slots, has_init, l2, scale, True)
    assert o.dtype == dtype and o.shape == v.shape and o.is_contiguous()
    assert cs.dtype == torch.float32 and cs.shape == (max_chunk_rows(sum(lens), len(lens), C), *pool.shape[1:])
    assert_close(o, ro, dtype)
    check_pool(pool_op, rpool, pool, slots, dtype)
    assert_close(cs, rcs, dtype)
    # padding requests: zero output, zero chunk rows
    offs = chunk_row_offsets(cu, C)
    for r in pad_rows:
        assert torch.all(o[cu[r] : cu[r + 1]] == 0)
        n = -(-lens[r] // C)
        assert torch.all(cs[offs[r] : offs[r] + n] == 0)
    # without chunk states: same output, 0-row tensor
    pool2 = pool.clone()
    o2, cs2 = ops.chunk_gated_delta_rule(q, k, v, g, beta, pool2, cu, slots, has_init, l2, scale, False, ssm_scales=None)
    assert cs2.shape == (0, *pool.shape[1:]) and cs2.dtype == torch.float32
    torch.testing.assert_close(o2, o, atol=0, rtol=0)
    torch.testing.assert_close(pool2, pool_op, atol=0, rtol=0)


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16])
def test_chunk_low_precision_pool(pool_dtype):
    lens = [65, 0, 3]
    q, k, v, g, beta, pool, cu, slots, has_init = chunk_case(lens, DIMS[1], torch.float32, pool_dtype, init=True)
    pool_op = pool.clone()
    o, _ = ops.chunk_gated_delta_rule(q, k, v, g, beta, pool_op, cu, slots, has_init, True, 0.0, False, ssm_scales=None)
    ro, rpool, _ = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, pool, cu, slots, has_init, True, 0.0, False)
    assert_close(o, ro, torch.float32)
    check_pool(pool_op, rpool, pool, slots, pool_dtype)


def test_chunk_all_padding_and_empty():
    dims = DIMS[1]
    q, k, v, g, beta, pool, cu, slots, has_init = chunk_case([3, 4], dims, torch.float32, pad_rows=(0, 1))
    pool_op = pool.clone()
    o, cs = ops.chunk_gated_delta_rule(q, k, v, g, beta, pool_op, cu, slots, has_init, True, 0.0, True, ssm_scales=None)
    assert torch.all(o == 0) and torch.all(cs == 0) and torch.equal(pool_op, pool)
    q, k, v, g, beta, pool, cu, slots, has_init = chunk_case([], dims, torch.float32)
    o, cs = ops.chunk_gated_delta_rule(q, k, v, g, beta, pool_op, cu, slots, has_init, True, 0.0, True, ssm_scales=None)
    assert o.shape == (0, 4, 8) and cs.shape == (0, 4, 16, 8)


def test_chunk_split_in_two_calls_equals_one_call():
    dims = DIMS[1]
    lens = [150, 70, 9]
    first = [37, 64, 0]  # second call: 113, 6, 9 (the third request starts in the second call)
    q, k, v, g, beta, pool, cu, slots, _ = chunk_case(lens, dims, torch.float32)
    init = torch.tensor([True, False, True])
    pool_one = pool.clone()
    o_one, _ = ops.chunk_gated_delta_rule(q, k, v, g, beta, pool_one, cu, slots, init, True, 0.0, False, ssm_scales=None)

    second = [n - f for n, f in zip(lens, first)]

    def part(x, which):
        pieces = []
        for i, n in enumerate(lens):
            s = int(cu[i])
            pieces.append(x[s : s + first[i]] if which == 0 else x[s + first[i] : s + n])
        return torch.cat(pieces)

    pool_two = pool.clone()
    o_a, _ = ops.chunk_gated_delta_rule(*[part(x, 0) for x in (q, k, v, g, beta)], pool_two, cu_seqlens_of(first),
                                        slots, init, True, 0.0, False, ssm_scales=None)
    # second call continues from the slot: every request that had tokens (or an initial state) before
    init_b = torch.tensor([f > 0 or bool(i) for f, i in zip(first, init)])
    o_b, _ = ops.chunk_gated_delta_rule(*[part(x, 1) for x in (q, k, v, g, beta)], pool_two, cu_seqlens_of(second),
                                        slots, init_b, True, 0.0, False, ssm_scales=None)
    ca, cb = cu_seqlens_of(first).tolist(), cu_seqlens_of(second).tolist()
    o_two = torch.cat([torch.cat([o_a[ca[i] : ca[i + 1]], o_b[cb[i] : cb[i + 1]]]) for i in range(len(lens))])
    assert_close(o_two, o_one, torch.float32)
    assert_close(pool_two, pool_one, torch.float32)


def test_chunk_states_rows_of_130_token_request():
    dims = DIMS[1]
    lens = [17, 130]
    q, k, v, g, beta, pool, cu, slots, _ = chunk_case(lens, dims, torch.float32)
    has_init = torch.tensor([False, True])
    pool_op = pool.clone()
    _, cs = ops.chunk_gated_delta_rule(q, k, v, g, beta, pool_op, cu, slots, has_init, True, 0.0, True, ssm_scales=None)
    assert cs.shape[0] == max_chunk_rows(147, 2, C) == 4
    s = 17
    _, states = ref.delta_rule_ref(q[s:], k[s:], v[s:], g[s:], beta[s:], pool[slots[1]], True, 0.0)
    # request 0 owns row 0 (its zero initial state), request 1 rows 1, 2, 3
    assert torch.all(cs[0] == 0)
    torch.testing.assert_close(cs[1], pool[slots[1]].float(), atol=0, rtol=0)
    for j in range(3):
        assert_close(cs[1 + j], states[j * 64], torch.float32, msg=f"chunk {j}")
    assert torch.all(cs[4:] == 0)
    assert_close(pool_op[slots[1]], states[130], torch.float32)


# ----------------------------------------------------------------------------------------------
# transformers as a second oracle (one request, no padding)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize("dims", [(1, 2, 8, 8), (2, 4, 16, 8)])
def test_chunk_matches_transformers(dims, with_init):
    hf_chunk, hf_rec = _hf()
    hk, hv, kd, vd = dims
    L = 100
    q, k, v = make_qkv((L,), hk, hv, kd, vd, torch.float32)
    g, beta = make_gb((L,), hv)
    pool = make_pool(hv, kd, vd, num_slots=2)
    init = pool[1].clone() if with_init else None
    pool_op = pool.clone()
    o, _ = ops.chunk_gated_delta_rule(
        q, k, v, g, beta, pool_op, cu_seqlens_of([L]), torch.tensor([1]), torch.tensor([with_init]), True, 0.0, False, ssm_scales=None,
    )
    # transformers >= 5.2x expands grouped q/k heads inside these functions, older versions in the
    # model's forward (both with repeat_interleave): expand here so either version applies.
    qe, ke = (x.repeat_interleave(hv // hk, dim=1) for x in (q, k))
    for fn in (hf_chunk, hf_rec):
        ho, hs = fn(qe[None], ke[None], v[None], g[None], beta[None], initial_state=None if init is None else init[None],
                    output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert_close(o, ho[0], torch.float32, msg=fn.__name__)
        assert_close(pool_op[1], hs[0], torch.float32, msg=fn.__name__)
        if hk != hv and "repeat_interleave" in inspect.getsource(fn):  # grouped heads expanded inside
            ho2, _ = fn(q[None], k[None], v[None], g[None], beta[None],
                        initial_state=None if init is None else init[None], use_qk_l2norm_in_kernel=True)
            assert_close(o, ho2[0], torch.float32, msg=fn.__name__ + " (grouped heads)")
    assert torch.equal(pool_op[0], pool[0])


def test_decode_and_verify_match_transformers():
    _, hf_rec = _hf()
    hk, hv, kd, vd = 1, 2, 16, 8
    L = 3
    q, k, v = make_qkv((1, L), hk, hv, kd, vd, torch.float32)
    A_log, dt_bias = make_gating_params(hv)
    a, b = torch.randn(1, L, hv), torch.randn(1, L, hv)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)  # Qwen3NextGatedDeltaNet.forward
    beta = b.sigmoid()
    pool = make_pool(hv, kd, vd, num_slots=3)
    qe, ke = (x.repeat_interleave(hv // hk, dim=2) for x in (q, k))
    ho, hs = hf_rec(qe, ke, v, g, beta, initial_state=pool[2:3].clone(), output_final_state=True,
                    use_qk_l2norm_in_kernel=True)
    # verify: all L steps at once
    pv = pool.clone()
    inter = torch.zeros(1, L, hv, kd, vd)
    o = ops.fused_recurrent_gated_delta_rule_update(q, k, v, g, beta, pv, torch.tensor([2]), True, 0.0, False, inter, ssm_scales=None, intermediate_scales=None, parent_indices=None)
    assert_close(o, ho, torch.float32)
    assert_close(pv[2], hs[0], torch.float32)
    assert_close(inter[0, -1], hs[0], torch.float32)
    # decode: L single steps with the fused gating
    pd = pool.clone()
    for t in range(L):
        od = ops.fused_sigmoid_gating_delta_rule_update(
            A_log, dt_bias, q[:, t], k[:, t], v[:, t], a[:, t], b[:, t], pd, torch.tensor([2]), True, 0.0, 1.0, 20.0, ssm_scales=None,
        )
        assert_close(od, ho[:, t], torch.float32)
    assert_close(pd[2], hs[0], torch.float32)


# ----------------------------------------------------------------------------------------------
# fused_sigmoid_gating_delta_rule_update (decode)
# ----------------------------------------------------------------------------------------------


def decode_case(B, dims, dtype, pool_dtype=torch.float32, pad_rows=()):
    hk, hv, kd, vd = dims
    q, k, v = make_qkv((B,), hk, hv, kd, vd, dtype)
    A_log, dt_bias = make_gating_params(hv)
    ab = torch.randn(B, 2 * hv).to(dtype)
    a, b = ab[:, :hv], ab[:, hv:]
    pool = make_pool(hv, kd, vd, pool_dtype)
    slots = distinct_slots(B, NUM_SLOTS, pad_rows=pad_rows)
    return A_log, dt_bias, q, k, v, a, b, pool, slots


@pytest.mark.parametrize("dtype,pool_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                              (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("pad_rows", [(), (1, 3)])
def test_decode_matches_reference(dtype, pool_dtype, dims, pad_rows):
    B = 5
    A_log, dt_bias, q, k, v, a, b, pool, slots = decode_case(B, dims, dtype, pool_dtype, pad_rows)
    l2 = dims[2] == 16
    scale = 0.0 if l2 else 0.3
    pool_op = pool.clone()
    o = ops.fused_sigmoid_gating_delta_rule_update(A_log, dt_bias, q, k, v, a, b, pool_op, slots, l2, scale, 1.0, 20.0, ssm_scales=None)
    ro, rpool = ref.fused_sigmoid_gating_delta_rule_update_ref(A_log, dt_bias, q, k, v, a, b, pool, slots, l2, scale)
    assert o.dtype == dtype and o.shape == v.shape
    tol_dtype = torch.bfloat16 if torch.bfloat16 in (dtype, pool_dtype) else torch.float32
    assert_close(o, ro, tol_dtype)
    check_pool(pool_op, rpool, pool, slots, tol_dtype)
    for r in pad_rows:
        assert torch.all(o[r] == 0)


def test_decode_after_prefill_equals_longer_prefill():
    hk, hv, kd, vd = DIMS[1]
    lens = [70, 5, 64]
    T = sum(lens)
    q, k, v = make_qkv((T + len(lens),), hk, hv, kd, vd, torch.float32)  # one extra token per request
    A_log, dt_bias = make_gating_params(hv)
    a, b = torch.randn(T + len(lens), hv), torch.randn(T + len(lens), hv)
    g, beta = ops.gdn_gating(A_log, a, b, dt_bias)
    pool = make_pool(hv, kd, vd)
    slots = distinct_slots(len(lens), NUM_SLOTS)
    init = torch.tensor([True, False, True])
    long_lens = [n + 1 for n in lens]
    cu_long = cu_seqlens_of(long_lens)
    pool_long = pool.clone()
    o_long, _ = ops.chunk_gated_delta_rule(q, k, v, g, beta, pool_long, cu_long, slots, init, True, 0.0, False, ssm_scales=None)
    last = cu_long[1:].long() - 1
    keep = torch.ones(T + len(lens), dtype=torch.bool)
    keep[last] = False
    pool_pd = pool.clone()
    ops.chunk_gated_delta_rule(q[keep], k[keep], v[keep], g[keep], beta[keep], pool_pd, cu_seqlens_of(lens), slots,
                               init, True, 0.0, False, ssm_scales=None)
    od = ops.fused_sigmoid_gating_delta_rule_update(A_log, dt_bias, q[last], k[last], v[last], a[last], b[last],
                                                    pool_pd, slots, True, 0.0, 1.0, 20.0, ssm_scales=None)
    assert_close(od, o_long[last], torch.float32)
    assert_close(pool_pd, pool_long, torch.float32)
    assert torch.equal(pool_pd[[i for i in range(NUM_SLOTS) if i not in slots.tolist()]],
                       pool[[i for i in range(NUM_SLOTS) if i not in slots.tolist()]])


# ----------------------------------------------------------------------------------------------
# fused_recurrent_gated_delta_rule_update (verify)
# ----------------------------------------------------------------------------------------------


def verify_case(B, L, dims, dtype, pool_dtype=torch.float32, pad_rows=()):
    hk, hv, kd, vd = dims
    q, k, v = make_qkv((B, L), hk, hv, kd, vd, dtype)
    g, beta = make_gb((B, L), hv)
    pool = make_pool(hv, kd, vd, pool_dtype)
    slots = distinct_slots(B, NUM_SLOTS, pad_rows=pad_rows)
    return q, k, v, g, beta, pool, slots


@pytest.mark.parametrize("dtype,pool_dtype,inter_dtype", [
    (torch.float32, torch.float32, torch.float32),
    (torch.bfloat16, torch.float32, torch.float32),
    (torch.float32, torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32, None),
])
@pytest.mark.parametrize("disable_state_update", [False, True])
@pytest.mark.parametrize("pad_rows", [(), (0, 2)])
def test_verify_matches_reference(dtype, pool_dtype, inter_dtype, disable_state_update, pad_rows):
    B, L = 4, 3
    dims = DIMS[(len(pad_rows) + int(disable_state_update)) % len(DIMS)]
    hk, hv, kd, vd = dims
    q, k, v, g, beta, pool, slots = verify_case(B, L, dims, dtype, pool_dtype, pad_rows)
    inter = None if inter_dtype is None else torch.randn(B + 2, L + 1, hv, kd, vd).to(inter_dtype)
    pool_op = pool.clone()
    inter_op = None if inter is None else inter.clone()
    o = ops.fused_recurrent_gated_delta_rule_update(q, k, v, g, beta, pool_op, slots, True, 0.0,
                                                    disable_state_update, inter_op, ssm_scales=None, intermediate_scales=None, parent_indices=None)
    ro, rpool, rinter = ref.fused_recurrent_gated_delta_rule_update_ref(
        q, k, v, g, beta, pool, slots, True, 0.0, disable_state_update, inter)
    tol_dtype = torch.bfloat16 if torch.bfloat16 in (dtype, pool_dtype) else torch.float32
    assert o.dtype == dtype and o.shape == v.shape
    assert_close(o, ro, tol_dtype)
    if disable_state_update:
        assert torch.equal(pool_op, pool)
    else:
        check_pool(pool_op, rpool, pool, slots, tol_dtype)
    if inter is not None:
        real = [i for i in range(B) if int(slots[i]) >= 0]
        untouched = torch.ones(inter.shape[:2], dtype=torch.bool)
        untouched[real, :L] = False
        assert torch.equal(inter_op[untouched], inter[untouched]), "intermediate rows/steps not owned were written"
        assert_close(inter_op[real, :L], rinter[real, :L], tol_dtype)
    for r in pad_rows:
        assert torch.all(o[r] == 0)


def test_verify_intermediate_equals_prefix_states():
    hk, hv, kd, vd = DIMS[0]
    prefix = [66, 3]
    L = 4
    total = [n + L for n in prefix]
    q, k, v = make_qkv((sum(total),), hk, hv, kd, vd, torch.float32)
    g, beta = make_gb((sum(total),), hv)
    pool = make_pool(hv, kd, vd)
    slots = torch.tensor([4, 1], dtype=torch.int64)
    init = torch.tensor([False, True])
    cu_total = cu_seqlens_of(total)
    pre_idx = torch.cat([torch.arange(int(cu_total[i]), int(cu_total[i]) + prefix[i]) for i in range(2)])
    ver_idx = torch.stack([torch.arange(int(cu_total[i]) + prefix[i], int(cu_total[i + 1])) for i in range(2)])  # [B, L]
    p = pool.clone()
    ops.chunk_gated_delta_rule(q[pre_idx], k[pre_idx], v[pre_idx], g[pre_idx], beta[pre_idx], p,
                               cu_seqlens_of(prefix), slots, init, True, 0.0, False, ssm_scales=None)
    inter = torch.zeros(2, L, hv, kd, vd)
    p_after_prefill = p.clone()
    o = ops.fused_recurrent_gated_delta_rule_update(q[ver_idx], k[ver_idx], v[ver_idx], g[ver_idx], beta[ver_idx],
                                                    p, slots, True, 0.0, True, inter, ssm_scales=None, intermediate_scales=None, parent_indices=None)
    assert torch.equal(p, p_after_prefill)  # disable_state_update
    for i in range(2):
        s, e = int(cu_total[i]), int(cu_total[i + 1])
        ro, states = ref.delta_rule_ref(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e],
                                        pool[slots[i]] if bool(init[i]) else None, True, 0.0)
        assert_close(o[i], ro[prefix[i]:], torch.float32)
        for t in range(L):
            assert_close(inter[i, t], states[prefix[i] + t + 1], torch.float32, msg=f"request {i} step {t}")


# ----------------------------------------------------------------------------------------------
# opcheck
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lens,pad_rows,dtype,out_states", [
    ([0, 7, 1], (1,), torch.float32, True),
    ([65, 0, 3], (), torch.bfloat16, True),
    ([5], (), torch.float32, False),
    ([2, 1], (0, 1), torch.float32, True),
])
def test_chunk_opcheck(lens, pad_rows, dtype, out_states):
    args = chunk_case(lens, DIMS[1], dtype, pad_rows=pad_rows)
    run_opcheck(ops.chunk_gated_delta_rule, (*args, True, 0.0, out_states))


@pytest.mark.parametrize("pad_rows,dtype", [((), torch.float32), ((0,), torch.bfloat16), ((0, 1, 2), torch.float32)])
def test_decode_opcheck(pad_rows, dtype):
    args = decode_case(3, DIMS[0], dtype, pad_rows=pad_rows)
    run_opcheck(ops.fused_sigmoid_gating_delta_rule_update, (*args, True, 0.0, 1.0, 20.0))
    empty = decode_case(0, DIMS[0], dtype)
    run_opcheck(ops.fused_sigmoid_gating_delta_rule_update, (*empty, False, 0.5, 1.0, 20.0))


@pytest.mark.parametrize("pad_rows,with_inter,disable", [((), True, True), ((1,), True, False), ((1,), False, False)])
def test_verify_opcheck(pad_rows, with_inter, disable):
    q, k, v, g, beta, pool, slots = verify_case(3, 2, DIMS[1], torch.float32, pad_rows=pad_rows)
    inter = torch.zeros(4, 2, *pool.shape[1:]) if with_inter else None
    run_opcheck(ops.fused_recurrent_gated_delta_rule_update, (q, k, v, g, beta, pool, slots, True, 0.0, disable, inter))


def test_verify_gates_raw_projections_as_gdn_gating():
    """``A_log`` / ``dt_bias`` given: the verify op takes the raw ``a`` / ``b`` projections and gates
    them itself, bit for bit what ``gdn_gating`` then the op give (a tree too); opcheck with them."""
    B, L = 3, 4
    q, k, v, g, beta, pool, slots = verify_case(B, L, DIMS[1], torch.float32, pad_rows=(1,))
    hv = v.shape[2]
    gen = torch.Generator().manual_seed(9)
    A_log, dt_bias = torch.randn(hv, generator=gen), torch.randn(hv, generator=gen)
    a, b = torch.randn(B, L, hv, generator=gen), torch.randn(B, L, hv, generator=gen)
    g, beta = (t.view(B, L, hv) for t in ops.gdn_gating(A_log, a.reshape(-1, hv), b.reshape(-1, hv), dt_bias,
                                                         1.0, 20.0))
    parents = torch.tensor([[-1, 0, 0, 1]] * B, dtype=torch.int32)
    for tree in (None, parents):
        inter, want_inter = (torch.zeros(B, L, *pool.shape[1:]) for _ in range(2))
        got = ops.fused_recurrent_gated_delta_rule_update(q, k, v, a, b, pool.clone(), slots, True, 0.0, True, inter,
                                                          None, None, tree, A_log=A_log, dt_bias=dt_bias)
        want = ops.fused_recurrent_gated_delta_rule_update(q, k, v, g, beta, pool.clone(), slots, True, 0.0, True,
                                                           want_inter, None, None, tree)
        assert torch.equal(got, want) and torch.equal(inter, want_inter)
    run_opcheck(ops.fused_recurrent_gated_delta_rule_update,
                (q, k, v, a, b, pool, slots, True, 0.0, True, torch.zeros(B, L, *pool.shape[1:]), None, None, parents),
                {"A_log": A_log, "dt_bias": dt_bias})
    op = functools.partial(ops.fused_recurrent_gated_delta_rule_update, ssm_scales=None, intermediate_scales=None)
    with pytest.raises(ValueError, match="`A_log` and `dt_bias`.*come together"):
        op(q, k, v, a, b, pool, slots, True, 0.0, True, None, A_log=A_log)
    with pytest.raises(ValueError, match="fused_recurrent_gated_delta_rule_update.*`dt_bias`"):
        op(q, k, v, a, b, pool, slots, True, 0.0, True, None, A_log=A_log, dt_bias=dt_bias[:1])
    with pytest.raises(ValueError, match="per-channel gate is not gated here"):
        op(q, k, v, a[..., None].expand(B, L, hv, q.shape[-1]), b, pool, slots, True, 0.0, True, None,
           A_log=A_log, dt_bias=dt_bias)


# ----------------------------------------------------------------------------------------------
# invalid arguments
# ----------------------------------------------------------------------------------------------


def test_chunk_invalid():
    q, k, v, g, beta, pool, cu, slots, hi = chunk_case([3, 4], DIMS[1], torch.float32)
    op = functools.partial(ops.chunk_gated_delta_rule, ssm_scales=None)
    with pytest.raises(ValueError, match="chunk_gated_delta_rule.*`k`"):
        op(q, k[:, :1], v, g, beta, pool, cu, slots, hi, True, 0.0, False)
    with pytest.raises(ValueError, match="chunk_gated_delta_rule.*multiple"):
        op(q, k, v[:, :3], g[:, :3], beta[:, :3], pool[:, :3], cu, slots, hi, True, 0.0, False)
    with pytest.raises(ValueError, match="chunk_gated_delta_rule.*`ssm_states`"):
        op(q, k, v, g, beta, pool[..., :4], cu, slots, hi, True, 0.0, False)
    with pytest.raises(ValueError, match="chunk_gated_delta_rule.*`has_initial_state`.*dtype"):
        op(q, k, v, g, beta, pool, cu, slots, hi.int(), True, 0.0, False)
    with pytest.raises(ValueError, match="chunk_gated_delta_rule.*`state_indices`.*dtype"):
        op(q, k, v, g, beta, pool, cu, slots.float(), hi, True, 0.0, False)
    with pytest.raises(ValueError, match="chunk_gated_delta_rule.*`cu_seqlens`"):
        op(q, k, v, g, beta, pool, cu_seqlens_of([3, 3]), slots, hi, True, 0.0, False)
    with pytest.raises(IndexError, match="chunk_gated_delta_rule.*`state_indices`"):
        op(q, k, v, g, beta, pool, cu, torch.tensor([0, NUM_SLOTS], dtype=torch.int32), hi, True, 0.0, False)
    with pytest.raises(ValueError, match="chunk_gated_delta_rule.*repeated"):
        op(q, k, v, g, beta, pool, cu, torch.tensor([2, 2], dtype=torch.int32), hi, True, 0.0, False)
    with pytest.raises(ValueError, match="chunk_gated_delta_rule.*`g`"):
        op(q, k, v, g[:-1], beta, pool, cu, slots, hi, True, 0.0, False)


def test_decode_invalid():
    A_log, dt_bias, q, k, v, a, b, pool, slots = decode_case(3, DIMS[1], torch.float32)
    op = functools.partial(ops.fused_sigmoid_gating_delta_rule_update, ssm_scales=None)
    with pytest.raises(ValueError, match="fused_sigmoid_gating_delta_rule_update.*`a`"):
        op(A_log, dt_bias, q, k, v, a[:2], b, pool, slots, True, 0.0, 1.0, 20.0)
    with pytest.raises(ValueError, match="fused_sigmoid_gating_delta_rule_update.*`A_log`"):
        op(A_log[:1], dt_bias, q, k, v, a, b, pool, slots, True, 0.0, 1.0, 20.0)
    with pytest.raises(ValueError, match="fused_sigmoid_gating_delta_rule_update.*`ssm_states`.*dtype"):
        op(A_log, dt_bias, q, k, v, a, b, pool.double(), slots, True, 0.0, 1.0, 20.0)
    with pytest.raises(IndexError, match="fused_sigmoid_gating_delta_rule_update.*`state_indices`"):
        op(A_log, dt_bias, q, k, v, a, b, pool, torch.tensor([0, 1, -2]), True, 0.0, 1.0, 20.0)
    with pytest.raises(ValueError, match="fused_sigmoid_gating_delta_rule_update.*`state_indices`"):
        op(A_log, dt_bias, q, k, v, a, b, pool, slots[:2], True, 0.0, 1.0, 20.0)


def test_verify_invalid():
    q, k, v, g, beta, pool, slots = verify_case(2, 3, DIMS[1], torch.float32)
    op = functools.partial(ops.fused_recurrent_gated_delta_rule_update, ssm_scales=None, intermediate_scales=None)
    with pytest.raises(ValueError, match="fused_recurrent_gated_delta_rule_update.*`intermediate_states`"):
        op(q, k, v, g, beta, pool, slots, True, 0.0, False, torch.zeros(1, 3, *pool.shape[1:]))
    with pytest.raises(ValueError, match="fused_recurrent_gated_delta_rule_update.*`intermediate_states`"):
        op(q, k, v, g, beta, pool, slots, True, 0.0, False, torch.zeros(2, 3, 4, 16, 4))
    with pytest.raises(ValueError, match="fused_recurrent_gated_delta_rule_update.*`v`"):
        op(q, k, v[:, :2], g, beta, pool, slots, True, 0.0, False, None)
    with pytest.raises(ValueError, match="fused_recurrent_gated_delta_rule_update.*`beta`"):
        op(q, k, v, g, beta[..., :1], pool, slots, True, 0.0, False, None)
    with pytest.raises(IndexError, match="fused_recurrent_gated_delta_rule_update.*`state_indices`"):
        op(q, k, v, g, beta, pool, torch.tensor([NUM_SLOTS, 0]), True, 0.0, False, None)


def test_fake_impl_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, g, beta, pool, cu, slots, hi = chunk_case([130, 0, 7], DIMS[1], torch.bfloat16)
    with FakeTensorMode() as mode:
        fq, fk, fv, fg, fb, fp, fcu, fs, fhi = (mode.from_tensor(x) for x in (q, k, v, g, beta, pool, cu, slots, hi))
        o, cs = ops.chunk_gated_delta_rule(fq, fk, fv, fg, fb, fp, fcu, fs, fhi, True, 0.0, True, ssm_scales=None)
        assert o.shape == v.shape and o.dtype == torch.bfloat16
        assert cs.shape == (137 // 64 + 3, 4, 16, 8) and cs.dtype == torch.float32
        with pytest.raises(ValueError, match="chunk_gated_delta_rule.*`beta`"):
            ops.chunk_gated_delta_rule(fq, fk, fv, fg, fb[:, :1], fp, fcu, fs, fhi, True, 0.0, True, ssm_scales=None)


# ----------------------------------------------------------------------------------------------
# torch.compile
# ----------------------------------------------------------------------------------------------


def test_compile_prefill_decode_verify():
    hk, hv, kd, vd = DIMS[1]
    lens = [70, 0, 5]
    T = sum(lens)
    q, k, v = make_qkv((T,), hk, hv, kd, vd, torch.float32)
    A_log, dt_bias = make_gating_params(hv)
    a, b = torch.randn(T, hv), torch.randn(T, hv)
    pool = make_pool(hv, kd, vd)
    cu = cu_seqlens_of(lens)
    slots = torch.tensor([3, 0, -1], dtype=torch.int32)
    hi = torch.tensor([True, False, True])

    def prefill(q, k, v, a, b, pool, cu, slots, hi):
        g, beta = ops.gdn_gating(A_log, a, b, dt_bias, 1.0, 20.0)
        o, cs = ops.chunk_gated_delta_rule(q, k, v, g, beta, pool, cu, slots, hi, True, 0.0, True, ssm_scales=None)
        return o * 2, cs

    eager, compiled, ea, ca = compile_and_compare(prefill, q, k, v, a, b, pool, cu, slots, hi)
    for x, y in zip(eager, compiled):
        torch.testing.assert_close(y, x)
    torch.testing.assert_close(ca[5], ea[5])
    assert not torch.equal(ea[5], pool)

    B, L = 3, 2
    dq, dk, dv = make_qkv((B,), hk, hv, kd, vd, torch.float32)
    da, db = torch.randn(B, hv), torch.randn(B, hv)
    dslots = torch.tensor([1, -1, 4])

    def decode(q, k, v, a, b, pool, slots):
        return ops.fused_sigmoid_gating_delta_rule_update(A_log, dt_bias, q, k, v, a, b, pool, slots, True, 0.0, 1.0, 20.0, ssm_scales=None) + 1

    eager, compiled, ea, ca = compile_and_compare(decode, dq, dk, dv, da, db, pool, dslots)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(ca[5], ea[5])
    assert not torch.equal(ea[5], pool)

    vq, vk, vv = make_qkv((B, L), hk, hv, kd, vd, torch.float32)
    vg, vb = make_gb((B, L), hv)
    inter = torch.zeros(B, L, hv, kd, vd)

    def verify(q, k, v, g, beta, pool, slots, inter):
        return ops.fused_recurrent_gated_delta_rule_update(q, k, v, g, beta, pool, slots, True, 0.0, False, inter, ssm_scales=None, intermediate_scales=None, parent_indices=None) * 3

    eager, compiled, ea, ca = compile_and_compare(verify, vq, vk, vv, vg, vb, pool, dslots, inter)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(ca[5], ea[5])
    torch.testing.assert_close(ca[7], ea[7])
    assert not torch.equal(ea[7], inter)
