"""Kimi Delta Attention (the gated delta rule with a per-channel gate ``g [..., H, K]``) through the
Gated DeltaNet ops (``chunk_gated_delta_rule``, ``fused_recurrent_gated_delta_rule_update``; CPU
plain-torch implementations) against the per-token reference and transformers' own
``chunk_kimi_delta_attention`` / ``recurrent_kimi_delta_attention``."""

from __future__ import annotations

import pytest
import torch

from hybrid_compile.ops import gdn
from hybrid_compile.ops._varlen import chunk_row_offsets
from hybrid_compile.ops.reference import gdn as ref
from op_testing import VARLEN_CASES, assert_close, compile_and_compare, cu_seqlens_of, distinct_slots, run_opcheck

ops = torch.ops.hybrid_compile
C = gdn.GDN_CHUNK_SIZE
NUM_SLOTS = 9
H, K, V = 2, 8, 8  # Kimi: one head count for q, k and v


def make_inputs(lead, dtype=torch.float32, h=H, kd=K, vd=V, strength=0.4):
    """q, k [*lead, H, K], v [*lead, H, V], per-channel g [*lead, H, K] (<= 0, channels differ), beta [*lead, H]."""
    q = torch.randn(*lead, h, kd).to(dtype)
    k = (torch.randn(*lead, h, kd) / kd ** 0.5).to(dtype)
    v = torch.randn(*lead, h, vd).to(dtype)
    g = -torch.rand(*lead, h, kd) * strength - 0.01
    beta = torch.rand(*lead, h)
    return q, k, v, g, beta


def make_pool(h=H, kd=K, vd=V, dtype=torch.float32):
    return (torch.randn(NUM_SLOTS, h, kd, vd) * 0.5).to(dtype)


def _hf():
    m = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    chunk = getattr(m.chunk_kimi_delta_attention, "__wrapped__", m.chunk_kimi_delta_attention)
    rec = getattr(m.recurrent_kimi_delta_attention, "__wrapped__", m.recurrent_kimi_delta_attention)
    return chunk, rec


def chunk_case(lens, dtype, pad_rows=(), pool_dtype=torch.float32):
    T = sum(lens)
    q, k, v, g, beta = make_inputs((T,), dtype)
    pool = make_pool(dtype=pool_dtype)
    cu = cu_seqlens_of(lens)
    slots = distinct_slots(len(lens), NUM_SLOTS, pad_rows=pad_rows)
    has_init = torch.rand(len(lens)) < 0.6
    return q, k, v, g, beta, pool, cu, slots, has_init


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(VARLEN_CASES)))
def test_chunk_per_channel_matches_reference(case, dtype):
    lens = VARLEN_CASES[case]
    pad = (0,) if len(lens) > 2 else ()
    q, k, v, g, beta, pool, cu, slots, has_init = chunk_case(lens, dtype, pad)
    got_pool = pool.clone()
    o, cs = ops.chunk_gated_delta_rule(q, k, v, g, beta, got_pool, cu, slots, has_init, True, 0.0, True, ssm_scales=None)
    want_o, want_pool, want_cs = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, pool, cu, slots, has_init,
                                                                True, 0.0, True)
    assert_close(o, want_o, dtype, msg="output")
    assert_close(got_pool, want_pool, msg="pool")
    assert_close(cs, want_cs, msg="chunk states")
    for r in pad:
        assert torch.all(o[cu[r]:cu[r + 1]] == 0)


def test_chunk_per_channel_strong_decay_is_finite():
    """A chunk's decay reaches exp(-600): the per-channel form uses differences of the cumulated
    log-decay, never exp(-cum), so nothing overflows."""
    q, k, v, g, beta, pool, cu, slots, has_init = chunk_case([100, 30], torch.float32)
    g = g * 25.0  # ~ -5 per token and channel
    got_pool = pool.clone()
    o, cs = ops.chunk_gated_delta_rule(q, k, v, g, beta, got_pool, cu, slots, has_init, True, 0.0, True, ssm_scales=None)
    want_o, want_pool, want_cs = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, pool, cu, slots, has_init,
                                                                True, 0.0, True)
    assert torch.isfinite(o).all() and torch.isfinite(cs).all()
    assert_close(o, want_o)
    assert_close(got_pool, want_pool)


def test_chunk_per_channel_split_in_two_calls_equals_one_call():
    """Chunked prefill: 70 tokens then 50 more from the stored state = one call of 120; the chunk
    state after 64 tokens is the prefix-cache checkpoint."""
    q, k, v, g, beta = make_inputs((120,))
    slots = torch.tensor([3], dtype=torch.int32)
    pool_one = make_pool()
    pool_two = pool_one.clone()
    o_one, cs_one = ops.chunk_gated_delta_rule(q, k, v, g, beta, pool_one, cu_seqlens_of([120]), slots,
                                               torch.tensor([False]), True, 0.0, True, ssm_scales=None)
    o_a, _ = ops.chunk_gated_delta_rule(q[:70], k[:70], v[:70], g[:70], beta[:70], pool_two, cu_seqlens_of([70]),
                                        slots, torch.tensor([False]), True, 0.0, False, ssm_scales=None)
    o_b, _ = ops.chunk_gated_delta_rule(q[70:], k[70:], v[70:], g[70:], beta[70:], pool_two, cu_seqlens_of([50]),
                                        slots, torch.tensor([True]), True, 0.0, False, ssm_scales=None)
    assert_close(torch.cat([o_a, o_b]), o_one)
    assert_close(pool_two[3], pool_one[3])
    _, states = ref.delta_rule_ref(q, k, v, g, beta, None, True, 0.0)
    assert_close(cs_one[1], states[C], msg="checkpoint after 64 tokens")


@pytest.mark.parametrize("with_init", [False, True])
def test_chunk_and_recurrent_match_transformers(with_init):
    """transformers' chunk_kimi_delta_attention (prefill) and recurrent_kimi_delta_attention
    (decode, one token), in fp32 with q/k L2-normalised in the kernel as KimiDeltaAttention calls
    them."""
    hf_chunk, hf_rec = _hf()
    T = 75
    q, k, v, g, beta = make_inputs((T,))
    init = torch.randn(H, K, V) * 0.5 if with_init else None
    want_o, want_state = hf_chunk(q[None], k[None], v[None], g[None], beta[None], initial_state=
                                  None if init is None else init[None], output_final_state=True,
                                  use_qk_l2norm_in_kernel=True)
    pool = torch.zeros(NUM_SLOTS, H, K, V)
    if init is not None:
        pool[4] = init
    o, _ = ops.chunk_gated_delta_rule(q, k, v, g, beta, pool, cu_seqlens_of([T]), torch.tensor([4], dtype=torch.int32),
                                      torch.tensor([with_init]), True, 0.0, False, ssm_scales=None)
    assert_close(o, want_o[0])
    assert_close(pool[4], want_state[0])

    q1, k1, v1, g1, b1 = make_inputs((1, 1))
    want_o1, want_s1 = hf_rec(q1, k1, v1, g1, b1, initial_state=pool[4:5].clone(), output_final_state=True,
                              use_qk_l2norm_in_kernel=True)
    o1 = ops.fused_recurrent_gated_delta_rule_update(q1, k1, v1, g1, b1, pool, torch.tensor([4], dtype=torch.int32),
                                                     True, 0.0, False, None, ssm_scales=None, intermediate_scales=None, parent_indices=None)
    assert_close(o1, want_o1)
    assert_close(pool[4], want_s1[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("disable_state_update", [False, True])
def test_verify_per_channel_matches_reference(dtype, disable_state_update):
    B, L = 4, 3
    q, k, v, g, beta = make_inputs((B, L), dtype)
    pool = make_pool()
    slots = distinct_slots(B, NUM_SLOTS, pad_rows=(2,))
    inter = torch.zeros(B, L, H, K, V)
    got_pool, got_inter = pool.clone(), inter.clone()
    o = ops.fused_recurrent_gated_delta_rule_update(q, k, v, g, beta, got_pool, slots, True, 0.0,
                                                    disable_state_update, got_inter, ssm_scales=None, intermediate_scales=None, parent_indices=None)
    want_o, want_pool, want_inter = ref.fused_recurrent_gated_delta_rule_update_ref(
        q, k, v, g, beta, pool, slots, True, 0.0, disable_state_update, inter)
    assert_close(o, want_o, dtype)
    assert_close(got_pool, want_pool)
    assert_close(got_inter, want_inter)
    assert torch.all(o[2] == 0) and torch.all(got_inter[2] == 0)


def test_verify_intermediate_equals_chunked_prefix_states():
    """The verify op's per-step states equal the chunked prefill's final state after 1, 2, 3 tokens."""
    q, k, v, g, beta = make_inputs((1, 3))
    pool = make_pool()
    slots = torch.tensor([5], dtype=torch.int32)
    inter = torch.zeros(1, 3, H, K, V)
    ops.fused_recurrent_gated_delta_rule_update(q, k, v, g, beta, pool.clone(), slots, True, 0.0, True, inter, ssm_scales=None, intermediate_scales=None, parent_indices=None)
    for n in (1, 2, 3):
        p = pool.clone()
        ops.chunk_gated_delta_rule(q[0, :n], k[0, :n], v[0, :n], g[0, :n], beta[0, :n], p, cu_seqlens_of([n]), slots,
                                   torch.tensor([True]), True, 0.0, False, ssm_scales=None)
        assert_close(inter[0, n - 1], p[5])


def test_opcheck_per_channel():
    args = chunk_case([70, 0, 5], torch.bfloat16, pad_rows=(1,))
    run_opcheck(ops.chunk_gated_delta_rule, (*args, True, 0.0, True))
    run_opcheck(ops.chunk_gated_delta_rule, (*args, True, 0.0, False))
    q, k, v, g, beta = make_inputs((3, 2))
    slots = distinct_slots(3, NUM_SLOTS, pad_rows=(1,))
    inter = torch.zeros(3, 2, H, K, V)
    run_opcheck(ops.fused_recurrent_gated_delta_rule_update, (q, k, v, g, beta, make_pool(), slots, True, 0.0,
                                                              False, inter))


def test_per_channel_gate_shape_is_checked():
    q, k, v, g, beta, pool, cu, slots, has_init = chunk_case([5], torch.float32)
    with pytest.raises(ValueError, match="`g`"):
        ops.chunk_gated_delta_rule(q, k, v, g[..., :3], beta, pool, cu, slots, has_init, True, 0.0, False, ssm_scales=None)
    q, k, v, g, beta = make_inputs((2, 1))
    with pytest.raises(ValueError, match="`g`"):
        ops.fused_recurrent_gated_delta_rule_update(q, k, v, g[:, :, :1], beta, make_pool(),
                                                    torch.tensor([0, 1], dtype=torch.int32), True, 0.0, False, None, ssm_scales=None, intermediate_scales=None, parent_indices=None)


def test_compile_per_channel_no_graph_break():
    q, k, v, g, beta, pool, cu, slots, has_init = chunk_case([70, 3], torch.float32)

    def fn(q, k, v, g, beta, pool, cu, slots, has_init):
        o, cs = ops.chunk_gated_delta_rule(q, k, v, g, beta, pool, cu, slots, has_init, True, 0.0, True, ssm_scales=None)
        return o * 2.0, cs

    (eo, ecs), (co, ccs), eargs, cargs = compile_and_compare(fn, q, k, v, g, beta, pool, cu, slots, has_init)
    assert_close(co, eo)
    assert_close(ccs, ecs)
    assert_close(cargs[5], eargs[5])
    offs = chunk_row_offsets(cu, C)
    assert offs.tolist() == [0, 2]
