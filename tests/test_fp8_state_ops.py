"""FP8 recurrent state (``ssm_state_dtype="fp8"``) in every kernel op that touches the Mamba pool.

Oracle: the same op on an fp32 pool holding the *dequantized* FP8 state, whose written slots are
then quantized with the format's own rule (:func:`quantize_vectors`). The plain-torch op must equal
it bit for bit (same arithmetic); the Triton kernels (interpreter on CPU, tiny shapes) must equal
the plain-torch op to fp32 noise in the outputs and to one e4m3 step in the state. Untouched slots
stay bit-identical, padding rows are skipped, and every op passes opcheck with the FP8 arguments.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_compile.ops import gdn
from hybrid_compile.ops.fp8_cache import (
    FP8_DTYPE, GDN_STATE_SCALE_DIM as GDN_DIM, MAMBA1_STATE_SCALE_DIM as M1_DIM, MAMBA2_STATE_SCALE_DIM as M2_DIM,
    dequantize_vectors, quantize_vectors,
)
from hybrid_compile.ops.triton import fp8_cache as tfp8
from hybrid_compile.ops.triton import gdn as tgdn
from hybrid_compile.ops.triton import mamba1 as tm1
from hybrid_compile.ops.triton import mamba2 as tm
from hybrid_compile.ops.triton import state as tstate
from op_testing import cu_seqlens_of, with_omitted_optionals
from test_ops_mamba1 import SCAN_ORDER as M1_SCAN_ORDER, UPDATE_ORDER as M1_UPDATE_ORDER, make_scan, make_update
from test_ops_mamba2 import DECODE_ORDER, PREFILL_ORDER, make_decode, make_prefill
from test_triton_gdn import make_gb, make_qkv

INTERPRETER_ONLY = True
ops = torch.ops.hybrid_compile
NUM_SLOTS = 10


def run_opcheck(op, args, kwargs=None):
    """opcheck minus ``test_schema``: its mutation check compares inputs with ``torch.allclose``,
    which has no float8 kernel; the fake-tensor and AOT-dispatch checks (which functionalize the
    declared mutations and compare the results) run as for every op."""
    torch.library.opcheck(op, args, with_omitted_optionals(op, args, kwargs),
                          test_utils=("test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic"))


def quantized(pool: torch.Tensor, dim: int):
    return quantize_vectors(pool, dim)


def deq(q, s, dim):
    return dequantize_vectors(q, s, dim)


def assert_state_equal(q, s, ref_fp32, slots, before_q, before_s, dim, exact=True):
    """Written slots: FP8 (q, s) == quantize(ref_fp32) (exact) or within one e4m3 step of it;
    other slots bit-identical to before."""
    written = sorted({int(x) for x in slots if int(x) >= 0})
    others = [i for i in range(q.shape[0]) if i not in written]
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32
    if others:
        assert torch.equal(q[others].view(torch.uint8), before_q[others].view(torch.uint8)), "untouched slots changed"
        assert torch.equal(s[others], before_s[others])
    if not written:
        return
    want_q, want_s = quantize_vectors(ref_fp32[written], dim)
    got = deq(q[written], s[written], dim)
    want = deq(want_q, want_s, dim)
    if exact:
        assert torch.equal(q[written].view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(s[written], want_s)
    else:
        # one e4m3 step of the vector's scale: 2^-3 relative at the top of the range (448 -> 416..480)
        step = want_s.unsqueeze(dim) * 32.0
        assert bool(((got - want).abs() <= step + 1e-6).all()), (got - want).abs().max()
        torch.testing.assert_close(s[written], want_s, rtol=1e-4, atol=1e-12)


def test_quantize_vectors_is_e4m3_with_one_scale_per_vector():
    x = torch.randn(3, 4, 5, 6) * torch.logspace(-4, 2, 6)  # columns of very different magnitude
    q, s = quantize_vectors(x, -2)
    assert q.dtype == FP8_DTYPE and s.shape == (3, 4, 6)
    # the largest element of each vector maps to +-448, so the rounding is relative to the vector
    assert torch.equal(q.float().abs().amax(-2), torch.full((3, 4, 6), 448.0))
    err = (deq(q, s, -2) - x).abs() / x.abs().amax(-2, keepdim=True)
    assert err.max() <= 2 ** -4 + 1e-6  # half an e4m3 step (3 mantissa bits) of the vector maximum
    z, zs = quantize_vectors(torch.zeros(2, 3), -1)
    assert torch.equal(z.float(), torch.zeros(2, 3)) and bool((zs > 0).all())


# --------------------------------------------------------------------------------------------
# GDN
# --------------------------------------------------------------------------------------------


def _gdn_pool(hv, kd, vd):
    return quantized(torch.randn(NUM_SLOTS, hv, kd, vd) * 0.5, GDN_DIM)


@pytest.mark.parametrize("pad", [False, True])
def test_gdn_decode_fp8_pool(pad):
    torch.manual_seed(0)
    bs, hk, hv, kd, vd = 3, 1, 2, 16, 16
    q, k, v = make_qkv((bs,), hk, hv, kd, vd, torch.float32)
    a, b = torch.randn(bs, hv), torch.randn(bs, hv)
    A_log, dt_bias = torch.randn(hv) * 0.3, torch.randn(hv) * 0.3
    slots = torch.tensor([4, -1, 7] if pad else [4, 0, 7], dtype=torch.int32)
    pq, ps = _gdn_pool(hv, kd, vd)
    ref_pool = deq(pq, ps, GDN_DIM)
    o_ref = ops.fused_sigmoid_gating_delta_rule_update(A_log, dt_bias, q, k, v, a, b, ref_pool, slots, True, 0.0,
                                                       1.0, 20.0, ssm_scales=None)
    gq, gs = pq.clone(), ps.clone()
    o = ops.fused_sigmoid_gating_delta_rule_update(A_log, dt_bias, q, k, v, a, b, gq, slots, True, 0.0, 1.0, 20.0,
                                                   ssm_scales=gs)
    assert torch.equal(o, o_ref)
    assert_state_equal(gq, gs, ref_pool, slots.tolist(), pq, ps, GDN_DIM)
    tq, ts = pq.clone(), ps.clone()
    o_t = tgdn.fused_sigmoid_gating_delta_rule_update_triton(A_log, dt_bias, q, k, v, a, b, tq, slots, True, 0.0,
                                                             1.0, 20.0, ts)
    torch.testing.assert_close(o_t, o, atol=1e-5, rtol=1e-5)
    assert_state_equal(tq, ts, ref_pool, slots.tolist(), pq, ps, GDN_DIM, exact=False)
    run_opcheck(ops.fused_sigmoid_gating_delta_rule_update,
                (A_log, dt_bias, q, k, v, a, b, pq.clone(), slots, True, 0.0, 1.0, 20.0), dict(ssm_scales=ps.clone()))


@pytest.mark.parametrize("disable", [False, True])
def test_gdn_verify_fp8_pool_and_intermediates(disable):
    torch.manual_seed(1)
    bs, steps, hk, hv, kd, vd = 3, 3, 1, 2, 16, 16
    q, k, v = make_qkv((bs, steps), hk, hv, kd, vd, torch.float32)
    g, beta = make_gb((bs, steps), hv)
    slots = torch.tensor([2, -1, 5], dtype=torch.int32)
    pq, ps = _gdn_pool(hv, kd, vd)
    # oracle: L one-token steps of the fp32 op on the dequantized pool, each stored in the FP8
    # format (quantize + dequantize) as a decode step would: verify must round exactly so
    ref_pool = deq(pq, ps, GDN_DIM)
    ref_inter = torch.zeros(bs + 1, steps, hv, kd, vd)
    real = slots[slots >= 0].long()
    outs = []
    for t in range(steps):
        outs.append(ops.fused_recurrent_gated_delta_rule_update(
            q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1], ref_pool, slots, True, 0.0,
            False, None, ssm_scales=None, intermediate_scales=None, parent_indices=None))
        ref_inter[:bs][slots >= 0, t] = ref_pool[real]
        if t < steps - 1:
            ref_pool[real] = deq(*quantize_vectors(ref_pool[real], GDN_DIM), GDN_DIM)
    o_ref = torch.cat(outs, 1)
    if disable:
        ref_pool = deq(pq, ps, GDN_DIM)
    iq = torch.zeros(bs + 1, steps, hv, kd, vd, dtype=FP8_DTYPE)
    iscale = torch.zeros(bs + 1, steps, hv, vd)
    results = {}
    for name in ("plain", "triton"):
        gq, gs, gi, gis = pq.clone(), ps.clone(), iq.clone(), iscale.clone()
        fn = ops.fused_recurrent_gated_delta_rule_update if name == "plain" else \
            tgdn.fused_recurrent_gated_delta_rule_update_triton
        o = fn(q, k, v, g, beta, gq, slots, True, 0.0, disable, gi, gs, gis)
        torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
        assert_state_equal(gq, gs, ref_pool, [] if disable else slots.tolist(), pq, ps, GDN_DIM,
                           exact=name == "plain")
        for row in (0, 2):  # intermediate rows of the real requests, every step
            for t in range(steps):
                want_q, want_s = quantize_vectors(ref_inter[row, t], GDN_DIM)
                got = deq(gi[row, t], gis[row, t], GDN_DIM)
                want = deq(want_q, want_s, GDN_DIM)
                assert ((got - want).abs() <= want_s.unsqueeze(GDN_DIM) * (0 if name == "plain" else 32) + 1e-6).all()
        assert torch.equal(gi[1].view(torch.uint8), iq[1].view(torch.uint8)), "padding row's intermediates written"
        results[name] = o
    run_opcheck(ops.fused_recurrent_gated_delta_rule_update,
                (q, k, v, g, beta, pq.clone(), slots, True, 0.0, disable, iq.clone()),
                dict(ssm_scales=ps.clone(), intermediate_scales=iscale.clone()))


def test_gdn_chunk_fp8_pool_and_tracked_checkpoints():
    torch.manual_seed(2)
    lens = [70, 0, 9, 5]
    hk, hv, kd, vd = 1, 2, 16, 16
    T = sum(lens)
    q, k, v = make_qkv((T,), hk, hv, kd, vd, torch.float32)
    g, beta = make_gb((T,), hv)
    cu = cu_seqlens_of(lens)
    slots = torch.tensor([3, 8, -1, 6], dtype=torch.int32)
    init = torch.tensor([True, True, False, False])
    pq, ps = _gdn_pool(hv, kd, vd)
    ref_pool = deq(pq, ps, GDN_DIM)
    o_ref, cs_ref = ops.chunk_gated_delta_rule(q, k, v, g, beta, ref_pool, cu, slots, init, True, 0.0, True, ssm_scales=None)
    written = [3, 6]  # slot 8's request is empty: untouched; the padding request writes nothing
    for name in ("plain", "triton"):
        gq, gs = pq.clone(), ps.clone()
        if name == "plain":
            o, cs = ops.chunk_gated_delta_rule(q, k, v, g, beta, gq, cu, slots, init, True, 0.0, True, ssm_scales=gs)
        else:
            o, cs = tgdn.chunk_gated_delta_rule_fp8_aware(q, k, v, g, beta, gq, cu, slots, init, True, 0.0, True, gs)
        torch.testing.assert_close(o, o_ref, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(cs, cs_ref, atol=2e-4, rtol=2e-4)
        assert_state_equal(gq, gs, ref_pool, written, pq, ps, GDN_DIM, exact=name == "plain")
    # a checkpoint of the state after 64 tokens of request 0 goes (quantized) into free slot 1
    src, dst = torch.tensor([1, -1]), torch.tensor([1, 2])
    for track in (ops.track_chunk_states, tstate.track_chunk_states_triton):
        gq, gs = pq.clone(), ps.clone()
        track(gq, cs_ref, src, dst, gs, GDN_DIM)
        ref = ref_pool.clone()
        ref[1] = cs_ref[1]
        assert_state_equal(gq, gs, ref, [1], pq, ps, GDN_DIM, exact=track is ops.track_chunk_states)
    run_opcheck(ops.chunk_gated_delta_rule, (q, k, v, g, beta, pq.clone(), cu, slots, init, True, 0.0, True),
                dict(ssm_scales=ps.clone()))
    run_opcheck(ops.track_chunk_states, (pq.clone(), cs_ref, src, dst), dict(ssm_scales=ps.clone(), scale_dim=GDN_DIM))


# --------------------------------------------------------------------------------------------
# Mamba2
# --------------------------------------------------------------------------------------------


def check_step_fp8_pool(op, triton_fn, order, inp, dim, steps, disable):
    """A Mamba step op (decode / verify) on an FP8 pool: oracle = L one-token steps of the fp32 op
    on the dequantized pool, each stored in the FP8 format as a decode step would; the plain op
    matches it exactly, the Triton kernel to fp32 noise / one e4m3 step; then opcheck."""
    pq, ps = quantized(inp["ssm_states"], dim)
    inp["ssm_states"] = deq(pq, ps, dim)
    ref_inter = inp["intermediate_states"]
    slots = inp["state_indices"].tolist()
    one = dict(inp, disable_state_update=False, intermediate_states=None, ssm_states=inp["ssm_states"].clone())
    real = inp["state_indices"][inp["state_indices"] >= 0].long()
    ys = []
    for t in range(steps):
        step = {k: (v[:, t:t + 1] if k in ("x", "dt", "B", "C", "z") and v is not None else v) for k, v in one.items()}
        ys.append(op(*(step[k] for k in order), False, None, None))
        if ref_inter is not None:
            ref_inter[: len(slots)][inp["state_indices"] >= 0, t] = one["ssm_states"][real]
        if t < steps - 1:
            one["ssm_states"][real] = deq(*quantize_vectors(one["ssm_states"][real], dim), dim)
    y_ref = torch.cat(ys, 1)
    if not disable:
        inp["ssm_states"] = one["ssm_states"]
    for name in ("plain", "triton"):
        args = dict(inp)
        args["ssm_states"], ss = pq.clone(), ps.clone()
        iq = iss = None
        if ref_inter is not None:
            iq = torch.zeros(ref_inter.shape, dtype=FP8_DTYPE)
            iss = torch.zeros(ref_inter.shape[:-1])
            args["intermediate_states"] = iq
        fn = op if name == "plain" else triton_fn
        y = fn(*(args[k] for k in order), False, ss, iss)
        torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
        assert_state_equal(args["ssm_states"], ss, inp["ssm_states"], [] if disable else slots, pq, ps, dim,
                           exact=name == "plain")
        if iq is not None:
            for row in (0, 2):
                want_q, want_s = quantize_vectors(ref_inter[row], dim)
                got, want = deq(iq[row], iss[row], dim), deq(want_q, want_s, dim)
                assert ((got - want).abs() <= want_s.unsqueeze(dim) * (0 if name == "plain" else 32) + 1e-6).all()
    args = dict(inp)
    args["ssm_states"] = pq.clone()
    extra = dict(A_is_log=False, ssm_scales=ps.clone())
    if ref_inter is not None:
        args["intermediate_states"] = torch.zeros(ref_inter.shape, dtype=FP8_DTYPE)
        extra["intermediate_scales"] = torch.zeros(ref_inter.shape[:-1])
    run_opcheck(op, tuple(args[k] for k in order), extra)


def scan_tail(op) -> dict:
    """``A_is_log=False`` for a scan op that has the argument (Mamba1's; its FP8 scales come after it and have no
    default, so it has none either)."""
    return {"A_is_log": False} if any(a.name == "A_is_log" for a in op.default._schema.arguments) else {}


def check_scan_fp8_pool(op, triton_fn, order, inp, dim, written, chunk_size=8):
    """A varlen scan op on an FP8 pool against the same op on the dequantized fp32 pool."""
    pq, ps = quantized(inp["ssm_states"], dim)
    inp["ssm_states"] = deq(pq, ps, dim)
    y_ref, cs_ref = op(*(inp[k] for k in order), chunk_size, True, **scan_tail(op), ssm_scales=None)
    for name in ("plain", "triton"):
        args = dict(inp)
        args["ssm_states"], ss = pq.clone(), ps.clone()
        fn = op if name == "plain" else triton_fn
        y, cs = fn(*(args[k] for k in order), chunk_size, True, **scan_tail(op), ssm_scales=ss)
        torch.testing.assert_close(y, y_ref, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(cs, cs_ref, atol=2e-4, rtol=2e-4)
        assert_state_equal(args["ssm_states"], ss, inp["ssm_states"], written, pq, ps, dim, exact=name == "plain")
    args = dict(inp)
    args["ssm_states"] = pq.clone()
    run_opcheck(op, tuple(args[k] for k in order) + (chunk_size, True), dict(**scan_tail(op), ssm_scales=ps.clone()))


@pytest.mark.parametrize("steps,disable", [(1, False), (3, True)])
def test_mamba2_step_fp8_pool(steps, disable):
    torch.manual_seed(3)
    inp = make_decode(3, steps, pad_rows=(1,), inter=steps > 1, disable=disable)
    check_step_fp8_pool(ops.selective_state_update, tm.selective_state_update_triton, DECODE_ORDER, inp, M2_DIM,
                        steps, disable)


def test_mamba2_chunk_scan_fp8_pool():
    torch.manual_seed(4)
    inp = make_prefill([20, 0, 7, 3], pad_rows=(3,))
    slots = inp["state_indices"].tolist()
    check_scan_fp8_pool(ops.ssd_chunk_scan, tm.ssd_chunk_scan_fp8_aware, PREFILL_ORDER, inp, M2_DIM,
                        [slots[0], slots[2]])


# --------------------------------------------------------------------------------------------
# Lightning attention (MiniMax; one scale per value column over K, as GDN)
# --------------------------------------------------------------------------------------------


def _lightning_ops():
    from hybrid_compile.ops import lightning
    from hybrid_compile.ops.triton import lightning as tlight
    from test_ops_lightning import chunk_inputs, recurrent_inputs

    assert lightning.LIGHTNING_STATE_SCALE_DIM == GDN_DIM
    return tlight, chunk_inputs, recurrent_inputs


@pytest.mark.parametrize("steps,disable", [(1, False), (3, True), (3, False)])
def test_lightning_recurrent_fp8_pool_and_intermediates(steps, disable):
    """Oracle: ``steps`` one-token steps of the fp32 op on the dequantized pool, each state stored
    in the FP8 format as a decode step would (the intermediates: every step's state, quantized)."""
    tlight, _, recurrent_inputs = _lightning_ops()
    torch.manual_seed(4)
    q, k, v, s, pool, slots = recurrent_inputs(3, steps, pad_rows=(1,))
    pq, ps = quantized(pool, GDN_DIM)
    ref_pool = deq(pq, ps, GDN_DIM)
    real = slots[slots >= 0].long()
    ys, inter_ref = [], torch.zeros(3, steps, *pool.shape[1:])
    for t in range(steps):
        ys.append(ops.recurrent_lightning_attention_update(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], s, ref_pool,
                                                           slots, False, None, None, None))
        inter_ref[slots >= 0, t] = ref_pool[real]
        if t < steps - 1 or not disable:
            ref_pool[real] = deq(*quantize_vectors(ref_pool[real], GDN_DIM), GDN_DIM)
    y_ref = torch.cat(ys, 1)
    scales_shape = inter_ref.shape[:-2] + inter_ref.shape[-1:]  # one per value column
    for name, fn in (("plain", ops.recurrent_lightning_attention_update),
                     ("triton", tlight.recurrent_lightning_attention_update_triton)):
        sq, ss = pq.clone(), ps.clone()
        iq, iss = torch.zeros(inter_ref.shape, dtype=FP8_DTYPE), torch.zeros(scales_shape)
        y = fn(q, k, v, s, sq, slots, disable, iq, ssm_scales=ss, intermediate_scales=iss)
        torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
        assert_state_equal(sq, ss, ref_pool, [] if disable else slots.tolist(), pq, ps, GDN_DIM, exact=name == "plain")
        for row in (0, 2):  # (row 1 is padding)
            want_q, want_s = quantize_vectors(inter_ref[row], GDN_DIM)
            got, want = deq(iq[row], iss[row], GDN_DIM), deq(want_q, want_s, GDN_DIM)
            assert ((got - want).abs() <= want_s.unsqueeze(GDN_DIM) * (0 if name == "plain" else 32) + 1e-6).all()
    iq, iss = torch.zeros(inter_ref.shape, dtype=FP8_DTYPE), torch.zeros(scales_shape)
    run_opcheck(ops.recurrent_lightning_attention_update, (q, k, v, s, pq.clone(), slots, disable, iq),
                dict(ssm_scales=ps.clone(), intermediate_scales=iss))


def test_lightning_chunk_fp8_pool():
    """Oracle: the fp32 op on the dequantized pool, its written slots quantized; a zero-length and
    a padding request leave their slots alone; chunk states (fp32) as the oracle's."""
    tlight, chunk_inputs, _ = _lightning_ops()
    torch.manual_seed(5)
    lens = [70, 0, 5, 9]
    q, k, v, s, pool, cu, slots, has_init = chunk_inputs(lens, pad_rows=(3,))
    pq, ps = quantized(pool, GDN_DIM)
    ref_pool = deq(pq, ps, GDN_DIM)
    o_ref, cs_ref = ops.chunk_lightning_attention(q, k, v, s, ref_pool, cu, slots, has_init, True, None)
    written = [sl for sl, n in zip(slots.tolist(), lens) if n > 0]
    for name, fn in (("plain", ops.chunk_lightning_attention), ("triton", tlight.chunk_lightning_attention_fp8_aware)):
        sq, ss = pq.clone(), ps.clone()
        o, cs = fn(q, k, v, s, sq, cu, slots, has_init, True, ss)
        torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cs, cs_ref, atol=1e-5, rtol=1e-5)
        assert_state_equal(sq, ss, ref_pool, written, pq, ps, GDN_DIM, exact=name == "plain")
    run_opcheck(ops.chunk_lightning_attention, (q, k, v, s, pq.clone(), cu, slots, has_init, True),
                dict(ssm_scales=ps.clone()))


def test_lightning_fp8_arguments_raise_clear_errors():
    _, _, recurrent_inputs = _lightning_ops()
    q, k, v, s, pool, slots = recurrent_inputs(2, 2)
    pq, ps = quantized(pool, GDN_DIM)
    with pytest.raises(ValueError, match="needs `ssm_scales`"):
        ops.recurrent_lightning_attention_update(q, k, v, s, pq, slots, False, None, None, None)
    with pytest.raises(ValueError, match="`ssm_scales` is only for an FP8"):
        ops.recurrent_lightning_attention_update(q, k, v, s, pool, slots, False, None, ps, None)
    with pytest.raises(ValueError, match="`intermediate_scales` without `intermediate_states`"):
        ops.recurrent_lightning_attention_update(q, k, v, s, pq, slots, True, None, ps, ps[:2, None])
    parents = torch.tensor([[-1, 0], [-1, 0]])
    with pytest.raises(ValueError, match="FP8"):  # draft trees keep float buffers
        ops.recurrent_lightning_attention_update(q, k, v, s, pq, slots, True, torch.zeros(2, 2, *pool.shape[1:]),
                                                 ps, None, parents)


# --------------------------------------------------------------------------------------------
# Mamba1 (one scale per channel over N)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("steps,disable", [(1, False), (3, True), (2, False)])
def test_mamba1_step_fp8_pool(steps, disable):
    torch.manual_seed(5)
    inp = make_update(3, steps, G=2, pad_rows=(1,), inter=steps > 1, disable=disable, num_slots=NUM_SLOTS)
    check_step_fp8_pool(ops.mamba1_state_update, tm1.mamba1_state_update_triton, M1_UPDATE_ORDER, inp, M1_DIM,
                        steps, disable)


def test_mamba1_scan_fp8_pool():
    torch.manual_seed(6)
    inp = make_scan([20, 0, 7, 3], G=3, pad_rows=(3,), num_slots=NUM_SLOTS)
    slots = inp["state_indices"].tolist()
    check_scan_fp8_pool(ops.mamba1_selective_scan, tm1.mamba1_selective_scan_fp8_aware, M1_SCAN_ORDER, inp, M1_DIM,
                        [slots[0], slots[2]])


# --------------------------------------------------------------------------------------------
# slot moves: copy and commit move the scales like any pool tensor
# --------------------------------------------------------------------------------------------


def test_copy_and_commit_move_fp8_states_with_their_scales():
    torch.manual_seed(5)
    pq, ps = _gdn_pool(2, 4, 8)
    iq, iscale = quantized(torch.randn(3, 2, 2, 4, 8), GDN_DIM)
    src, dst = torch.tensor([1, 4, -1]), torch.tensor([6, 2, 3])
    idx, acc = torch.tensor([7, -1, 0]), torch.tensor([2, 1, 1])
    for copy, commit in ((ops.copy_state_slots, ops.commit_speculative_state),
                         (tstate.copy_state_slots_triton, tstate.commit_speculative_state_triton)):
        q, s = pq.clone(), ps.clone()
        copy([q, s], src, dst)
        assert torch.equal(q[6].view(torch.uint8), pq[1].view(torch.uint8)) and torch.equal(s[2], ps[4])
        assert torch.equal(q[3].view(torch.uint8), pq[3].view(torch.uint8))
        commit([q, s], [iq, iscale], idx, acc)
        assert torch.equal(q[7].view(torch.uint8), iq[0, 1].view(torch.uint8)) and torch.equal(s[7], iscale[0, 1])
        assert torch.equal(q[0].view(torch.uint8), iq[2, 0].view(torch.uint8)) and torch.equal(s[0], iscale[2, 0])
    run_opcheck(ops.copy_state_slots, ([pq.clone(), ps.clone()], src, dst))
    run_opcheck(ops.commit_speculative_state, ([pq.clone(), ps.clone()], [iq, iscale], idx, acc))


def test_fp8_pool_arguments_are_validated():
    pq, ps = _gdn_pool(2, 16, 16)
    q, k, v = make_qkv((1,), 1, 2, 16, 16, torch.float32)
    a = b = torch.zeros(1, 2)
    A_log = dt_bias = torch.zeros(2)
    slots = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(ValueError, match="needs `ssm_scales`"):
        ops.fused_sigmoid_gating_delta_rule_update(A_log, dt_bias, q, k, v, a, b, pq, slots, True, 0.0, 1.0, 20.0, ssm_scales=None)
    with pytest.raises(ValueError, match="must be fp32 of shape"):
        ops.fused_sigmoid_gating_delta_rule_update(A_log, dt_bias, q, k, v, a, b, pq, slots, True, 0.0, 1.0, 20.0,
                                                   ssm_scales=ps[:, :, :4])
    with pytest.raises(ValueError, match="only for an FP8"):
        ops.fused_sigmoid_gating_delta_rule_update(A_log, dt_bias, q, k, v, a, b, pq.float(), slots, True, 0.0, 1.0,
                                                   20.0, ssm_scales=ps)


def test_move_state_rows_round_trips():
    """The staging kernel: dequantize slots into fp32 rows and quantize them back unchanged."""
    pq, ps = _gdn_pool(2, 16, 8)
    idx = torch.tensor([5, -1, 2], dtype=torch.int32)
    buf, rows = tfp8.stage_states(pq, ps, idx, GDN_DIM)
    torch.testing.assert_close(buf[0], deq(pq[5], ps[5], GDN_DIM), rtol=0, atol=0)
    assert torch.equal(buf[1], torch.zeros_like(buf[1]))
    q, s = pq.clone(), ps.clone()
    tfp8.unstage_states(buf, rows, q, s, idx, torch.tensor([True, True, False]), GDN_DIM)
    assert torch.equal(q.view(torch.uint8), pq.view(torch.uint8))
    torch.testing.assert_close(s, ps, rtol=1e-6, atol=0)


# --------------------------------------------------------------------------------------------
# GPU: the registered CUDA kernels at real shapes against the plain-torch ops
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_gdn_fp8_pool_at_qwen3_next_shape():
    """Decode, verify and chunked prefill at Qwen3-Next's GDN shape (Hk 16, Hv 32, K = V = 128)."""
    torch.manual_seed(10)
    bs, steps, hk, hv, kd, vd, slots_n = 8, 3, 16, 32, 128, 128, 12
    pq, ps = quantize_vectors(torch.randn(slots_n, hv, kd, vd) * 0.1, GDN_DIM)
    slots = torch.tensor([3, 0, -1, 7, 1, 11, 5, 9], dtype=torch.int32)
    q, k, v = make_qkv((bs, steps), hk, hv, kd, vd, torch.bfloat16)
    g, beta = make_gb((bs, steps), hv)
    ref_q, ref_s = pq.clone(), ps.clone()
    o_ref = ops.fused_recurrent_gated_delta_rule_update(q, k, v, g, beta, ref_q, slots, True, 0.0, False, None,
                                                        ref_s, intermediate_scales=None, parent_indices=None)
    dev = [t.cuda() for t in (q, k, v, g, beta, pq, slots, ps)]
    o = ops.fused_recurrent_gated_delta_rule_update(*dev[:6], dev[6], True, 0.0, False, None, dev[7], intermediate_scales=None)
    torch.testing.assert_close(o.cpu().float(), o_ref.float(), atol=2e-2, rtol=2e-2)
    got_s = dev[7].cpu()
    got, want = deq(dev[5].cpu(), got_s, GDN_DIM), deq(ref_q, ref_s, GDN_DIM)
    # the fp32 recurrences differ in rounding, so each of the `steps` re-quantizing writes may land a value
    # one e4m3 step away (<= 32 x its scale at the top of the range), and the two scales may differ
    # slightly (times the largest code, 448)
    tol = steps * 32 * torch.maximum(ref_s, got_s) + 448 * (got_s - ref_s).abs()
    assert ((got - want).abs() <= tol.unsqueeze(GDN_DIM) + 1e-6).all()
    lens = [200, 1, 64]
    T = sum(lens)
    q, k, v = make_qkv((T,), hk, hv, kd, vd, torch.bfloat16)
    g, beta = make_gb((T,), hv)
    cu, idx, init = cu_seqlens_of(lens), torch.tensor([4, 2, 6], dtype=torch.int32), torch.tensor([True, False, True])
    ref_q, ref_s = pq.clone(), ps.clone()
    o_ref, _ = ops.chunk_gated_delta_rule(q, k, v, g, beta, ref_q, cu, idx, init, True, 0.0, False, ref_s)
    gq, gs = pq.cuda(), ps.cuda()
    o, _ = ops.chunk_gated_delta_rule(q.cuda(), k.cuda(), v.cuda(), g.cuda(), beta.cuda(), gq, cu.cuda(), idx.cuda(),
                                      init.cuda(), True, 0.0, False, gs)
    torch.testing.assert_close(o.cpu().float(), o_ref.float(), atol=3e-2, rtol=3e-2)
    got, want = deq(gq.cpu(), gs.cpu(), GDN_DIM), deq(ref_q, ref_s, GDN_DIM)
    # the chunked kernels' fp32 states differ like their outputs (3 % of a vector's largest value, 448 x its
    # scale), plus one e4m3 step (<= 32 x the scale)
    ratio = ((got - want).abs() / torch.maximum(ref_s, gs.cpu()).unsqueeze(GDN_DIM)).max().item()
    assert ratio <= 32 + 0.03 * 448, f"state off by {ratio:.1f} x its scale"


@pytest.mark.gpu
def test_gpu_mamba2_fp8_pool_at_nemotron_shape():
    torch.manual_seed(11)
    inp = make_decode(8, 1, H=32, G=8, P=64, N=128, dtype=torch.bfloat16, pad_rows=(2,), inter=False, num_slots=12)
    pq, ps = quantize_vectors(inp["ssm_states"], M2_DIM)
    inp["ssm_states"] = pq.clone()
    ref_s = ps.clone()
    y_ref = ops.selective_state_update(*(inp[k] for k in DECODE_ORDER), False, ref_s, intermediate_scales=None)
    dev = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
    dev["ssm_states"] = pq.cuda()
    gs = ps.cuda()
    y = ops.selective_state_update(*(dev[k] for k in DECODE_ORDER), False, gs, intermediate_scales=None)
    torch.testing.assert_close(y.cpu().float(), y_ref.float(), atol=2e-2, rtol=2e-2)
    got, want = deq(dev["ssm_states"].cpu(), gs.cpu(), M2_DIM), deq(inp["ssm_states"], ref_s, M2_DIM)
    assert ((got - want).abs() <= ref_s.unsqueeze(M2_DIM) * 32 + 1e-6).all()


@pytest.mark.gpu
def test_gpu_mamba1_fp8_pool_at_falcon_mamba_shape():
    torch.manual_seed(12)
    inp = make_update(8, 1, D_inner=4096, N=16, dtype=torch.bfloat16, pad_rows=(2,), inter=False, num_slots=12)
    pq, ps = quantize_vectors(inp["ssm_states"], M1_DIM)
    inp["ssm_states"] = pq.clone()
    ref_s = ps.clone()
    y_ref = ops.mamba1_state_update(*(inp[k] for k in M1_UPDATE_ORDER), False, ref_s, intermediate_scales=None)
    dev = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
    dev["ssm_states"] = pq.cuda()
    gs = ps.cuda()
    y = ops.mamba1_state_update(*(dev[k] for k in M1_UPDATE_ORDER), False, gs, intermediate_scales=None)
    torch.testing.assert_close(y.cpu().float(), y_ref.float(), atol=2e-2, rtol=2e-2)
    got, want = deq(dev["ssm_states"].cpu(), gs.cpu(), M1_DIM), deq(inp["ssm_states"], ref_s, M1_DIM)
    assert ((got - want).abs() <= ref_s.unsqueeze(M1_DIM) * 32 + 1e-6).all()
    scan = make_scan([700, 0, 129], D_inner=4096, N=16, dtype=torch.bfloat16, num_slots=12)
    sq, sps = quantize_vectors(scan["ssm_states"], M1_DIM)
    cpu = dict(scan, ssm_states=sq.clone())
    cpu_s = sps.clone()
    y_ref, cs_ref = ops.mamba1_selective_scan(*(cpu[k] for k in M1_SCAN_ORDER), 64, True, False, cpu_s)
    dev = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in scan.items()}
    dev["ssm_states"], dev_s = sq.cuda(), sps.cuda()
    y, cs = ops.mamba1_selective_scan(*(dev[k] for k in M1_SCAN_ORDER), 64, True, False, dev_s)
    torch.testing.assert_close(y.cpu().float(), y_ref.float(), atol=6e-2, rtol=3e-2)
    torch.testing.assert_close(cs.cpu(), cs_ref, atol=6e-2, rtol=3e-2)
    got, want = deq(dev["ssm_states"].cpu(), dev_s.cpu(), M1_DIM), deq(cpu["ssm_states"], cpu_s, M1_DIM)
    assert ((got - want).abs() <= cpu_s.unsqueeze(M1_DIM) * 32 + 0.05 * want.abs() + 1e-6).all()


@pytest.mark.gpu
def test_gpu_lightning_fp8_pool_at_minimax_shape():
    """Decode-verify (3 steps, e4m3 intermediates) and chunked prefill at MiniMax-Text-01's lightning
    shape (64 heads, K = V = 128) on an FP8 pool: the CUDA kernels against the plain-torch ops, in
    the tolerances of the GDN case above (fp32 sums in another order, each re-quantizing write up to
    one e4m3 step apart)."""
    from test_ops_lightning import slopes

    torch.manual_seed(11)
    bs, steps, h, d, slots_n = 8, 3, 64, 128, 12
    pq, ps = quantize_vectors(torch.randn(slots_n, h, d, d) * 0.1, GDN_DIM)
    slots = torch.tensor([3, 0, -1, 7, 1, 11, 5, 9], dtype=torch.int32)
    q, k = ((torch.randn(bs, steps, h, d) / d ** 0.5).bfloat16() for _ in range(2))
    v, s = torch.randn(bs, steps, h, d).bfloat16(), slopes(h)
    iq = torch.zeros(bs, steps, h, d, d, dtype=FP8_DTYPE)
    iss = torch.zeros(bs, steps, h, d)
    ref_q, ref_s, ref_iq, ref_is = pq.clone(), ps.clone(), iq.clone(), iss.clone()
    o_ref = ops.recurrent_lightning_attention_update(q, k, v, s, ref_q, slots, False, ref_iq, ref_s, ref_is)
    gq, gs, giq, gis = pq.cuda(), ps.cuda(), iq.cuda(), iss.cuda()
    o = ops.recurrent_lightning_attention_update(q.cuda(), k.cuda(), v.cuda(), s.cuda(), gq, slots.cuda(), False, giq,
                                                 gs, gis)
    torch.testing.assert_close(o.cpu().float(), o_ref.float(), atol=2e-2, rtol=2e-2)
    for got_q, got_s, want_q, want_s in ((gq, gs, ref_q, ref_s), (giq, gis, ref_iq, ref_is)):
        got_s = got_s.cpu()
        got, want = deq(got_q.cpu(), got_s, GDN_DIM), deq(want_q, want_s, GDN_DIM)
        tol = steps * 32 * torch.maximum(want_s, got_s) + 448 * (got_s - want_s).abs()
        assert ((got - want).abs() <= tol.unsqueeze(GDN_DIM) + 1e-6).all()
    lens = [200, 1, 64]
    T = sum(lens)
    q, k = ((torch.randn(T, h, d) / d ** 0.5).bfloat16() for _ in range(2))
    v = torch.randn(T, h, d).bfloat16()
    cu, idx, init = cu_seqlens_of(lens), torch.tensor([4, 2, 6], dtype=torch.int32), torch.tensor([True, False, True])
    ref_q, ref_s = pq.clone(), ps.clone()
    o_ref, _ = ops.chunk_lightning_attention(q, k, v, s, ref_q, cu, idx, init, False, ref_s)
    gq, gs = pq.cuda(), ps.cuda()
    o, _ = ops.chunk_lightning_attention(q.cuda(), k.cuda(), v.cuda(), s.cuda(), gq, cu.cuda(), idx.cuda(), init.cuda(),
                                         False, gs)
    torch.testing.assert_close(o.cpu().float(), o_ref.float(), atol=3e-2, rtol=3e-2)
    got, want = deq(gq.cpu(), gs.cpu(), GDN_DIM), deq(ref_q, ref_s, GDN_DIM)
    ratio = ((got - want).abs() / torch.maximum(ref_s, gs.cpu()).unsqueeze(GDN_DIM)).max().item()
    assert ratio <= 32 + 0.03 * 448, f"state off by {ratio:.1f} x its scale"
